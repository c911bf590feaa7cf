"""Plain attention math, the slow and obviously correct backend (float32, float64 for float64)."""
from __future__ import annotations

import einops
import torch

from .base import AttentionBackend, compute_delta, finite_lse
from .checks import accum_dtype, causal_mask


def _grouped(q, nheads_kv):
    """(b, s, h, d) -> (b, s, h_kv, g, d): query heads grouped by the kv head they read."""
    return einops.rearrange(q, "b s (hk g) d -> b s hk g d", hk=nheads_kv)


def _scores(q, k, scale, causal):
    acc = accum_dtype(q.dtype)
    qg = _grouped(q.to(acc), k.shape[2])
    s = torch.einsum("bqkgd,bjkd->bkgqj", qg, k.to(acc)) * scale  # (b, h_kv, g, s_q, s_k)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    return s


class ReferenceBackend(AttentionBackend):
    """Materialises the (s_q, s_k) score matrix: for tests and small inputs only."""

    name = "reference"

    def _fwd(self, q, k, v, scale, causal):
        b, s_q, h, d = q.shape
        s = _scores(q, k, scale, causal)
        lse = torch.logsumexp(s, dim=-1)  # (b, h_kv, g, s_q); -inf where no key is visible
        p = torch.exp(s - finite_lse(lse)[..., None])
        out = torch.einsum("bkgqj,bjkd->bqkgd", p, v.to(p.dtype)).reshape(b, s_q, h, d)
        return out.to(q.dtype), lse.reshape(b, h, s_q)

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta):
        b, s_q, h, d = q.shape
        h_kv = k.shape[2]
        acc = accum_dtype(q.dtype)
        s = _scores(q, k, scale, causal)
        p = torch.exp(s - finite_lse(lse.to(acc)).reshape(b, h_kv, h // h_kv, s_q)[..., None])
        do = _grouped(dout.to(acc), h_kv)  # (b, s_q, h_kv, g, d)
        if delta is None:
            delta = compute_delta(dout, out)  # (b, h, s_q)
        dp = torch.einsum("bqkgd,bjkd->bkgqj", do, v.to(acc))
        ds = p * (dp - delta.to(acc).reshape(b, h_kv, h // h_kv, s_q)[..., None])
        dq = torch.einsum("bkgqj,bjkd->bqkgd", ds, k.to(acc)).reshape(b, s_q, h, d) * scale
        dk = torch.einsum("bkgqj,bqkgd->bjkd", ds, _grouped(q.to(acc), h_kv)) * scale
        dv = torch.einsum("bkgqj,bqkgd->bjkd", p, do)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
