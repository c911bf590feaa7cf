"""ringseq's ring engine against ring-flash-attention, timed by one harness, same block kernel.

ring-flash-attn (``pip install --no-deps ring-flash-attn``) runs on CPU ranks through a stand-in
for flash-attn's private block functions over torch's CPU flash op (``benchmarks/peer_shim/``);
ringseq runs ``backend="sdpa"``, the same op. For each layout both engines run on ``--world-size``
spawned gloo ranks with one thread each, one after the other; every iteration starts after a
barrier, each rank takes the median of ``--repeats`` iterations and the slowest rank is reported.

Before timing, each engine's output and q/k/v gradients are checked against float64 attention
at a small length (``CHECK_TOKENS_PER_RANK`` tokens per rank, the same layout, heads, head dim
and dtype; flash-attn's rule: error at most 2x (out) / 3x (gradients) plain attention's in the
same dtype, plus the main job's floor, ``ring_job.CHECK_FLOOR``). ringseq failing it is a failed
run (exit 1); a peer failing it is reported as WRONG beside its times, whose ratio then compares
the same work, not a result. The dtype is bf16 or fp16: ring-flash-attn runs on flash-attn 2,
which takes no float32, and the stand-in refuses it as flash-attn does (a float32 run of the
stand-in showed ring-flash-attn's backward wrong, in a setup no real installation can make).

    pip install --no-deps ring-flash-attn
    python benchmarks/bench_ring_vs_rfa.py [--json out.json]

Exit status: 0, 1 (ringseq's check failed), 2 (usage), 3 (the local ranks did not finish).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_types import json_path, positive_int, positive_seconds  # noqa: E402  (before torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import (PeakMemory, attention_flops, cpu_header, environment,  # noqa: E402
                    format_table, load_average, max_over_ranks, mib, plain_attention,
                    progress, spawn_cpu_ranks, write_json)
from ring_job import CHECK_FLOOR, DTYPES  # noqa: E402  (the main job's dtypes and floors)

ENGINES = ("ring-flash-attn", "ringseq")
LAYOUTS = ("zigzag", "contiguous")
CHECK_TOKENS_PER_RANK = 128
BOUND = {"out": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}  # x plain attention's error (same dtype)


def _shard(x, layout, rank, world):
    """This rank's tokens of x (b, s, h, d): zigzag chunks r and 2W-1-r, or the r-th of W."""
    if layout == "zigzag":
        c = x.chunk(2 * world, 1)
        return torch.cat([c[rank], c[2 * world - 1 - rank]], 1)
    return x.chunk(world, 1)[rank]


def _attention_fn(engine, layout):
    """fn(q, k, v) -> out of one engine's causal ring over the default group."""
    if engine == "ring-flash-attn":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_shim"))
        import import_rfa  # noqa: F401  (ring-flash-attn over the CPU stand-in for flash-attn)
        from ring_flash_attn import ring_flash_attn_func, zigzag_ring_flash_attn_func

        fn = zigzag_ring_flash_attn_func if layout == "zigzag" else ring_flash_attn_func
        return lambda q, k, v: fn(q, k, v, causal=True)
    import ringseq

    return lambda q, k, v: ringseq.ring_flash_attn_func(q, k, v, causal=True, layout=layout,
                                                        backend="sdpa")


def _plain(q, k, v, dout, dtype):
    """(out, dq, dk, dv) of plain causal attention in dtype, on the whole sequence."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = plain_attention(q, k, v, dtype, causal=True)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.to(dtype)))


def _check(attn, layout, heads, headdim, dtype):
    """{name: {"error", "plain_error", "excess"}} for out / dq / dk / dv against float64
    attention, CHECK_TOKENS_PER_RANK tokens per rank, each the largest over the ranks; excess =
    error - the rule's bound (BOUND x plain attention's error + CHECK_FLOOR): above
    0 the engine fails the check. Inputs in ``dtype``; plain attention in ``dtype`` too."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(2)
    full = [torch.randn(1, CHECK_TOKENS_PER_RANK * world, heads, headdim, generator=g).to(dtype)
            for _ in range(4)]  # q, k, v, dout: (1, s, h, d)
    q, k, v, dout = (_shard(x, layout, rank, world).contiguous().requires_grad_(i < 3)
                     for i, x in enumerate(full))
    out = attn(q, k, v)
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    ref, plain = _plain(*full, torch.float64), _plain(*full, dtype)
    rows = []
    for name, a, r, p in zip(BOUND, got, ref, plain):
        r_local, p_local = _shard(r, layout, rank, world), _shard(p, layout, rank, world)
        # (a NaN anywhere is an infinite error: max() and gloo's MAX can drop a NaN)
        err = float(torch.nan_to_num((a.double() - r_local).abs(), nan=math.inf).max())
        plain_err = float((p_local.double() - r_local).abs().max())
        floor = CHECK_FLOOR[dtype]
        rows.append([err, plain_err, err - BOUND[name] * plain_err - floor])
    t = max_over_ranks([x for row in rows for x in row]).view(4, 3)  # (4, 3)
    return {name: dict(zip(("error", "plain_error", "excess"), row))
            for name, row in zip(BOUND, t.tolist())}


