"""Long-context ring attention benchmark: the README's main job.

Without a launcher (and without a GPU) it spawns ``--world-size`` local CPU ranks on gloo
(default: one per physical core, at most 4, one torch thread each, so ranks never time-share a
core); under ``torchrun`` it uses the launcher's ranks (NCCL on GPUs, one GPU per local rank).
For every layout it reports forward and forward+backward time on the busiest rank, TFLOP/s,
peak memory per rank, the ring overhead and a correctness spot check against float64
attention on a slice of queries, then the load balance. Rank 0 prints every stage as it starts
and ends (flushed, with elapsed time), also into a file or pipe; the first line comes before
torch is imported.

Definitions (also in the README):
  ring overhead = ring time / time of the same block kernel calls without communication on
                  the busiest rank (no exchange, no merge, no copies; on CPU ranks with one
                  thread timed by the thread's CPU clock, which other processes
                  sharing the core inflate far less than wall time). 1.0: the exchange is hidden and the bookkeeping is free.
  load balance  = contiguous causal time / zigzag causal time at the same shape; its ideal
                  is the ratio of the busiest ranks' visible (query, key) pairs (2 - 1/W:
                  1.5 at W=2).
  spot check    = --check-rows query rows of each rank, spread over its shard (zigzag's two
                  chunks included), against float64 attention over
                  the full sequence; passes when the error is at most 2x that of plain
                  same-dtype attention plus a small floor.

Every row is checked against what the definitions rule out: overhead >= 0.95, spot check
passed, and 1 <= load balance <= its ideal (3 % allowed for timing noise). A row that breaks
a timing invariant is measured once more; if it still breaks it, it is printed with a warning
naming the likely cause (other processes' CPU use during the row, ranks sharing cores, times
too short for the timer). A machine busy with other processes is announced before the numbers.
Exit status: 0, 1 when a spot check failed, 2 for bad arguments (before any rank starts), 3
when local ranks raised, died or timed out.

    python benchmarks/bench_ring.py                                   # the main job
    python benchmarks/bench_ring.py --world-size 2 --seqlen 16384 --json out.json
    python benchmarks/bench_ring.py --memory-scaling 1,2,4 --memory-seqlen 32768
    torchrun --nproc-per-node 8 benchmarks/bench_ring.py --seqlen 131072 --dtype bf16
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

_START = time.time()  # every progress line counts from here
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # (run from any directory, or imported by the tests)
    sys.path.insert(0, HERE)
from cli_types import (comma_list, non_negative_int, positive_int,  # noqa: E402
                       png_path, positive_ints, positive_seconds, json_path)

DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp64")
MODES = ("fwd", "fwd_bwd")


def _first_line(msg):
    print(f"[{time.time() - _START:7.1f}s] {msg}", flush=True)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=None, metavar="W",
                   help="local CPU ranks to spawn, >= 1 (default: one per physical core, at "
                        "most 4); ignored under torchrun, which sets the ranks")
    p.add_argument("--seqlen", type=positive_int, default=8192, metavar="S",
                   help="total (global) sequence length; each layout needs a multiple of its "
                        "unit: W for contiguous and stripe, 2W for zigzag (default 8192)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads (default 8)")
    p.add_argument("--heads-kv", type=positive_int, default=None, metavar="H_KV",
                   help="key/value heads (GQA/MQA), dividing --heads (default: --heads)")
    p.add_argument("--headdim", type=positive_int, default=64, metavar="D",
                   help="head dimension (default 64; the CUDA kernels take 64 or 128, the CPU "
                        "kernel any)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="input dtype: bf16, fp16, fp32 or fp64 (default fp32 on CPU, bf16 on GPU)")
    p.add_argument("--layouts", type=comma_list(None), default=None,
                   help="comma list of layouts: contiguous, zigzag, stripe, or a name given to "
                        "ringseq.register_layout (default all three; the load balance needs "
                        "contiguous and zigzag)")
    p.add_argument("--causal", choices=["true", "false", "both"], default="true",
                   help="causal attention: true, false (full) or both (default true)")
    p.add_argument("--modes", type=comma_list(MODES), default=None,
                   help="comma list of fwd (forward) and fwd_bwd (forward+backward) "
                        "(default both; --sp-mode measures fwd_bwd only)")
    p.add_argument("--backend", default=None,
                   help="block kernel: ringseq (ours), sdpa (torch's fused attention), "
                        "reference (plain math) or flash_attn (the flash-attn package, CUDA) "
                        "(default: the best that runs the device and dtype)")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="untimed calls before the timed ones, >= 0 (default 1, after the "
                        "first call and the peak-memory call)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed calls, >= 1; each rank's median counts (default 3: the default "
                        "run takes 1-2 minutes on a 2-core machine)")
    p.add_argument("--threads-per-rank", type=positive_int, default=None, metavar="T",
                   help="torch threads per spawned CPU rank (default 1; more than one makes "
                        "the compute-only baseline wall-clock timed, one rank at a time)")
    p.add_argument("--check-rows", type=positive_int, default=32, metavar="N",
                   help="query rows per rank in the spot check (default 32)")
    p.add_argument("--memory-scaling", type=positive_ints, default=None, metavar="W1,W2,...",
                   help="also measure the forward peak memory per rank at each of these world "
                        "sizes, at --memory-seqlen (spawned CPU ranks only)")
    p.add_argument("--memory-seqlen", type=positive_int, default=32768, metavar="S",
                   help="sequence length of --memory-scaling (zigzag: a multiple of 2W for "
                        "each W; default 32768)")
    p.add_argument("--timeout", type=positive_seconds, default=1800,
                   help="seconds before spawned ranks are killed (default 1800)")
    p.add_argument("--json", type=json_path, default=None, metavar="PATH",
                   help="write the arguments, environment, rows, load balance and warnings here")
    p.add_argument("--plot", type=png_path, default=None, metavar="PATH.png",
                   help="write a PNG bar chart of ring and compute-only times (needs matplotlib)")
    # sequence-parallel modes (benchmarks/sp_modes.py): instead of the layout jobs, compare
    # ring / Ulysses / hybrid / double ring at this shape (measured bytes per rank per call)
    p.add_argument("--sp-mode", default=None, metavar="MODES",
                   help="instead of the layout rows: a comma list of ring, ulysses, hybrid, "
                        "double_ring, hybrid_double_ring, or 'all' (benchmarks/sp_modes.py: "
                        "bytes per rank per call and time in each mode)")
    p.add_argument("--ulysses-size", type=positive_int, default=None, metavar="U",
                   help="Ulysses degree of the hybrid modes, dividing W and --heads (default 2)")
    p.add_argument("--inner-ring-size", type=positive_int, default=None, metavar="I",
                   help="inner ring size of the double-ring modes (default 2)")
    # masked ring attention (benchmarks/masked_ring.py): instead of the layout jobs
    p.add_argument("--window", type=positive_int, default=None, metavar="L",
                   help="instead of the layout rows: a causal sliding window of L tokens "
                        "against full causal attention at the same shape (exchanges, bytes, "
                        "time, overhead; benchmarks/masked_ring.py; batch 1, causal, fwd+bwd: "
                        "--batch, --causal and --modes do not apply)")
    p.add_argument("--docs", default=None, metavar="MIX",
                   help="instead of the layout rows: packed documents, 'seeded', 'longtail' or "
                        "a comma list of lengths, the last one stretched to end at --seqlen "
                        "(Documents layout; benchmarks/masked_ring.py; "
                        "batch 1, causal, fwd+bwd: --batch, --causal and --modes do not apply)")
    return p


def parse_args(argv=None):
    """The command line, checked for form only (no torch needed): values, lists, ranges."""
    p = build_parser()
    args = p.parse_args(argv)
    args.parser = p
    return args


def check_args(args, launched, device):
    """The checks that need ringseq (layout names and the lengths they can split, heads,
    backend), before any rank starts: argparse errors (exit status 2), never a traceback."""
    from ring_job import DTYPES
    from ringseq.kernels import get_backend
    from ringseq.layouts import PerBatchDocuments, get_layout

    p = args.parser
    args.world_size = int(os.environ["WORLD_SIZE"]) if launched else args.world_size
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error(f"--plot {args.plot}: needs matplotlib (pip install matplotlib)")
    if args.heads_kv is not None and args.heads % args.heads_kv:
        p.error(f"--heads-kv {args.heads_kv} must divide --heads {args.heads}")
    if args.docs is not None and not args.docs.strip(" ,"):  # (before: dropped, no job)
        p.error(f"--docs {args.docs!r}: give seeded, longtail or a comma list of lengths")
    if args.window is not None and args.docs:
        p.error("--window and --docs are two jobs: pass one of them")
    if args.docs:  # the Documents layout's job: --layouts play no part
        if args.layouts is not None:  # (before: dropped without a word, the Documents
            # layout ran)
            p.error(f"--layouts {','.join(args.layouts)} with --docs: the documents job runs "
                    f"the Documents layout only; drop --layouts (or time the layouts "
                    f"without --docs)")
        from masked_ring import document_lengths
        try:
            lengths = document_lengths(args.docs, args.seqlen)
        except (ValueError, SystemExit) as exc:
            p.error(f"--docs {args.docs!r} (seeded, longtail or a comma list of lengths): {exc}")
        if min(lengths) < 0:
            p.error(f"--docs {args.docs!r}: lengths must be >= 0")
        from masked_ring import _cu
        from ringseq.layouts import Documents
        try:  # (before: the ranks cut the length to a multiple of W and failed on it)
            Documents(_cu(lengths)).check_seqlen(args.seqlen, args.world_size)
        except ValueError as exc:
            p.error(f"--seqlen {args.seqlen} with --docs at world size {args.world_size}: {exc}")
    if args.window is not None or args.docs:
        # the masked jobs run on spawned CPU ranks and print their own table: refused, not
        # silently dropped
        for given, what in ((args.memory_scaling, "--memory-scaling"), (args.plot, "--plot"),
                            (args.sp_mode is not None or None, "--sp-mode"),
                            (launched or None, "torchrun"), (args.batch != 1 or None, "--batch"),
                            (args.causal != "true" or None, "--causal"),
                            (args.modes, "--modes")):
            if given:
                p.error(f"--window / --docs compare masked and full attention on spawned CPU "
                        f"ranks: {what} does not apply to them")
    if args.sp_mode is not None:
        # options of the layout rows that the mode comparison has no use for: refused, not
        # silently dropped
        for given, what in ((args.memory_scaling, "--memory-scaling"), (args.plot, "--plot"),
                            (args.modes, "--modes"),
                            (args.causal == "both" or None, "--causal both")):
            if given:
                p.error(f"--sp-mode compares the modes at one shape, forward+backward, causal "
                        f"or not: {what} does not apply to it")
    if args.sp_mode is None:  # (before: taken and ignored)
        for dest, flag in (("ulysses_size", "--ulysses-size"),
                           ("inner_ring_size", "--inner-ring-size")):
            if getattr(args, dest) is not None:
                p.error(f"{flag} {getattr(args, dest)}: sizes a mode of --sp-mode; the layout "
                        f"rows and the masked jobs run the plain ring (pass --sp-mode too)")
    # the defaults of the options above (None: not given, which the refusals above tell)
    args.layouts = args.layouts or ["contiguous", "zigzag", "stripe"]
    args.ulysses_size = args.ulysses_size or 2
    args.inner_ring_size = args.inner_ring_size or 2
    args.modes = args.modes or ["fwd", "fwd_bwd"]
    if args.sp_mode is not None:  # the same checks as sp_modes.main_sp, as usage errors
        from sp_modes import fitting_sp_modes, parse_sp_modes
        try:
            fitting_sp_modes(parse_sp_modes(args.sp_mode), args.sp_mode == "all",
                             args.world_size, args.heads, args.ulysses_size,
                             args.inner_ring_size)
        except SystemExit as exc:
            p.error(str(exc))
    for name in args.layouts:
        try:
            layout = get_layout(name, "--layouts")
        except ValueError:  # (get_layout's list has the per-batch layouts, refused below)
            p.error(f"--layouts {name!r}: expected a comma list of contiguous, zigzag and "
                    f"stripe (packed documents: --docs)")
        if isinstance(layout, PerBatchDocuments):
            p.error(f"--layouts {name}: a layout of packed documents needs each batch's "
                    f"boundaries; time it with --docs (seeded, longtail or lengths) instead")
        if args.docs:
            continue
        try:
            layout.check_seqlen(args.seqlen, args.world_size)
        except ValueError as exc:
            p.error(f"--seqlen {args.seqlen} at world size {args.world_size}: {exc}")
    for w in args.memory_scaling or []:
        try:
            get_layout("zigzag").check_seqlen(args.memory_seqlen, w)
        except ValueError as exc:
            p.error(f"--memory-seqlen {args.memory_seqlen} at --memory-scaling world size {w}: {exc}")
    if args.memory_scaling and launched:
        p.error("--memory-scaling spawns its own local ranks: run it without torchrun")
    try:
        get_backend(args.backend, device, DTYPES[args.dtype], args.headdim)
    except ValueError as exc:
        p.error(f"--backend {args.backend}: {exc}")


# ---------------------------------------------------------------- report
def report(args, rows, balance, memory, device, load):
    from common import cpu_header, format_table, logical_cpus, usable_cores

    world = rows[0]["world_size"] if rows else 1
    print(f"# bench_ring: total s={args.seqlen} b={args.batch} h={args.heads} "
          f"h_kv={args.heads_kv or args.heads} d={args.headdim} {args.dtype} on {device}, W={world}")
    if device.type == "cpu":
        print(cpu_header(args.threads))
        load.print_summary(world * args.threads)
    clock = rows[0]["compute_clock"] if rows else "wall"
    print("# overhead = ring time / the same kernel calls without communication on the busiest "
          f"rank (compute-only timed by {'thread CPU time' if clock == 'cpu' else 'wall time'}); "
          "err = max |out - float64| on --check-rows rows spread over each shard (plain = "
          "same-dtype attention's error)")
    for r in rows:
        # (a wrong result is no timing warning: FAIL, as the exit status says)
        r["status"] = ("FAIL" if not r["check_ok"] else "WARN" if r["warnings"] else
                       "ok" if not r.get("remeasured") else "ok (2nd)")
    columns = [("layout", "layout", "{}"), ("causal", "causal", "{}"), ("mode", "mode", "{}"),
               ("ms", "ms", "{:.1f}"), ("tflops", "TFLOP/s (all ranks)", "{:.4f}"),
               ("peak_mib_per_rank", "peak MiB/rank", "{:.1f}"),
               ("compute_only_ms", "compute-only ms", "{:.1f}"), ("ring_overhead", "overhead", "{:.3f}"),
               ("max_err", "err", "{:.2e}"), ("plain_err", "plain err", "{:.2e}"),
               ("status", "check", "{}")]
    print(format_table(rows, columns))
    for (causal, mode), b in balance.items():
        mark = "" if b["ok"] else "   <-- WARNING"
        print(f"load balance ({mode}): contiguous {'causal' if causal else 'full'} / zigzag = "
              f"{b['value']:.2f} (ideal {b['ideal']:.2f}: busiest ranks' visible pairs){mark}")
    if memory:
        print("forward peak memory per rank above baseline, zigzag causal, total s="
              f"{args.memory_seqlen}: " + ", ".join(
                  f"W={w}: {'-' if m is None else f'{m:.1f}'} MiB" for w, m in memory.items()))
        ws = sorted(memory)
        for w in ws[1:]:
            base = memory[ws[0]]
            # (a peak too small for the resident set's page counts reads 0: no ratio then)
            print(f"  W={w} / W={ws[0]}: " + (f"{memory[w] / base:.3f}" if base and memory[w]
                                              is not None else
                                              f"- (W={ws[0]}'s peak is {base} MiB: use a "
                                              f"larger --memory-seqlen)"))
    if device.type == "cpu" and world * args.threads > usable_cores():
        smt = logical_cpus() > usable_cores()
        print(f"note: {world} ranks x {args.threads} thread(s) exceed this machine's "
              f"{usable_cores()} physical cores"
              f"{f' ({logical_cpus()} logical CPUs: SMT siblings share a core)' if smt else ''}, "
              f"so ranks time-share: ring overhead and load balance are not meaningful here "
              f"(use --world-size {max(1, usable_cores())} --threads-per-rank 1)")
    warnings = [f"{r['layout']} {'causal' if r['causal'] else 'full'} {r['mode']}: {w}"
                for r in rows for w in r["warnings"]]
    warnings += [b["warning"] for b in balance.values() if "warning" in b]
    for w in warnings:
        print(f"WARNING: {w}")
    return warnings


def plot(path, rows):
    from common import progress
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # (--plot's folders)
    fig.savefig(path, dpi=120)
    progress(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not launched:
        _first_line("bench_ring: starting (importing torch and ringseq) ...")
    sys.path.insert(0, HERE)
    import warnings
    # The main job's install command has no NumPy; torch warns about that on import, here and
    # in each rank's interpreter (the fork server's, which reads the variable).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (
        os.environ.get("PYTHONWARNINGS"), "ignore:Failed to initialize NumPy")))
    import torch
    import torch.distributed as dist

    import common
    from common import (Stage, cpu_isa, cpu_model, environment, init_launched_group,
                        launcher_device, progress, run_with_load, spawn_cpu_ranks,
                        threads_per_rank, usable_cores, write_json)
    common.set_progress_start(_START)

    launched, device = launcher_device()
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if args.world_size is None:
        args.world_size = max(1, min(4, usable_cores()))
    check_args(args, launched, device)
    args.physical_cores = usable_cores()
    requested, args.threads_per_rank = args.threads_per_rank, args.threads_per_rank or 1
    if launched and device.type == "cpu":
        # Each launched rank is its own process: it runs (and the report states) its own torch
        # thread count, --threads-per-rank where given, else the launcher's (torchrun sets
        # OMP_NUM_THREADS=1). Before, the report stated the requested count, which no rank ran.
        if requested:
            torch.set_num_threads(requested)
        args.threads = torch.get_num_threads()
    else:
        args.threads = threads_per_rank(args.threads_per_rank, args.world_size)
    del args.parser  # not picklable into the ranks
    if args.sp_mode is not None:
        from sp_modes import main_sp
        return main_sp(args, launched, device)
    if args.window is not None or args.docs:
        from masked_ring import main_masked
        return main_masked(args, launched, device)
    import ring_job

    memory = {}
    cores = args.world_size * args.threads
    if launched:
        init_launched_group(device, args.timeout)
        out, load = run_with_load(True, device, cores, lambda: ring_job.run_rank(args, device))
        is_main = dist.get_rank() == 0
    else:
        progress(f"bench_ring: {args.world_size} local CPU ranks (gloo), {args.threads} "
                 f"thread(s) each, on {usable_cores()} physical cores ({cpu_model()}); ringseq "
                 f"CPU kernel ISA {cpu_isa()}")

        def spawned():
            with Stage(f"all measurements on {args.world_size} spawned ranks"):
                result = spawn_cpu_ranks(args.world_size, ring_job.run_rank, args,
                                         args.timeout, args.threads)
            for w in args.memory_scaling or ():
                with Stage(f"memory: forward at W={w}, s={args.memory_seqlen}"):
                    memory[w] = spawn_cpu_ranks(w, ring_job.memory_task, args, args.timeout,
                                                threads_per_rank(args.threads_per_rank, w))
            return result
        out, load = run_with_load(False, device, cores, spawned)
        is_main = True
    failed = False
    if is_main:
        rows, balance = out["rows"], out["balance"]
        warnings_seen = report(args, rows, balance, memory, device, load)
        failed = any(not r["check_ok"] for r in rows)
        sys.stdout.flush()
        write_json(args.json, {"benchmark": "bench_ring", "environment": environment(device),
                               "args": vars(args), "results": rows,
                               "load_balance": {mode: b["value"] for (c, mode), b in balance.items() if c},
                               "load_balance_all": [dict(causal=c, mode=m, **b)
                                                    for (c, m), b in balance.items()],
                               "machine_load": load.as_dict(), "warnings": warnings_seen,
                               "memory_per_rank_mib": memory})
        if args.plot:
            plot(args.plot, rows)
    if launched:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
