"""The CUDA compile gate (.ci/cuda_compile_check.py): its parser and shared flags always; the
gate itself only on request (``RINGSEQ_TEST_NVCC=1``, needs nvcc).

Every csrc/**/*.cu must compile for sm_80 and sm_90 with -Xptxas -v,-warn-spills,-Werror, with
no spills and a 0-byte stack frame, and every expected kernel must appear in the table. A cold
run compiles every CUDA source twice (tens of minutes on 2 cores, silently), so the README's
``python -m pytest -q`` leaves it to CI, which runs ``.ci/cuda_compile_check.py`` as its own
step; ``RINGSEQ_TEST_NVCC=1 python -m pytest -q tests/test_cuda_compile.py`` runs it here. The
gate caches successful results under build/, so a rerun in an unchanged checkout is instant.
"""
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATE = os.path.join(ROOT, ".ci", "cuda_compile_check.py")


def find_nvcc():
    cand = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return cand if os.path.exists(cand) else None


NVCC = find_nvcc()
ARCHS = ("sm_80", "sm_90")
# Forward kernels: Traits<head dim, block_m, block_n, element> for every tile configuration
# (csrc/kernel_math.h: fwd_block_m / fwd_block_n; d=64's config 2 is its config 0 tile).
FWD_TILES = {64: [(128, 64), (64, 64)], 128: [(128, 32), (64, 64), (128, 64)]}
ELEMENTS = ("__nv_bfloat16", "__half")


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_gate():
    return load_module(GATE, "cuda_compile_check")


def test_gate_and_build_share_one_list_of_nvcc_flags():
    """setup.py and the gate both take their nvcc flags from csrc/build_flags.py, so the gate
    cannot drift from the real build (no GPU, no nvcc, no torch needed)."""
    flags = load_module(os.path.join(ROOT, "csrc", "build_flags.py"), "build_flags")
    assert "--use_fast_math" in flags.NVCC_FLAGS and "-DRINGSEQ_WITH_CUDA" in flags.NVCC_FLAGS
    assert flags.nvcc_flags(default_gencode=False) == list(flags.NVCC_FLAGS)
    assert flags.gencode_flags() == ["-gencode", "arch=compute_80,code=sm_80", "-gencode",
                                     "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
    assert load_gate().load_build_flags(ROOT).NVCC_FLAGS == flags.NVCC_FLAGS
    setup = open(os.path.join(ROOT, "setup.py")).read()
    gate = open(GATE).read()
    assert "build_flags.py" in setup and "nvcc_flags(" in setup
    for text in (setup, gate):  # no second copy of a flag or an architecture
        for flag in ("--use_fast_math", "-U__CUDA_NO_HALF_OPERATORS__", "arch=compute_80"):
            assert flag not in text


def test_gate_parses_ptxas_report():
    """The parser finds kernels, registers, smem, stack frames and spills (no nvcc needed)."""
    log = (
        "ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1kPf\n"
        "    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 24 bytes cumulative stack size, "
        "4096 bytes smem, 360 bytes cmem[0]\n"
        "ptxas info    : Function properties for _Z6helperv\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    kernels = load_gate().parse_ptxas(log)
    assert kernels == [{"mangled": "_Z1kPf", "arch": "sm_90", "stack": 24, "spill_stores": 8,
                        "spill_loads": 12, "registers": 40, "smem": 4096}]


NVCC_REQUESTED = os.environ.get("RINGSEQ_TEST_NVCC", "0") == "1"


@pytest.mark.skipif(not NVCC_REQUESTED, reason="the nvcc compile gate runs on request: "
                    "RINGSEQ_TEST_NVCC=1 (CI runs .ci/cuda_compile_check.py as its own step)")
def test_cuda_sources_pass_compile_gate(tmp_path):
    assert NVCC is not None, "RINGSEQ_TEST_NVCC=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    out = tmp_path / "gate.json"
    proc = subprocess.run([sys.executable, GATE, "--json", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=3600)
    assert proc.returncode == 0, f"compile gate failed:\n{proc.stdout}\n{proc.stderr}"
    assert "PASS" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"]
    rows = report["kernels"]
    for row in rows:
        assert row["stack"] == 0 and row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert row["registers"] is not None and row["registers"] <= 255, row

    sources = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))
    if not sources:
        pytest.skip("no .cu files yet")
    compiled = {(f["file"], f["arch"]) for f in report["files"] if f["returncode"] == 0}
    assert compiled == {(s, a) for s in sources for a in ARCHS}

    names = {(r["arch"], r["kernel"].replace(" ", "")) for r in rows}
    for arch in ARCHS:
        for d, tiles in FWD_TILES.items():
            for bm, bn in tiles:
                for elem in ELEMENTS:
                    name = f"fwd::flash_fwd_kernel<fwd::Traits<{d},{bm},{bn},{elem}>>"
                    assert (arch, name) in names, f"missing {name} on {arch}; have {sorted(names)}"
                    smem = next(r["smem"] for r in rows if (r["arch"], r["kernel"].replace(" ", "")) == (arch, name))
                    # static shared memory shows in the table; the >48 KB tile's is dynamic (0)
                    assert smem == ((bm + 2 * bn) * d * 2 if (bm + 2 * bn) * d * 2 <= 48 * 1024 else 0), name
        # every per-(direction, head dim, dtype) instantiation file yields kernels on each arch
        for src in sources:
            if os.path.basename(src).startswith(("flash_fwd_hdim", "flash_bwd_hdim")):
                assert any(r["file"] == src and r["arch"] == arch for r in rows), (src, arch)
