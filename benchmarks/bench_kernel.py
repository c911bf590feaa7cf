"""Single-device attention benchmark: ringseq's kernel against its peers at the same shapes.

Times forward and forward+backward of every available backend on the current device and
prints ms, TFLOP/s (flash-attn FLOP count), peak memory and the ratio to the peer measured in
the same run (torch SDPA on CPU; SDPA's flash and cuDNN backends on CUDA). At each shape the
backends' timed calls alternate (one call of each in turn, --repeats rounds; median per backend),
so a machine whose speed drifts during the run favours none of them; the "paired" column is the
median over rounds of the ratio within one round, which a VM whose clock swings moves less.

    python benchmarks/bench_kernel.py                       # CPU: every ISA level this CPU runs
    python benchmarks/bench_kernel.py --isa avx2,avx512 --dtype fp32,bf16 --threads 1,2
    python benchmarks/bench_kernel.py --device cuda --batch 2 --heads 16 \
        --seqlens 4096,8192 --headdims 64,128 --dtype bf16 --tile-configs 0,1 --json out.json

On CPU the run is split per ISA level of ringseq's kernel (--isa; default every level this CPU
can run): each level runs in its own process with RINGSEQ_CPU_ISA=<level>. --sdpa-isa says
which torch SDPA it is compared with: "match" (default) caps torch's own ISA dispatch at the
same level in that process (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA),
which is what a CPU of that level runs; "native" runs SDPA once with everything this CPU has;
"both" reports both ratios. Each process measures the core's speed before and after its rows
(common.core_probe_gflops, a cached 1-thread matmul): printed under its table and kept in the
JSON, per row for a split run (the level's own process), so a table from a VM whose clock
drifted says so.

--window W (a causal sliding window of W keys left of the diagonal, flash-attn's
window_size=(W, 0)) and --softcap C time the spans/band/soft-cap path of ringseq's kernels
(through ringseq.engine.op.span_attention); FLOPs then count the visible
(query, key) pairs only. torch's SDPA peers take the window as a boolean mask and cannot
soft-cap (skipped).

Backends: ringseq (ours; "ringseq:1" = tile config 1 on CUDA), sdpa (our adapter of torch's
LSE-returning ops), reference, flash_attn (if installed), and torch's public
F.scaled_dot_product_attention as torch_sdpa (default dispatch), sdpa_flash, sdpa_cudnn,
sdpa_efficient, sdpa_math (one SDPA backend forced).

Before timing a shape, each backend is checked against float64 attention on the first and
last 32 queries, once per mode as that mode runs it: the fwd rows' forward under no_grad, the
fwd_bwd rows' forward with gradients and its dq, dk, dv for an output gradient on those queries
(flash-attn's rule: at most 2x plain attention's error in the same dtype, 3x for the
gradients, plus the shared floor; a NaN is an infinite error); the err / plain err / grad err /
plain grad err / check columns show it. Exit status: 0; 1
when a level's child failed; 2 for a usage error; 4 when a ringseq backend failed the check
(its rows are still printed and written; torch's own SDPA failing it is only warned about).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import json_io  # noqa: E402
from common import (  # noqa: E402
                    CHECK_FLOOR, DTYPES, PeakMemory, attention_flops, core_probe_gflops,
                    cpu_description, cpu_isa, environment, format_table, isa_forced_note,
                    load_average, max_error, mib, plain_attention,
                    plain_attention_grads, probe_note, progress, time_ms,
                    write_json)

import ringseq  # noqa: E402
from ringseq.kernels import BACKEND_NAMES, available_backends  # noqa: E402
from ringseq.kernels.spans import check_softcap  # noqa: E402
from cli_types import json_path, non_negative_int, positive_int, positive_ints  # noqa: E402

SDPA_PEERS = {"torch_sdpa": None, "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
              "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}


def window_spans(s_q, s_k, window, causal):
    """The one span of a sliding window of `window` keys (flash-attn window_size=(window, 0)
    when causal, (window, window) otherwise), or None without a window."""
    if window < 0:
        return None
    from ringseq.kernels import Span, window_band
    return [Span(0, s_q, 0, s_k, *window_band(s_q, s_k, (window, 0 if causal else window), causal))]


def visible_pairs(s_q, s_k, window, causal):
    """(query, key) pairs a call computes: flash-attn's count (s_q * s_k, halved for causal)
    without a window, else the pairs inside the window's band."""
    if window < 0:
        return s_q * s_k / (2 if causal else 1)
    from ringseq.kernels.spans import visible_mask
    spans = torch.tensor([list(window_spans(s_q, s_k, window, causal)[0])], dtype=torch.int64)
    return float(visible_mask(spans, s_q, s_k, False).sum())


