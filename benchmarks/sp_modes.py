"""``bench_ring.py --sp-mode ...``: ring vs Ulysses vs hybrid (USP) vs double ring at one shape.

For each mode, on every rank: one forward and one backward with the byte counters of
:mod:`ringseq.commstats` on (bytes this rank hands to ring exchanges and all-to-alls, measured
at the transport / collective wrapper), the bytes the formulas of docs/sp_modes.md predict,
forward+backward time on the busiest rank, and a spot check of the output against float64
attention on a slice of each rank's queries. Rank 0 prints the table with the ratios to the
plain ring at the same shape.

Modes: ``ring`` (U = 1), ``ulysses`` (U = W), ``hybrid`` (U = --ulysses-size, ring W / U),
``double_ring`` (U = 1, inner rings of --inner-ring-size), ``hybrid_double_ring`` (both), or
``all``.

    python benchmarks/bench_ring.py --sp-mode all --world-size 4 --seqlen 4096
    torchrun --nproc-per-node 8 benchmarks/bench_ring.py --sp-mode all --seqlen 65536 --dtype bf16
"""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

from common import (PeakMemory, attention_flops, cpu_header, environment, format_table,  # noqa: E402
                    init_launched_group, max_over_ranks, mib, progress, run_with_load, spot_check,
                    spawn_cpu_ranks, time_ms, worst, write_json)

import ringseq  # noqa: E402
from ringseq import commstats  # noqa: E402
from ringseq._dist import consistency_check_mode  # noqa: E402
from ringseq.engine.integrity import HEADER_BYTES  # noqa: E402
from ringseq.ulysses import kv_replication  # noqa: E402

SP_MODE_NAMES = ("ring", "ulysses", "hybrid", "double_ring", "hybrid_double_ring")


def parse_sp_modes(text):
    """The comma list of --sp-mode (``all``: every mode), validated."""
    modes = list(SP_MODE_NAMES) if text == "all" else [m for m in text.split(",") if m]
    if not modes:  # (before: "," ran no mode and exited 0, "" the layout job)
        raise SystemExit(f"--sp-mode needs at least one mode ({', '.join(SP_MODE_NAMES)} or "
                         f"all), got {text!r}")
    for m in modes:
        if m not in SP_MODE_NAMES:
            raise SystemExit(f"--sp-mode takes {', '.join(SP_MODE_NAMES)} or all, got {m!r}")
    return modes


def mode_sizes(mode, world, ulysses_size, inner_ring_size):
    """(U, I or None) of a mode on ``world`` ranks."""
    return {"ring": (1, None), "ulysses": (world, None), "hybrid": (ulysses_size, None),
            "double_ring": (1, inner_ring_size),
            "hybrid_double_ring": (ulysses_size, inner_ring_size)}[mode]


