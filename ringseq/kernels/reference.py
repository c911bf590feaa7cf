"""Plain attention math, the slow and obviously correct backend (float32, float64 for float64)."""
from __future__ import annotations

import einops
import torch

from .base import AttentionBackend, compute_delta, finite_lse
from .checks import accum_dtype
from .spans import visible_mask


def _grouped(q, nheads_kv):
    """(b, s, h, d) -> (b, s, h_kv, g, d): query heads grouped by the kv head they read."""
    return einops.rearrange(q, "b s (hk g) d -> b s hk g d", hk=nheads_kv)


def _scores(q, k, scale, causal, spans=None, softcap=0.0):
    """Masked scores (b, h_kv, g, s_q, s_k) and, with a soft-cap, tanh of the scaled scores
    (for the backward's 1 - tanh^2), else None."""
    acc = accum_dtype(q.dtype)
    qg = _grouped(q.to(acc), k.shape[2])
    s = torch.einsum("bqkgd,bjkd->bkgqj", qg, k.to(acc)) * scale  # (b, h_kv, g, s_q, s_k)
    th = None
    if softcap > 0.0:  # softcap * tanh(x / softcap) of the scaled score x, before the mask
        th = torch.tanh(s / softcap)
        s = softcap * th
    if causal or spans is not None:
        s = s.masked_fill(~visible_mask(spans, q.shape[1], k.shape[1], causal, q.device), float("-inf"))
    return s, th


class ReferenceBackend(AttentionBackend):
    """Materialises the (s_q, s_k) score matrix: for tests and small inputs only."""

    name = "reference"
    supports_spans = True
    supports_softcap = True

    def _fwd(self, q, k, v, scale, causal, spans=None, softcap=0.0):
        b, s_q, h, d = q.shape
        s, _ = _scores(q, k, scale, causal, spans, softcap)
        lse = torch.logsumexp(s, dim=-1)  # (b, h_kv, g, s_q); -inf where no key is visible
        p = torch.exp(s - finite_lse(lse)[..., None])
        out = torch.einsum("bkgqj,bjkd->bqkgd", p, v.to(p.dtype)).reshape(b, s_q, h, d)
        return out.to(q.dtype), lse.reshape(b, h, s_q)

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta, spans=None, softcap=0.0):
        b, s_q, h, d = q.shape
        h_kv = k.shape[2]
        acc = accum_dtype(q.dtype)
        s, th = _scores(q, k, scale, causal, spans, softcap)
        p = torch.exp(s - finite_lse(lse.to(acc)).reshape(b, h_kv, h // h_kv, s_q)[..., None])
        do = _grouped(dout.to(acc), h_kv)  # (b, s_q, h_kv, g, d)
        if delta is None:
            delta = compute_delta(dout, out)  # (b, h, s_q)
        dp = torch.einsum("bqkgd,bjkd->bkgqj", do, v.to(acc))
        ds = p * (dp - delta.to(acc).reshape(b, h_kv, h // h_kv, s_q)[..., None])
        if th is not None:  # d(softcap * tanh(x / softcap)) / dx
            ds = ds * (1 - th * th)
        dq = torch.einsum("bkgqj,bjkd->bqkgd", ds, k.to(acc)).reshape(b, s_q, h, d) * scale
        dk = torch.einsum("bkgqj,bqkgd->bjkd", ds, _grouped(q.to(acc), h_kv)) * scale
        dv = torch.einsum("bkgqj,bqkgd->bjkd", p, do)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
