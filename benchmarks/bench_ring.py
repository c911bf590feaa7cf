"""Long-context ring attention benchmark: the README's main job.

Without a launcher (and without a GPU) it spawns ``--world-size`` local CPU ranks on gloo
(default min(4, cores), one torch thread each, so ranks never time-share a core); under
``torchrun`` it uses the launcher's ranks (NCCL on GPUs, one GPU per local rank). For every
layout it reports forward and forward+backward time, TFLOP/s, peak memory per rank, the ring
overhead and a correctness spot check against float64 attention on a slice of queries. Rank 0
prints every stage as it starts and ends (flushed, with elapsed time), also into a file or pipe.

Definitions (also in the README):
  ring overhead = ring time / time of the same block tasks run without communication on the
                  busiest rank (kernel calls only: no exchange, no merge, no copies; each rank
                  timed alone while the others wait).
  load balance  = contiguous causal time / zigzag causal time at the same shape.

    python benchmarks/bench_ring.py                                   # min(4, cores) CPU ranks
    python benchmarks/bench_ring.py --world-size 2 --seqlen 16384 --threads-per-rank 1
    python benchmarks/bench_ring.py --memory-scaling 1,2,4 --memory-seqlen 32768
    torchrun --nproc-per-node 8 benchmarks/bench_ring.py --seqlen 131072 --dtype bf16
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

# The main job's install command has no NumPy; torch warns about that on import (in every rank).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (PeakMemory, Stage, attention_flops, cpu_isa, cpu_model,  # noqa: E402
                    environment, format_table, init_launched_group, launcher_device,
                    load_average, logical_cpus, mib, progress, spawn_cpu_ranks,
                    threads_per_rank, time_ms, usable_cores, write_json)

import ringseq  # noqa: E402
from ringseq.comm import get_comm  # noqa: E402
from ringseq.kernels import compute_delta  # noqa: E402
from ringseq.layouts import get_layout  # noqa: E402
from ringseq.ops import get_backend  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
# absolute floor of the spot check (docs/design.md tolerance: 2x plain same-dtype error + floor)
CHECK_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None,
                   help="local ranks to spawn (default min(4, cores); ignored under torchrun)")
    p.add_argument("--seqlen", type=int, default=8192, help="total (global) sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=None)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp32 on CPU, bf16 on GPU")
    p.add_argument("--layouts", default="contiguous,zigzag,stripe")
    p.add_argument("--causal", choices=["true", "false", "both"], default="true")
    p.add_argument("--modes", default="fwd,fwd_bwd")
    p.add_argument("--backend", default=None, help="block kernel backend (default: best available)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5,
                   help="timed repetitions (median); the default run takes about two minutes on a "
                        "2-core AVX2 machine, about one with AVX-512")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="torch threads per spawned CPU rank (default 1)")
    p.add_argument("--check-rows", type=int, default=32, help="query rows per rank in the spot check")
    p.add_argument("--memory-scaling", default=None,
                   help="comma list of world sizes: forward peak memory per rank at --memory-seqlen "
                        "(local spawned ranks only)")
    p.add_argument("--memory-seqlen", type=int, default=32768)
    p.add_argument("--timeout", type=float, default=1800, help="seconds before spawned ranks are killed")
    p.add_argument("--json", default=None, help="write results to this path")
    p.add_argument("--plot", default=None, help="write a PNG bar chart (needs matplotlib)")
    # sequence-parallel modes (benchmarks/sp_modes.py): instead of the layout jobs, compare
    # ring / Ulysses / hybrid / double ring at this shape (measured bytes per rank per call)
    p.add_argument("--sp-mode", default=None,
                   help="comma list of ring,ulysses,hybrid,double_ring,hybrid_double_ring or "
                        "'all': run benchmarks/sp_modes.py's comparison instead")
    p.add_argument("--ulysses-size", type=int, default=2, help="Ulysses degree of hybrid modes")
    p.add_argument("--inner-ring-size", type=int, default=2, help="inner ring of double rings")
    # masked ring attention (benchmarks/masked_ring.py): instead of the layout jobs
    p.add_argument("--window", type=int, default=None,
                   help="causal sliding window of this many tokens vs full causal at the same "
                        "shape: exchanges, bytes, time, overhead (layouts: --layouts)")
    p.add_argument("--docs", default=None,
                   help="packed documents: 'seeded', 'longtail' or a comma list of lengths "
                        "(Documents layout; visible work per rank, time vs documents alone)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in ("fwd", "fwd_bwd"):
            p.error(f"--modes takes fwd and fwd_bwd, got {m!r}")
    args.layouts = [x for x in args.layouts.split(",") if x]
    for name in args.layouts:
        get_layout(name)  # unknown names fail here, before any rank starts
    if args.world_size is None:
        args.world_size = max(1, min(4, usable_cores()))
    if args.threads_per_rank is None:
        args.threads_per_rank = 1
    return args


# ---------------------------------------------------------------- one rank
def _inputs(args, device, dtype, seqlen, layout, group):
    """Global q, k, v from one seed on every rank, then this rank's shards (b, s_local, h, d)."""
    gen = torch.Generator().manual_seed(1234)
    h_kv = args.heads_kv or args.heads
    shape_q = (args.batch, seqlen, args.heads, args.headdim)
    shape_kv = (args.batch, seqlen, h_kv, args.headdim)
    full = [torch.randn(s, generator=gen).to(dtype) for s in (shape_q, shape_kv, shape_kv)]
    local = [ringseq.shard(t, layout, group).to(device) for t in full]
    return full, local


