"""Single-device attention with log-sum-exp, with flash-attn 2's signatures.

``flash_attn_func`` (and its kv/qkv-packed forms) and ``flash_attn_varlen_func`` (and its
packed forms) take flash-attn 2's arguments and (batch, seqlen, nheads, headdim) or packed
(total, nheads, headdim) tensors, build the call's :class:`ringseq.spec.AttnSpec` once and run
on any backend of ``ringseq.kernels`` through the one custom operator
(:mod:`ringseq.engine.op`, local placement).

Return conventions are flash-attn's: ``(out, softmax_lse, None)`` with ``return_attn_probs``;
a row that sees no key has out 0 and ``softmax_lse = +inf`` as in flash-attn (its kernels
write +inf there so that ``exp(score - lse)`` is 0 in their backward). ringseq's own
``return_lse=True`` gives ``(out, lse)`` with ``lse = -inf`` for such rows, the value the ring
merges with (both are differentiable where finite).
"""
from __future__ import annotations

import torch

from ._args import (as_int, check_cu_seqlens, check_returns, given, split_kv, split_packed_varlen,
                    split_qkv)
from .engine.op import run_attention
from .engine.placement import LOCAL
from .kernels import AttentionBackend, available_backends, get_backend
from .kernels.checks import FLASH_FORM, VARLEN_FORM
from .spec import attn_spec, local_spans

__all__ = ["AttentionBackend", "available_backends", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "get_backend",
           "returns"]


def returns(out, lse, return_attn_probs: bool, return_lse: bool):
    """What a flash-attn style function returns: ``out``; ``(out, lse)`` with ringseq's
    ``return_lse`` (-inf for rows that see no key); ``(out, softmax_lse, None)`` with
    flash-attn's ``return_attn_probs`` (+inf for such rows, flash-attn's convention)."""
    if return_attn_probs:
        return out, torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse), None
    return (out, lse) if return_lse else out


