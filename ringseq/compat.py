"""ring-flash-attention's layout-named ring functions, as bindings over the one ring engine.

ring-flash-attention (``pip install ring-flash-attn``) names a function per layout;
ringseq has one :func:`ringseq.ring_flash_attn_func` with ``layout=``. These functions take
ring-flash-attention's signatures (flash-attn's order, ``group`` last) and fix the layout:

=========================================  ==============================================
ring-flash-attention                       ringseq
=========================================  ==============================================
``ring_flash_attn_func``                   ``ring_flash_attn_func`` (layout "contiguous")
``zigzag_ring_flash_attn_func``            ``ring_flash_attn_func(..., layout="zigzag")``
``stripe_flash_attn_func``                 ``ring_flash_attn_func(..., layout="stripe")``
=========================================  ==============================================

and the same for the ``_kvpacked_func`` / ``_qkvpacked_func`` forms. As in
ring-flash-attention, the inputs are this rank's shards already in the layout's order:
``ringseq.shard(x, "zigzag")`` gives rank r the chunks r and 2W-1-r of 2W,
``ringseq.shard(x, "stripe")`` the tokens t with t mod W == r (stripe size 1). The varlen
forms are :func:`ringseq.ring_flash_attn_varlen_func` (global ``cu_seqlens``, any layout);
``zigzag_``/``stripe_``/``llama3_`` varlen names are not provided.

ringseq's own options (``return_lse``, ``backend``, ``grad_comm_dtype``) are keyword-only.
"""
from __future__ import annotations

from ._args import split_kv, split_qkv
from .kernels.checks import FLASH_FORM
from .nn import ring_attention, unpack

__all__ = ["zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func", "stripe_flash_attn_func",
           "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func"]


def _bound(fn, layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
           deterministic, return_attn_probs, group, return_lse, backend, grad_comm_dtype,
           softcap=0.0, form=FLASH_FORM):
    # errors name the function that was called, and the tensors as it takes them (``form``)
    return ring_attention(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                          causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, return_attn_probs=return_attn_probs,
                          group=group, layout=layout, return_lse=return_lse, backend=backend,
                          grad_comm_dtype=grad_comm_dtype, softcap=softcap, form=form)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None, *, return_lse=False,
                                backend=None, grad_comm_dtype=None, softcap=0.0):
    """:func:`ringseq.ring_flash_attn_func` with ``layout="zigzag"``: q, k, v are this rank's
    zigzag shards (chunks r and 2W-1-r of 2W; ``ringseq.shard(x, "zigzag")``), local length
    even. Arguments, returns and errors as in ``ring_flash_attn_func``."""
    return _bound("zigzag_ring_flash_attn_func", "zigzag", q, k, v, dropout_p, softmax_scale,
                  causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                  return_lse, backend, grad_comm_dtype, softcap)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False,
                                         group=None, *, return_lse=False, backend=None,
                                         grad_comm_dtype=None, softcap=0.0):
    """:func:`zigzag_ring_flash_attn_func` with kv (batch, s_local, 2, nheads_kv, headdim)."""
    fn = "zigzag_ring_flash_attn_kvpacked_func"
    k, v = unpack(fn, group, split_kv, kv)
    return _bound(fn, "zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group, return_lse, backend,
                  grad_comm_dtype, softcap, FLASH_FORM.packed("kv"))


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None,
                                          deterministic=False, return_attn_probs=False,
                                          group=None, *, return_lse=False, backend=None,
                                          grad_comm_dtype=None, softcap=0.0):
    """:func:`zigzag_ring_flash_attn_func` with qkv (batch, s_local, 3, nheads, headdim)."""
    fn = "zigzag_ring_flash_attn_qkvpacked_func"
    q, k, v = unpack(fn, group, split_qkv, qkv)
    return _bound(fn, "zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group, return_lse, backend,
                  grad_comm_dtype, softcap, FLASH_FORM.packed("qkv"))


def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, group=None, *, return_lse=False,
                           backend=None, grad_comm_dtype=None, softcap=0.0):
    """:func:`ringseq.ring_flash_attn_func` with ``layout="stripe"``: q, k, v are this rank's
    stripe shards (token t on rank t mod W; ``ringseq.shard(x, "stripe")``). Arguments,
    returns and errors as in ``ring_flash_attn_func``."""
    return _bound("stripe_flash_attn_func", "stripe", q, k, v, dropout_p, softmax_scale, causal,
                  window_size, alibi_slopes, deterministic, return_attn_probs, group,
                  return_lse, backend, grad_comm_dtype, softcap)


def stripe_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, group=None, *, return_lse=False,
                                    backend=None, grad_comm_dtype=None, softcap=0.0):
    """:func:`stripe_flash_attn_func` with kv (batch, s_local, 2, nheads_kv, headdim)."""
    fn = "stripe_flash_attn_kvpacked_func"
    k, v = unpack(fn, group, split_kv, kv)
    return _bound(fn, "stripe", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group, return_lse, backend,
                  grad_comm_dtype, softcap, FLASH_FORM.packed("kv"))


def stripe_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, group=None,
                                     *, return_lse=False, backend=None, grad_comm_dtype=None,
                                     softcap=0.0):
    """:func:`stripe_flash_attn_func` with qkv (batch, s_local, 3, nheads, headdim)."""
    fn = "stripe_flash_attn_qkvpacked_func"
    q, k, v = unpack(fn, group, split_qkv, qkv)
    return _bound(fn, "stripe", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group, return_lse, backend,
                  grad_comm_dtype, softcap, FLASH_FORM.packed("qkv"))
