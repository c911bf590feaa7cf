"""Checks the machine code of the built CPU kernel (objdump of ringseq._C).

1. The micro-kernels' inner loops (csrc/cpu/gemm.h) keep their accumulators in registers and
   move whole vectors: no stack traffic, full-width loads/stores, one FMA per accumulator and
   step. (A memcpy-based vector load once compiled to 16-byte moves through a stack temporary
   under GCC's znver tuning: 6.5x slower on Zen 3.)
2. Each ISA level's instructions stay in its own namespace: code outside ringseq::cpu::avx2 /
   avx512 / avx512bf16 / amx uses nothing beyond baseline x86-64, avx2 code no AVX-512, avx512
   code no bf16 instruction, avx512bf16 code no AMX tile and amx code no bf16 dot product (the
   slow path it exists to avoid), so the extension runs on any x86-64 CPU and the dispatcher's
   choice is the only way in.
3. The avx512bf16 level's bf16 pair micro-kernels (Bf16PairStep) run one vdpbf16ps per
   accumulator and step on full registers, from registers.
4. The amx level's tile product (csrc/cpu/amx.h) runs a 2 x 2 block of C tiles: four
   tdpbf16ps on four tile loads per step.
"""
import os
import platform
import re
import shutil
import sys

import pytest

import ringseq
from ringseq.kernels.extension import _C

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from mca_loops import count, disassemble, innermost_loops  # noqa: E402  (one objdump parser)

OBJDUMP = shutil.which("objdump")
pytestmark = [
    pytest.mark.skipif(_C is None, reason="ringseq._C is not built"),
    pytest.mark.skipif(OBJDUMP is None, reason="objdump not found"),
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 code checks"),
]

LEVEL_NS = {"avx2": "ringseq::cpu::avx2::", "avx512": "ringseq::cpu::avx512::",
            "avx512bf16": "ringseq::cpu::avx512bf16::", "amx": "ringseq::cpu::amx::"}
# micro-kernel rows x vectors per level for float (csrc/cpu/vec.h: kMR x kNR)
FLOAT_BLOCK = {"baseline": (6, 2), "avx2": (6, 2), "avx512": (8, 2), "avx512bf16": (8, 2), "amx": (8, 2)}
VECTOR_REG = {"baseline": "xmm", "avx2": "ymm", "avx512": "zmm", "avx512bf16": "zmm", "amx": "zmm"}
# Not in baseline x86-64 and not spelled with a v prefix: BMI1/2, LZCNT, POPCNT, MOVBE, ADX...
NON_BASELINE = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx",
                "sarx", "shlx", "shrx", "tzcnt", "lzcnt", "popcnt", "movbe", "adcx", "adox", "crc32",
                "pshufb", "pmulld", "pminsd", "pmaxsd", "ptest", "blendvps", "roundps", "dpps",
                "pcmpeqq", "pextrd", "pinsrd", "pextrq", "pinsrq", "pmovzxbw", "pmovsxbw"}


@pytest.fixture(scope="module")
def code():
    """{function name: [(address, mnemonic, operands)]} of the extension."""
    return disassemble(_C.__file__)


def inner_loop(insns):
    """Instructions of the innermost loop (a backward jump's target up to the jump, with no
    other loop inside) that holds the most FMAs/multiplies, or None."""
    body = max(innermost_loops(insns), key=lambda b: count(b, r"fmadd|^v?mulps$"), default=None)
    return body if body is not None and count(body, r"fmadd|^v?mulps$") else None


def built_levels():
    return list(_C.cpu_isa_built())


@pytest.mark.parametrize("level", ["baseline", "avx2", "avx512", "avx512bf16", "amx"])
def test_micro_kernel_inner_loops_stay_in_registers(code, level):
    if level not in built_levels():
        pytest.skip(f"{level} not built")
    mr, nr = FLOAT_BLOCK[level]
    reg = VECTOR_REG[level]
    prefix = f"ringseq::cpu::{level}::micro_kernel<float, {mr}, {nr},"
    kernels = {n: i for n, i in code.items() if prefix in n and not n.endswith("@plt")
               and "Bf16PairStep" not in n}
    assert kernels, f"no {prefix}...> symbol in {_C.__file__}"
    for name, insns in kernels.items():
        body = inner_loop(insns)
        assert body is not None, f"{name}: no inner loop found"
        text = "\n".join(f"{a:x}: {o} {r}" for a, o, r in body)
        stack = [x for x in body if re.search(r"\(%r[sb]p\)|%r[sb]p\)", x[2])]
        assert not stack, f"{name}: stack traffic in the inner loop:\n{text}"
        if level == "baseline":
            fmas = sum(1 for _, o, _ in body if o == "mulps")
        else:
            fmas = sum(1 for _, o, _ in body if "fmadd" in o)
            # every FMA works on full-width registers
            narrow = [x for x in body if "fmadd" in x[1] and reg not in x[2]]
            assert not narrow, f"{name}: FMA on narrower vectors than {reg}:\n{text}"
        assert fmas == mr * nr, f"{name}: {fmas} multiplies per step, expected {mr * nr}:\n{text}"
        moves = [x for x in body if re.match(r"v?mov(u|a)ps|v?broadcastss|v?movss", x[1])]
        for _, op, args in moves:
            if "broadcast" in op or "movss" in op:
                continue
            assert reg in args, f"{name}: a vector move narrower than {reg} ({op} {args}):\n{text}"


