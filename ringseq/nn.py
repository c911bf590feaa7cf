"""Public ring-attention API: functions on local shards and the ``RingAttention`` module.

Every function takes this rank's shard of a sequence that was split with
``ringseq.shard(x, layout, group)`` (or an equivalent data loader) and returns this rank's
shard of the output. All ranks of ``group`` must call with the same shapes, dtype, layout and
causal flag; a first call per shape checks that across ranks (see
``ringseq.set_consistency_check``) and every rank raises ``RingMismatchError`` (a ValueError)
naming what differs, instead of hanging.

``group=None`` means the default process group; without an initialized process group the
functions compute plain local attention (world size 1).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .kernels import get_backend
from .layouts import get_layout
from .ring_op import ring_attention_op

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
           "ring_flash_attn_qkvpacked_func", "ring_sdpa", "RingAttention"]


def _autocast(q, k, v):
    # Like F.scaled_dot_product_attention, ring attention runs in autocast's lower precision:
    # under autocast, models hand over mixed dtypes (e.g. transformers' RoPE returns float32
    # q/k next to a bf16 v), which the kernels would refuse.
    dev = q.device.type
    if not torch.is_autocast_enabled(dev):
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (q, k, v))


def ring_flash_attn_func(q, k, v, softmax_scale=None, causal=False, group=None,
                         layout="contiguous", return_lse=False, backend=None,
                         grad_comm_dtype=None):
    """Exact attention over a sequence sharded across ``group``, on this rank's shards.

    Args:
        q: (batch, s_local, nheads, headdim); k, v: (batch, s_local, nheads_kv, headdim) with
            ``nheads % nheads_kv == 0`` (GQA/MQA: only the kv heads travel the ring). float32,
            float64, bfloat16 or float16; only the last dimension must be contiguous. Under
            ``torch.autocast`` they are first cast to the autocast dtype (float64 excepted),
            as ``F.scaled_dot_product_attention`` is, so mixed float32/bf16 inputs work.
        softmax_scale: defaults to ``headdim ** -0.5``.
        causal: causal mask over GLOBAL positions as placed by ``layout``.
        group: process group of the ring (None: default group; no process group: local).
        layout: ``"contiguous"``, ``"zigzag"``, ``"stripe"`` or a ``ringseq.layouts.Layout``;
            must match how the shards were made. All layouts are exact for full (non-causal)
            attention, which is permutation invariant; zigzag/stripe only balance causal work.
        return_lse: also return lse.
        backend: block kernel: None (best available), "ringseq", "reference", ... (see
            ``ringseq.get_backend``); "sdpa" works for forward and backward without lse grads.
        grad_comm_dtype: dtype in which the dK/dV accumulators travel in the backward. None:
            float32 (float64 for float64 inputs), exact accumulation. ``"input"`` (or e.g.
            ``torch.bfloat16``): 2/3 of the backward traffic, one rounding per ring hop. Measured
            for bf16 inputs at W=4 (tests/test_ring.py): about 2x the dK/dV error of float32
            transit, about the error of plain bf16 attention; bounded by float32 transit's
            error + W * 2**-8 * max|dK|. out, lse and dQ are unaffected. float16 transit
            can overflow (partial sums above 65504 become inf); prefer bfloat16.

    Returns:
        out (batch, s_local, nheads, headdim) in q's dtype (under ``torch.autocast``: the
        autocast dtype, float64 inputs excepted); with ``return_lse`` also
        lse (batch, nheads, s_local) float32 (float64 for float64 inputs), natural log, -inf
        for rows that see no key. Gradients flow to q, k, v (in their dtype) and through lse.

    Raises:
        ValueError: bad shapes/dtypes/devices, a local length the layout cannot use (zigzag
            needs an even one), an unknown layout or backend -- before any communication.
        RingMismatchError (a ValueError): ranks called with different arguments (every rank).
    """
    q, k, v = _autocast(q, k, v)
    # The inputs now have the dtype autocast asked for; the block kernels choose their own
    # accumulation dtype (the reference backend's float32/float64 einsums), which the caller's
    # autocast would otherwise silently lower to bf16/fp16.
    with torch.autocast(q.device.type, enabled=False):
        out, lse = ring_attention_op(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                     layout=get_layout(layout), group=group,
                                     backend=get_backend(backend, q.device, q.dtype, q.shape[-1]),
                                     grad_comm_dtype=grad_comm_dtype)
    return (out, lse) if return_lse else out


def ring_flash_attn_kvpacked_func(q, kv, softmax_scale=None, causal=False, group=None,
                                  layout="contiguous", return_lse=False, backend=None,
                                  grad_comm_dtype=None):
    """:func:`ring_flash_attn_func` with ``kv`` packed as (batch, s_local, 2, nheads_kv, headdim).

    K and V are read as strided views of ``kv`` (no copy); the gradient comes back packed."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads_kv, headdim), got "
                         f"{tuple(kv.shape)}")
    return ring_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, group,
                                layout, return_lse, backend, grad_comm_dtype)