def make_runner(name, q, k, v, causal, tile_config, window=-1, softcap=0.0):
    """A closure running one forward of backend `name` on (b, s, h, d) inputs."""
    spans = window_spans(q.shape[1], k.shape[1], window, causal)
    if name in SDPA_PEERS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
                      for t in (q, k, v))  # SDPA's (b, h, s, d)
        gqa = q.shape[2] != k.shape[2]
        kernel = SDPA_PEERS[name]
        mask = None
        if spans is not None:  # the window as a boolean mask (True: visible)
            from ringseq.kernels.spans import visible_mask
            mask = visible_mask(torch.tensor([list(spans[0])], dtype=torch.int64), q.shape[1], k.shape[1],
                                False, q.device)
        is_causal = causal and mask is None

        def run():
            if kernel is None:
                return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal,
                                                      enable_gqa=gqa)
            with sdpa_kernel(getattr(SDPBackend, kernel)):
                return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal,
                                                      enable_gqa=gqa)

        return run, (qt, kt, vt)
    backend = name
    if name == "ringseq" and tile_config:
        from ringseq.kernels import ExtensionBackend
        backend = ExtensionBackend(tile_config)
    if spans is not None or softcap:
        from ringseq.kernels import get_backend
        from ringseq.engine.op import span_attention as attention
        be = get_backend(backend, q.device, q.dtype, q.shape[-1])
        scale = q.shape[-1] ** -0.5

        def run():
            return attention(q, k, v, scale, causal and spans is None, be, spans=spans, softcap=softcap)[0]

        return run, (q, k, v)

    def run():
        return ringseq.flash_attn_func(q, k, v, causal=causal, backend=backend)

    return run, (q, k, v)


def supported(name, device, dtype, headdim, causal, q, k, window=-1, softcap=0.0):
    """None when the peer can run these inputs here, else a short reason."""
    if name in SDPA_PEERS:
        if SDPA_PEERS[name] and device.type != "cuda" and name != "sdpa_math":
            return "CUDA only"
        if softcap:
            return "no soft-cap in SDPA"
        try:
            run, _ = make_runner(name, q[:, :8], k[:, :8], k[:, :8], causal, 0, window)
            with torch.no_grad():
                run()
        except RuntimeError as exc:
            return str(exc).splitlines()[0][:80]
        return None
    if name not in available_backends(device, dtype, headdim):
        return "unavailable"
    if window >= 0 or softcap:  # (the spans path: sdpa takes no soft-cap, say)
        from ringseq.kernels import get_backend
        try:
            get_backend(name, device, dtype, headdim, spans=window >= 0, softcap=softcap)
        except (NotImplementedError, ValueError) as exc:
            return str(exc).split(f"backend {name!r} ", 1)[-1][:80]
    return None


CHECK_ROWS = 32  # queries checked at each end of the sequence


def accuracy(name, q, k, v, causal, tile_config, window, softcap, grads=False):
    """(max |out - float64|, plain same-dtype attention's error, then the same two for the
    gradients or (None, None)) on the first and last CHECK_ROWS queries of one call of
    backend ``name``: its forward under no_grad as the fwd rows time it, or with ``grads``
    the forward and the dq, dk, dv of a backward whose output gradient is random on those
    rows (zero elsewhere), as the fwd_bwd rows time them. A backend passes within 2x the
    plain error plus CHECK_FLOOR (flash-attn's rule, as the ring benchmarks check theirs),
    3x for the gradients (the largest error of the three). A NaN counts as infinite. Plain
    attention's gradient error is the larger of autograd's and the flash formula's
    (common.plain_attention_grads: autograd is exact where a row sees one key)."""
    s = q.shape[1]
    rows = torch.unique(torch.cat([torch.arange(min(CHECK_ROWS, s)),
                                   torch.arange(max(0, s - CHECK_ROWS), s)]))
    # (the window as window_spans makes it: (W, 0) causal, (W, W) full)
    wnd = (window, 0 if causal else window) if window >= 0 else (-1, -1)
    leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]  # (b, s, h*, d)
    run, inputs = make_runner(name, *leaves, causal, tile_config, window, softcap)
    with torch.set_grad_enabled(grads):
        out = run()
    if name in SDPA_PEERS:
        out = out.transpose(1, 2)  # (b, h, s, d) -> (b, s, h, d)
    cpu = [t.detach().cpu().requires_grad_(grads) for t in (q, k, v)]
    with torch.set_grad_enabled(grads):
        ref = plain_attention(*cpu, torch.float64, causal, rows, window=wnd, softcap=softcap)
        plain = (plain_attention(*cpu, q.dtype, causal, rows, window=wnd, softcap=softcap)
                 if q.dtype != torch.float64 else ref)
    errors = (max_error(out[:, rows].detach(), ref.detach()),
              max_error(plain.detach(), ref.detach()))
    if not grads:
        return errors + (None, None)
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out[:, rows], inputs, dout.to(out.dtype).to(out.device),
                              allow_unused=True)
    # (an input the output does not depend on: its gradient is zero, which the check judges)
    got = [torch.zeros_like(x) if g is None else g for g, x in zip(got, inputs)]
    if name in SDPA_PEERS:
        got = [g.transpose(1, 2) for g in got]  # (b, h, s, d) -> (b, s, h, d)
    want = torch.autograd.grad(ref, cpu, dout, retain_graph=True)
    same = torch.autograd.grad(plain, cpu, dout.to(plain.dtype)) if plain is not ref else want
    flash = plain_attention_grads(*(t.detach() for t in cpu), dout, q.dtype, causal, rows,
                                  window=wnd, softcap=softcap)
    return errors + (max(max_error(g, w) for g, w in zip(got, want)),
                     max(max_error(p, w) for grads_ in (same, flash)
                         for p, w in zip(grads_, want)))


