"""The main job's rank side (``bench_ring.py``): one (layout, causal, mode) row per call of
:func:`run_rank`, measured on every rank in lockstep, with its invariants checked and a row
that breaks one measured once more.

Per row, on every rank (rank 0 prints the stages):
  ring          1 untimed call (the consistency check's first call, exchange buffers made),
                1 call under the peak-memory probe, ``--warmup`` untimed, ``--repeats`` timed:
                wall time (the ring waits for its peers), median per rank, busiest rank.
  compute only  the same block kernel calls without exchange, merge or copies, ``--warmup``
                untimed and ``--repeats`` timed on all ranks at once: the calling thread's CPU
                time on CPU ranks with one thread (what the kernels cost this rank; other
                processes sharing its core inflate it far less than wall time), wall time
                otherwise; median per rank, busiest rank.
  spot check    ``--check-rows`` query rows spread over the shard against float64 attention.

Invariants (the definitions rule out anything else): ring overhead >= 0.95, spot check
error <= 2x plain same-dtype attention's + floor, load balance <= the ideal of the schedules'
visible (query, key) pairs (a cross-row check, done by bench_ring.py). A row whose overhead
is below 0.95 is measured once more here, on every rank alike (the decision uses all-reduced
numbers); if it still is, it carries a warning naming the likely cause.
"""
from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from common import (CHECK_FLOOR, DTYPES, PeakMemory, Stage, attention_flops, busy_cores,  # noqa: F401
                    keep_failed_check, max_over_ranks, mib, proc_stat, progress, spot_check,
                    time_ms, worst)
from masked_ring import visible_pairs

import ringseq
from ringseq import get_comm
from ringseq.kernels import compute_delta
from ringseq.layouts import get_layout
from ringseq.masks import AttnMask
from ringseq.ops import get_backend

MIN_OVERHEAD = 0.95   # ring time / compute-only time below this is a measurement error
SHORT_MS = 2.0        # below this, timer resolution and per-call costs dominate a time
BALANCE_SLACK = 0.03  # medians of a few timed calls: the load balance's allowance for noise


# ---------------------------------------------------------------- machine load
class LoadProbe:
    """CPU cores other processes kept busy during a block, on average: the machine's busy
    time (/proc/stat) minus this run's own ranks' CPU time (each rank's ``process_time``, all
    threads, summed over the ranks by an all-reduce). None where /proc/stat is missing."""

    def __init__(self, device):
        self.device, self.others = device, None

    def __enter__(self):
        self.stat, self.cpu, self.t0 = proc_stat(), time.process_time(), time.time()
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            return False
        ours = torch.tensor([time.process_time() - self.cpu], dtype=torch.float64, device=self.device)
        dist.all_reduce(ours)
        total = busy_cores(self.stat, proc_stat())
        if total is not None:
            self.others = max(0.0, total - float(ours) / max(1e-9, time.time() - self.t0))
        return False


# ---------------------------------------------------------------- one row
def _inputs(args, device, dtype, seqlen, layout, group):
    """Global q, k, v from one seed on every rank, then this rank's shards (b, s_local, h, d)."""
    gen = torch.Generator().manual_seed(1234)
    h_kv = args.heads_kv or args.heads
    shape_q = (args.batch, seqlen, args.heads, args.headdim)
    shape_kv = (args.batch, seqlen, h_kv, args.headdim)
    full = [torch.randn(s, generator=gen).to(dtype) for s in (shape_q, shape_kv, shape_kv)]
    local = [ringseq.shard(t, layout, group).to(device) for t in full]
    return full, local