def _flash(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           deterministic, return_attn_probs, return_lse, backend, form=FLASH_FORM):
    check_returns(fn, return_attn_probs, return_lse)
    spec = attn_spec(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                     causal=causal, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, deterministic=deterministic, backend=backend,
                     form=form)
    out, lse = run_attention(q, k, v, spec, LOCAL)  # (its window's span: LOCAL builds it)
    return returns(out, lse, return_attn_probs, return_lse)


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
            float16/bfloat16 with head dim 64 or 128; use backend="sdpa" otherwise). Computed
            in that dtype also under ``torch.autocast``, as flash-attn's function does (the
            ring forms, ``ring_flash_attn_func`` and the rest, cast to the autocast dtype
            first: model code switched to them under autocast gets what its projections
            gave).
        dropout_p: must be 0.0: ringseq has no attention dropout (NotImplementedError for any
            ``dropout_p > 0``, in training and evaluation: flash-attn applies it in both).
        softmax_scale: a float, or None for ``headdim ** -0.5``.
        causal: bool; bottom-right aligned mask: key j is visible to query i iff
            ``j <= i + seqlen_k - seqlen_q``.
        window_size: flash-attn's ``(left, right)`` sliding window (ints, a 2-element integer
            tensor or 0-d integer tensors; -1: unbounded), bottom-right aligned: key j is
            visible to query i iff ``i + s_k - s_q - left <= j <= i + s_k - s_q + right``,
            combined with ``causal``. As in flash-attn 2's kernels, a side of at least
            ``seqlen_k`` is unbounded (-1): with ``seqlen_q > seqlen_k`` the first rows then
            see keys the formula alone would not give them; and with ``left >= 0`` an
            unbounded right side is ``seqlen_k`` wide, which the formula then applies to
            (the first ``seqlen_q - seqlen_k - 1`` rows see fewer keys). The kernels skip
            the tiles outside the band.
        softcap: logit soft-capping ``softcap * tanh(s / softcap)`` of the scaled scores
            (Gemma 2; 0.0: off).
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
        out (batch, seqlen_q, nheads, headdim) in q's dtype (0 for rows that see no key);
        with ``return_attn_probs`` ``(out, softmax_lse, None)`` (+inf for rows that see no
        key, as flash-attn), with ``return_lse`` ``(out, lse)`` (-inf there), where lse is
        (batch, nheads, seqlen_q), float32 (float64 for float64 inputs), natural log of the
        softmax normalizer of ``softmax_scale * q k^T``; gradients may flow through it.

    Raises:
        TypeError: an argument of the wrong kind (a bool or None for ``dropout_p`` or
            ``softmax_scale``, a ``causal`` that is not a bool, ...), naming it.
        NotImplementedError: ``dropout_p > 0``, ``alibi_slopes``, a backend without spans or
            soft-capping asked for them, naming the parameter.
        ValueError: a ``dropout_p`` outside [0, 1] (not a probability); inputs that do not
            fit together or that the chosen backend cannot run (the message names the
            argument, what was given and what is expected); also when backend "ringseq" is
            requested but the extension is not built.
    """
    return _flash("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs, return_lse, backend)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, return_lse=False,
                             backend=None):
    """:func:`flash_attn_func` with ``kv`` packed as (batch, seqlen_k, 2, nheads_kv, headdim),
    flash-attn 2's ``flash_attn_kvpacked_func`` signature. K and V are strided views of ``kv``
    (no copy); its gradient comes back packed. ValueError for another ``kv`` shape."""
    fn = "flash_attn_kvpacked_func"
    k, v = split_kv(fn, kv)
    return _flash(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs, return_lse, backend,
                  FLASH_FORM.packed("kv"))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              return_lse=False, backend=None):
    """:func:`flash_attn_func` with ``qkv`` packed as (batch, seqlen, 3, nheads, headdim),
    flash-attn 2's ``flash_attn_qkvpacked_func`` signature (no GQA in this form). ValueError
    for another ``qkv`` shape."""
    fn = "flash_attn_qkvpacked_func"
    q, k, v = split_qkv(fn, qkv)
    return _flash(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs, return_lse, backend,
                  FLASH_FORM.packed("qkv"))


def _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, block_table, return_lse, backend, form=VARLEN_FORM,
            lengths=("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")):
    """The varlen functions' one body; ``form`` and ``lengths`` name the tensors and the
    length arguments as the function called takes them (a packed form's one cu_seqlens)."""
    check_returns(fn, return_attn_probs, return_lse)
    if block_table is not None:
        raise NotImplementedError(f"{fn}: block_table (a paged KV cache) is not supported; pass "
                                  f"block_table=None")
    q4, k4, v4 = form.to_flash(fn, q, k, v)  # (1, total, h, d) views
    cu_k = check_cu_seqlens(fn, lengths[1], cu_seqlens_k, k.shape[0], "the packed length")
    cu_q = check_cu_seqlens(fn, lengths[0], cu_seqlens_q, q.shape[0], "the packed length")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {len(cu_q) - 1} and {len(cu_k) - 1}")
    limits = {}
    for name, cu, mx in ((lengths[2], cu_q, max_seqlen_q), (lengths[3], cu_k, max_seqlen_k)):
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        # NumPy's integers and 0-d integer tensors too (np.diff(cu).max()); a SymInt
        # (torch.compile) as it is
        # (dynamo sees a traced int as an int, not as a SymInt: both kept as they are)
        as_int_mx = (mx if isinstance(mx, (int, torch.SymInt)) and not isinstance(mx, bool)
                     else as_int(mx))
        if as_int_mx is None:
            raise TypeError(f"{fn}: {name} must be an int (the longest sequence, {longest}, or "
                            f"more), got {given(mx)}")
        if as_int_mx < longest:
            raise ValueError(f"{fn}: {name} must be >= the longest sequence ({longest}), got "
                             f"{as_int_mx}")
        limits[name] = as_int_mx
    spec = attn_spec(fn, q4, k4, v4, dropout_p=dropout_p, softmax_scale=softmax_scale,
                     causal=causal, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, deterministic=deterministic, backend=backend,
                     varlen=True, form=form)
    spec = local_spans(spec, q.shape[0], k.shape[0], cu_q, cu_k,
                       window_clamp=limits[lengths[3]])
    out, lse = run_attention(q4, k4, v4, spec, LOCAL)
    return returns(out[0], lse[0], return_attn_probs, return_lse)  # (total_q, h, d), (h, total_q)


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
        max_seqlen_q, max_seqlen_k: integers (Python's, NumPy's or a 0-d integer tensor) >=
            the longest sequence: TypeError for a bool, float or other kind, ValueError for
            a smaller value.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as in :func:`flash_attn_func`; causal masks and windows are
            bottom-right aligned within each sequence.
        block_table: must be None (paged KV caches are not supported).
        return_lse, backend (keyword-only): as in :func:`flash_attn_func`.

    Returns out (total_q, nheads, headdim) in q's dtype; with ``return_lse`` also lse
    (nheads, total_q) float32 (float64 for float64; -inf for rows that see no key), with
    ``return_attn_probs`` ``(out, softmax_lse, None)`` (+inf for such rows). Differentiable
    (q, k, v, lse). Work grows with the sum over sequences of ``len_q * len_k`` (each
    sequence is one span of the block kernel).

    Raises:
        TypeError / ValueError / NotImplementedError: as :func:`flash_attn_func`, plus
            malformed ``cu_seqlens_*`` (not 1-D int, not starting at 0, decreasing, not ending
            at the packed length, different batch sizes) and a ``max_seqlen`` below the
            longest sequence; ``block_table`` not None (NotImplementedError).
    """
    return _varlen("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, block_table, return_lse,
                   backend)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, return_lse=False, backend=None):
    """:func:`flash_attn_varlen_func` with ``kv`` packed as (total_k, 2, nheads_kv, headdim),
    flash-attn 2's ``flash_attn_varlen_kvpacked_func`` signature and returns. K and V are
    strided views of ``kv`` (no copy); its gradient comes back packed."""
    fn = "flash_attn_varlen_kvpacked_func"
    k, v = split_packed_varlen(fn, "kv", kv, 2, "nheads_kv")
    return _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs, None, return_lse, backend,
                   VARLEN_FORM.packed("kv"))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_lse=False,
                                     backend=None):
    """:func:`flash_attn_varlen_func` with ``qkv`` packed as (total, 3, nheads, headdim) and
    one ``cu_seqlens`` / ``max_seqlen`` for queries and keys, flash-attn 2's
    ``flash_attn_varlen_qkvpacked_func`` signature and returns."""
    fn = "flash_attn_varlen_qkvpacked_func"
    q, k, v = split_packed_varlen(fn, "qkv", qkv, 3, "nheads")
    return _varlen(fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, None, return_lse, backend, VARLEN_FORM.packed("qkv"),
                   ("cu_seqlens", "cu_seqlens", "max_seqlen", "max_seqlen"))