def make_step(run, leaves, dout):
    """One timed call: a forward, or (dout given) a forward and backward that frees the grads."""
    def step():
        if dout is not None:
            out = run()
            torch.autograd.backward(out, dout)
            for t in leaves:
                t.grad = None
        else:
            with torch.no_grad():
                run()
    return step


def measure(entries, args, device, dtype_name, s, d, causal, window=None, softcap=None):
    """Rows of every backend of `entries` ((name, tile_config) pairs) at one shape, in entry
    order. Each mode's repeats are interleaved across the backends (one timed call of each in
    turn), so a machine whose speed drifts during the run (a shared VM: up to 15 % within
    minutes) biases no backend against another. Every backend's inputs of one shape (SDPA's
    transposed copies, its mask) are alive together while the shape runs."""
    dtype = DTYPES[dtype_name]
    h, h_kv, b = args.heads, args.heads_kv or args.heads, args.batch
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, s, h, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(b, s, h_kv, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(b, s, h_kv, d, device=device, dtype=dtype, generator=gen)
    window = args.window if window is None else window
    softcap = args.softcap if softcap is None else softcap
    rows = {}  # entry index -> its rows
    live = []  # (entry index, name, tile_config, row) of the backends that run here
    for i, (name, tile_config) in enumerate(entries):
        reason = supported(name, device, dtype, d, causal, q, k, window, softcap)
        row = {"backend": name if not tile_config else f"{name}:{tile_config}", "batch": b, "heads": h,
               "heads_kv": h_kv, "seqlen": s, "headdim": d, "causal": causal,
               "dtype": dtype_name, "threads": torch.get_num_threads(), "skipped": reason}
        if window >= 0 or softcap:
            row.update(window=window, softcap=softcap)
        rows[i] = [dict(row, mode=m) for m in args.modes] if reason else []
        if not reason:
            live.append((i, name, tile_config, row))
    floor = CHECK_FLOOR[dtype]
    checks = {}  # (entry index, mode) -> the check's fields
    for i, name, tile_config, row in live:  # each backend checked per mode and shape, untimed
        for mode in args.modes:  # (fwd: under no_grad, as timed; fwd_bwd: with gradients)
            err, plain_err, grad_err, grad_plain_err = accuracy(
                name, q, k, v, causal, tile_config, window, softcap, grads=mode == "fwd_bwd")
            fwd_ok = err <= 2 * plain_err + floor
            bwd_ok = grad_err is None or grad_err <= 3 * grad_plain_err + floor
            checks[i, mode] = dict(max_err=err, plain_err=plain_err, grad_err=grad_err,
                                   grad_plain_err=grad_plain_err,
                                   fwd_check="ok" if fwd_ok else "FAIL",
                                   check="ok" if fwd_ok and bwd_ok else "FAIL")
    for mode in args.modes:
        grad = mode == "fwd_bwd"
        for t in (q, k, v):
            t.requires_grad_(grad)
        steps = []
        for i, name, tile_config, row in live:
            run, leaves = make_runner(name, q, k, v, causal, tile_config, window, softcap)
            step = make_step(run, leaves, torch.randn_like(leaves[0]) if grad else None)
            with PeakMemory(device) as mem:
                step()
            for _ in range(args.warmup):
                step()
            steps.append((i, row, step, mem.peak))
        times = [[] for _ in steps]
        for _ in range(args.repeats):
            for t, (_, _, step, _) in zip(times, steps):
                t.append(time_ms(step, device, warmup=0, repeats=1, clock=args.clock))
        flops = attention_flops(b, h, s, s, d, False, mode) * visible_pairs(s, s, window, causal) / (s * s)
        for (i, row, _, peak), t in zip(steps, times):
            ms = statistics.median(t)
            # (a fwd_bwd row passes when its forward and its gradients do)
            rows[i].append(dict(row, mode=mode, ms=ms, tflops=flops / ms / 1e9, peak_mib=mib(peak),
                                rounds_ms=t, **checks[i, mode]))
    return [r for i in range(len(entries)) for r in rows[i]]


# torch's own ISA knobs per ringseq level, for SDPA at the same level ("--sdpa-isa match")
TORCH_ISA_ENV = {
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                 "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    # ATen has no level above avx512 on x86 (its bf16 kernels check the CPU themselves); oneDNN
    # may use the bf16 instructions a CPU of this level has
    "avx512bf16": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                   "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    # and AMX tiles, which torch's bf16 SDPA uses through oneDNN on such a CPU
    "amx": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
}
KEY = ("dtype", "threads", "seqlen", "headdim", "causal", "mode", "window", "softcap")


def tile_config(text):
    """One of the kernels' tile configurations, 0, 1 or 2."""
    value = non_negative_int(text)
    if value > 2:
        raise argparse.ArgumentTypeError(f"must be 0, 1 or 2 (the kernels' tile "
                                         f"configurations), got {value}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--backends", default=None,
                   help="comma list; default: every available one plus torch_sdpa (CPU) or "
                        "sdpa_flash,sdpa_cudnn (CUDA); reference only with --reference; on CPU "
                        "with --isa: ringseq and torch_sdpa")
    p.add_argument("--reference", action="store_true", help="include the (slow) reference backend")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads (default 8)")
    p.add_argument("--heads-kv", type=positive_int, default=None,
                   help="key/value heads, dividing --heads (default: --heads)")
    p.add_argument("--seqlens", default="4096",
                   help="comma list of sequence lengths (default 4096)")
    p.add_argument("--headdims", default="64,128", help="comma list of head dims (default 64,128)")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both",
                   help="causal, full or both (default both)")
    p.add_argument("--dtype", default=None,
                   help=f"comma list of {', '.join(sorted(DTYPES))}; default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--modes", default="fwd,fwd_bwd",
                   help="comma list of fwd, fwd_bwd (default: both)")
    p.add_argument("--tile-configs", default="0",
                   help="CUDA tile configurations of ringseq to time (comma list of 0, 1, 2)")
    p.add_argument("--window", type=int, default=-1,
                   help="sliding window of W keys (flash-attn window_size=(W, 0) when causal); -1: none")
    p.add_argument("--softcap", type=float, default=0.0, help="logit soft-cap (0: off)")
    p.add_argument("--masks", default=None, metavar="W:C1,C2",
                   help="also time the spans path at the largest shape: causal window W, soft-caps C1, C2, ... "
                        "(ringseq and an SDPA peer with a mask)")
    p.add_argument("--ratio-to", default=None,
                   help="comma list of peers for ratio columns (default torch_sdpa on CPU, "
                        "sdpa_flash,sdpa_cudnn on CUDA)")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="untimed calls per cell (default 1)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed rounds per cell, backends interleaved (default 3)")
    p.add_argument("--threads", default=None, help="comma list of torch CPU thread counts")
    p.add_argument("--isa", default=None,
                   help="CPU: comma list of ringseq ISA levels (default: every level this CPU runs; "
                        "'current': no split, this process's level)")
    p.add_argument("--sdpa-isa", choices=["match", "native", "both"], default="match",
                   help="CPU: torch SDPA capped at each ringseq level's ISA, or uncapped, or both")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="CPU: wall time, or the benchmark thread's CPU time (1 thread only: not "
                        "inflated by other jobs on a shared machine)")
    p.add_argument("--json", type=json_path, default=None, help="write results to this path")
    args = p.parse_args(argv)
    # comma lists stay strings (they are passed on to the per-level child processes): checked,
    # and written back without empty items ("256," was accepted here, then failed in int(""))
    for name in ("seqlens", "headdims", "threads", "tile_configs"):
        text = getattr(args, name)
        if text is not None:
            try:
                values = positive_ints(text) if name != "tile_configs" else [
                    tile_config(x) for x in text.split(",") if x.strip()]
                if not values:
                    raise argparse.ArgumentTypeError(f"no value given in {text!r}")
            except argparse.ArgumentTypeError as exc:
                p.error(f"--{name.replace('_', '-')}: {exc}")
            setattr(args, name, ",".join(map(str, values)))
    if args.heads_kv is not None and args.heads % args.heads_kv:
        p.error(f"--heads-kv {args.heads_kv} must divide --heads {args.heads}")
    if args.window < -1:
        p.error(f"--window must be >= 0, or -1 for none, got {args.window}")
    try:  # the kernels' own rule (finite, 0 or within float32's range), before any work
        check_softcap(args.softcap, "--softcap")
    except ValueError as exc:
        p.error(str(exc))
    if args.masks is not None:
        window, _, caps = args.masks.partition(":")
        try:
            if int(window) < 0 or not caps:
                raise ValueError
            for cap in caps.split(","):
                check_softcap(float(cap), "--masks")
        except ValueError as exc:
            p.error(f"--masks takes W:C1,C2 (a window >= 0 and soft-caps that are 0 or within "
                    f"float32's range), got {args.masks!r}"
                    + (f" ({exc})" if str(exc).startswith("--masks") else ""))
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        p.error(f"--device takes cpu, cuda or cuda:N, got {args.device!r}")
    # options that do nothing here are refused (before: taken, and silently ignored)
    if device.type == "cpu" and args.tile_configs != "0":
        p.error(f"--tile-configs {args.tile_configs}: tile configurations of the CUDA kernel; "
                f"the CPU kernel has none (--device cpu)")
    if (device.type != "cpu" or args.isa == "current") and args.sdpa_isa != "match":
        p.error(f"--sdpa-isa {args.sdpa_isa}: applies to the per-level CPU run (--isa other "
                f"than 'current', on CPU)")
    known = set(SDPA_PEERS) | set(BACKEND_NAMES)
    for option in ("backends", "ratio_to"):
        bad = [n for n in (getattr(args, option) or "").split(",") if n and n not in known]
        if bad:
            p.error(f"--{option.replace('_', '-')}: unknown {bad}; known: {sorted(known)}")
    if args.backends and args.ratio_to:
        # (a peer that is not timed has no row: its ratio columns were all "-"; --masks times
        # its own peer, SDPA with a mask, whatever --backends says)
        timed = set(args.backends.split(",")) | ({masks_peer(device)} if args.masks else set())
        missing = [n for n in args.ratio_to.split(",") if n and n not in timed]
        if missing:
            p.error(f"--ratio-to {','.join(missing)}: not among --backends {args.backends} "
                    f"(a peer is timed only when it is one of them)")
    if args.clock == "cpu" and (not args.threads or any(int(t) != 1 for t in args.threads.split(","))):
        p.error("--clock cpu measures one thread: pass --threads 1")
    args.dtypes = [x for x in (args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")).split(",") if x]
    if not args.dtypes:  # (before: fp32 in the per-level children, an IndexError here)
        p.error(f"--dtype: no dtype given in {args.dtype!r}")
    for dt in args.dtypes:
        if dt not in DTYPES:
            p.error(f"--dtype takes {', '.join(sorted(DTYPES))}, got {dt!r}")
    modes = args.modes
    args.modes = [m for m in modes.split(",") if m]
    if not args.modes:  # (before: an empty table and exit 0)
        p.error(f"--modes: no mode given in {modes!r} (fwd, fwd_bwd)")
    for m in args.modes:
        if m not in ("fwd", "fwd_bwd"):
            p.error(f"--modes takes fwd and fwd_bwd, got {m!r}")
    args.thread_counts = [int(x) for x in args.threads.split(",")] if args.threads else [None]
    return p, args


def masks_peer(device) -> str:
    """The SDPA backend the --masks rows are timed against: one that takes a mask."""
    return "sdpa_efficient" if device.type == "cuda" else "torch_sdpa"


def run_here(args, device):
    """Every job in this process (ringseq at this process's ISA level). Returns the rows."""
    peers = (args.ratio_to or ("sdpa_flash,sdpa_cudnn" if device.type == "cuda" else "torch_sdpa")).split(",")
    if args.masks and device.type == "cuda" and masks_peer(device) not in peers:
        peers.append(masks_peer(device))  # the peer of the --masks rows (on CPU the default)
    if args.backends:
        names = args.backends.split(",")
        if not args.ratio_to:  # (the default peers that are timed: an untimed one has no row)
            peers = [peer for peer in peers if peer in names]
    else:
        names = [n for n in ("ringseq", "sdpa", "flash_attn")
                 if n in available_backends(device, DTYPES[args.dtypes[0]], 64)]
        names += ["reference"] if args.reference else []
        names += [peer for peer in peers if peer not in names]
    if args.masks and masks_peer(device) not in peers:
        peers.append(masks_peer(device))  # (--backends left it out: the --masks rows time it)
    tile_configs = [int(c) for c in args.tile_configs.split(",")]
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    jobs = []  # (threads, dtype, [(backend, tile config)], s, d, causal, window, softcap)
    for threads in args.thread_counts:
        for dt in args.dtypes:
            for s in (int(x) for x in args.seqlens.split(",")):
                for d in (int(x) for x in args.headdims.split(",")):
                    for causal in causals:
                        entries = [(name, tc) for name in names
                                   for tc in (tile_configs if name == "ringseq" and device.type == "cuda" else [0])]
                        jobs.append((threads, dt, entries, s, d, causal, None, None))
    if args.masks:
        # --masks W:C1,C2: the spans path at the largest shape, causal, window W, each soft-cap;
        # ringseq (config 2's d=128 forward runs config 0 with spans) and a peer that takes a mask
        window, caps = args.masks.split(":")
        s = max(int(x) for x in args.seqlens.split(","))
        d = max(int(x) for x in args.headdims.split(","))
        peer = masks_peer(device)
        for threads in args.thread_counts:
            for dt in args.dtypes:
                for cap in (float(c) for c in caps.split(",")):
                    entries = []
                    # (ringseq where --backends runs it; the peer whatever --backends says)
                    for name in [n for n in ("ringseq", peer)
                                 if n == peer or not args.backends or n in names]:
                        tcs = [c for c in tile_configs if not (c == 2 and d == 128)] if name == "ringseq" and device.type == "cuda" else [0]
                        entries += [(name, tc) for tc in tcs]
                    jobs.append((threads, dt, entries, s, d, True, int(window), cap))
    rows = []
    isa = cpu_isa() if device.type == "cpu" else None
    for i, (threads, dt, entries, s, d, causal, window, cap) in enumerate(jobs, 1):
        if threads:
            torch.set_num_threads(threads)
        names_here = ", ".join(n + (f":{tc}" if tc else "") for n, tc in entries)
        progress(f"[{i}/{len(jobs)}] {names_here} (interleaved) s={s} d={d} "
                 f"{'causal' if causal else 'full'} {dt}, {torch.get_num_threads()} thread(s)"
                 + (f", ringseq CPU ISA {isa}" if isa and any(n == "ringseq" for n, _ in entries) else "")
                 + (f", window {window} softcap {cap}" if window is not None else ""))
        for r in measure(entries, args, device, dt, s, d, causal, window, cap):
            r["isa"] = isa if r["backend"].split(":")[0] == "ringseq" else None
            rows.append(r)
    for r in rows:  # ratios against peers measured in this run at the same shape and mode
        for peer in peers:
            base = peer_row(rows, peer, r)
            r[f"x_{peer}"] = (base["ms"] / r["ms"]) if base and r.get("ms") else None
            r[f"px_{peer}"] = paired_ratio(base, r)
    return rows, peers


def paired_ratio(base, r):
    """Median over the timed rounds of base's time / r's time in the same round, or None.

    The rounds of one shape alternate between the backends (measure), so the two calls of a
    round ran seconds apart: on a VM whose clock swings (seen: 2.1-3.2 GHz within minutes on
    a shared Zen 3) this ratio moves less than the ratio of the two medians, whose calls may
    come from different rounds."""
    if not base or not r.get("ms"):
        return None
    a, b = base.get("rounds_ms") or [], r.get("rounds_ms") or []
    if not a or len(a) != len(b):
        return None
    return statistics.median(x / y for x, y in zip(a, b))


def peer_row(rows, peer, r, same_level=False):
    """The timed row of backend `peer` at r's shape, mode and mask (and ISA level), or None."""
    return next((x for x in rows if x["backend"] == peer and x.get("ms")
                 and all(x.get(k) == r.get(k) for k in KEY)
                 and (not same_level or x.get("level") == r.get("level"))), None)


# the accuracy check's columns (grad: the largest of dq, dk, dv; checked with fwd_bwd in --modes)
CHECK_COLUMNS = [("max_err", "err", "{:.1e}"), ("plain_err", "plain err", "{:.1e}"),
                 ("grad_err", "grad err", "{:.1e}"), ("grad_plain_err", "plain grad err", "{:.1e}"),
                 ("check", "check", "{}")]
CHECK_FAILED = 4  # the exit status of a run whose ringseq rows failed the accuracy check


class ChildFailed(Exception):
    """A level's child process exited with a failure (its own output says why)."""


def run_child(args, level, env_extra, backends):
    """This script in a child process (RINGSEQ_CPU_ISA=level or none, extra env); its rows.
    Raises ChildFailed naming the exit status when the child fails."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--device", "cpu", "--isa", "current",
           "--backends", backends, "--batch", str(args.batch), "--heads", str(args.heads),
           "--seqlens", args.seqlens, "--headdims", args.headdims, "--causal", args.causal,
           "--dtype", ",".join(args.dtypes), "--modes", ",".join(args.modes),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--clock", args.clock,
           "--json", path]
    if args.heads_kv:
        cmd += ["--heads-kv", str(args.heads_kv)]
    if args.window >= 0 or args.softcap:
        cmd += ["--window", str(args.window), "--softcap", str(args.softcap)]
    if args.masks:
        cmd += ["--masks", args.masks]
    if args.threads:
        cmd += ["--threads", args.threads]
    env = {k: v for k, v in os.environ.items() if k != "RINGSEQ_CPU_ISA"}
    if level:
        env["RINGSEQ_CPU_ISA"] = level
    env.update(env_extra)
    try:
        status = subprocess.run(cmd, env=env).returncode
        if status not in (0, CHECK_FAILED):  # (a failed check: its rows say so, and are kept)
            raise ChildFailed(f"exit status {status}" + (f" (killed by signal {-status})"
                                                         if status < 0 else ""))
        with open(path) as f:
            data = json_io.load(f)  # (a failed row's "inf" error as a float again)
        # Each row keeps its own child's core probe: the children run minutes apart (and with
        # torch's ISA capped), so the parent's probe says little about a level's rows.
        for r in data["results"]:
            r["core_probe_gflops"] = data.get("core_probe_gflops")
        return data["results"]
    finally:
        os.unlink(path)


def run_cpu_levels(args, levels):
    """One child per ISA level (ringseq, and SDPA capped at that level for "match"), plus one
    uncapped SDPA child for "native"; ratios per level against both. Returns (rows, peers,
    failed): a child that fails is named in ``failed`` ({level or "native": why}) and the
    other levels still run and report."""
    rows, failed = [], {}
    match = args.sdpa_isa in ("match", "both")
    for level in levels:
        progress(f"== ISA level {level}: ringseq with RINGSEQ_CPU_ISA={level}"
                 + (f", torch SDPA with {' '.join(f'{k}={v}' for k, v in TORCH_ISA_ENV[level].items())}"
                    if match else ""))
        try:
            got = run_child(args, level, TORCH_ISA_ENV[level] if match else {},
                            "ringseq,torch_sdpa" if match else "ringseq")
        except ChildFailed as exc:
            failed[level] = str(exc)
            progress(f"== ISA level {level}: FAILED ({exc}); going on with the other levels")
            continue
        for r in got:
            r["level"] = level
            if r["backend"] == "torch_sdpa":
                r["backend"] = "torch_sdpa_match"
        rows += got
    if args.sdpa_isa in ("native", "both"):
        progress("== torch SDPA with this CPU's full ISA (no caps)")
        try:
            native = run_child(args, None, {}, "torch_sdpa")
        except ChildFailed as exc:
            failed["native"] = str(exc)
            progress(f"== torch SDPA (native): FAILED ({exc})")
            native = []
        for r in (r for r in native if r["backend"] == "torch_sdpa"):
            r["level"] = "native"
            r["backend"] = "torch_sdpa_native"
            rows.append(r)
    peers = (["torch_sdpa_match"] if match else []) + (["torch_sdpa_native"] if args.sdpa_isa != "match" else [])
    for r in rows:
        if r["backend"] != "ringseq":
            continue
        for peer in peers:
            base = peer_row(rows, peer, r, same_level=peer != "torch_sdpa_native")
            r[f"x_{peer}"] = (base["ms"] / r["ms"]) if base and r.get("ms") else None
            r[f"{peer}_ms"] = base["ms"] if base else None
            r[f"{peer}_peak_mib"] = base.get("peak_mib") if base else None
            # rounds pair up only within one child (the native SDPA runs in its own)
            r[f"px_{peer}"] = paired_ratio(base, r) if peer != "torch_sdpa_native" else None
    return rows, peers, failed


def main(argv=None):
    p, args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available")
    load_start = load_average()
    probe_start = core_probe_gflops() if device.type == "cpu" else None
    split = device.type == "cpu" and args.isa != "current"
    if split:
        supported = ringseq.kernels.extension.cpu_isa_levels()
        levels = [x for x in (args.isa if args.isa is not None else ",".join(supported)
                              ).split(",") if x]
        if not levels:
            p.error(f"--isa: no level given in {args.isa!r}")
        if len(set(levels)) < len(levels):
            # (rows of one level from two children: a ratio took the other child's SDPA)
            p.error(f"--isa: each level once, got {args.isa!r}")
        for level in levels:
            if level not in supported:
                p.error(f"--isa {level}: this CPU/build runs {', '.join(supported) or 'no level'}")
        if args.ratio_to or args.reference:
            p.error(f"--{'ratio-to' if args.ratio_to else 'reference'} applies to one process "
                    f"(--isa current): the per-level run compares ringseq with torch SDPA at "
                    f"each level (--sdpa-isa)")
        rows, peers, failed = run_cpu_levels(args, levels)
        shown = [r for r in rows if r["backend"] == "ringseq" and not r["skipped"]]
        columns = [("level", "ISA", "{}"), ("dtype", "dtype", "{}"), ("threads", "thr", "{}"),
                   ("mode", "mode", "{}"), ("seqlen", "s", "{}"), ("headdim", "d", "{}"),
                   ("causal", "causal", "{}"), ("ms", "ringseq ms", "{:.1f}"),
                   ("tflops", "TFLOP/s", "{:.3f}"), ("peak_mib", "peak MiB", "{:.1f}")]
        for peer in peers:
            columns += [(f"{peer}_ms", peer.replace("torch_", "") + " ms", "{:.1f}"),
                        (f"{peer}_peak_mib", "peak MiB", "{:.1f}"),
                        (f"x_{peer}", "x " + peer.replace("torch_", ""), "{:.2f}")]
            if peer != "torch_sdpa_native":
                columns += [(f"px_{peer}", "paired", "{:.2f}")]
        columns += CHECK_COLUMNS
    else:
        if args.thread_counts == [None] and device.type == "cpu":
            args.thread_counts = [torch.get_num_threads()]
        rows, peers = run_here(args, device)
        failed = {}
        shown = [r for r in rows if not r["skipped"]]
        columns = [("backend", "backend", "{}"), ("dtype", "dtype", "{}"), ("threads", "thr", "{}"),
                   ("mode", "mode", "{}"), ("seqlen", "s", "{}"),
                   ("headdim", "d", "{}"), ("causal", "causal", "{}"), ("ms", "ms", "{:.2f}"),
                   ("tflops", "TFLOP/s", "{:.3f}"), ("peak_mib", "peak MiB", "{:.1f}")]
        columns += [c for peer in peers for c in ((f"x_{peer}", f"x {peer}", "{:.2f}"),
                                                  (f"px_{peer}", "paired", "{:.2f}"))]
        columns += CHECK_COLUMNS
    if any("window" in r for r in rows):  # --window / --softcap / --masks rows
        columns[7:7] = [("window", "window", "{}"), ("softcap", "softcap", "{}")]
    print(f"# bench_kernel: b={args.batch} h={args.heads} h_kv={args.heads_kv or args.heads} "
          f"{','.join(args.dtypes)} on {device} (torch {torch.__version__}; "
          f"{'thread CPU time' if args.clock == 'cpu' else 'wall time'}, median of {args.repeats}, "
          f"backends interleaved)")
    if device.type == "cpu":
        end = load_average()
        probe_end = core_probe_gflops()
        isa_note = ("per row: " + "; ".join(isa_forced_note(lv, requested=lv) for lv in levels)
                    if split else isa_forced_note(cpu_isa()))
        print(f"# CPU: {cpu_description()}; ringseq CPU kernel ISA {isa_note}; 1-minute load "
              f"average {load_start if load_start is None else round(load_start, 2)} before, "
              f"{end if end is None else round(end, 2)} after")
        print(f"# core probe (1-thread float32 matmul in cache, common.core_probe_gflops): "
              f"{probe_note(probe_start, probe_end)}")
    if split:
        print("# x PEER = PEER's time / ringseq's time at the same shape (>1: ringseq faster); "
              "sdpa_match = torch SDPA capped at the row's ISA level, sdpa_native = uncapped; "
              "paired = median over rounds of the same ratio within a round (paired_ratio)")
    else:
        print("# x PEER = PEER's time / this backend's time at the same shape (>1: faster than PEER); "
              "paired = median over rounds of the same ratio within a round (paired_ratio)")
    print(format_table(shown, columns), flush=True)
    for r in rows:
        if r["skipped"]:
            print(f"# skipped {r['backend']} s={r['seqlen']} d={r['headdim']} {r['mode']}: {r['skipped']}")
    probe = {"before": probe_start, "after": probe_end} if device.type == "cpu" else None
    write_json(args.json, {"benchmark": "bench_kernel", "environment": environment(device),
                           "core_probe_gflops": probe,
                           "args": {k: v for k, v in vars(args).items()}, "results": rows,
                           "failed_children": failed})
    if rows and not shown and any(r["backend"].split(":")[0] in BACKEND_NAMES for r in rows):
        # (e.g. --backends flash_attn on a CPU: before, an empty table and exit status 0; a
        # run of SDPA peers alone, the per-level run's native child, may skip them all)
        print("FAILED: no row was timed: every backend asked for was skipped here (the reasons "
              "above)", flush=True)
        raise SystemExit(1)
    wrong = [r for r in rows if r.get("check") == "FAIL"]
    for r in wrong:
        # (the forward's error where it failed, else the gradients')
        grads = r.get("fwd_check") == "ok" and r.get("grad_err") is not None
        what, err, plain, times = (("gradient error", r["grad_err"], r["grad_plain_err"], 3)
                                   if grads else ("error", r["max_err"], r["plain_err"], 2))
        print(f"WARNING: {r['backend']} {r['dtype']} s={r['seqlen']} d={r['headdim']} "
              f"{'causal' if r['causal'] else 'full'} {r['mode']}: max {what} {err:.2e} "
              f"against float64, more than {times} x plain {r['dtype']} attention's "
              f"{plain:.2e} + {CHECK_FLOOR[DTYPES[r['dtype']]]:.0e}", flush=True)
    if failed:
        names = {lv: "torch SDPA native" if lv == "native" else f"ISA level {lv}" for lv in failed}
        print("FAILED: " + "; ".join(f"{names[lv]}: {why}" for lv, why in failed.items())
              + " (the rows above are the children that finished)", flush=True)
        raise SystemExit(1)
    if any(r["backend"].split(":")[0] in BACKEND_NAMES for r in wrong):
        raise SystemExit(CHECK_FAILED)  # (torch's SDPA failing is warned about, not ours)
    return rows


if __name__ == "__main__":
    main()
