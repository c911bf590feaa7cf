"""Float64 ground truth for masked attention (windows, documents, soft-capping) and a block
kernel that implements the span contract by plain dense math.

``masked_attention`` is the oracle: attention over the WHOLE sequence with the global mask of
``ringseq.masks.AttnMask`` semantics, computed in ``dtype`` (float64 for the reference, the
input dtype for the "plain" error baseline of the tolerance rule).

``DenseSpanBackend`` is an ``AttentionBackend`` whose ``fwd``/``bwd`` materialize every span's
(q_len x k_len) mask and run the reference backend's math; the ring tests use it to check the
engine's schedules independently of the optimized kernels, and vice versa.
"""
from __future__ import annotations

import torch

from ringseq.kernels import get_backend
from ringseq.kernels.base import AttentionBackend, finite_lse


def global_mask(s_q, s_k, causal=False, window=(-1, -1), cu_seqlens=None, device="cpu"):
    """(s_q, s_k) bool: key j visible to query i (bottom-right aligned when s_q != s_k)."""
    i = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=device)[None, :]
    vis = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        vis &= j <= i
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    if cu_seqlens is not None:
        bounds = torch.tensor(list(cu_seqlens[1:]), device=device)
        dq = torch.bucketize(i, bounds, right=True)
        dk = torch.bucketize(j, bounds, right=True)
        vis &= dq == dk
    return vis


def masked_attention(q, k, v, mask, softmax_scale=None, softcap=0.0, dtype=torch.float64):
    """(out, lse) of attention under the (s_q, s_k) bool ``mask``, in ``dtype``; rows that see
    nothing give out 0, lse -inf. q (b, s_q, h, d), k/v (b, s_k, h_kv, d). Differentiable."""
    h, h_kv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    qd = q.to(dtype)
    kd = k.to(dtype).repeat_interleave(h // h_kv, 2)
    vd = v.to(dtype).repeat_interleave(h // h_kv, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float() if dtype in (torch.float16, torch.bfloat16) else s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vd), lse


def _span_mask(spans, s_q, s_k, device):
    mask = torch.zeros(s_q, s_k, dtype=torch.bool, device=device)
    for q0, nq, k0, nk, lo, hi in spans:
        a = torch.arange(nq, device=device)[:, None]
        b = torch.arange(nk, device=device)[None, :]
        mask[q0:q0 + nq, k0:k0 + nk] = (b - a >= lo) & (b - a <= hi)
    return mask


class DenseSpanBackend(AttentionBackend):
    """Span-contract block kernel by dense masking (see module doc); float32/float64 math."""

    name = "dense_spans"
    supports_spans = supports_softcap = True

    def __init__(self):
        self.inner = get_backend("reference")

    def _mask(self, q, k, causal, spans):
        s_q, s_k = q.shape[1], k.shape[1]
        if spans is not None:
            return _span_mask(spans.tolist(), s_q, s_k, q.device)
        return global_mask(s_q, s_k, causal, device=q.device)

    def _fwd(self, q, k, v, softmax_scale, causal, spans=None, softcap=0.0):
        acc = self.accum_dtype(q.dtype)
        out, lse = masked_attention(q, k, v, self._mask(q, k, causal, spans), softmax_scale,
                                    softcap, dtype=acc)
        return out.to(q.dtype), lse.to(acc)

    def _bwd(self, dout, q, k, v, out, lse, softmax_scale, causal, delta=None, spans=None,
             softcap=0.0):
        # Explicit formulas (no autograd: block kernels run below the autograd dispatch), with
        # the GIVEN (possibly ring-global) lse and delta.
        acc = self.accum_dtype(q.dtype)
        mask = self._mask(q, k, causal, spans)
        h, h_kv = q.shape[2], k.shape[2]
        qd, do = q.to(acc), dout.to(acc)
        kd = k.to(acc).repeat_interleave(h // h_kv, 2)
        vd = v.to(acc).repeat_interleave(h // h_kv, 2)
        raw = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * softmax_scale
        logits = softcap * torch.tanh(raw / softcap) if softcap else raw
        p = torch.exp(logits - finite_lse(lse.to(acc))[..., None]).masked_fill(~mask, 0.0)
        if delta is None:
            delta = (do * out.to(acc)).sum(-1).transpose(1, 2)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vd)
        ds = p * (dp - delta.to(acc)[..., None])
        if softcap:
            ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * softmax_scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, qd) * softmax_scale
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        b_, s_k = k.shape[0], k.shape[1]
        dk = dk.reshape(b_, s_k, h_kv, h // h_kv, -1).sum(3)
        dv = dv.reshape(b_, s_k, h_kv, h // h_kv, -1).sum(3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
