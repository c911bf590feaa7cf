"""What ring integrity costs (ringseq.integrity): control collectives and exchange headers.

Times a causal zigzag ring forward+backward with the checks on and with the control
collectives off (``set_consistency_check``), times one control collective and one header
stamp+check alone, and reports the per-call cost of integrity (4 control collectives and
2W headers per forward+backward call) as a share of the call, the TFLOP/s and peak memory of
the call with checks. Spawns local CPU ranks.

Its invariants: the output and gradients are bitwise the same with and without the control
collectives (the checks change no number), and the output is within 2x plain float32
attention's error of float64 on 64 queries of each rank spread from its shard's first to its
last (a NaN counts as infinite); a failure of either exits 1 after the report.

    python benchmarks/bench_integrity.py --world-size 2 --seqlen 8192
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_types import json_path, positive_int  # noqa: E402
from common import (PeakMemory, attention_flops, max_over_ranks, mib, progress,  # noqa: E402
                    spawn_cpu_ranks, spot_check, write_json)

CHECK_ROWS = 64  # queries per rank checked against float64
CHECK_FLOOR = 1e-6  # float32's (common's floors; this benchmark runs float32)


def _rank(args, device):
    import ringseq
    from ringseq.engine import integrity
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, args.seqlen, args.heads, args.headdim, generator=g) for _ in range(4)]
    q, k, v, dout = (ringseq.shard(t, "zigzag") for t in full)
    for t in (q, k, v):
        t.requires_grad_()

    def step():
        ringseq.ring_flash_attn_func(q, k, v, causal=True, layout="zigzag").backward(dout)

    def results():  # out (s_local, h, d) and its gradients
        out = ringseq.ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")
        return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)

    times = {}
    for mode in ("first", "off") * 2:  # interleaved: load changes hit both alike
        ringseq.set_consistency_check(mode)
        step()
        dist.barrier()
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        times.setdefault(mode, []).append(statistics.median(ts))
    got = {}
    for mode in ("first", "off"):
        ringseq.set_consistency_check(mode)
        got[mode] = results()
    ringseq.set_consistency_check(True)
    with PeakMemory("cpu") as mem:
        step()  # (with the checks, as reported: before, measured with them off)
    # (bitwise: a NaN equals itself here, which torch.equal would not say)
    same = all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for a, b in zip(got["first"], got["off"]))
    pos = ringseq.positions(args.seqlen, "zigzag")
    err, plain_err = spot_check(full[:3], got["first"][0], pos, True, CHECK_ROWS)
    # (each rank's error against its own plain error; a NaN anywhere is infinite)
    err = err if err == err else float("inf")
    worst = max_over_ranks([err, plain_err, err - 2 * plain_err - CHECK_FLOOR,
                            0.0 if same else 1.0, -1.0 if mem.peak is None else mem.peak])
    comm = ringseq.get_comm()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        integrity.gather(comm, integrity.END, integrity.OK)
    control_s = (time.perf_counter() - t0) / 200
    call = integrity.RingCall(comm, integrity.FWD, (("x", 1),), "cpu")
    call._base = torch.zeros(integrity.HEADER_BASE_WORDS, dtype=torch.int64)
    call._expect = call._base.clone()
    call._bad = torch.zeros((), dtype=torch.bool)
    header = torch.zeros(integrity.HEADER_WORDS, dtype=torch.int64)
    t0 = time.perf_counter()
    for _ in range(2000):
        call.check(header, call.stamp(header))
    header_s = (time.perf_counter() - t0) / 2000
    return {"on_ms": 1e3 * min(times["first"]), "off_ms": 1e3 * min(times["off"]),
            "control_us": 1e6 * control_s, "header_us": 1e6 * header_s,
            "max_err": worst[0].item(), "plain_err": worst[1].item(),
            "check_ok": bool(worst[2] <= 0), "same_without_checks": bool(worst[3] == 0),
            "peak_mib": None if worst[4] < 0 else mib(worst[4].item())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=2)
    p.add_argument("--seqlen", type=positive_int, default=8192)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--headdim", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--json", type=json_path, default=None)
    args = p.parse_args(argv)
    W = args.world_size
    if W < 2:  # (a ring of one has no control collective and no header: nothing to time)
        p.error(f"--world-size {W}: integrity costs nothing on a ring of one; use 2 or more")
    if args.seqlen % (2 * W):  # the zigzag split, as a usage error before any rank starts
        p.error(f"--seqlen {args.seqlen}: zigzag over --world-size {W} needs a multiple of "
                f"{2 * W}")
    progress(f"spawning {W} local CPU ranks, 1 thread each; s={args.seqlen}")
    r = spawn_cpu_ranks(W, _rank, args, 3600, 1)  # rank 0 (the ranks run in lockstep)
    cost_ms = (4 * r["control_us"] + 2 * W * r["header_us"]) / 1e3
    flops = attention_flops(1, args.heads, args.seqlen, args.seqlen, args.headdim, True,
                            "fwd_bwd")
    r["tflops"] = flops / (r["on_ms"] * 1e-3) / 1e12
    print(f"# ring integrity cost, zigzag causal fwd+bwd, W={W} s={args.seqlen} "
          f"h={args.heads} d={args.headdim} fp32, 1 thread per rank")
    print(f"fwd+bwd: {r['on_ms']:.1f} ms with checks ({r['tflops']:.3f} TFLOP/s, peak "
          + ("not measured" if r["peak_mib"] is None else f"{r['peak_mib']:.1f} MiB")
          + f" on the largest rank), {r['off_ms']:.1f} ms without control collectives (ratio "
          f"{r['on_ms'] / r['off_ms']:.3f})")
    print(f"one control collective {r['control_us']:.0f} us, one header stamp+check "
          f"{r['header_us']:.1f} us")
    print(f"integrity per call (4 control collectives + {2 * W} headers): {cost_ms:.2f} ms = "
          f"{100 * cost_ms / r['on_ms']:.2f}% of the call", flush=True)
    print(f"check: max error {r['max_err']:.1e} against float64 (plain float32 "
          f"{r['plain_err']:.1e}): {'ok' if r['check_ok'] else 'FAILED'}; output and gradients "
          f"{'bitwise the same' if r['same_without_checks'] else 'DIFFERENT'} without the "
          f"control collectives", flush=True)
    write_json(args.json, {"benchmark": "bench_integrity", "args": vars(args), "result": r,
                           "cost_ms": cost_ms})
    if not (r["check_ok"] and r["same_without_checks"]):
        print("FAILED: the ring's results are wrong (see the check line)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
