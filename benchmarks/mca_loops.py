"""Static throughput model of the CPU kernel's hot loops (llvm-mca), for CPUs you cannot run.

Disassembles the built extension (objdump), cuts out the innermost loops that dominate the CPU
kernel's time at one ISA level and feeds each to ``llvm-mca -mcpu=<cpu>``, which simulates the
loop on that CPU's scheduling model (ports, latencies, queue sizes; not caches or TLBs):

    python benchmarks/mca_loops.py --level avx2 --mcpu znver3,znver4
    python benchmarks/mca_loops.py --level avx512 --mcpu znver4 --so path/to/_C.so --json out.json

Loops (float32):
  micro-kernel   gemm.h's register block (kMR x kNR vectors, kStore), one K step
  ... bf16       the avx512bf16 level's bf16 pair block (vdpbf16ps), one step of two K terms
  fwd softmax    flash_fwd.cpp's P = exp(S - m) with row sums, two vectors per iteration
  bwd softmax    flash_bwd.cpp's P = exp(S - lse), dS = P (dP - D) scale, one vector
  ... softcap    the same loops with the soft-cap's tanh (masks.h), one vector

Per loop: instructions, cycles per iteration (simulated), IPC, llvm-mca's block reciprocal
throughput (the port-bound cycles per iteration: below the simulated cycles means the loop is
latency- or queue-bound), and for the micro-kernel FMAs per cycle (2 is the peak of two FMA
pipes; a vdpbf16ps counts once, though it does two multiply-adds per lane). Needs objdump and llvm-mca (LLVM >= 16 knows znver4; e.g. ``apt-get install llvm-19``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

# (the script's folder is on sys.path, as for the tests)
from cli_types import comma_list, json_path, positive_int

HEADER = re.compile(r"^([0-9a-f]+) <(.+)>:$")
INSN = re.compile(r"^\s*([0-9a-f]+):\s+([a-z0-9._]+)\s*(.*?)\s*$")
BLOCK = {"baseline": 6, "avx2": 6, "avx512": 8, "avx512bf16": 8, "amx": 8}  # vec.h kMR (kNR = 2)


def disassemble(path):
    """{function: [(address, mnemonic, operands)]} of a shared object."""
    out = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", "-w", path],
                         capture_output=True, text=True, check=True).stdout
    funcs, name = defaultdict(list), None
    for line in out.splitlines():
        m = HEADER.match(line)
        if m:
            name = m.group(2)
            continue
        m = INSN.match(line)
        if m and name is not None:
            funcs[name].append((int(m.group(1), 16), m.group(2), m.group(3)))
    return funcs


def innermost_loops(insns):
    """Bodies of the loops (a backward jump's target up to the jump) with no loop inside."""
    spans = []
    for i, (addr, op, args) in enumerate(insns):
        m = re.match(r"([0-9a-f]+) <", args) if op.startswith("j") else None
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr, i))
    loops = []
    for start, end, i in spans:
        if any(start <= s and e < end for s, e, _ in spans if (s, e) != (start, end)):
            continue
        body = [x for x in insns[: i + 1] if x[0] >= start]
        if not any(op.startswith("call") for _, op, _ in body):
            loops.append(body)
    return loops


def count(body, pattern):
    return sum(1 for _, op, _ in body if re.search(pattern, op))


def find_loops(funcs, level):
    """{loop name: body} of the float32 hot loops of `level`."""
    ns = f"ringseq::cpu::{level}::"
    found = {}
    for step, name, insn in (("FmaStep<float>", "micro-kernel", "fmadd|mulps"),
                             ("Bf16PairStep", "micro-kernel bf16", "dpbf16ps")):
        mk = [n for n in funcs if n.startswith(f"void {ns}micro_kernel<float, {BLOCK[level]}, 2, ({ns}Epi)0, ")
              and step in n]
        if mk:
            found[name] = max(innermost_loops(funcs[mk[0]]), key=lambda b: count(b, insn))
    for key, name in (("fwd_impl<float>", "fwd softmax"), ("bwd_impl<float>", "bwd softmax")):
        # the work item's lambda, or run_items where the compiler inlined it there
        lam = [n for n in funcs if f"{ns}(anonymous namespace)::{key}" in n
               and ("operator()" in n or n.startswith(f"{ns}run_items<"))]
        # exp's 2^n: an integer shift, or vscalefps on the AVX-512 levels (vec.h: exp_vecs); the
        # soft-capped variants also divide (tanh)
        loops = [b for n in lam for b in innermost_loops(funcs[n]) if count(b, "pslld|vscalefps")]
        for suffix, cands in (("", [b for b in loops if not count(b, "div")]),
                              (" softcap", [b for b in loops if count(b, "div")])):
            if cands:
                found[name + suffix] = max(cands, key=lambda b: count(b, "fmadd|mulps|addps"))
    return found


def as_asm(body):
    lines = [".Lloop:"]
    for _, op, args in body:
        args = re.sub(r"#.*", "", args).strip()
        if op.startswith("j"):
            args = ".Lloop"
        lines.append(f"  {op} {args}")
    return "\n".join(lines) + "\n"