def test_each_isa_level_stays_in_its_namespace(code):
    offenders = []
    for name, insns in code.items():
        level = next((lv for lv, ns in LEVEL_NS.items() if ns in name), None)
        for _, op, args in insns:
            if level is None:
                bad = (op.startswith("v") and op not in ("verr", "verw")) or op.startswith("k") \
                    or op in NON_BASELINE or re.search(r"%[yz]mm|%k[0-7]", args)
            elif level == "avx2":
                bad = re.search(r"%zmm|%k[0-7]|\{%k", args) or op.startswith("k")
            elif level == "avx512":
                bad = "bf16" in op
            elif level == "avx512bf16":
                bad = op.startswith(("tile", "tdp", "ldtilecfg"))
            else:  # amx
                bad = op == "vdpbf16ps"
            if bad:
                offenders.append(f"{name}: {op} {args}")
                break
    assert not offenders, ("instructions beyond their level outside the per-level namespaces "
                           "(an inline function shared between levels?):\n" + "\n".join(offenders[:20]))


def test_bf16_pair_micro_kernels_use_the_dot_product_from_registers(code):
    if "avx512bf16" not in built_levels():
        pytest.skip("avx512bf16 not built")
    mr, nr = FLOAT_BLOCK["avx512bf16"]
    kernels = {n: i for n, i in code.items()
               if n.startswith(f"void ringseq::cpu::avx512bf16::micro_kernel<float, {mr}, {nr},")
               and "Bf16PairStep" in n}
    assert kernels, "no avx512bf16 Bf16PairStep micro-kernel in the extension"
    for name, insns in kernels.items():
        body = max(innermost_loops(insns), key=lambda b: count(b, r"^vdpbf16ps$"), default=None)
        assert body is not None and count(body, r"^vdpbf16ps$"), f"{name}: no vdpbf16ps loop"
        text = "\n".join(f"{a:x}: {o} {r}" for a, o, r in body)
        dots = [x for x in body if x[1] == "vdpbf16ps"]
        assert len(dots) == mr * nr, f"{name}: {len(dots)} dot products per step, expected {mr * nr}:\n{text}"
        assert all(re.fullmatch(r"%zmm\d+,%zmm\d+,%zmm\d+", a) for _, _, a in dots), \
            f"{name}: a dot product not on three zmm registers:\n{text}"
        stack = [x for x in body if re.search(r"\(%r[sb]p\)|%r[sb]p\)", x[2])]
        assert not stack, f"{name}: stack traffic in the inner loop:\n{text}"


def test_amx_tile_product_runs_a_two_by_two_block(code):
    if "amx" not in built_levels():
        pytest.skip("amx not built")
    products = {n: i for n, i in code.items() if n.startswith("ringseq::cpu::amx::amx_gemm(")}
    assert products, "no ringseq::cpu::amx::amx_gemm symbol in the extension"
    for name, insns in products.items():
        body = max(innermost_loops(insns), key=lambda b: count(b, r"^tdpbf16ps$"), default=None)
        assert body is not None, f"{name}: no loop"
        text = "\n".join(f"{a:x}: {o} {r}" for a, o, r in body)
        dots = [r for _, o, r in body if o == "tdpbf16ps"]
        # the 2 x 2 block: C tiles 0-3, A tiles 4-5, B tiles 6-7 (amx.h)
        assert sorted(dots) == sorted(f"%tmm{b},%tmm{a},%tmm{c}" for a, b, c in
                                      ((4, 6, 0), (4, 7, 1), (5, 6, 2), (5, 7, 3))), text
        assert count(body, r"^tileloadd") == 4, text
        assert not count(body, r"^tilestored"), f"{name}: C stored inside the K loop:\n{text}"


def test_default_build_needs_no_native_flags():
    # The extension was built without -march=native: the baseline level exists, and the CPU
    # kernel reports a level the CPU supports.
    assert "baseline" in built_levels()
    assert ringseq.cpu_isa() in _C.cpu_isa_supported()
    if os.environ.get("RINGSEQ_CPU_FLAGS"):
        pytest.skip("built with RINGSEQ_CPU_FLAGS")