def _busiest_ms(ms, device):
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _compute_only(args, layout, causal, be, q, k, v, with_bwd):
    """The rank's block tasks with its own K/V standing in for the remote ones (no comm/merge)."""
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


def _isolated_ms(fn, device, args):
    """time_ms(fn) on each rank in turn while the others wait at a barrier: the rank's own
    kernel time, whatever else shares its core. Timing all ranks at once would charge a rank
    for its neighbours whenever ranks share a physical core (SMT siblings, an oversubscribed
    or busy machine): there the balanced layouts, whose ranks are all busy, looked slower than
    the unbalanced contiguous one, whose busiest rank mostly runs alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ms = 0.0
    for r in range(world):
        dist.barrier()
        if r == rank:
            ms = time_ms(fn, device, args.warmup, args.repeats)
    dist.barrier()
    return ms


def _spot_check(args, layout, causal, full, out_local, group):
    """Max error of this rank's first query rows against float64 attention, and the error of
    plain same-dtype attention at the same rows (docs/design.md's tolerance base)."""
    q, k, v = full
    n = min(args.check_rows, out_local.shape[1])
    pos = ringseq.positions(q.shape[1], layout, group)[:n]
    h, h_kv = q.shape[2], k.shape[2]

    def attend(dtype):
        qs = q[:, pos].to(dtype)
        ks = k.to(dtype).repeat_interleave(h // h_kv, 2)
        vs = v.to(dtype).repeat_interleave(h // h_kv, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", qs, ks) * args.headdim ** -0.5
        if causal:
            s = s.masked_fill(torch.arange(k.shape[1])[None, :] > pos[:, None], float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vs)

    ref = attend(torch.float64)
    plain = attend(q.dtype) if q.dtype != torch.float64 else ref
    err = float((out_local[:, :n].double().cpu() - ref).abs().max())
    base = float((plain.double() - ref).abs().max())
    return err, base


def _run_job(args, device, dtype, group, be, layout, causal, mode, main):
    """One (layout, causal, mode) measurement on every rank; rank 0's stages are printed."""
    world = dist.get_world_size()
    full, (q, k, v) = _inputs(args, device, dtype, args.seqlen, layout, group)
    grad = mode == "fwd_bwd"
    for t in (q, k, v):
        t.requires_grad_(grad)
    dout = torch.randn_like(q)

    def ring_step():
        if grad:
            out = ringseq.ring_flash_attn_func(q, k, v, causal=causal, group=group,
                                               layout=layout, backend=be)
            torch.autograd.backward(out, dout)
            for t in (q, k, v):
                t.grad = None
            return out
        with torch.no_grad():
            return ringseq.ring_flash_attn_func(q, k, v, causal=causal, group=group,
                                                layout=layout, backend=be)

    with Stage("  ring: first call and peak memory", main):
        out = ring_step()  # also the consistency check's first call
        gc.collect()
        dist.barrier()
        with PeakMemory(device) as mem:
            ring_step()
        dist.barrier()
    with Stage(f"  ring: {args.warmup} warm-up + {args.repeats} timed", main) as st:
        ms = _busiest_ms(time_ms(ring_step, device, args.warmup, args.repeats), device)
        st.note = f"{ms:.1f} ms on the busiest rank"
    with Stage(f"  compute only: {args.warmup} warm-up + {args.repeats} timed, one rank at a time",
               main) as st:
        with torch.no_grad():
            compute = _compute_only(args, layout, causal, be, q.detach(), k.detach(), v.detach(), grad)
            base_ms = _busiest_ms(_isolated_ms(compute, device, args), device)
        st.note = f"{base_ms:.1f} ms on the busiest rank"
    with Stage("  spot check against float64", main):
        err, plain_err = _spot_check(args, layout, causal, full, out.detach(), group)
    peak = torch.tensor([float(mem.peak or 0)], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    errs = torch.tensor([err, plain_err], dtype=torch.float64, device=device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    flops = attention_flops(args.batch, args.heads, args.seqlen, args.seqlen, args.headdim, causal, mode)
    row = {
        "layout": layout, "causal": causal, "mode": mode, "world_size": world,
        "seqlen": args.seqlen, "ms": ms, "tflops": flops / ms / 1e9,
        "peak_mib_per_rank": mib(peak.item()) if mem.peak is not None else None,
        "compute_only_ms": base_ms, "ring_overhead": ms / base_ms,
        "max_err": float(errs[0]), "plain_err": float(errs[1]),
        "check_ok": bool(errs[0] <= 2 * errs[1] + CHECK_FLOOR[dtype]),
    }
    del full, q, k, v, out
    gc.collect()
    return row


def run_rank(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    group = dist.group.WORLD
    be = get_backend(args.backend, device, dtype, args.headdim)
    causals = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    jobs = [(lay, c, m) for lay in args.layouts for c in causals for m in args.modes]
    rows = []
    main = rank == 0
    for i, (layout, causal, mode) in enumerate(jobs, 1):
        job = Stage(f"[{i}/{len(jobs)}] {layout} {'causal' if causal else 'full'} {mode} "
                    f"W={world} s={args.seqlen}", main)
        with job:
            row = _run_job(args, device, dtype, group, be, layout, causal, mode, main)
            job.note = (f"ring {row['ms']:.1f} ms, compute-only {row['compute_only_ms']:.1f} ms, "
                        f"check {'ok' if row['check_ok'] else 'FAILED'}")
        rows.append(row)
    return rows


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


# ---------------------------------------------------------------- report
def report(args, rows, memory, device):
    print(f"# bench_ring: total s={args.seqlen} b={args.batch} h={args.heads} "
          f"h_kv={args.heads_kv or args.heads} d={args.headdim} {args.dtype} on {device}, "
          f"W={rows[0]['world_size'] if rows else '?'}")
    if device.type == "cpu":
        print(f"# CPU: {cpu_model()}, {usable_cores()} cores; ringseq CPU kernel ISA: {cpu_isa()}; "
              f"{threads_per_rank(args.threads_per_rank, rows[0]['world_size'] if rows else 1)} "
              f"thread(s) per rank")
    print("# overhead = ring time / same block tasks without communication on the busiest rank "
          "(ranks timed one at a time); "
          "err = max |out - float64| on a query slice (plain = same-dtype attention's error)")
    columns = [("layout", "layout", "{}"), ("causal", "causal", "{}"), ("mode", "mode", "{}"),
               ("ms", "ms", "{:.1f}"), ("tflops", "TFLOP/s (all ranks)", "{:.4f}"),
               ("peak_mib_per_rank", "peak MiB/rank", "{:.1f}"),
               ("compute_only_ms", "compute-only ms", "{:.1f}"), ("ring_overhead", "overhead", "{:.3f}"),
               ("max_err", "err", "{:.2e}"), ("plain_err", "plain err", "{:.2e}"),
               ("check_ok", "check", "{}")]
    print(format_table(rows, columns))
    balance = {}
    for mode in args.modes:
        cont = next((r for r in rows if r["layout"] == "contiguous" and r["causal"] and r["mode"] == mode), None)
        zig = next((r for r in rows if r["layout"] == "zigzag" and r["causal"] and r["mode"] == mode), None)
        if cont and zig:
            balance[mode] = cont["ms"] / zig["ms"]
            print(f"load balance ({mode}): contiguous causal / zigzag causal = {balance[mode]:.2f}")
    if memory:
        print("forward peak memory per rank above baseline, zigzag causal, total s="
              f"{args.memory_seqlen}: " + ", ".join(f"W={w}: {m:.1f} MiB" for w, m in memory.items()))
        ws = sorted(memory)
        for w in ws[1:]:
            print(f"  W={w} / W={ws[0]}: {memory[w] / memory[ws[0]]:.3f}")
    world = rows[0]["world_size"] if rows else 1
    threads = threads_per_rank(args.threads_per_rank, world)
    if device.type == "cpu" and world * threads > usable_cores():
        smt = logical_cpus() > usable_cores()
        print(f"note: {world} ranks x {threads} thread(s) exceed this machine's {usable_cores()} "
              f"physical cores{f' ({logical_cpus()} logical CPUs: SMT siblings share a core)' if smt else ''}, "
              f"so ranks time-share: ring overhead and load balance are not meaningful "
              f"here (use --world-size {max(1, usable_cores())} --threads-per-rank 1)")
    if device.type == "cpu":
        start, end = args.load_average_start, load_average()
        if start is not None and end is not None:
            print(f"# 1-minute load average {start:.2f} before, {end:.2f} after the run "
                  f"(this run's own ranks add up to {world * threads})")
    failed = [r for r in rows if not r["check_ok"]]
    for r in failed:
        print(f"SPOT CHECK FAILED: {r['layout']} {r['mode']} err {r['max_err']:.3e} > 2x {r['plain_err']:.3e}")
    return balance, failed


def plot(path, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("--plot needs matplotlib (pip install matplotlib); no plot written")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['layout']}\n{'causal' if r['causal'] else 'full'} {r['mode']}" for r in rows]
    ax.bar(range(len(rows)), [r["ms"] for r in rows], label="ring")
    ax.bar(range(len(rows)), [r["compute_only_ms"] for r in rows], width=0.4, label="compute only")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("ms (busiest rank)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    progress(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    args.load_average_start = load_average()
    launched, device = launcher_device()
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if args.sp_mode:
        from sp_modes import main_sp
        return main_sp(args, launched, device)
    if args.window is not None or args.docs:
        from masked_ring import main_masked
        return main_masked(args, launched, device)
    memory = {}
    if launched:
        init_launched_group(device, args.timeout)
        rows = run_rank(args, device)
        is_main = dist.get_rank() == 0
    else:
        threads = threads_per_rank(args.threads_per_rank, args.world_size)
        progress(f"bench_ring: {args.world_size} local CPU ranks (gloo), {threads} thread(s) each, "
                 f"on {usable_cores()} cores ({cpu_model()}); ringseq CPU kernel ISA {cpu_isa()}")
        with Stage(f"all measurements on {args.world_size} spawned ranks"):
            rows = spawn_cpu_ranks(args.world_size, run_rank, args, args.timeout, threads)
        if args.memory_scaling:
            for w in (int(x) for x in args.memory_scaling.split(",")):
                with Stage(f"memory: forward at W={w}, s={args.memory_seqlen}"):
                    memory[w] = spawn_cpu_ranks(w, memory_task, args, args.timeout,
                                                threads_per_rank(args.threads_per_rank, w))
        is_main = True
    failed = []
    if is_main:
        balance, failed = report(args, rows, memory, device)
        sys.stdout.flush()
        write_json(args.json, {"benchmark": "bench_ring", "environment": environment(device),
                               "args": vars(args), "results": rows, "load_balance": balance,
                               "memory_per_rank_mib": memory})
        if args.plot:
            plot(args.plot, rows)
    if launched:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