def mca(mca_bin, body, cpu, iterations):
    """llvm-mca's summary of `body` on `cpu`."""
    proc = subprocess.run([mca_bin, f"-mcpu={cpu}", "-mtriple=x86_64-unknown-linux-gnu",
                           f"-iterations={iterations}"], input=as_asm(body), capture_output=True, text=True)
    if proc.returncode:
        why = (proc.stderr.strip() or f"exit status {proc.returncode}").splitlines()[0]
        raise RuntimeError(f"llvm-mca -mcpu={cpu}: {why}")
    get = lambda key: float(re.search(rf"{key}:\s+([0-9.]+)", proc.stdout).group(1))  # noqa: E731
    return {"cycles_per_iter": get("Total Cycles") / iterations, "ipc": get("IPC"),
            "block_rthroughput": get("Block RThroughput")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", default="avx2", choices=sorted(BLOCK))
    p.add_argument("--mcpu", type=comma_list(None), default=["znver3"],
                   help="comma list of llvm-mca CPU names (llvm-mca -mcpu=help lists them)")
    p.add_argument("--so", default=None, help="the extension to read (default: ringseq._C)")
    p.add_argument("--mca", default=None, help="llvm-mca binary (default: llvm-mca-19, llvm-mca)")
    p.add_argument("--iterations", type=positive_int, default=300)
    p.add_argument("--json", type=json_path, default=None)
    args = p.parse_args(argv)
    if args.mca is not None and not shutil.which(args.mca):
        p.error(f"--mca {args.mca!r}: no such executable")
    if args.so is not None and not (os.path.isfile(args.so) and os.access(args.so, os.R_OK)):
        p.error(f"--so {args.so!r}: not a readable file (the extension, ringseq/_C*.so)")
    mca_bin = args.mca or shutil.which("llvm-mca-19") or shutil.which("llvm-mca")
    if not mca_bin or not shutil.which("objdump"):
        p.error("needs objdump and llvm-mca on PATH (e.g. apt-get install binutils llvm-19)")
    # (models differ by version: LLVM 14's znver3 issues one FMA per cycle, 19's two)
    version = subprocess.run([mca_bin, "--version"], capture_output=True, text=True).stdout
    version = next((line.strip() for line in version.splitlines() if "version" in line.lower()),
                   "version unknown")
    for cpu in args.mcpu:  # (before any work: an unknown name was "skipped" in every row)
        probe = subprocess.run([mca_bin, f"-mcpu={cpu}", "-mtriple=x86_64-unknown-linux-gnu"],
                               input="  nop\n", capture_output=True, text=True)
        if probe.returncode or "not a recognized processor" in probe.stderr:
            p.error(f"--mcpu {cpu!r}: not a CPU this llvm-mca models ({version}; "
                    f"{mca_bin} -mcpu=help lists them)")
    so = args.so
    if so is None:
        from ringseq.kernels.extension import _C
        if _C is None:
            p.error("ringseq._C is not built; pass --so")
        so = _C.__file__
    try:
        funcs = disassemble(so)
    except subprocess.CalledProcessError as exc:
        p.error(f"--so {so!r}: objdump cannot read it ({(exc.stderr or '').strip()[:200]})")
    loops = find_loops(funcs, args.level)
    if not loops:
        p.error(f"no {args.level} loops found in {so} (level not built?)")
    rows = []
    print(f"# llvm-mca ({mca_bin}, {version}) on the {args.level} loops of {so}, "
          f"{args.iterations} iterations; FMA/cycle: multiply-adds per cycle (a mulps with its "
          f"addps where the level has no FMA)")
    print(f"{'loop':<19} {'cpu':<8} {'insns':>5} {'cycles/iter':>11} {'IPC':>5} {'RThroughput':>11} {'FMA/cycle':>9}")
    for name, body in loops.items():
        for cpu in args.mcpu:
            try:
                r = mca(mca_bin, body, cpu, args.iterations)
            except RuntimeError as exc:  # e.g. AVX-512 on a CPU model without it
                print(f"{name:<19} {cpu:<8} skipped: {exc}")
                continue
            # FMA-class instructions per cycle (a vdpbf16ps counts once: two multiply-adds per
            # lane); the baseline level multiplies and adds apart: its mulps count
            fmas = ((count(body, "fmadd|dpbf16ps") or count(body, "mulps"))
                    / r["cycles_per_iter"] if name.startswith("micro-kernel") else None)
            rows.append(dict(r, loop=name, cpu=cpu, level=args.level, instructions=len(body),
                             fma_per_cycle=fmas))
            print(f"{name:<19} {cpu:<8} {len(body):>5} {r['cycles_per_iter']:>11.2f} {r['ipc']:>5.2f} "
                  f"{r['block_rthroughput']:>11.2f} {'-' if fmas is None else f'{fmas:.2f}':>9}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"so": so, "mca": mca_bin, "mca_version": version, "rows": rows}, f,
                      indent=2)
    if not rows:
        print(f"FAILED: no loop could be modelled on {','.join(args.mcpu)} (see the skipped "
              f"lines)")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
