"""ringseq's ring engine against ring-flash-attention, timed by one harness, same block kernel.

ring-flash-attn (``pip install --no-deps ring-flash-attn``) runs on CPU ranks through a stand-in
for flash-attn's private block functions over torch's CPU flash op (``benchmarks/peer_shim/``);
ringseq runs ``backend="sdpa"``, the same op. For each layout both engines run on ``--world-size``
spawned gloo ranks with one thread each, one after the other; every iteration starts after a
barrier, each rank takes the median of ``--repeats`` iterations and the slowest rank is reported.

    pip install --no-deps ring-flash-attn
    python benchmarks/bench_ring_vs_rfa.py
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
from common import load_average, progress, spawn_cpu_ranks  # noqa: E402


def _rank(args, device):
    engine, layout, a = args
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, a.seqlen, a.heads, a.headdim, generator=g) for _ in range(4)]

    def shard(x):
        if layout == "zigzag":
            c = x.chunk(2 * world, 1)
            return torch.cat([c[rank], c[2 * world - 1 - rank]], 1)
        return x.chunk(world, 1)[rank]

    q, k, v, dout = (shard(x).contiguous().requires_grad_(i < 3) for i, x in enumerate(full))
    if engine == "ring-flash-attn":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_shim"))
        import import_rfa  # noqa: F401  (ring-flash-attn over the CPU stand-in for flash-attn)
        from ring_flash_attn import ring_flash_attn_func, zigzag_ring_flash_attn_func

        fn = zigzag_ring_flash_attn_func if layout == "zigzag" else ring_flash_attn_func
        attn = lambda: fn(q, k, v, causal=True)  # noqa: E731
    else:
        import ringseq

        attn = lambda: ringseq.ring_flash_attn_func(q, k, v, causal=True, layout=layout,  # noqa: E731
                                                    backend="sdpa")
    out = []
    for mode in ("fwd", "fwd_bwd"):
        def step():
            if mode == "fwd":
                with torch.no_grad():
                    attn()
            else:
                torch.autograd.grad(attn(), (q, k, v), dout)

        step()
        times = []
        for _ in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times) * 1e3)
    t = torch.tensor(out, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _fmt(x):
    return "?" if x is None else f"{x:.2f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    try:
        import importlib.util
        if importlib.util.find_spec("ring_flash_attn") is None:
            raise ImportError
    except ImportError:
        p.error("ring-flash-attn is not installed: pip install --no-deps ring-flash-attn")
    start = load_average()
    rows = []
    for layout in ("zigzag", "contiguous"):
        for engine in ("ring-flash-attn", "ringseq"):
            progress(f"{engine} {layout} ...")
            fwd, fb = spawn_cpu_ranks(a.world_size, _rank, (engine, layout, a), a.timeout, 1)
            rows.append((engine, layout, fwd, fb))
            progress(f"{engine} {layout}: fwd {fwd:.1f} ms, fwd+bwd {fb:.1f} ms")
    print(f"# W={a.world_size} s={a.seqlen} h={a.heads} d={a.headdim} fp32 causal, 1 thread per rank, "
          f"block kernel: torch's CPU flash op; median of {a.repeats} per rank, slowest rank; "
          f"1-minute load average {_fmt(start)} before, {_fmt(load_average())} after")
    for engine, layout, fwd, fb in rows:
        name = "plain ring" if engine == "ring-flash-attn" and layout == "contiguous" else layout
        print(f"{engine:16s} {name:11s} fwd {fwd:8.1f} ms   fwd+bwd {fb:8.1f} ms")


if __name__ == "__main__":
    main()
