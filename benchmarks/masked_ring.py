"""``bench_ring.py --window L`` and ``bench_ring.py --docs MIX``: masked ring attention.

``--window L`` (causal sliding window of L tokens, each of ``--layouts``): for the
window and for full causal attention at the same shape, forward+backward time on the busiest
rank, exchanges per call (forward / backward, as the transport counted them), bytes each rank
sent (:mod:`ringseq.commstats`), and the ring overhead = ring time / the same banded block
tasks without communication (kernel calls only, on the real K/V of each step's source rank). Bars (issue of record): overhead <= 1.2 and
full causal >= 2x slower than the window at 32k tokens, window 4096, W=2.

``--docs MIX`` (packed documents; MIX: ``seeded`` -- a seeded mix of >= 8 documents --,
``longtail`` -- one long document and many short ones --, or a comma list of lengths): the
Documents layout; per-rank visible FLOPs (max / mean), forward+backward time on the busiest
rank, and the time of all documents alone on one device (one thread, one
``flash_attn_varlen_func`` call; every rank runs it at the same time, so it sees the same load
as a ring rank) for the ratio ``busiest / (alone / W)``. Bars: max/mean <=
1.10 and ratio <= 1.15 at 16k tokens, W=2, one thread per rank.

    python benchmarks/bench_ring.py --world-size 2 --threads-per-rank 1 --seqlen 32768 --window 4096
    python benchmarks/bench_ring.py --world-size 2 --threads-per-rank 1 --seqlen 16384 --docs seeded
"""
from __future__ import annotations

import gc
import random

import torch
import torch.distributed as dist

from common import (CHECK_FLOOR, DTYPES, PeakMemory, cpu_header, environment, format_table,
                    keep_failed_check, max_over_ranks, mib, progress, run_with_load,
                    spawn_cpu_ranks, spot_check, threads_per_rank, time_ms, write_json)

import ringseq  # noqa: E402
from ringseq import commstats  # noqa: E402
from ringseq.engine.plan import make_plan  # noqa: E402
from ringseq.spec import attn_spec  # noqa: E402
from ringseq.layouts import Documents, get_layout  # noqa: E402
from ringseq.masks import AttnMask  # noqa: E402