def _rank(args, device):
    engine, layout, a = args
    rank, world = dist.get_rank(), dist.get_world_size()
    attn = _attention_fn(engine, layout)
    dtype = DTYPES[a.dtype]
    check = _check(attn, layout, a.heads, a.headdim, dtype)
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, a.seqlen, a.heads, a.headdim, generator=g).to(dtype) for _ in range(4)]
    q, k, v, dout = (_shard(x, layout, rank, world).contiguous().requires_grad_(i < 3)
                     for i, x in enumerate(full))  # (1, s / W, h, d)
    del full
    times, peaks = [], []
    for mode in ("fwd", "fwd_bwd"):
        def step():
            if mode == "fwd":
                with torch.no_grad():
                    attn(q, k, v)
            else:
                torch.autograd.grad(attn(q, k, v), (q, k, v), dout)

        step()
        samples = []
        with PeakMemory(device) as mem:
            for _ in range(a.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples) * 1e3)
        # (a peak not measured, None where /proc has no clear_refs: -1, which a MAX keeps
        # only where no rank measured one)
        peaks.append(-1.0 if mem.peak is None else float(mem.peak))
    t = torch.tensor(times + peaks, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank, the largest peak
    fwd_peak, fwd_bwd_peak = (None if x < 0 else mib(x) for x in t[2:].tolist())
    return {"fwd_ms": t[0].item(), "fwd_bwd_ms": t[1].item(), "fwd_peak_mib": fwd_peak,
            "fwd_bwd_peak_mib": fwd_bwd_peak, "check": check}


def _fmt(x):
    return "?" if x is None else f"{x:.2f}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=2)
    p.add_argument("--seqlen", type=positive_int, default=8192,
                   help="total tokens, a multiple of 2 x --world-size (zigzag's chunks)")
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--headdim", type=positive_int, default=64)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                   help="bf16 (default) or fp16: flash-attn 2, ring-flash-attn's kernel, takes "
                        "no float32")
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--timeout", type=positive_seconds, default=900,
                   help="seconds the ranks of one engine and layout may take")
    p.add_argument("--json", type=json_path, default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.world_size < 2:  # (before: gloo's "Pair is not connected" inside ring-flash-attn)
        p.error(f"--world-size {a.world_size}: a ring needs 2 ranks or more")
    if a.headdim > 256:  # (before: timed, with the stand-in of flash-attn's kernel)
        p.error(f"--headdim {a.headdim}: flash-attn 2, ring-flash-attn's kernel, takes head "
                f"dims up to 256")
    if a.seqlen % (2 * a.world_size):
        p.error(f"--seqlen {a.seqlen} must be a multiple of 2 x --world-size = "
                f"{2 * a.world_size} (zigzag cuts the sequence into that many chunks)")
    import importlib.util
    if importlib.util.find_spec("ring_flash_attn") is None:
        p.error("ring-flash-attn is not installed: pip install --no-deps ring-flash-attn")
    return a


def _check_text(check, detail=False):
    """'ok' or 'WRONG (dq, dk)' for one engine's check; with detail each error beside plain
    attention's, e.g. 'dq 1.5e+00 vs plain 6.9e-07'."""
    over = [f"{n} {c['error']:.1e} vs plain {c['plain_error']:.1e}" if detail else n
            for n, c in check.items() if not c["excess"] <= 0]  # (NaN: wrong)
    return "ok" if not over else "WRONG (" + ", ".join(over) + ")"


def main(argv=None):
    a = parse_args(argv)
    start = load_average()
    progress(f"{len(ENGINES) * len(LAYOUTS)} runs of {a.world_size} ranks: each engine's "
             f"check against float64 ({CHECK_TOKENS_PER_RANK} tokens per rank), then "
             f"{a.repeats} timed iterations of fwd and fwd+bwd at {a.seqlen} tokens")
    rows = []
    for layout in LAYOUTS:
        for engine in ENGINES:
            progress(f"{engine} {layout} ...")
            res = spawn_cpu_ranks(a.world_size, _rank, (engine, layout, a), a.timeout, 1)
            res.update(engine=engine, layout=layout, check_text=_check_text(res["check"]))
            for mode in ("fwd", "fwd_bwd"):
                flops = attention_flops(1, a.heads, a.seqlen, a.seqlen, a.headdim, True, mode)
                res[f"{mode}_tflops"] = flops / (res[f"{mode}_ms"] * 1e-3) / 1e12
            rows.append(res)
            progress(f"{engine} {layout}: fwd {res['fwd_ms']:.1f} ms, fwd+bwd "
                     f"{res['fwd_bwd_ms']:.1f} ms, check {_check_text(res['check'], True)}")
    for res in rows:  # ringseq's rows carry the ratio: the peer's time / ours, same layout
        peer = next(r for r in rows if r["layout"] == res["layout"] and r["engine"] == ENGINES[0])
        if res["engine"] == "ringseq":
            for mode in ("fwd", "fwd_bwd"):
                res[f"{mode}_x_peer"] = peer[f"{mode}_ms"] / res[f"{mode}_ms"]
    print(f"{cpu_header(1)}; torch {torch.__version__}; block kernel of both engines: torch's "
          f"CPU flash op (ringseq backend='sdpa', not its own kernel)")
    print(f"# W={a.world_size} s={a.seqlen} h={a.heads} d={a.headdim} {a.dtype} causal, 1 thread "
          f"per rank; median of {a.repeats} per rank, slowest rank; peak = resident-set high-water "
          f"mark above the timed loop's start, largest rank; x ring-flash-attn = its time / "
          f"ringseq's; 1-minute load average {_fmt(start)} before, {_fmt(load_average())} after")
    for res in rows:
        res["ring"] = ("plain ring" if res["engine"] == ENGINES[0] and res["layout"] == "contiguous"
                       else res["layout"])
    print(format_table(rows, [
        ("engine", "engine", "{}"), ("ring", "layout", "{}"),
        ("fwd_ms", "fwd ms", "{:.1f}"), ("fwd_tflops", "TFLOP/s", "{:.3f}"),
        ("fwd_x_peer", "x ring-flash-attn", "{:.3f}"), ("fwd_peak_mib", "peak MiB", "{:.1f}"),
        ("fwd_bwd_ms", "fwd+bwd ms", "{:.1f}"), ("fwd_bwd_tflops", "TFLOP/s", "{:.3f}"),
        ("fwd_bwd_x_peer", "x ring-flash-attn", "{:.3f}"),
        ("fwd_bwd_peak_mib", "peak MiB", "{:.1f}"), ("check_text", "vs float64", "{}")]))
    for r in rows:
        if r["check_text"] != "ok":
            print(f"{r['engine']} {r['ring']}: {_check_text(r['check'], True)} "
                  f"({CHECK_TOKENS_PER_RANK * a.world_size} tokens, against float64)")
    if any(r["engine"] == ENGINES[0] and r["check_text"] != "ok" for r in rows):
        print("note: ring-flash-attn's results differ from float64 beyond flash-attn's rule "
              "where marked WRONG: its times there compare the same work, not a usable result")
    failed = [r for r in rows if r["engine"] == "ringseq" and r["check_text"] != "ok"]
    write_json(a.json, {"args": vars(a), "environment": environment("cpu"),
                        "check_tokens_per_rank": CHECK_TOKENS_PER_RANK, "rows": rows,
                        "failed": bool(failed)})
    if failed:
        print(f"FAILED: ringseq's results differ from float64 beyond flash-attn's rule "
              f"({', '.join(r['layout'] for r in failed)})")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
