"""``torch.compile(fullgraph=True)`` of every public attention function works from a cold start.

Each of 2 freshly spawned gloo ranks compiles the ring function as its very first ringseq call
(default Inductor backend: nothing the traced path touches may be created lazily), then every
other public function (``aot_eager``: the same Dynamo trace and autograd graph without
Inductor's code generation, to keep the test short), forward and backward, and compares each
with the eager call.
"""
from __future__ import annotations

import torch

from dist_utils import run_ranks

S, H, HKV, D = 16, 4, 2, 8


def _worker():
    import ringseq
    import torch.distributed as dist
    from ringseq.kernels.checks import CHECK_COUNTS

    torch.manual_seed(dist.get_rank())
    q = torch.randn(1, S, H, D)
    k = torch.randn(1, S, HKV, D)
    v = torch.randn(1, S, HKV, D)
    sp = None

    def cases():
        nonlocal sp
        cu = [0, 5, 16]
        qkv = torch.randn(1, S, 3, H, D)
        kv = torch.stack([k, k], dim=2)
        yield "ring_flash_attn_func", lambda q, k, v: ringseq.ring_flash_attn_func(
            q, k, v, causal=True, layout="zigzag")
        yield "flash_attn_func", lambda q, k, v: ringseq.flash_attn_func(
            q, k, v, causal=True, window_size=(3, 0), softcap=2.0)
        yield "flash_attn_kvpacked_func", lambda q, k, v: ringseq.flash_attn_kvpacked_func(
            q, torch.stack([k, v], 2), causal=True)
        yield "flash_attn_qkvpacked_func", lambda q, k, v: ringseq.flash_attn_qkvpacked_func(
            torch.stack([q, q, q], 2), causal=True)
        yield "flash_attn_varlen_func", lambda q, k, v: ringseq.flash_attn_varlen_func(
            q[0], k[0], v[0], cu, cu, 11, 11, causal=True)
        yield "flash_attn_varlen_kvpacked_func", lambda q, k, v: \
            ringseq.flash_attn_varlen_kvpacked_func(q[0], torch.stack([k[0], v[0]], 1), cu, cu,
                                                    11, 11, causal=True)
        yield "flash_attn_varlen_qkvpacked_func", lambda q, k, v: \
            ringseq.flash_attn_varlen_qkvpacked_func(torch.stack([q[0]] * 3, 1), cu, 11)
        yield "ring_flash_attn_kvpacked_func", lambda q, k, v: \
            ringseq.ring_flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True)
        yield "ring_flash_attn_qkvpacked_func", lambda q, k, v: \
            ringseq.ring_flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), causal=True)
        yield "ring_flash_attn_varlen_func", lambda q, k, v: \
            ringseq.ring_flash_attn_varlen_func(q[0], k[0], v[0], [0, 9, 2 * S], causal=True)
        yield "zigzag_ring_flash_attn_func", lambda q, k, v: \
            ringseq.zigzag_ring_flash_attn_func(q, k, v, causal=True)
        yield "stripe_flash_attn_func", lambda q, k, v: \
            ringseq.stripe_flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
        yield "ring_sdpa", lambda q, k, v: ringseq.ring_sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        yield "RingAttention", ringseq.RingAttention(layout="stripe", causal=True)
        yield "ulysses_attn_func", lambda q, k, v: ringseq.ulysses_attn_func(
            q, k, v, causal=True, window_size=(5, 0))
        sp = ringseq.make_sp_groups(2)
        yield "usp_attn_func", lambda q, k, v: ringseq.usp_attn_func(
            q, k, v, causal=True, sp=sp, softcap=3.0)
        yield "usp_sdpa", lambda q, k, v: ringseq.usp_sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, sp=sp)

    results = {}
    for i, (name, fn) in enumerate(cases()):
        first = i == 0  # the process's first ringseq call: a cold compile with Inductor
        compiled = torch.compile(fn, fullgraph=True, backend="inductor" if first else "aot_eager")
        torch._dynamo.reset()
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        got = compiled(*ins)
        got.float().sum().backward()
        grads = [t.grad for t in ins]
        ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
        want = fn(*ref_ins)
        want.float().sum().backward()
        err = max([float((got - want).abs().max())]
                  + [float((a - b).abs().max()) for a, b in zip(grads, [t.grad for t in ref_ins])
                     if a is not None and b is not None])
        results[name] = err
    results["_checks"] = dict(CHECK_COUNTS)
    return results


def test_every_public_function_compiles_cold_with_fullgraph():
    per_rank = run_ranks(_worker, 2, timeout=600)
    for rank, res in enumerate(per_rank):
        res.pop("_checks")
        assert len(res) == 17, sorted(res)
        for name, err in res.items():
            assert err < 1e-5, f"rank {rank} {name}: compiled differs from eager by {err}"