def _busiest(value, device):
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _compute_only(args, layout, causal, be, q, k, v, with_bwd):
    """The rank's block tasks with its own K/V standing in for the remote ones (no exchange,
    merge or copies): the ring's kernel calls in the ring's order; the backward uses the local
    out/lse in place of the ring's merged ones (same shapes, same work)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule = get_layout(layout).schedule(rank, world, q.shape[1], causal)
    scale = args.headdim ** -0.5
    tasks = [t for step in schedule for t in step]
    if with_bwd:
        out, lse = be.fwd(q, k, v, scale, causal)
        dout = torch.randn_like(out)
        acc = be.accum_dtype(q.dtype)
        delta = compute_delta(dout, out)
        grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v)]

    def run():
        for t in tasks:
            be.fwd(q[:, t.q], k[:, t.kv], v[:, t.kv], scale, t.causal)
        if with_bwd:
            for t in tasks:
                be.bwd_accum(dout[:, t.q], q[:, t.q], k[:, t.kv], v[:, t.kv], out[:, t.q],
                             lse[:, :, t.q], scale, t.causal, delta[:, :, t.q],
                             grads[0][:, t.q], grads[1][:, t.kv], grads[2][:, t.kv])

    return run


def _compute_ms(fn, device, args, clock):
    """time_ms(fn) of the compute-only tasks. With the CPU clock all ranks run at once: a
    thread's CPU time is its own work whoever shares the core. With wall time on CPU ranks,
    each rank in turn while the others wait at a barrier, so that a rank is not charged for
    its neighbours where ranks share a physical core (SMT siblings, more rank threads than
    cores); on GPUs (one per rank) all at once."""
    if clock == "cpu" or device.type != "cpu":
        dist.barrier()
        return time_ms(fn, device, args.warmup, args.repeats, clock)
    rank, world = dist.get_rank(), dist.get_world_size()
    ms = 0.0
    for r in range(world):
        dist.barrier()
        if r == rank:
            ms = time_ms(fn, device, args.warmup, args.repeats)
    dist.barrier()
    return ms


def compute_clock(args, device):
    """The compute-only clock: thread CPU time where all kernel work runs on the calling
    thread (CPU ranks with one torch thread), so that other processes and this run's other
    ranks sharing a core do not inflate it; wall time (CUDA events) otherwise."""
    return "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"


def _spot_check(args, layout, causal, full, out_local, group):
    """common.spot_check on ``--check-rows`` query rows of this rank's shard of ``layout``."""
    pos = ringseq.positions(full[0].shape[1], layout, group)
    return spot_check(full, out_local, pos, causal, args.check_rows)


