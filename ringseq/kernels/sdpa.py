"""torch's own fused attention ops that return the log-sum-exp (a peer, and a fallback).

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.
CUDA: ``aten._scaled_dot_product_flash_attention`` (fp16/bf16, causal only with s_q == s_k),
otherwise ``aten._scaled_dot_product_efficient_attention`` with a bottom-right mask as bias.
These ops compute delta from ``dout`` and ``out`` themselves, which is exact when ``out`` is the
(global) output the ``lse`` belongs to, but they cannot take a different delta.
GQA is handled by expanding K/V heads here (torch's ops need equal head counts).

Spans (bands, windows, documents) become an additive -inf bias of the same visibility, which
these ops take exactly (rows that see nothing are set to out = 0, lse = -inf here). Logit
soft-capping cannot be expressed: it applies tanh to each score inside the kernel, before the
softmax, and the bias is only added; such calls raise NotImplementedError.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, expand_kv, finite_lse, reduce_kv
from .checks import causal_mask, no_key_rows
from .spans import visible_mask

aten = torch.ops.aten


def _bias(s_q, s_k, causal, dtype, device, spans=None):
    """Additive bias (s_q, s_k): -inf where the bottom-right causal mask or the spans hide a
    key, or None when is_causal/no mask does it.

    Its rows start on 16-element boundaries (a view of a padded buffer): CUDA's
    memory-efficient kernel rejects a bias whose row stride is not aligned."""
    if spans is None and (not causal or s_q == s_k):
        return None
    visible = causal_mask(s_q, s_k, device) if spans is None else visible_mask(spans, s_q, s_k, False, device)
    bias = torch.zeros(s_q, s_k + (-s_k) % 16, dtype=dtype, device=device)[:, :s_k]
    return bias.masked_fill_(~visible, float("-inf"))


def _zero_unseen_rows(out_bhsd, lse, s_q, s_k, causal, bias=None):
    """torch's ops give lse = 0 (or NaN) for rows that see no key; the contract says -inf, out 0."""
    if bias is not None:
        unseen = torch.isneginf(bias).all(dim=-1)  # (s_q,): rows whose every key is hidden
        if bool(unseen.any()):
            lse.masked_fill_(unseen, float("-inf"))
            out_bhsd.masked_fill_(unseen[:, None], 0.0)
        return out_bhsd, lse
    n = no_key_rows(s_q, s_k, causal)
    if n:
        lse[..., :n] = float("-inf")
        out_bhsd[:, :, :n] = 0
    return out_bhsd, lse


