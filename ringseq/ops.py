"""Single-device attention with log-sum-exp: the Python face of the kernels.

``flash_attn_func`` (and its kv/qkv-packed forms) takes flash-attn 2's signature and
(batch, seqlen, nheads, headdim) layout and runs on any backend of ``ringseq.kernels`` through
one differentiable custom operator (``ringseq.kernels.autograd``); ``get_backend`` resolves
the name the ring uses.
"""
from __future__ import annotations

import torch

from ._args import check_flash_args, split_kv, split_qkv
from .kernels import AttentionBackend, available_backends, check_qkv, get_backend, resolve_scale
from .kernels.autograd import attention
from .kernels.spans import document_spans


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_lse=False, backend=None):
    """Exact attention of q against k, v, with flash-attn 2's signature.

    The positional order and defaults are flash-attn's ``flash_attn_func``, so a call written
    for flash-attn means the same here or raises; ringseq's own options are keyword-only.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
            ``nheads % nheads_kv == 0`` (GQA/MQA without expanding K/V). Only the last
            dimension must be contiguous. float32, float64, bfloat16 or float16 (CUDA kernel:
            float16/bfloat16 with head dim 64 or 128; use backend="sdpa" otherwise).
        dropout_p: must be 0.0: ringseq has no attention dropout (NotImplementedError for any
            ``dropout_p > 0``, in training and evaluation: flash-attn applies it in both).
        softmax_scale: a float, or None for ``headdim ** -0.5``.
        causal: bool; bottom-right aligned mask: key j is visible to query i iff
            ``j <= i + seqlen_k - seqlen_q``. Rows that see no key give 0 and lse = -inf.
        window_size: must be (-1, -1) (no sliding window yet; NotImplementedError otherwise).
        softcap: must be 0.0 (no softcapping yet; NotImplementedError otherwise).
        alibi_slopes: must be None (NotImplementedError otherwise).
        deterministic: accepted and without effect: ringseq's kernels (the default backend)
            are always deterministic (fixed accumulation order, no atomics), forward and
            backward; with backend "sdpa" / "flash_attn" determinism is that library's.
        return_attn_probs: as in flash-attn: return ``(out, softmax_lse, None)``; the third
            entry (flash-attn's attention probabilities, "for testing only") is always None.
        return_lse (keyword-only): return ``(out, lse)``.
        backend (keyword-only): None (ringseq's kernels where they support the inputs),
            "ringseq", "sdpa", "reference", "flash_attn", or an AttentionBackend instance.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with ``return_attn_probs``
        ``(out, softmax_lse, None)``, with ``return_lse`` ``(out, lse)``, where lse is
        (batch, nheads, seqlen_q), float32 (float64 for float64 inputs), natural log of the
        softmax normalizer of ``softmax_scale * q k^T``; gradients may flow through it.

    Raises:
        TypeError: an argument of the wrong kind (a bool or None for ``dropout_p`` or
            ``softmax_scale``, a ``causal`` that is not a bool, ...), naming it.
        NotImplementedError: ``dropout_p > 0``, ``window_size != (-1, -1)``, ``softcap != 0``,
            ``alibi_slopes``, naming the parameter.
        ValueError: inputs that do not fit together or that the chosen backend cannot run (the
            message names the argument, what was given and what is expected); also when
            backend "ringseq" is requested but the extension is not built.
    """
    check_flash_args("flash_attn_func", dropout_p=dropout_p, softmax_scale=softmax_scale,
                     causal=causal, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, deterministic=deterministic,
                     return_attn_probs=return_attn_probs, return_lse=return_lse)
    check_qkv(q, k, v)
    be = get_backend(backend, q.device, q.dtype, q.shape[-1])
    window = tuple(window_size)
    spans = (None if window == (-1, -1) else
             document_spans((0, q.shape[1]), (0, k.shape[1]), causal, window))
    out, lse = attention(q, k, v, resolve_scale(softmax_scale, q.shape[-1]),
                         causal and spans is None, be, spans=spans, softcap=softcap)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, return_lse=False,
                             backend=None):
    """:func:`flash_attn_func` with ``kv`` packed as (batch, seqlen_k, 2, nheads_kv, headdim),
    flash-attn 2's ``flash_attn_kvpacked_func`` signature. K and V are strided views of ``kv``
    (no copy); its gradient comes back packed. ValueError for another ``kv`` shape."""
    fn = "flash_attn_kvpacked_func"
    check_flash_args(fn, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                     deterministic=deterministic, return_attn_probs=return_attn_probs,
                     return_lse=return_lse)
    k, v = split_kv(fn, kv)
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap,
                           return_attn_probs=return_attn_probs, return_lse=return_lse,
                           backend=backend)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              return_lse=False, backend=None):
    """:func:`flash_attn_func` with ``qkv`` packed as (batch, seqlen, 3, nheads, headdim),
    flash-attn 2's ``flash_attn_qkvpacked_func`` signature (no GQA in this form). ValueError
    for another ``qkv`` shape."""
    fn = "flash_attn_qkvpacked_func"
    check_flash_args(fn, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                     deterministic=deterministic, return_attn_probs=return_attn_probs,
                     return_lse=return_lse)
    q, k, v = split_qkv(fn, qkv)
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap,
                           return_attn_probs=return_attn_probs, return_lse=return_lse,
                           backend=backend)


