"""One small forward + backward through the CUDA kernels, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python benchmarks/sanitize_shape.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_shape.py

b=1, h=2, h_kv=1 (GQA), s=200 (ragged: not a multiple of any tile), causal, every head dim,
dtype and tile configuration with kernels of its own (fwd, bwd and bwd_accum; d=64's config 2
is its config 0), plus one s_q != s_k shape where some rows see no key, plus the spans path
(csrc/cuda: the spans/soft-cap kernels; configs 0 and 1, which config 2 maps to with spans):
two spans, a sliding window and a one-sided band, rows outside both, soft-cap 30. Small on
purpose: the sanitizer slows kernels down by orders of magnitude. Exits non-zero when a result
is not finite.
"""
from __future__ import annotations

import argparse
import sys

import torch


# q rows [0, 90) x kv rows [0, 100) with a causal window of 40 keys (bottom-right), q rows
# [110, 200) x kv rows [120, 200) with band (-inf, 5]; q rows [90, 110), kv rows [100, 120)
# belong to no span.
SPANS = [(0, 90, 0, 100, 100 - 90 - 40, 100 - 90), (110, 90, 120, 80, -(2 ** 62), 5)]


def one(dtype, d, cfg, s_q, s_k, causal, gen, spans=None, softcap=0.0):
    import ringseq  # noqa: F401  (registers torch.ops.ringseq.*)

    def rnd(*shape):
        return torch.randn(shape, device="cuda", generator=gen).to(dtype)

    q, dout = rnd(1, s_q, 2, d), rnd(1, s_q, 2, d)
    k, v = rnd(1, s_k, 1, d), rnd(1, s_k, 1, d)
    scale = d ** -0.5
    extra = () if spans is None else (torch.tensor(spans, dtype=torch.int64), softcap)
    out, lse = torch.ops.ringseq.fwd(q, k, v, scale, causal, cfg, *extra)
    dq, dk, dv = torch.ops.ringseq.bwd(dout, q, k, v, out, lse, scale, causal, None, cfg, *extra)
    acc = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
    torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, scale, causal, None, *acc, cfg, *extra)
    torch.cuda.synchronize()
    bad = [name for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv),
                                ("dq_accum", acc[0]), ("dk_accum", acc[1]), ("dv_accum", acc[2]))
           if not torch.isfinite(t).all()]
    if not torch.isfinite(lse[~torch.isneginf(lse)]).all():
        bad.append("lse")
    return bad


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only bf16 (every head dim and tile config)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sanitize_shape: no CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(1234)
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    configs = {64: (0, 1), 128: (0, 1, 2)}  # csrc/kernel_math.h: fwd_block_m / fwd_block_n
    failures = []
    for dtype in dtypes:
        for d, cfgs in configs.items():
            for cfg in cfgs:
                shapes = [(200, 200, True, None), (200, 77, True, None)]
                if cfg in (0, 1):
                    shapes.append((200, 200, False, SPANS))
                for s_q, s_k, causal, spans in shapes:
                    bad = one(dtype, d, cfg, s_q, s_k, causal, gen, spans, 30.0 if spans else 0.0)
                    tag = (f"{str(dtype).replace('torch.', '')} d={d} cfg={cfg} s_q={s_q} s_k={s_k}"
                           + (" spans+window+softcap" if spans else ""))
                    print(f"sanitize_shape: {tag}: {'non-finite ' + ','.join(bad) if bad else 'ok'}",
                          flush=True)
                    if bad:
                        failures.append(tag)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