def busiest_pairs(layout, world, seqlen, causal):
    """Visible (query, key) pairs of the busiest rank's schedule: the work the load balance's
    ideal is the ratio of."""
    lay = get_layout(layout)
    return max(visible_pairs(lay, world, seqlen // world, AttnMask(causal=causal)))


def measure_row(args, device, dtype, group, be, layout, causal, mode, main):
    """One (layout, causal, mode) measurement on every rank; rank 0's stages are printed."""
    world = dist.get_world_size()
    full, (q, k, v) = _inputs(args, device, dtype, args.seqlen, layout, group)
    grad = mode == "fwd_bwd"
    for t in (q, k, v):
        t.requires_grad_(grad)
    dout = torch.randn_like(q)
    last = {}  # the latest call's output: the last timed call's is spot-checked too

    def ring_step():
        if grad:
            out = ringseq.ring_flash_attn_func(q, k, v, causal=causal, group=group,
                                               layout=layout, backend=be)
            torch.autograd.backward(out, dout)
            for t in (q, k, v):
                t.grad = None
        else:
            with torch.no_grad():
                out = ringseq.ring_flash_attn_func(q, k, v, causal=causal, group=group,
                                                   layout=layout, backend=be)
        last["out"] = out.detach()
        return out

    with LoadProbe(device) as load:
        out = ring_step()  # also the consistency check's first call
        # The ring's exchange buffers are attention memory too: count them in the peak (as
        # forward_peak and --memory-scaling do), not as part of the rank's baseline.
        get_comm(group).release_buffers()
        gc.collect()
        dist.barrier()
        with PeakMemory(device) as mem:
            ring_step()
        dist.barrier()
        ms = _busiest(time_ms(ring_step, device, args.warmup, args.repeats), device)
        clock = compute_clock(args, device)
        with torch.no_grad():
            compute = _compute_only(args, layout, causal, be, q.detach(), k.detach(),
                                    v.detach(), grad)
            base_ms = _busiest(_compute_ms(compute, device, args, clock), device)
    # the first call (fresh exchange buffers) and the last timed one (reused buffers, cached
    # plans): a defect that shows from the second call on fails the row too
    err, plain_err = _spot_check(args, layout, causal, full, out.detach(), group)
    err_last, _ = _spot_check(args, layout, causal, full, last["out"], group)
    err = worst(err, err_last)
    peak = torch.tensor([float(mem.peak or 0)], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    # Each rank's error against its own plain error (a rank whose rows see few keys has a
    # larger one, which must not become the bound of another rank's rows): the worst excess.
    errs = max_over_ranks([err, plain_err, err - 2 * plain_err], device)
    flops = attention_flops(args.batch, args.heads, args.seqlen, args.seqlen, args.headdim, causal, mode)
    row = {
        "layout": layout, "causal": causal, "mode": mode, "world_size": world,
        "seqlen": args.seqlen, "ms": ms, "tflops": flops / ms / 1e9,
        "peak_mib_per_rank": mib(peak.item()) if mem.peak is not None else None,
        "compute_only_ms": base_ms, "compute_clock": clock, "ring_overhead": ms / base_ms,
        "max_err": float(errs[0]), "plain_err": float(errs[1]),
        "check_ok": bool(errs[2] <= CHECK_FLOOR[dtype]),
        "other_load_cores": load.others, "warnings": [],
    }
    del full, q, k, v, out, last
    gc.collect()
    return row


def likely_cause(rows, cores_used, cores):
    """Why timings broke an invariant, from what was measured while they ran."""
    others = max((r["other_load_cores"] or 0.0) for r in rows)
    if others > 0.25 or cores_used > cores:
        why = []
        if others > 0.25:
            why.append(f"other processes kept {others:.1f} core(s) busy meanwhile")
        if cores_used > cores:
            why.append(f"this run's {cores_used} rank thread(s) share {cores} physical core(s)")
        return "machine load: " + "; ".join(why)
    if min(min(r["ms"], r["compute_only_ms"]) for r in rows) < SHORT_MS:
        return (f"timer resolution: times under {SHORT_MS} ms are dominated by the clock and "
                f"per-call costs (raise --seqlen)")
    return ("no load or short time seen: CPU frequency changes or a noisy neighbour on a "
            "virtual machine; rerun, and report it if it persists")


def _measure_checked(args, device, dtype, group, be, job, label, main, cores_used):
    """measure_row with the row invariants: a row whose overhead is below MIN_OVERHEAD is
    measured once more (every rank decides alike: the numbers are all-reduced)."""
    layout, causal, mode = job
    with Stage(label, main) as stage:
        row = measure_row(args, device, dtype, group, be, layout, causal, mode, main)
        if row["ring_overhead"] < MIN_OVERHEAD:
            first = row
            if main:
                progress(f"  overhead {row['ring_overhead']:.3f} < {MIN_OVERHEAD}: measuring "
                         f"this row once more")
            row = keep_failed_check(first, measure_row(args, device, dtype, group, be, layout,
                                                       causal, mode, main))
            row["remeasured"] = True
            if row["ring_overhead"] < MIN_OVERHEAD:
                row["warnings"].append(
                    f"ring overhead {row['ring_overhead']:.3f} < {MIN_OVERHEAD} twice (first "
                    f"{first['ring_overhead']:.3f}); likely cause: "
                    f"{likely_cause([first, row], cores_used, args.physical_cores)}")
        if not row["check_ok"]:
            row["warnings"].append(
                f"spot check failed: error {row['max_err']:.3e} > 2 x plain "
                f"{row['plain_err']:.3e} + {CHECK_FLOOR[dtype]:.0e}: a wrong result, not a "
                f"timing problem")
        stage.note = (f"ring {row['ms']:.1f} ms, compute-only {row['compute_only_ms']:.1f} ms, "
                      f"overhead {row['ring_overhead']:.3f}, "
                      f"check {'ok' if row['check_ok'] else 'FAILED'}")
    return row


def load_balance(rows, world, seqlen):
    """For each (causal, mode) with both a contiguous and a zigzag row: the measured
    contiguous / zigzag time and its ideal, the ratio of the busiest ranks' visible pairs
    (W=2, causal: 1.5; full attention: 1). Returns {(causal, mode): {"value", "ideal", "ok"}};
    ok when 1 <= value <= ideal, each end widened by BALANCE_SLACK: zigzag's busiest rank has
    no more pairs than contiguous's, and contiguous cannot beat the ratio of the work unless
    its per-pair cost is below zigzag's."""
    out = {}
    for r in rows:
        if r["layout"] != "contiguous":
            continue
        zig = next((z for z in rows if z["layout"] == "zigzag" and z["causal"] == r["causal"]
                    and z["mode"] == r["mode"]), None)
        if zig is None:
            continue
        ideal = (busiest_pairs("contiguous", world, seqlen, r["causal"])
                 / busiest_pairs("zigzag", world, seqlen, r["causal"]))
        value = r["ms"] / zig["ms"]
        low, high = (1.0 - BALANCE_SLACK) * min(1.0, ideal), (1.0 + BALANCE_SLACK) * max(1.0, ideal)
        out[(r["causal"], r["mode"])] = {"value": value, "ideal": ideal,
                                         "ok": low <= value <= high}
    return out


def run_rank(args, device):
    """Every (layout, causal, mode) row on this rank with the invariants checked (see the
    module docstring); returns {"rows": [...], "balance": load_balance(...)}: rank 0's view,
    the numbers are all-reduced so every rank agrees."""
    world = dist.get_world_size()
    dtype = DTYPES[args.dtype]
    group = dist.group.WORLD
    be = get_backend(args.backend, device, dtype, args.headdim)
    causals = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    jobs = [(lay, c, m) for lay in args.layouts for c in causals for m in args.modes]
    main = dist.get_rank() == 0
    cores_used = world * torch.get_num_threads()
    rows = []
    for i, job in enumerate(jobs, 1):
        layout, causal, mode = job
        label = f"[{i}/{len(jobs)}] {layout} {'causal' if causal else 'full'} {mode} W={world} s={args.seqlen}"
        rows.append(_measure_checked(args, device, dtype, group, be, job, label, main, cores_used))
    balance = load_balance(rows, world, args.seqlen)
    for (causal, mode), b in list(balance.items()):
        if b["ok"]:
            continue
        if main:
            progress(f"load balance ({mode}) {b['value']:.2f} outside [1, {b['ideal']:.2f}]: "
                     f"measuring contiguous and zigzag once more")
        pair = [next(j for j, r in enumerate(rows) if (r["layout"], r["causal"], r["mode"])
                     == (lay, causal, mode)) for lay in ("contiguous", "zigzag")]
        first = [rows[j] for j in pair]
        for j in pair:
            r = rows[j]
            rows[j] = _measure_checked(args, device, dtype, group, be,
                                       (r["layout"], causal, mode), f"again: {r['layout']} "
                                       f"{'causal' if causal else 'full'} {mode}", main, cores_used)
            rows[j]["remeasured"] = True
        again = load_balance(rows, world, args.seqlen)[(causal, mode)]
        if not again["ok"]:
            again["warning"] = (
                f"load balance ({mode}) {again['value']:.2f} outside [1, {again['ideal']:.2f}] "
                f"twice (first {b['value']:.2f}); likely cause: "
                f"{likely_cause(first + [rows[j] for j in pair], cores_used, args.physical_cores)}")
        balance[(causal, mode)] = again
    return {"rows": rows, "balance": balance}


def forward_peak(args, device, seqlen, layout):
    """Peak memory of one ring forward above the rank's baseline (inputs already resident,
    exchange buffers not yet allocated)."""
    dtype = DTYPES[args.dtype]
    _, (q, k, v) = _inputs(args, device, dtype, seqlen, layout, dist.group.WORLD)
    be = get_backend(args.backend, device, dtype, args.headdim)
    with torch.no_grad():
        ringseq.ring_flash_attn_func(q, k, v, causal=True, layout=layout, backend=be)  # warm-up, consistency check
        # The ring's exchange buffers are attention memory too: count them in the peak.
        get_comm(None).release_buffers()
        gc.collect()
        dist.barrier()
        with PeakMemory(device) as mem:
            ringseq.ring_flash_attn_func(q, k, v, causal=True, layout=layout, backend=be)
    peak = torch.tensor([float(mem.peak or 0)], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return None if mem.peak is None else mib(peak.item())


def memory_task(args, device):
    return forward_peak(args, device, args.memory_seqlen, "zigzag")