def document_lengths(mix: str, total: int, seed: int = 0):
    """Document lengths summing to ``total``: ``seeded`` (>= 8 documents of random lengths),
    ``longtail`` (one document of half the tokens, the rest in documents of 16-300 tokens) or
    an explicit comma list (the last one absorbs the rest)."""
    rng = random.Random(seed)
    if mix == "seeded":
        if total < 10:  # (before: random.sample's "Sample larger than population")
            raise ValueError(f"'seeded' cuts the sequence at 9 places: it needs at least 10 "
                             f"tokens, got {total}")
        cuts = sorted(rng.sample(range(1, total), 9))
        bounds = [0] + cuts + [total]
        return [b - a for a, b in zip(bounds, bounds[1:])]
    if mix == "longtail":
        lens, left = [total // 2], total - total // 2
        while left > 0:
            n = min(left, rng.randint(16, 300))
            lens.append(n)
            left -= n
        return lens
    try:
        lens = [int(x) for x in mix.split(",") if x]
    except ValueError:
        raise ValueError(f"not 'seeded', 'longtail' or a comma list of ints: {mix!r}") from None
    if not lens:
        raise ValueError("no document lengths")
    if min(lens) < 0:  # (before the last one absorbs the rest, which could hide it)
        raise ValueError(f"lengths must be >= 0, got {min(lens)}")
    if sum(lens) > total:
        raise SystemExit(f"--docs lengths sum to {sum(lens)} > --seqlen {total}")
    lens[-1] += total - sum(lens)
    return lens


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def visible_pairs(lay, world, s_local, mask: AttnMask):
    """Visible (query, key) pairs each rank's schedule computes (the FLOPs that matter)."""
    work = []
    for r in range(world):
        total = 0
        for tasks in lay.schedule(r, world, s_local, mask):
            for t in tasks:
                nq = len(range(*t.q.indices(s_local)))
                nk = len(range(*t.kv.indices(s_local)))
                spans = t.spans or [(0, nq, 0, nk, -(nq - 1), nk - nq if t.causal else nk - 1)]
                for _, a, _, b, lo, hi in spans:
                    for i in range(a):  # keys j with lo <= j - i <= hi, 0 <= j < b
                        total += max(0, min(b - 1, i + hi) - max(0, i + lo) + 1)
        work.append(total)
    return work


def _rank(args, case):
    """One masked ring case on this rank: time, exchanges, bytes; and the compute-only time."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(1)
    s, h, d = args.seqlen, args.heads, args.headdim
    h_kv = args.heads_kv or h
    full = [torch.randn(1, s, n, d, generator=g).to(dtype) for n in (h, h_kv, h_kv)]
    lay = case["layout"]
    q, k, v = (ringseq.shard(t, lay).requires_grad_() for t in full)
    dout = torch.randn_like(q)
    comm = ringseq.get_comm()  # the ring: its exchanges counted, its buffers released
    kw = dict(causal=True, layout=lay, window_size=case["window"], cu_seqlens=case["cu"],
              backend=args.backend)

    def step():
        out = ringseq.ring_flash_attn_func(q, k, v, **kw)
        fwd = comm.last_exchanges
        out.backward(dout)
        q.grad = k.grad = v.grad = None
        return fwd, comm.last_exchanges

    with commstats.count_bytes() as counter:
        exchanges = step()
    sent = counter.total
    # Peak of one fwd+bwd above the inputs, the ring's exchange buffers included (released
    # first, as bench_ring does), so every case is measured the same way.
    comm.release_buffers()
    gc.collect()
    dist.barrier()
    with PeakMemory(torch.device("cpu")) as mem:
        step()
    dist.barrier()
    ms = time_ms(step, torch.device("cpu"), args.warmup, args.repeats)
    # the same block tasks without communication (this rank's own K/V stand in)
    spec = attn_spec("masked_ring", q, k, v, causal=True, window_size=case["window"],
                     documents=case["cu"], backend=args.backend, needs_grad=False)
    bound = get_layout(lay).bind(spec.documents)  # (the documents layout: this call's)
    plan = make_plan(spec, bound, world, rank, q.shape, k.shape[2], q.dtype)
    be, scale = plan.backend, plan.softmax_scale
    qd, kd, vd, dd = (t.detach() for t in (q, k, v, dout))
    # The backward's kernels get the ring's own merged out / lse: their cost depends on the
    # values (exp of far-negative scores is cheap), so stand-ins would time another workload.
    out0, lse0 = ringseq.ring_flash_attn_func(qd, kd, vd, return_lse=True, **kw)
    # The ring's output against float64 attention with the same mask on --check-rows queries
    # spread over this rank's shard (each rank's error against its own plain error: the
    # worst excess)
    rows = args.check_rows
    pos = ringseq.layouts.positions_local(s, bound, world, rank)
    err, plain_err = spot_check(full, out0, pos, True, rows, window=case["window"],
                                cu_seqlens=case["cu"])
    errs = max_over_ranks([err, plain_err, err - 2 * plain_err])
    delta = ringseq.kernels.compute_delta(dd, out0)
    acc = [torch.zeros(t.shape, dtype=lse0.dtype) for t in (qd, kd, vd)]
    # the real K/V of each step's source rank (every rank holds the full tensors here), as the
    # ring delivers them: the rows that travel (plan.carried) from step 1 on
    held = []
    for i in range(plan.hops + 1):
        src = (rank - i) % world
        shards = [ringseq.layouts.shard_local(t, lay, world, src) for t in full[1:]]
        held.append(shards if i == 0 else [plan.carried(t, src) for t in shards])

    def compute():
        o = torch.zeros(qd.shape, dtype=lse0.dtype)
        ls = torch.full(lse0.shape, float("-inf"), dtype=lse0.dtype)
        for (kk, vv), tasks in zip(held, plan.schedule[:plan.hops + 1]):
            for t in tasks:
                be.run_fwd_accum(qd[:, t.q], kk[:, t.kv], vv[:, t.kv], scale, t.causal,
                                 o[:, t.q], ls[:, :, t.q], **plan.kernel_kwargs(t))
                be.run_bwd_accum(dd[:, t.q], qd[:, t.q], kk[:, t.kv], vv[:, t.kv],
                                 out0[:, t.q], lse0[:, :, t.q], scale, t.causal,
                                 delta[:, :, t.q], acc[0][:, t.q], acc[1][:, t.kv],
                                 acc[2][:, t.kv], **plan.kernel_kwargs(t))

    # (the main job's clock: a thread's CPU time with one thread per rank, so that the other
    # ranks and processes sharing a core do not inflate the baseline; before: wall time, and
    # a loaded machine showed overheads of 0.6-0.8)
    from ring_job import compute_clock  # (ring_job imports this module)
    clock = compute_clock(args, torch.device("cpu"))
    dist.barrier()
    compute_ms = time_ms(compute, torch.device("cpu"), args.warmup, args.repeats, clock)
    alone_ms = None
    if case["cu"] is not None:
        # Every rank runs all documents alone at once, so that the single-device time is
        # taken under the same load as the ring's ranks (all cores busy, one thread each).
        qf, kf, vf = (t[0].detach().requires_grad_() for t in full)
        cu = torch.tensor(case["cu"], dtype=torch.int32)
        mx = max(b - a for a, b in zip(case["cu"], case["cu"][1:]))
        do = torch.randn_like(qf)

        def alone():
            out = ringseq.flash_attn_varlen_func(qf, kf, vf, cu, cu, mx, mx, causal=True,
                                                 backend=args.backend)
            out.backward(do)
            qf.grad = kf.grad = vf.grad = None

        dist.barrier()
        alone_ms = time_ms(alone, torch.device("cpu"), args.warmup, args.repeats)
    stats = torch.tensor([ms, compute_ms, float(sent), alone_ms or 0.0, float(mem.peak or 0)],
                         dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    return {"ms": max(float(x[0]) for x in gathered),
            "compute_ms": max(float(x[1]) for x in gathered),
            "bytes_per_rank": max(float(x[2]) for x in gathered),
            "compute_clock": clock, "exchanges": exchanges,
            "max_err": float(errs[0]), "plain_err": float(errs[1]),
            "check_ok": bool(errs[2] <= CHECK_FLOOR[dtype]),
            "alone_ms": max(float(x[3]) for x in gathered) if alone_ms is not None else None,
            "peak_mib_per_rank": mib(max(float(x[4]) for x in gathered))
            if mem.peak is not None else None}


def _cases(args):
    world = args.world_size
    s_local = args.seqlen // world
    if args.docs:
        lens = document_lengths(args.docs, args.seqlen)
        cu = _cu(lens)
        lay = Documents(cu)
        mask = lay.mask(True)
        work = visible_pairs(lay, world, s_local, mask)
        # (the lengths the run used in the JSON: a comma list's last one absorbs the rest, so
        # "--docs 10,50" at 128 tokens ran 10 and 118)
        return [{"name": f"docs {args.docs} ({len(lens)} documents)", "layout": lay,
                 "window": (-1, -1), "cu": cu, "work": work, "doc_lengths": lens}]
    cases = []
    for name in args.layouts:
        lay = get_layout(name)
        for window in ((args.window, -1), (-1, -1)):
            mask = AttnMask(causal=True, window=window)
            cases.append({"name": f"{name} {'window ' + str(window[0]) if window[0] >= 0 else 'full causal'}",
                          "layout": lay, "window": window, "cu": None,
                          "work": visible_pairs(lay, world, s_local, mask)})
    return cases


def _run_all(args, device):
    from ring_job import MIN_OVERHEAD  # (ring_job imports this module)
    out = []
    for case in _cases(args):
        main = dist.get_rank() == 0
        if main:
            progress(f"{case['name']}: W={dist.get_world_size()} s={args.seqlen}")
        res = _rank(args, case)
        res["warnings"] = []
        # the main job's invariant: a ring slower than its own tasks alone is a measurement
        # error; measured once more, then warned about (every rank decides alike: the times
        # are gathered)
        if res["ms"] / res["compute_ms"] < MIN_OVERHEAD:
            first = res["ms"] / res["compute_ms"]
            if main:
                progress(f"  overhead {first:.3f} < {MIN_OVERHEAD}: measuring this case once "
                         f"more")
            res = keep_failed_check(res, _rank(args, case))
            res["remeasured"], res["warnings"] = True, []
            if res["ms"] / res["compute_ms"] < MIN_OVERHEAD:
                res["warnings"].append(
                    f"ring overhead {res['ms'] / res['compute_ms']:.3f} < {MIN_OVERHEAD} twice "
                    f"(first {first:.3f}): the timing is not meaningful here (see the machine "
                    f"load line)")
        if "doc_lengths" in case:
            res["doc_lengths"] = case["doc_lengths"]
        res.update(name=case["name"], work_max=max(case["work"]), work_all=sum(case["work"]),
                   work_max_over_mean=max(case["work"]) / (sum(case["work"]) / len(case["work"])))
        out.append(res)
    return out


def main_masked(args, launched, device):
    """Entry from bench_ring.py (--window / --docs)."""
    if launched or device.type != "cpu":
        raise SystemExit("--window / --docs run on spawned local CPU ranks (no launcher)")
    threads = threads_per_rank(args.threads_per_rank, args.world_size)
    progress(f"spawning {args.world_size} local CPU ranks (gloo), {threads} thread(s) each")
    W = args.world_size
    rows, load = run_with_load(False, device, W * threads, lambda: spawn_cpu_ranks(
        W, _run_all, args, args.timeout, threads))
    for r in rows:
        fwd, bwd = r["exchanges"]
        r["exchanges"] = f"{fwd} / {bwd}"
        r["overhead"] = r["ms"] / r["compute_ms"]
        r["mib_per_rank"] = r["bytes_per_rank"] / 2 ** 20
        # every rank's visible pairs (the main table's definition: the whole call's FLOPs
        # over its time): forward 4·d FLOPs per pair and head, backward 2.5x
        r["tflops"] = 3.5 * 4 * args.headdim * args.heads * r["work_all"] / r["ms"] / 1e9
        if r["alone_ms"]:
            r["vs_alone"] = r["ms"] / (r["alone_ms"] / W)
    full = {r["name"].split()[0]: r["ms"] for r in rows if "full causal" in r["name"]}
    for r in rows:
        if "window" in r["name"]:
            r["full_over_window"] = full.get(r["name"].split()[0], float("nan")) / r["ms"]
    columns = [("name", "case", "{}"), ("ms", "fwd+bwd ms (busiest)", "{:.1f}"),
               ("tflops", "TFLOP/s (visible, all ranks)", "{:.4f}"), ("peak_mib_per_rank", "peak MiB/rank", "{:.1f}"),
               ("compute_ms", "tasks alone ms", "{:.1f}"), ("overhead", "overhead", "{:.3f}"),
               ("exchanges", "exchanges fwd / bwd", "{}"), ("mib_per_rank", "MiB sent/rank", "{:.2f}"),
               ("work_max_over_mean", "visible work max/mean", "{:.3f}"),
               ("max_err", "err", "{:.2e}"), ("plain_err", "plain err", "{:.2e}"),
               ("check_ok", "check", "{}")]
    if any("full_over_window" in r for r in rows):
        columns.append(("full_over_window", "full causal / window", "{:.2f}"))
    if any(r.get("alone_ms") for r in rows):
        columns += [("alone_ms", "docs alone, 1 device ms", "{:.1f}"),
                    ("vs_alone", "busiest / (alone / W)", "{:.3f}")]
    print(f"# masked ring: s={args.seqlen} h={args.heads} d={args.headdim} {args.dtype} W={W}, "
          f"{threads} thread(s) per rank; overhead = ring time / the same block tasks without "
          f"communication ({rows[0]['compute_clock']} time)", flush=True)
    print(cpu_header(threads))
    load.print_summary(W * threads)
    print(format_table(rows, columns), flush=True)
    write_json(args.json, {"benchmark": "bench_ring masked", "environment": environment(device),
                           "args": vars(args), "results": rows,  # (numbers as numbers)
                           "machine_load": load.as_dict(),
                           "warnings": [f"{r['name']}: {w}" for r in rows for w in r["warnings"]]})
    for r in rows:
        for w in r["warnings"]:
            print(f"WARNING: {r['name']}: {w}", flush=True)
    failed = [r for r in rows if not r["check_ok"]]
    for r in failed:
        floor = CHECK_FLOOR[DTYPES[args.dtype]]
        print(f"WARNING: {r['name']}: spot check failed: error {r['max_err']:.3e} > 2 x plain "
              f"{r['plain_err']:.3e} + {floor:.0e}: a wrong result, not a timing problem",
              flush=True)
    return 1 if failed else 0