def ring_flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, group=None,
                                   layout="contiguous", return_lse=False, backend=None,
                                   grad_comm_dtype=None):
    """:func:`ring_flash_attn_func` with ``qkv`` packed as (batch, s_local, 3, nheads, headdim)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got "
                         f"{tuple(qkv.shape)}")
    return ring_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal,
                                group, layout, return_lse, backend, grad_comm_dtype)


def ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=True, *, group=None, layout="contiguous", backend=None,
              grad_comm_dtype=None):
    """Ring attention with ``F.scaled_dot_product_attention``'s layout and positional order,
    for SDPA model code (a call written for SDPA means the same here).

    Args:
        query: (batch, nheads, s_local, headdim); key, value: (batch, nheads_kv, s_local,
            headdim), ``nheads % nheads_kv == 0`` (GQA is always allowed).
        attn_mask, dropout_p: as in SDPA's signature; only None / 0.0 are supported
            (ValueError otherwise).
        is_causal, scale: as in SDPA (causal over global positions of ``layout``).
        enable_gqa: accepted for SDPA compatibility (GQA is always on).
        group, layout, backend, grad_comm_dtype (keyword-only): as in
            :func:`ring_flash_attn_func`.

    Returns (batch, nheads, s_local, headdim) in query's dtype (under ``torch.autocast``: the
    autocast dtype, float64 inputs excepted; a transposed view).
    """
    if attn_mask is not None:
        raise ValueError("ring_sdpa does not support attn_mask; use is_causal or a layout")
    if dropout_p:
        raise ValueError(f"ring_sdpa does not support dropout, got dropout_p={dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, nheads, seqlen, headdim), got "
                             f"{tuple(t.shape)}")
    out = ring_flash_attn_func(query.transpose(1, 2), key.transpose(1, 2),
                               value.transpose(1, 2), scale, is_causal, group, layout, False,
                               backend, grad_comm_dtype)
    return out.transpose(1, 2)


class RingAttention(nn.Module):
    """Ring attention as a module holding its group, layout, causal flag and backend.

    ``forward(q, k, v, return_lse=False)`` takes flash-attn's (batch, s_local, nheads,
    headdim) shards and returns what :func:`ring_flash_attn_func` returns.
    """

    def __init__(self, group=None, layout="contiguous", causal: bool = False,
                 backend: Optional[str] = None, softmax_scale: Optional[float] = None,
                 grad_comm_dtype=None):
        super().__init__()
        self.group = group
        self.layout = get_layout(layout)
        self.causal = bool(causal)
        self.backend = backend
        self.softmax_scale = softmax_scale
        self.grad_comm_dtype = grad_comm_dtype

    def forward(self, q, k, v, return_lse: bool = False):
        return ring_flash_attn_func(q, k, v, self.softmax_scale, self.causal, self.group,
                                    self.layout, return_lse, self.backend, self.grad_comm_dtype)

    def extra_repr(self) -> str:
        return f"layout={self.layout.name!r}, causal={self.causal}, backend={self.backend!r}"