def _cu_list(fn: str, name: str, cu, total: int, n_docs=None):
    """cu_seqlens as a list of ints after flash-attn's rules: a 1-D int32/int64 tensor (or a
    sequence) starting at 0, non-decreasing, ending at ``total``."""
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{fn}: {name} must be a 1-D int32 tensor (batch + 1,), got "
                             f"{cu.dtype} of shape {tuple(cu.shape)}")
        cu = cu.tolist()  # host copy: the spans are planned on the host
    cu = [int(c) for c in cu]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{fn}: {name} must start at 0 and never decrease, got {cu}")
    if cu[-1] != total:
        raise ValueError(f"{fn}: {name} must end at the packed length {total}, got {cu[-1]}")
    if n_docs is not None and len(cu) != n_docs:
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {len(cu) - 1} and {n_docs - 1}")
    return cu


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, return_lse=False,
                           backend=None):
    """Attention over packed variable-length sequences, flash-attn 2's
    ``flash_attn_varlen_func`` signature and conventions.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim): the sequences of
            a batch packed back to back (no padding).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 (int64 accepted): sequence i is rows
            ``[cu[i], cu[i+1])``. Read on the host (a device copy synchronizes once).
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence (checked).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as in :func:`flash_attn_func`; causal masks and windows are
            bottom-right aligned within each sequence.
        block_table: must be None (paged KV caches are not supported).
        return_lse, backend (keyword-only): as in :func:`flash_attn_func`.

    Returns out (total_q, nheads, headdim) in q's dtype; with ``return_lse`` also lse
    (nheads, total_q) float32 (float64 for float64), with ``return_attn_probs``
    ``(out, lse, None)``. Differentiable (q, k, v, lse). Work grows with the sum over
    sequences of ``len_q * len_k`` (each sequence is one span of the block kernel).

    Raises:
        TypeError / ValueError / NotImplementedError: as :func:`flash_attn_func`, plus
            malformed ``cu_seqlens_*`` (not 1-D int, not starting at 0, decreasing, not ending
            at the packed length, different batch sizes) and a ``max_seqlen`` below the
            longest sequence; ``block_table`` not None (NotImplementedError).
    """
    fn = "flash_attn_varlen_func"
    check_flash_args(fn, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                     deterministic=deterministic, return_attn_probs=return_attn_probs,
                     return_lse=return_lse)
    if block_table is not None:
        raise NotImplementedError(f"{fn}: block_table (a paged KV cache) is not supported")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{fn}: {name} must be a 3-dim tensor (total, nheads, headdim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    cu_k = _cu_list(fn, "cu_seqlens_k", cu_seqlens_k, k.shape[0])
    cu_q = _cu_list(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0], len(cu_k))
    for name, cu, mx in (("max_seqlen_q", cu_q, max_seqlen_q), ("max_seqlen_k", cu_k, max_seqlen_k)):
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        if not isinstance(mx, int) or isinstance(mx, bool) or mx < longest:
            raise ValueError(f"{fn}: {name} must be an int >= the longest sequence ({longest}), "
                             f"got {mx!r}")
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # (1, total, h, d) views
    check_qkv(q4, k4, v4)
    be = get_backend(backend, q.device, q.dtype, q.shape[-1])
    # empty documents (no query or no key rows) give nothing: out 0 and lse -inf by contract
    spans = [sp for sp in document_spans(cu_q, cu_k, causal, tuple(window_size))
             if sp[1] > 0 and sp[3] > 0]
    out, lse = attention(q4, k4, v4, resolve_scale(softmax_scale, q.shape[-1]), False, be,
                         spans=spans, softcap=softcap)
    out, lse = out[0], lse[0]  # (total_q, h, d), (h, total_q)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


__all__ = ["AttentionBackend", "available_backends", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "get_backend"]