def _rows_of_neg_inf_scores(out_bhsd, lse, qt, kt, scale, causal, bias):
    """(b, h, s_q) bool, or None for none: the rows whose every visible score is -inf (a
    -inf in the query, say). torch's ops give such a row lse 0 and out 0: only rows that
    look so are checked, each by its scores in float32, the scale applied before the product
    (an fp16 product that overflows is no -inf score); NaN rows are not among them.
    ``bias``: the (s_q, s_k) bias of :func:`_bias` or None."""
    looks = lse == 0  # (b, h, s_q)
    if not bool(looks.any()):
        return None
    looks &= (out_bhsd == 0).all(dim=-1)
    if not bool(looks.any()):
        return None
    s_q, s_k = qt.shape[-2], kt.shape[-2]
    hidden = None if bias is None else torch.isneginf(bias)  # (s_q, s_k)
    if hidden is None and causal:
        hidden = ~causal_mask(s_q, s_k, qt.device)
    for b, h, i in looks.nonzero().tolist():  # (few: rows torch gave lse 0 and out 0)
        scores = (kt[b, h].float() @ (qt[b, h, i].float() * scale))  # (s_k,)
        if hidden is not None:
            scores = scores.masked_fill(hidden[i], float("-inf"))
        looks[b, h, i] = bool(torch.isneginf(scores).all())
    return looks


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    supports_delta = False
    supports_spans = True  # as an additive bias

    def features_reason(self, *, spans, softcap):
        if softcap:
            return (f"cannot do logit soft-capping (softcap={softcap}): torch's SDPA ops would "
                    f"have to apply tanh to each score inside the kernel, which an additive mask "
                    f"cannot express")
        return super().features_reason(spans=spans, softcap=softcap)

    def unsupported_reason(self, device, dtype, headdim):
        if device.type not in ("cpu", "cuda"):
            return f"it runs on CPU and CUDA tensors, got {device}"
        if device.type == "cuda" and dtype == torch.float64:
            return "torch's fused CUDA attention kernels have no float64 path; use backend='reference'"
        return None

    def _use_flash_cuda(self, q, causal):
        return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
                and q.shape[-1] % 8 == 0)

    def _fwd(self, q, k, v, scale, causal, spans=None, softcap=0.0):
        b, s_q, h, d = q.shape
        s_k = k.shape[1]
        qt = q.transpose(1, 2)  # (b, h, s_q, d)
        kt = expand_kv(k, h).transpose(1, 2)  # (b, h, s_k, d)
        vt = expand_kv(v, h).transpose(1, 2)
        bias = bias2d = _bias(s_q, s_k, causal, q.dtype, q.device, spans)  # (s_q, s_k)
        is_causal = causal and bias is None
        if q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, is_causal, attn_mask=bias, scale=scale)
        elif bias is None and self._use_flash_cuda(q, causal):
            out, lse = aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, is_causal, False,
                                                                scale=scale)[:2]
        else:
            if bias is not None:
                bias = bias.expand(b, h, s_q, s_k)
            out, lse = aten._scaled_dot_product_efficient_attention(
                qt, kt, vt, bias, True, 0.0, is_causal, scale=scale)[:2]
            lse = lse[..., :s_q]  # the CUDA kernel pads lse to a multiple of 32 rows
        lse = lse.to(self.accum_dtype(q.dtype)).contiguous()
        out, lse = _zero_unseen_rows(out, lse, s_q, s_k, causal, bias if spans is not None else None)
        # torch's ops give lse 0 for a row whose every score is -inf; the contract says -inf
        # (out 0), which the ring's merge needs (before: lse log W over W blocks)
        unseen = _rows_of_neg_inf_scores(out, lse, qt, kt, scale, causal, bias2d)
        if unseen is not None:  # (b, h, s_q)
            lse.masked_fill_(unseen, float("-inf"))
            out.masked_fill_(unseen[..., None], 0.0)
        return out.transpose(1, 2), lse  # (b, s_q, h, d), (b, h, s_q)

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta, spans=None, softcap=0.0):
        b, s_q, h, d = q.shape
        s_k, h_kv = k.shape[1], k.shape[2]
        qt = q.transpose(1, 2)
        kt = expand_kv(k, h).transpose(1, 2)
        vt = expand_kv(v, h).transpose(1, 2)
        ot = out.transpose(1, 2)
        dot = dout.transpose(1, 2)
        lse = finite_lse(lse).float() if q.dtype != torch.float64 else finite_lse(lse)
        bias = _bias(s_q, s_k, causal, q.dtype, q.device, spans)
        is_causal = causal and bias is None
        if q.device.type == "cpu":
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse, 0.0, is_causal, attn_mask=bias, scale=scale)
        elif bias is None and self._use_flash_cuda(q, causal):
            # cum_seq_q/k must be *undefined* (None), not empty: a defined tensor selects
            # torch's variable-length backward. The philox seed/offset are unused (dropout 0).
            empty = torch.empty(0, dtype=torch.int64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dot, qt, kt, vt, ot, lse.contiguous(), None, None, s_q, s_k, 0.0,
                is_causal, empty, empty, scale=scale)
        else:
            if bias is not None:
                bias = bias.expand(b, h, s_q, s_k)
            padded = F.pad(lse, (0, (-s_q) % 32)).contiguous()
            empty = torch.empty(0, dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                dot, qt, kt, vt, bias, ot, padded, empty, empty, 0.0,
                [True, True, True, False], is_causal, scale=scale)
        dq = dq.transpose(1, 2)
        dk = reduce_kv(dk.transpose(1, 2), h_kv)
        dv = reduce_kv(dv.transpose(1, 2), h_kv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
