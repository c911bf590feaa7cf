"""Summary of one benchmarks/gpu_check.sh run, printed last by that script.

Reads OUT/raw/ (stages.txt, env.json, tests.xml, memcheck.log, racecheck.log,
bench_kernel.json, ring_w*.json) and writes OUT/summary.json, OUT/summary.txt (what it prints)
and OUT/results.md, a draft section for benchmarks/RESULTS.md. Any input may be missing (a
stage skipped or cut): its part of the summary says so. Standard library only.

    python benchmarks/gpu_check_summary.py OUT --total SECONDS --has-gpu 0|1
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import json_io  # noqa: E402 - bench_kernel's JSON (no torch import)

CONFIGS = ("ringseq", "ringseq:1", "ringseq:2")  # bench_kernel.py's names of tile configs 0, 1, 2
PEERS = ("sdpa_flash", "sdpa_cudnn", "flash_attn")


def read_json(path):
    try:
        with open(path) as f:
            return json_io.load(f)  # (a failed row's "inf" error as a float again)
    except (OSError, ValueError):
        return None


def read_stages(raw):
    rows = []
    try:
        lines = open(os.path.join(raw, "stages.txt")).read().splitlines()
    except OSError:
        return rows
    for line in lines:
        if line.strip():
            name, status, secs, limit, note = line.split("|", 4)
            rows.append({"stage": name, "status": status, "seconds": float(secs),
                         "limit": int(limit), "note": note})
    return rows


def test_counts(raw):
    """Totals of the junit XML pytest wrote (None when the tests did not finish)."""
    try:
        root = ET.parse(os.path.join(raw, "tests.xml")).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def sanitizer_result(raw, tool):
    """compute-sanitizer's closing summary line of `tool`'s log, or None."""
    try:
        text = open(os.path.join(raw, f"{tool}.log"), errors="replace").read()
    except OSError:
        return None
    lines = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: .*", text)
    return lines[-1].strip() if lines else None


def bench_rows(raw, masks=False):
    """The measured rows of bench_kernel.json: the dense ones, or (masks) the --masks rows of
    the spans path (they carry window / softcap)."""
    data = read_json(os.path.join(raw, "bench_kernel.json"))
    if not data:
        return []
    return [r for r in data.get("results", []) if not r.get("skipped") and r.get("ms")
            and ("window" in r) == masks]


def masks_table(rows):
    """Lines of the spans-path table: ms and TFLOP/s (visible pairs) per backend and soft-cap."""
    if not rows:
        return []
    lines = [f"{'mode':8}{'s':>6}{'d':>5}{'window':>8}{'softcap':>8} {'backend':16}{'ms':>9}{'TFLOP/s':>9}"]
    for r in sorted(rows, key=lambda r: (r["mode"] != "fwd", r["softcap"], r["backend"])):
        lines.append(f"{r['mode']:8}{r['seqlen']:6d}{r['headdim']:5d}{r['window']:8d}{r['softcap']:8.1f} "
                     f"{r['backend']:16}{r['ms']:9.2f}{r['tflops']:9.1f}")
    return lines


def bench_groups(rows):
    """Per (mode, s, d, causal), forward first: the key, {backend: row}, the fastest tile
    config (None if no ringseq row) and [SDPA flash, cuDNN] time / that config's time."""
    keys = sorted({(r["mode"], r["seqlen"], r["headdim"], r["causal"]) for r in rows},
                  key=lambda k: (k[0] != "fwd", k[1], k[2], k[3]))
    for k in keys:
        got = {r["backend"]: r for r in rows if (r["mode"], r["seqlen"], r["headdim"], r["causal"]) == k}
        ours = [n for n in CONFIGS if n in got]
        best = min(ours, key=lambda n: got[n]["ms"]) if ours else None
        ratios = [got[p]["ms"] / got[best]["ms"] if best and p in got else None for p in PEERS[:2]]
        yield k, got, best, ratios


def bench_table(rows):
    """Lines of the kernel table: TFLOP/s of each tile config and peer per (mode, s, d, mask),
    and the best config's speed relative to SDPA flash and cuDNN."""
    if not rows:
        return []
    names = [n for n in CONFIGS + PEERS if any(r["backend"] == n for r in rows)]
    lines = [f"{'mode':8}{'s':>6}{'d':>5} {'mask':7}" + "".join(f"{n:>12}" for n in names)
             + f"{'best':>6}{'/flash':>8}{'/cudnn':>8}"]
    for k, got, best, ratios in bench_groups(rows):
        cells = "".join(f"{got[n]['tflops']:12.1f}" if n in got else f"{'-':>12}" for n in names)
        tail = f"{CONFIGS.index(best) if best else '-':>6}" + "".join(f"{x:8.2f}" if x else f"{'-':>8}" for x in ratios)
        lines.append(f"{k[0]:8}{k[1]:6d}{k[2]:5d} {'causal' if k[3] else 'full':7}{cells}{tail}")
    return lines


def ring_rows(raw):
    rows = []
    for path in sorted(glob.glob(os.path.join(raw, "ring_w*.json"))):
        data = read_json(path) or {}
        rows += data.get("results", [])
    return rows


def ring_table(rows):
    if not rows:
        return []
    lines = [f"{'W':>2} {'layout':8} {'mode':8}{'ms':>9}{'compute ms':>12}{'overhead':>10}{'err':>10}{'plain':>10}  check"]
    for r in rows:
        lines.append(f"{r['world_size']:>2} {r['layout']:8} {r['mode']:8}{r['ms']:9.2f}{r['compute_only_ms']:12.2f}"
                     f"{r['ring_overhead']:10.3f}{r['max_err']:10.2e}{r['plain_err']:10.2e}  "
                     f"{'ok' if r['check_ok'] else 'FAILED'}")
    return lines


