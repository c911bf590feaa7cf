"""Single-device attention benchmark: ringseq's kernel against its peers at the same shapes.

Times forward and forward+backward of every available backend on the current device and
prints ms, TFLOP/s (flash-attn FLOP count), peak memory and the ratio to the peer measured in
the same run (torch SDPA on CPU; SDPA's flash and cuDNN backends on CUDA).

    python benchmarks/bench_kernel.py                       # CPU defaults: b=1 h=8 s=4096
    python benchmarks/bench_kernel.py --device cuda --batch 2 --heads 16 \
        --seqlens 4096,8192 --headdims 64,128 --dtype bf16 --tile-configs 0,1 --json out.json

Backends: ringseq (ours; "ringseq:1" = tile config 1 on CUDA), sdpa (our adapter of torch's
LSE-returning ops), reference, flash_attn (if installed), and torch's public
F.scaled_dot_product_attention as torch_sdpa (default dispatch), sdpa_flash, sdpa_cudnn,
sdpa_efficient, sdpa_math (one SDPA backend forced).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (PeakMemory, attention_flops, environment, format_table, mib,  # noqa: E402
                    progress, time_ms, write_json)

import ringseq  # noqa: E402
from ringseq.kernels import available_backends  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
SDPA_PEERS = {"torch_sdpa": None, "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
              "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}


def make_runner(name, q, k, v, causal, tile_config):
    """A closure running one forward of backend `name` on (b, s, h, d) inputs."""
    if name in SDPA_PEERS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
                      for t in (q, k, v))  # SDPA's (b, h, s, d)
        gqa = q.shape[2] != k.shape[2]
        kernel = SDPA_PEERS[name]

        def run():
            if kernel is None:
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
            with sdpa_kernel(getattr(SDPBackend, kernel)):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

        return run, (qt, kt, vt)
    backend = name
    if name == "ringseq" and tile_config:
        from ringseq.kernels import ExtensionBackend
        backend = ExtensionBackend(tile_config)

    def run():
        return ringseq.flash_attn_func(q, k, v, causal=causal, backend=backend)

    return run, (q, k, v)


def supported(name, device, dtype, headdim, causal, q, k):
    """None when the peer can run these inputs here, else a short reason."""
    if name in SDPA_PEERS:
        if SDPA_PEERS[name] and device.type != "cuda" and name != "sdpa_math":
            return "CUDA only"
        try:
            run, _ = make_runner(name, q[:, :8], k[:, :8], k[:, :8], causal, 0)
            with torch.no_grad():
                run()
        except RuntimeError as exc:
            return str(exc).splitlines()[0][:80]
        return None
    if name not in available_backends(device, dtype, headdim):
        return "unavailable"
    return None


def measure(name, tile_config, args, device, dtype, s, d, causal):
    h, h_kv, b = args.heads, args.heads_kv or args.heads, args.batch
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, s, h, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(b, s, h_kv, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(b, s, h_kv, d, device=device, dtype=dtype, generator=gen)
    reason = supported(name, device, dtype, d, causal, q, k)
    row = {"backend": name if not tile_config else f"{name}:{tile_config}", "batch": b, "heads": h,
           "heads_kv": h_kv, "seqlen": s, "headdim": d, "causal": causal,
           "dtype": args.dtype, "skipped": reason}
    if reason:
        return [dict(row, mode=m) for m in args.modes]
    rows = []
    for mode in args.modes:
        grad = mode == "fwd_bwd"
        for t in (q, k, v):
            t.requires_grad_(grad)
        run, leaves = make_runner(name, q, k, v, causal, tile_config)
        dout = torch.randn_like(leaves[0]) if grad else None

        def step():
            if grad:
                out = run()
                torch.autograd.backward(out, dout)
                for t in leaves:
                    t.grad = None
            else:
                with torch.no_grad():
                    run()

        with PeakMemory(device) as mem:
            step()
        ms = time_ms(step, device, warmup=args.warmup, repeats=args.repeats)
        flops = attention_flops(b, h, s, s, d, causal, mode)
        rows.append(dict(row, mode=mode, ms=ms, tflops=flops / ms / 1e9,
                         peak_mib=mib(mem.peak)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", default=None,
                   help="comma list; default: every available one plus torch_sdpa (CPU) or "
                        "sdpa_flash,sdpa_cudnn (CUDA); reference only with --reference")
    p.add_argument("--reference", action="store_true", help="include the (slow) reference backend")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=None)
    p.add_argument("--seqlens", default="4096")
    p.add_argument("--headdims", default="64,128")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--modes", default="fwd,fwd_bwd")
    p.add_argument("--tile-configs", default="0", help="CUDA tile configurations of ringseq to time")
    p.add_argument("--ratio-to", default=None,
                   help="comma list of peers for ratio columns (default torch_sdpa on CPU, "
                        "sdpa_flash,sdpa_cudnn on CUDA)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None, help="write results to this path")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[args.dtype]
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in ("fwd", "fwd_bwd"):
            p.error(f"--modes takes fwd and fwd_bwd, got {m!r}")
    peers = (args.ratio_to or ("sdpa_flash,sdpa_cudnn" if device.type == "cuda" else "torch_sdpa")).split(",")
    if args.backends:
        names = args.backends.split(",")
    else:
        names = [n for n in ("ringseq", "sdpa", "flash_attn") if n in available_backends(device, dtype, 64)]
        names += ["reference"] if args.reference else []
    names += [peer for peer in peers if peer not in names]
    tile_configs = [int(c) for c in args.tile_configs.split(",")]
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    jobs = []
    for s in (int(x) for x in args.seqlens.split(",")):
        for d in (int(x) for x in args.headdims.split(",")):
            for causal in causals:
                for name in names:
                    for tc in (tile_configs if name == "ringseq" and device.type == "cuda" else [0]):
                        jobs.append((name, tc, s, d, causal))

    rows = []
    for i, (name, tc, s, d, causal) in enumerate(jobs, 1):
        progress(f"[{i}/{len(jobs)}] {name}{':' + str(tc) if tc else ''} s={s} d={d} "
                 f"{'causal' if causal else 'full'} {args.dtype}")
        rows += measure(name, tc, args, device, dtype, s, d, causal)

    for r in rows:  # ratios against peers measured in this run at the same shape and mode
        for peer in peers:
            base = next((x for x in rows if x["backend"] == peer and x.get("ms") and
                         all(x[k] == r[k] for k in ("seqlen", "headdim", "causal", "mode"))), None)
            r[f"x_{peer}"] = (base["ms"] / r["ms"]) if base and r.get("ms") else None

    columns = [("backend", "backend", "{}"), ("mode", "mode", "{}"), ("seqlen", "s", "{}"),
               ("headdim", "d", "{}"), ("causal", "causal", "{}"), ("ms", "ms", "{:.2f}"),
               ("tflops", "TFLOP/s", "{:.3f}"), ("peak_mib", "peak MiB", "{:.1f}")]
    columns += [(f"x_{peer}", f"x {peer}", "{:.2f}") for peer in peers]
    print(f"# bench_kernel: b={args.batch} h={args.heads} h_kv={args.heads_kv or args.heads} "
          f"{args.dtype} on {device} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print("# x PEER = PEER's time / this backend's time at the same shape (>1: faster than PEER)")
    print(format_table([r for r in rows if not r["skipped"]], columns))
    for r in rows:
        if r["skipped"]:
            print(f"# skipped {r['backend']} s={r['seqlen']} d={r['headdim']} {r['mode']}: {r['skipped']}")
    write_json(args.json, {"benchmark": "bench_kernel", "environment": environment(device),
                           "args": {k: v for k, v in vars(args).items()}, "results": rows})
    return rows


if __name__ == "__main__":
    main()