def _padded(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


def expected_bytes(b, s, h, h_kv, d, itemsize, U, R, I=None, acc_itemsize=4, lse_grad=False):
    """Bytes one rank sends per call from the formulas of docs/sp_modes.md, with the padding
    the packing adds (all-to-all pieces to 8 bytes, a ring's dK/dV accumulator segment to 64):
    ``{"fwd": ..., "bwd": ...}`` (full attention or a layout without idle laps). ``lse_grad``:
    the backward's all-to-all carries an lse gradient, as with the consistency checks off
    (before, left out: "= formula" read False for correct counts)."""
    rows = b * s // (U * R)  # (batch x tokens) of one rank's shard
    tok = rows * d  # elements per head of one rank's shard
    rep = kv_replication(h_kv, U)
    fwd_a2a = bwd_a2a = 0
    if U > 1:  # what each of the U - 1 peers gets: the header, then each piece padded
        q, kv = tok * (h // U) * itemsize, tok * (h_kv * rep // U) * itemsize
        lse = rows * (h // U) * acc_itemsize  # (the forward's, back with its output)
        qkv, out = _padded(q, 8) + 2 * _padded(kv, 8), _padded(q, 8) + _padded(lse, 8)
        dout = _padded(q, 8) + (_padded(lse, 8) if lse_grad else 0)
        fwd_a2a = (U - 1) * (2 * HEADER_BYTES + qkv + out)
        bwd_a2a = (U - 1) * (2 * HEADER_BYTES + dout + qkv)  # (dq, dk, dv as q, k, v)
    blk = 2 * tok * U * (h_kv * rep // U)  # K and V elements of one ring block
    I = I or R
    O = R // I
    fwd_ring = (R - 1) * blk * itemsize if R > 1 else 0
    bwd_ring = 0
    if R > 1:
        bwd_ring = (R - 1) * blk * itemsize + (R + (O if I < R else 0)) * _padded(
            blk * acc_itemsize, 64)
        # every exchange also carries the ring's integrity header: the forward posts W - 1
        # exchanges and the backward W + 1 on a ring of W (a double ring: the outer ring of O
        # plus one inner lap of I per outer step)
        laps = [(O, 1), (I, O)] if I < R else [(R, 1)]  # (ring size, passes per call)
        fwd_ring += sum((w - 1) * n for w, n in laps if w > 1) * HEADER_BYTES
        bwd_ring += sum((w + 1) * n for w, n in laps if w > 1) * HEADER_BYTES
    return {"fwd": fwd_a2a + fwd_ring, "bwd": bwd_a2a + bwd_ring}


def _max(x, device):
    return float(max_over_ranks([x], device)[0])


def sp_layout_of(args) -> str:
    """The one layout --sp-mode runs: zigzag when --layouts lists it, else the first listed."""
    return "zigzag" if "zigzag" in args.layouts else args.layouts[0]


def run_rank_sp(args, device):
    """Every mode of ``args.sp_modes`` on this rank; returns the rows (same on all ranks)."""
    from ring_job import CHECK_FLOOR, DTYPES  # the main job's dtypes and check floors
    world = dist.get_world_size()
    dtype = DTYPES[args.dtype]
    layout = sp_layout_of(args)
    causal = args.causal != "false"
    h_kv = args.heads_kv or args.heads
    gen = torch.Generator().manual_seed(1234)
    full = [torch.randn(args.batch, args.seqlen, n, args.headdim, generator=gen).to(dtype)
            for n in (args.heads, h_kv, h_kv)]
    dout_full = torch.randn(args.batch, args.seqlen, args.heads, args.headdim,
                            generator=gen).to(dtype)
    rows, jobs = [], []
    for i, mode in enumerate(args.sp_modes, 1):
        U, I = mode_sizes(mode, world, args.ulysses_size, args.inner_ring_size)
        R = world // U
        if dist.get_rank() == 0:
            progress(f"[{i}/{len(args.sp_modes)}] sp-mode {mode}: ulysses {U} x ring {R}"
                     + (f" (inner rings of {I})" if I else "") + f", {layout} "
                     f"{'causal' if causal else 'full'}, W={world} s={args.seqlen}")
        sp = ringseq.make_sp_groups(U, I)
        last = {}
        q, k, v = (sp.shard(t, layout).to(device).requires_grad_() for t in full)
        dout = sp.shard(dout_full, layout).to(device)

        def call(q=q, k=k, v=v, sp=sp):
            return ringseq.usp_attn_func(q, k, v, causal=causal, sp=sp, layout=layout,
                                         backend=args.backend)

        def step(call=call, q=q, k=k, v=v, dout=dout, last=last):
            out = call()
            out.backward(dout)
            for t in (q, k, v):
                t.grad = None
            last["out"] = out.detach()  # the last timed call's output: spot-checked too

        step()  # warm-up, consistency checks
        jobs.append((mode, U, R, I, sp, call, step, dout, last))
    # all modes warmed up before any is timed (the first calls of a process are slower)
    for mode, U, R, I, sp, call, step, dout, last in jobs:
        # The rings' exchange buffers, cached since the warm-up, are the call's memory too
        # (Ulysses' all-to-all buffers are made per call): count them in the peak, as the
        # main job does.
        for g in sp.process_groups():
            ringseq.get_comm(g).release_buffers()
        gc.collect()
        dist.barrier()
        with PeakMemory(device) as mem:  # (above the inputs: the call's own memory)
            with commstats.count_bytes() as c_fwd:
                out = call()
            with commstats.count_bytes() as c_bwd:
                out.backward(dout)
        gc.collect()
        dist.barrier()
        ms = _max(time_ms(step, device, args.warmup, args.repeats), device)
        pos = sp.positions(args.seqlen, layout)
        # the call on fresh exchange buffers and the last timed one (buffers reused, plans
        # cached): a defect that shows from a later call on fails the row too
        err, plain_err = spot_check(full, out.detach(), pos, causal, args.check_rows)
        err = worst(err, spot_check(full, last["out"], pos, causal, args.check_rows)[0])
        # ok per rank (its rows' own plain error bounds them), then over ranks
        excess = _max(err - 2 * plain_err, device)
        err, plain_err = _max(err, device), _max(plain_err, device)
        exp = expected_bytes(args.batch, args.seqlen, args.heads, h_kv, args.headdim,
                             dtype.itemsize, U, R, I, 8 if dtype == torch.float64 else 4,
                             lse_grad=consistency_check_mode() == "off")
        flops = attention_flops(args.batch, args.heads, args.seqlen, args.seqlen,
                                args.headdim, causal, "fwd_bwd")  # (the whole call's)
        flops_rank = flops / world
        sent = _max(c_fwd.total + c_bwd.total, device)
        rows.append({
            "mode": mode, "split": f"{U}x{R}" + (f" ({R // I}x{I})" if I and I < R else ""),
            "fwd_bytes": _max(c_fwd.total, device), "bwd_bytes": _max(c_bwd.total, device),
            "bytes": sent, "expected_bytes": exp["fwd"] + exp["bwd"],
            # the formulas count every lap: equal unless the layout leaves laps idle
            "bytes_as_formula": sent == exp["fwd"] + exp["bwd"],
            "a2a_bytes": _max(c_fwd.bytes.get("all_to_all", 0)
                              + c_bwd.bytes.get("all_to_all", 0), device),
            "outer_bytes": _max(c_fwd.bytes.get("ring_outer", 0)
                                + c_bwd.bytes.get("ring_outer", 0), device),
            "bytes_per_flop": sent / flops_rank, "ms": ms,
            "tflops": flops / ms / 1e9,  # (all ranks together, over the busiest rank's time)
            "peak_mib_per_rank": (mib(_max(float(mem.peak), device))
                                  if mem.peak is not None else None),
            "max_err": err, "plain_err": plain_err,
            "check_ok": bool(excess <= CHECK_FLOOR[dtype]),
        })
        del out
        gc.collect()
    ring = next((r for r in rows if r["mode"] == "ring"), None)
    for r in rows:
        r["bytes_vs_ring"] = r["bytes"] / ring["bytes"] if ring and ring["bytes"] else None
        r["time_vs_ring"] = r["ms"] / ring["ms"] if ring else None
    return rows


def report_sp(args, rows, device, load):
    world = args.world_size if not dist.is_initialized() else dist.get_world_size()
    threads = args.threads  # (bench_ring's: what the ranks run, launched or spawned)
    layout = sp_layout_of(args)
    print(f"# bench_ring --sp-mode: total s={args.seqlen} b={args.batch} h={args.heads} "
          f"h_kv={args.heads_kv or args.heads} d={args.headdim} {args.dtype} on {device}, "
          f"W={world}, causal={args.causal != 'false'}, layout {layout}")
    if device.type == "cpu":
        print(cpu_header(threads))
        load.print_summary(world * threads)
    print("# bytes = sent per rank per fwd+bwd call, measured at the ring transport and the "
          "all-to-all (max over ranks); expected = docs/sp_modes.md formulas; ms = fwd+bwd on "
          "the busiest rank; ratios against the plain ring at the same shape")
    columns = [("mode", "mode", "{}"), ("split", "U x R", "{}"),
               ("fwd_bytes", "fwd MiB", "{:.2f}"), ("bwd_bytes", "bwd MiB", "{:.2f}"),
               ("bytes", "MiB/rank/call", "{:.2f}"), ("expected_bytes", "expected MiB", "{:.2f}"),
               ("bytes_as_formula", "= formula", "{}"),
               ("a2a_bytes", "all-to-all MiB", "{:.2f}"), ("outer_bytes", "outer ring MiB", "{:.2f}"),
               ("bytes_vs_ring", "bytes / ring", "{:.3f}"), ("bytes_per_flop", "bytes/FLOP", "{:.2e}"),
               ("ms", "ms", "{:.1f}"), ("tflops", "TFLOP/s (all ranks)", "{:.4f}"),
               ("peak_mib_per_rank", "peak MiB/rank", "{:.1f}"),
               ("time_vs_ring", "time / ring", "{:.2f}"),
               ("max_err", "err", "{:.2e}"), ("check_ok", "check", "{}")]
    shown = [dict(r, **{key: r[key] / 2**20 for key in ("fwd_bytes", "bwd_bytes", "bytes",
                                                        "expected_bytes", "a2a_bytes",
                                                        "outer_bytes")}) for r in rows]
    print(format_table(shown, columns))
    if device.type == "cpu" and world * threads > (os.cpu_count() or 1):
        print(f"note: {world} ranks x {threads} thread(s) exceed this machine's cores, so ranks "
              f"time-share: the times mix compute and waiting; the byte counts are exact")
    failed = [r for r in rows if not r["check_ok"]]
    for r in failed:
        print(f"SPOT CHECK FAILED: {r['mode']} err {r['max_err']:.3e} > 2x {r['plain_err']:.3e}")
    return failed


def fitting_sp_modes(modes, all_modes: bool, world: int, heads: int, ulysses_size: int,
                     inner_ring_size: int):
    """The modes to run: SystemExit (a usage error's text) for a mode whose sizes do not fit
    the world size and the heads, or that would run another mode at these sizes (naming it);
    with ``all_modes`` those modes are left out instead, and so
    are the modes that would repeat another here (a hybrid whose ring is one rank is the
    Ulysses mode, a double ring of one inner ring the plain ring)."""
    if all_modes:
        return [m for m in modes
                if _misfit(m, world, heads, ulysses_size, inner_ring_size) is None
                and _distinct(m, world, ulysses_size, inner_ring_size)]
    for mode in modes:
        problem = _misfit(mode, world, heads, ulysses_size, inner_ring_size) or \
            _repeats(mode, world, ulysses_size, inner_ring_size)
        if problem is not None:
            raise SystemExit(f"--sp-mode {mode}: {problem}")
    return modes


def _misfit(mode, world, heads, ulysses_size, inner_ring_size):
    """Why ``mode``'s sizes do not fit the world size and the heads, or None."""
    U, I = mode_sizes(mode, world, ulysses_size, inner_ring_size)
    R = world // U
    if I is not None and I < 2:
        # (a double ring is one of inner rings of more than one rank: with rings of one
        # the library runs the plain ring, which the row would have named a double ring
        # and held to the double ring's byte formula)
        return (f"--inner-ring-size {I} must be at least 2 (an inner ring of one rank is the "
                f"plain ring: --sp-mode ring)")
    # (each condition named by the option that sets it: the Ulysses degree is
    # --ulysses-size in the hybrid, the world size itself in the Ulysses mode)
    degree = "--ulysses-size" if mode.startswith("hybrid") else "the world size"
    if world % U:
        return f"the Ulysses degree {U} ({degree}) must divide --world-size {world}"
    if heads % U:
        return (f"--heads {heads} must be a multiple of the Ulysses degree {U} ({degree}): "
                f"each rank of the all-to-all takes whole heads")
    if I and R % I:
        return (f"--inner-ring-size {I} must divide the ring size {R} (--world-size {world} "
                f"/ Ulysses degree {U})")
    return None


def _distinct(mode, world, ulysses_size, inner_ring_size) -> bool:
    """Whether ``mode`` runs something the other modes of ``all`` do not (sizes that fit)."""
    return _repeats(mode, world, ulysses_size, inner_ring_size) is None


def _repeats(mode, world, ulysses_size, inner_ring_size):
    """Which other mode ``mode`` runs at these sizes (sizes that fit), or None. A named mode
    that does is refused (before: run and labelled as asked, a hybrid 1x2 or a double ring of
    one inner ring moving no all-to-all / outer-ring bytes)."""
    U, I = mode_sizes(mode, world, ulysses_size, inner_ring_size)
    R = world // U
    if mode.startswith("hybrid") and U == 1:  # (the mode it runs, itself not refused here)
        return ("--ulysses-size 1 moves no heads: that is the "
                + ("double ring (--sp-mode double_ring)" if I and R > I
                   else "plain ring (--sp-mode ring)"))
    if mode.startswith("hybrid") and R == 1:
        return (f"a ring of --world-size {world} / --ulysses-size {U} = 1 rank: that is the "
                f"Ulysses mode (--sp-mode ulysses)")
    if mode == "ulysses" and U == 1:
        return "--world-size 1: a Ulysses degree of 1 moves nothing (run 2 ranks or more)"
    if I is not None and R <= I:
        return (f"--inner-ring-size {I} is the whole ring of {R} ranks: one inner ring is the "
                + ("plain ring (--sp-mode ring)" if U == 1 else "hybrid (--sp-mode hybrid)"))
    return None


def main_sp(args, launched, device):
    """The --sp-mode job: spawn (or use the launcher's) ranks, run every mode, print, JSON."""
    args.sp_modes = parse_sp_modes(args.sp_mode)
    world = int(os.environ["WORLD_SIZE"]) if launched else args.world_size
    asked = args.sp_modes
    args.sp_modes = fitting_sp_modes(args.sp_modes, args.sp_mode == "all", world, args.heads,
                                     args.ulysses_size, args.inner_ring_size)
    left_out = [m for m in asked if m not in args.sp_modes]
    if left_out and (not launched or int(os.environ.get("RANK", 0)) == 0):
        progress(f"--sp-mode all: leaving out {', '.join(left_out)} (sizes that do not fit "
                 f"--world-size {world} and --heads {args.heads}, or the same as another mode "
                 f"here)")
    threads = args.threads  # (bench_ring's: what the ranks run, launched or spawned)
    if launched:
        init_launched_group(device, args.timeout)
        rows, load = run_with_load(True, device, world * threads,
                                   lambda: run_rank_sp(args, device))
        is_main = dist.get_rank() == 0
    else:
        progress(f"spawning {args.world_size} local CPU ranks (gloo); {threads} thread(s) each")
        rows, load = run_with_load(False, device, world * threads, lambda: spawn_cpu_ranks(
            args.world_size, run_rank_sp, args, args.timeout, threads))
        is_main = True
    failed = []
    if is_main:
        failed = report_sp(args, rows, device, load)
        write_json(args.json, {"benchmark": "bench_ring --sp-mode",
                               "environment": environment(device), "args": vars(args),
                               "results": rows, "machine_load": load.as_dict()})
    if launched:
        dist.destroy_process_group()
    return 1 if failed else 0