def results_md(env, tests, san, bench, ring, ring_args, masks=(), stages=()):
    """A benchmarks/RESULTS.md section with what this run measured (``stages``: read_stages'
    rows, which say why a stage that wrote nothing did not run)."""
    gpu = env.get("gpu", "no GPU")
    md = [f"## {datetime.date.today().isoformat()} — CUDA kernels on {gpu} (`benchmarks/gpu_check.sh`)", "",
          f"{gpu} ({env.get('sms', '?')} SMs), torch {env.get('torch')}, nvcc {env.get('nvcc')}, "
          f"Python {env.get('python')}.", ""]
    if tests:
        md.append(f"GPU tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
                  f"{tests['skipped']} skipped.")
    else:
        row = next((s for s in stages if s["stage"] == "tests"), None)
        why = ("the stage did not run" if row is None else
               f"tests stage: {row['status']}, {row['note']}")
        md.append(f"GPU tests: no junit report ({why}).")
    for tool in ("memcheck", "racecheck"):
        md.append(f"compute-sanitizer {tool} (benchmarks/sanitize_shape.py --quick): {san.get(tool) or 'no summary line'}.")
    if bench:
        md += ["", "TFLOP/s (flash-attn FLOP count), b=2, h=16, bf16, median of 3; cfg N = ringseq tile "
               "config N, best/flash = SDPA flash time / best ringseq config's time:", "",
               "| mode | s | d | mask | " + " | ".join(f"cfg {i}" for i in range(len(CONFIGS)))
               + " | SDPA flash | cuDNN | best / flash | best / cuDNN |",
               "|---" * (4 + len(CONFIGS) + 4) + "|"]
        for k, got, best, ratios in bench_groups(bench):
            cell = [f"{got[n]['tflops']:.1f}" if n in got else "-" for n in CONFIGS + PEERS[:2]]
            ratio = [f"{x:.2f}" if x else "-" for x in ratios]
            md.append(f"| {'fwd+bwd' if k[0] == 'fwd_bwd' else k[0]} | {k[1]} | {k[2]} | "
                      f"{'causal' if k[3] else 'full'} | " + " | ".join(cell + ratio) + " |")
    if masks:
        md += ["", "Spans path (`--masks`): causal sliding window, TFLOP/s of the visible pairs:", "",
               "| mode | s | d | window | softcap | backend | ms | TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
        for r in masks:
            md.append(f"| {r['mode']} | {r['seqlen']} | {r['headdim']} | {r['window']} | {r['softcap']} | "
                      f"{r['backend']} | {r['ms']:.2f} | {r['tflops']:.1f} |")
    if ring:
        md += ["", f"Ring over NCCL (`bench_ring.py {ring_args}`), busiest rank:", "",
               "| W | layout | mode | ms | compute-only ms | overhead | err | plain err | check |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in ring:
            md.append(f"| {r['world_size']} | {r['layout']} | {r['mode']} | {r['ms']:.2f} | "
                      f"{r['compute_only_ms']:.2f} | {r['ring_overhead']:.3f} | {r['max_err']:.2e} | "
                      f"{r['plain_err']:.2e} | {'ok' if r['check_ok'] else 'FAILED'} |")
    return "\n".join(md) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--total", type=int, default=0, help="seconds the run took")
    p.add_argument("--has-gpu", type=int, default=1)
    p.add_argument("--ring-args", default="", help="bench_ring.py arguments, for results.md")
    args = p.parse_args(argv)
    raw = os.path.join(args.out, "raw")
    env = read_json(os.path.join(raw, "env.json")) or {}
    stages = read_stages(raw)
    tests = test_counts(raw)
    san = {tool: sanitizer_result(raw, tool) for tool in ("memcheck", "racecheck")}
    bench = bench_rows(raw)
    masks = bench_rows(raw, masks=True)
    ring = ring_rows(raw)

    lines = []
    if bench:
        lines += ["", "bench_kernel: TFLOP/s, b=2 h=16 bf16 (ringseq:N = tile config N; best = fastest "
                  "config, /flash and /cudnn = peer ms / best ms, > 1: ringseq faster)"] + bench_table(bench)
    if masks:
        lines += ["", "bench_kernel --masks: the spans path, causal sliding window (TFLOP/s of the visible "
                  "pairs; sdpa_efficient takes the window as a mask and cannot soft-cap)"] + masks_table(masks)
    if ring:
        lines += ["", "bench_ring (NCCL; overhead = ring ms / same kernels without communication)"] + ring_table(ring)
    lines += [""]
    if tests:
        lines.append(f"tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
                     f"{tests['skipped']} skipped")
    for tool, res in san.items():
        if res:
            lines.append(f"{tool}: {res}")
    lines += [f"gpu_check: {env.get('gpu', 'no GPU')} | torch {env.get('torch')} | nvcc {env.get('nvcc')} | "
              f"total {args.total}s | out {args.out}",
              f"{'stage':10} {'status':12} {'seconds':>8} {'limit':>6}  note"]
    for s in stages:
        lines.append(f"{s['stage']:10} {s['status']:12} {s['seconds']:8.1f} {s['limit']:6d}  {s['note']}")
    text = "\n".join(lines) + "\n"

    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "summary.json"), "w") as f:  # (strict: a failed row's inf)
        json_io.dump({"total_seconds": args.total, "has_gpu": bool(args.has_gpu), "env": env,
                      "stages": stages, "tests": tests, "sanitizers": san, "bench": bench,
                      "bench_masks": masks, "ring": ring}, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(results_md(env, tests, san, bench, ring, args.ring_args, masks, stages))
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
