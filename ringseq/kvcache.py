"""KV-cache decoding: flash-attn's ``flash_attn_with_kvcache`` and its context-parallel form.

``flash_attn_with_kvcache`` has flash-attn 2's signature and semantics: new keys/values are
written into the caches in place at ``cache_seqlens``, optionally rotated (rotary), and the
queries attend to each row's valid prefix with causal masking and windows aligned to it.
It runs on ringseq's kernels (``torch.ops.ringseq.fwd_kvcache``: per-row cache lengths without
copying the cache, split over keys so one token uses every thread or SM, docs/kernels.md
"KV-cache decoding") and falls back to plain torch math where they do not run the inputs.

``ring_flash_attn_with_kvcache`` decodes a context whose KV cache stays sharded across the ranks
of a group, where a ring prefill left it: every rank attends the (replicated) new queries to
its own shard and the partial results merge exactly by their log-sum-exp in one all-gather of
(out, lse); no key or value moves.

Inference only: nothing here is differentiable (flash-attn's kvcache function has no backward
either); the functions run under ``torch.no_grad()`` whatever their inputs require.
"""
from __future__ import annotations

import functools
import numbers

import torch

from ._args import as_int, check_alibi_slopes, check_bool, check_softmax_scale, parse_window
from ._dist import RingPeerError, group_info, named_for
from ._hash import ints_field
from .engine.integrity import FWD, operation_field
from .engine.ring import get_ring, refuse_on_error
from .kernels.checks import (FLOAT_DTYPES, accum_dtype, check_tensor_of_rank, given,
                             refuse_dtensors, resolve_scale)
from .kernels.spans import check_softcap
from .kernels.extension import ExtensionBackend, extension_available, forced_level_error
from .layouts import Layout, layout_field
from .layouts.base import values_key
from .parallel.ulysses import all_to_all
from .spec import dtype_code, float_field, named_layout

__all__ = ["flash_attn_with_kvcache", "ring_flash_attn_with_kvcache"]

_FN = "flash_attn_with_kvcache"
_RING_FN = "ring_flash_attn_with_kvcache"


# ------------------------------------------------------------------------------ arguments
def _check_tensor(fn: str, name: str, t, dims: int, layout: str) -> None:
    check_tensor_of_rank(fn, name, t, dims, layout)  # (the attention entry points' words)
    if t.is_meta:  # (no data: its values are read, as counts too)
        raise ValueError(f"{fn}: {name} must be a tensor with data (CPU or CUDA), got one on "
                         f"the meta device")


_INT32_RANGE = (-2 ** 31, 2 ** 31 - 1)


def _row_ints(fn: str, name: str, x, batch: int, device, allow_int: bool = False):
    """A (batch,) int32 tensor on ``device`` from an int32/int64 tensor (or an int when
    ``allow_int``), else TypeError / ValueError naming ``name``; values outside int32 (read
    where that costs no device synchronization: ints, CPU tensors) are a ValueError rather than
    wrapped around by the cast."""
    lo, hi = _INT32_RANGE
    if allow_int and isinstance(x, numbers.Integral) and not isinstance(x, bool):
        if not lo <= int(x) <= hi:
            raise ValueError(f"{fn}: {name} must fit in int32 ([{lo}, {hi}]), got {int(x)}")
        return torch.full((batch,), int(x), dtype=torch.int32, device=device)
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
        what = "an int or " if allow_int else ""
        raise TypeError(f"{fn}: {name} must be {what}an int32 or int64 tensor (batch,), got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(f"{fn}: {name} must have shape ({batch},) (one entry per batch row of "
                         f"q), got {tuple(x.shape)}")
    if x.dtype == torch.int64 and x.device.type == "cpu" and x.numel() \
            and not (lo <= int(x.min()) and int(x.max()) <= hi):
        raise ValueError(f"{fn}: {name} values must fit in int32 ([{lo}, {hi}]), got "
                         f"{x.tolist()}")
    return x.to(device=device, dtype=torch.int32).contiguous()


def _given_values(x, batch: int):
    """The per-row values of an argument _row_ints accepted, as the caller gave it, when
    reading them costs no device synchronization (an int, or a CPU tensor), else None."""
    if isinstance(x, numbers.Integral):
        return [int(x)] * batch
    return x.tolist() if x.device.type == "cpu" else None


def _check_q_and_caches(fn: str, q, k_cache, v_cache, names: tuple, cache_layout: str,
                        batch_of_q: bool) -> tuple:
    """The two decoding functions' one check of q (b, s_q, h, d) and the caches
    ``cache_layout`` (``batch_of_q``: a row per batch row of q), before anything is written into
    them: TypeError for a non-tensor, ValueError for dims, dtypes (those the attention entry
    points take), devices, a head dim that is not contiguous in a cache (written in place: not
    copied) and shapes that do not fit. Returns (the caches' length, nheads_k)."""
    _check_tensor(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: q, the caches and k, v must be float32, float64, bfloat16 or "
                         f"float16, got {q.dtype}")
    for name, t in zip(names, (k_cache, v_cache)):
        _check_tensor(fn, name, t, 4, cache_layout)
        if t.dtype != q.dtype or t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must have q's dtype and device ({q.dtype} on "
                             f"{q.device}) and a contiguous last dimension, got {t.dtype} on "
                             f"{t.device}, strides {t.stride()}")
    b, _, h, d = q.shape
    if d == 0:
        raise ValueError(f"{fn}: headdim must be positive, got q {tuple(q.shape)}")
    shape = k_cache.shape
    if shape != v_cache.shape or shape[3] != d or shape[2] == 0 or h % shape[2] \
            or (batch_of_q and shape[0] != b):
        batch = f"batch {b}, " if batch_of_q else ""
        raise ValueError(f"{fn}: {names[0]} and {names[1]} must both be {cache_layout} with "
                         f"{batch}q's headdim {d} and nheads_k dividing nheads = {h}, got "
                         f"{tuple(shape)} and {tuple(v_cache.shape)}")
    return shape[1], shape[2]


def _check_writable(fn: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, rotary: bool, names=("k_cache", "v_cache")) -> None:
    """ValueError, before anything is written, for caches the new keys and values cannot be
    written into apart: caches that share memory (overlapping views of one buffer, or one
    tensor passed as both with new keys and values that differ: one tensor as both caches
    and as both ``k`` and ``v``, tied K = V, is fine without rotary), or a cache whose rows
    share memory (an expanded / broadcast tensor: a stride of 0), where one write lands on
    another's place and the cache read next holds the wrong keys; and for caches made under
    ``torch.inference_mode()`` written outside it (torch refuses the in-place update).
    ``names``: the caller's names of the two caches (the ring's are its shards)."""
    for name, t in zip(names, (k_cache, v_cache)):
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise ValueError(f"{fn}: {name} has rows that share memory (strides {t.stride()} "
                             f"for shape {tuple(t.shape)}: an expanded or broadcast tensor), so "
                             f"the new keys and values of one row would overwrite another's; "
                             f"pass a cache of its own memory ({name}.contiguous())")
    # one cache for K = V, appended one tensor, is fine: the same values land twice (not with
    # rotary: the keys are rotated, the values not)
    tied = (not rotary and k_cache.data_ptr() == v_cache.data_ptr()
            and k_cache.stride() == v_cache.stride() and k.data_ptr() == v.data_ptr()
            and k.stride() == v.stride())
    if not tied and _share_elements(k_cache, v_cache):
        raise ValueError(f"{fn}: {names[0]} and {names[1]} share memory (views of one buffer that "
                         f"overlap: data pointers {k_cache.data_ptr()} and {v_cache.data_ptr()}, "
                         f"strides {k_cache.stride()}), so new values would overwrite keys; "
                         f"pass two caches, or two halves of one buffer that do not overlap")
    if torch.is_inference_mode_enabled():
        return
    for name, t in zip(names, (k_cache, v_cache)):
        if t.is_inference():
            raise ValueError(f"{fn}: {name} was created under torch.inference_mode(), and the new "
                             f"keys are written into it in place, which torch allows only inside "
                             f"inference mode: call this inside torch.inference_mode() too, or "
                             f"pass a cache made outside it (e.g. {name}.clone() outside it)")


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two caches on one storage may hold a common element. Of one shape and strides:
    exactly, when their offsets differ by ``delta`` = sum of m_i * stride_i with |m_i| <
    size_i (two halves of an interleaved (b, cap, 2, h, d) buffer are apart; ``buf[:, :16]``
    and ``buf[:, 1:17]`` are not). Of other strides: when their spans of memory meet."""
    if a.numel() == 0 or b.numel() == 0 or \
            a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.shape != b.shape or a.stride() != b.stride():
        def span(t):
            last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
            return t.storage_offset(), t.storage_offset() + last
        (a0, a1), (b0, b1) = span(a), span(b)
        return a0 <= b1 and b0 <= a1
    dims = sorted(((st, n) for st, n in zip(a.stride(), a.shape) if n > 1), reverse=True)

    def reach(rest: int, i: int) -> bool:
        # (the largest strides first; only the two multiples around rest/stride can leave a
        # remainder the smaller dims reach, for the nested strides of a tensor without
        # internal overlap)
        if rest == 0:
            return True
        if i == len(dims):
            return False
        st, n = dims[i]
        return any(reach(rest - m * st, i + 1)
                   for m in {max(-(n - 1), min(n - 1, rest // st + c)) for c in (0, 1)})
    return reach(b.storage_offset() - a.storage_offset(), 0)


def _check_leftpad(fn: str, pads, lengths, s_new: int, implied: bool = False) -> None:
    """ValueError unless every row's left padding lies in [0, its keys after the append].
    ``implied``: cache_seqlens was not given (``lengths``: the whole cache per row)."""
    if any(a < 0 or a > n + s_new for a, n in zip(pads, lengths)):
        raise ValueError(f"{fn}: cache_leftpad entries must lie in [0, cache_seqlens + "
                         f"seqlen_new], got cache_leftpad = {pads} for cache_seqlens = "
                         f"{lengths}{' (not given: the whole cache)' if implied else ''} and "
                         f"seqlen_new = {s_new}")


def _head_contiguous(*tensors):
    """The tensors (None passes) with a contiguous head dimension: the only one the kernels
    need contiguous (flash-attn copies the others' too)."""
    return tuple(t if t is None or t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _check_forced_level(fn: str, q: torch.Tensor) -> None:
    """RuntimeError naming ``fn`` for a ``RINGSEQ_CPU_ISA`` level that cannot run, where the
    call would run ringseq's CPU kernel (as every other entry point raises it), before any
    cache is written (before: the kernel's message alone, after the new keys were appended,
    so a retry appended them twice)."""
    if q.device.type == "cpu" and _kernel_runs("cpu", q.dtype, q.shape[-1]):
        forced = forced_level_error()
        if forced is not None:
            raise RuntimeError(f"{fn}: {forced}")


@functools.lru_cache(maxsize=None)
def _kernel_runs(device_type: str, dtype: torch.dtype, headdim: int) -> bool:
    if not extension_available():
        return False
    return ExtensionBackend.instance(0).unsupported_reason(torch.device(device_type), dtype,
                                                           headdim) is None


# ------------------------------------------------------------------------------ rotary
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """x (b, s, h, d) with its first ``rotary_dim = 2 * cos.shape[1]`` channels rotated by
    the angles of rows ``pos`` (b, s) of cos/sin (seqlen_ro, rotary_dim / 2): pairs (0, 1),
    (2, 3), ... when interleaved (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX). Computed in
    float32 (float64 for float64 inputs) and rounded once to x's dtype."""
    half = cos.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(acc)[pos].unsqueeze(2)  # (b, s, 1, rotary_dim / 2)
    s = sin.to(acc)[pos].unsqueeze(2)
    xr = x[..., :2 * half].to(acc)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _check_rotary(fn, rotary_cos, rotary_sin, q, has_new, seqlen_needed):
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{fn}: pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is None:
        return
    if not has_new:
        raise ValueError(f"{fn}: rotary_cos / rotary_sin rotate the new keys: they need k and v "
                         f"(as in flash-attn)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _check_tensor(fn, name, t, 2, "(seqlen_ro, rotary_dim / 2)")
        if not t.is_floating_point() or t.device != q.device:
            raise ValueError(f"{fn}: {name} must be a floating tensor on {q.device}, got "
                             f"{t.dtype} on {t.device}")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"{fn}: rotary_cos and rotary_sin must have the same shape, got "
                         f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    rotary_dim = 2 * rotary_cos.shape[1]
    if rotary_dim > q.shape[-1] or rotary_dim % 16 != 0:
        raise ValueError(f"{fn}: rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be a "
                         f"multiple of 16 and at most headdim = {q.shape[-1]}")
    if rotary_cos.shape[0] < seqlen_needed:
        raise ValueError(f"{fn}: rotary_cos / rotary_sin need at least {seqlen_needed} rows (the "
                         f"positions they rotate), got {rotary_cos.shape[0]}")


def _check_rotary_rows(fn, rotary_cos, last: int) -> None:
    """ValueError unless the rotary tables (if any) have a row for every position up to
    ``last`` (exclusive) that the call rotates."""
    if rotary_cos is not None and rotary_cos.shape[0] < last:
        raise ValueError(f"{fn}: rotary_cos / rotary_sin need at least {last} rows (the last "
                         f"position the call rotates is {last - 1}), got {rotary_cos.shape[0]}")


def _rotary_q_positions(cache_seqlens, s_q, causal_or_local):
    """flash-attn's rule: with causal or a window, query i stands at cache_seqlens + i; else
    every query stands at cache_seqlens. (b, s_q) int64."""
    steps = torch.arange(s_q, device=cache_seqlens.device) if causal_or_local else \
        torch.zeros(s_q, dtype=torch.long, device=cache_seqlens.device)
    return cache_seqlens.long()[:, None] + steps[None, :]


# ------------------------------------------------------------------------------ attention
def _attend_cache(q, k_cache, v_cache, seqlens, leftpad, batch_idx, scale, causal, window,
                  softcap, num_splits, out_acc=False):
    """(out, lse) of q (b, s_q, h, d) against keys [leftpad[b], seqlens[b]) of cache row
    batch_idx[b], causal / window bottom-right aligned to them; lse -inf where a row sees no
    key. ringseq's kernel where it runs the inputs, else plain torch math (float32, float64 for
    float64 inputs). out is in q's dtype; with out_acc, a partial result merged afterwards, in
    the accumulation dtype (lse's), except from the CUDA kernel, which writes q's dtype only."""
    if _kernel_runs(q.device.type, q.dtype, q.shape[-1]) and k_cache.stride(-1) == 1:
        return torch.ops.ringseq.fwd_kvcache(q, k_cache, v_cache, seqlens, leftpad, batch_idx,
                                             scale, causal, window[0], window[1], softcap,
                                             num_splits, out_acc and q.device.type == "cpu")
    return _attend_cache_torch(q, k_cache, v_cache, seqlens, leftpad, batch_idx, scale, causal,
                               window, softcap, out_acc)


def _attend_cache_torch(q, k_cache, v_cache, seqlens, leftpad, batch_idx, scale, causal, window,
                        softcap, out_acc=False):
    """The same in plain torch math: gathers the cache rows (a copy of the caches' size)."""
    b, s_q, h, d = q.shape
    s_c, h_kv = k_cache.shape[1], k_cache.shape[2]
    acc = accum_dtype(q.dtype)
    rows = batch_idx.long() if batch_idx is not None else torch.arange(b, device=q.device)
    k = k_cache[rows].to(acc).repeat_interleave(h // h_kv, dim=2)  # (b, s_c, h, d)
    v = v_cache[rows].to(acc).repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    start = leftpad.long() if leftpad is not None else torch.zeros(b, dtype=torch.long,
                                                                   device=q.device)
    k_len = seqlens.long() - start  # (b,)
    j = torch.arange(s_c, device=q.device)[None, None, :] - start[:, None, None]  # (b, 1, s_c)
    i = torch.arange(s_q, device=q.device)[None, :, None]  # (1, s_q, 1)
    off = (k_len - s_q)[:, None, None]
    # a window at least as wide as the cache is no window, and with the left side bounded an
    # unbounded right side is the cache's width (flash-attn's rule, the kernel's too)
    lo, hi = (-1 if w >= s_c else w for w in window)
    if lo >= 0 and hi < 0:
        hi = s_c
    # Not in place: the first term is (b, 1, s_c), the masks below broadcast it to (b, s_q, s_c).
    read = (j >= 0) & (j < k_len[:, None, None])  # (b, 1, s_c): the slots of this call's keys
    vis = read
    if lo >= 0:
        vis = vis & (j >= i + off - lo)
    if hi >= 0:
        vis = vis & (j <= i + off + hi)
    if causal:
        vis = vis & (j <= i + off)
    s = s.masked_fill(~vis[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (b, h, s_q)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)[..., None])
    # The other slots may hold anything (torch.empty's NaN): their p is 0, but 0 * NaN is NaN
    # (before: every output row NaN where the kernel, which never reads them, was exact)
    v = v.masked_fill(~read[:, 0, :, None, None], 0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)  # (b, s_q, h, d), strides of the product's
    # (b, h, s_q, d): made contiguous like the kernel's (and flash-attn's) output
    return (out.to(dtype=acc if out_acc else q.dtype, memory_format=torch.contiguous_format),
            lse.to(acc))


def _flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """flash-attn's convention for rows that see no key: lse = +inf (ringseq keeps -inf)."""
    return lse.masked_fill(torch.isneginf(lse), float("inf"))


# ------------------------------------------------------------------------------ single device
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention of new queries against a KV cache, with flash-attn 2's signature and semantics.

    If ``k`` and ``v`` are given they are first written into ``k_cache`` / ``v_cache`` *in
    place* at positions ``cache_seqlens[b], cache_seqlens[b] + 1, ...`` of cache row
    ``cache_batch_idx[b]`` (rotated first when ``rotary_cos`` / ``rotary_sin`` are given); then
    query row b attends to the valid keys ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)``
    of that cache row. The caches are read in place (no copy, whatever their length).

    Masks are bottom-right aligned to the valid keys (``k_len`` of them): query i sees key j
    (0-based from ``cache_leftpad``) iff ``j <= i + k_len - seqlen_q`` when causal and
    ``i + k_len - seqlen_q - left <= j <= i + k_len - seqlen_q + right`` with
    ``window_size = (left, right)`` (-1: unbounded; flash-attn 2's rule: a side of at least
    ``seqlen_cache`` is unbounded, and with the left side bounded an unbounded right side is
    ``seqlen_cache`` wide, so the first ``seqlen_q - k_len - seqlen_cache`` rows see no key). A
    row that sees no key gives 0 (and lse +inf, as flash-attn).

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), ``nheads % nheads_k
            == 0`` (GQA/MQA), the last dimension contiguous; same dtype and device as q.
        k, v: None, or (batch, seqlen_new, nheads_k, headdim) to append (both or neither).
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2) with rotary_dim a
            multiple of 16 and <= headdim: k is rotated at its positions ``cache_seqlens + i``
            before it is stored; q at ``cache_seqlens + i`` when causal or windowed, else every
            query at ``cache_seqlens`` (flash-attn's rule). Needs k and v.
        cache_seqlens: int, or (batch,) int32 tensor: each row's cache length before the new
            keys (None: the whole cache, ``seqlen_cache``; required with k and v).
        cache_batch_idx: None (rows 0..batch-1) or a (batch,) int32 / int64 tensor of indices
            into the cache rows (TypeError for ints or a list). With k and v, repeated indices
            in a CPU tensor are refused
            (ValueError: two rows' keys would be written into one cache row); in a CUDA
            tensor they are not read back, and which row's keys end up stored is unspecified
            (as in flash-attn).
        cache_leftpad: None or (batch,) int32: the first valid key of each row (left padding).
        block_table: must be None: paged caches are not supported (NotImplementedError).
        softmax_scale: a float, or None for ``headdim ** -0.5``.
        causal, window_size, softcap: as above (softcap > 0 caps the scaled scores at
            ``softcap * tanh(x / softcap)``; 0 is off). window_size may be ints or tensors.
        rotary_interleaved: bool, see rotary_cos.
        alibi_slopes: must be None (NotImplementedError).
        num_splits: int in [0, 2**31): how many ranges the keys of each query tile are cut
            into and computed in parallel (then merged exactly); 0 chooses from the shape (only when
            batch x heads leaves threads / SMs idle). Results agree to rounding whatever it is.
        return_softmax_lse: also return lse (batch, nheads, seqlen_q), float32 (float64 for
            float64 inputs), natural log of the softmax normalizer, +inf for rows that see no
            key.

    float32/float64/bfloat16/float16 on CPU; on CUDA ringseq's kernel runs bfloat16/float16
    with head dim 64 or 128, other inputs take the plain-torch path (which gathers the cache
    rows: memory of the caches' size).

    Returns ``out`` (batch, seqlen_q, nheads, headdim) in q's dtype, or ``(out, lse)``.
    Not differentiable (flash-attn's is not either): runs under ``torch.no_grad()``.

    Raises:
        TypeError / ValueError: malformed arguments (shapes, dtypes, devices, index tensors
            that are not int32/int64 (batch,), new keys that do not fit the cache, rotary
            tables of the wrong size, values outside int32), naming the argument; a dtype
            other than float32/float64/bfloat16/float16 (ValueError, as every attention
            function gives it); before anything is written,
            ValueError for caches made under ``torch.inference_mode()`` written outside it,
            and, when k and v are appended, for caches that share memory (one tensor as both,
            overlapping views of one buffer), a cache whose rows share memory (expanded /
            broadcast: a stride of 0) and a ``cache_batch_idx`` that names a row twice.
            Lengths given as ints, and values in CPU tensors, are checked; values in CUDA
            tensors are not read back (no synchronization): a row whose lengths or index are
            out of range gets NaN instead of reading outside the cache.
        NotImplementedError: ``block_table`` or ``alibi_slopes`` given.
    """
    fn = _FN
    softmax_scale, window, softcap, num_splits = _check_options(
        fn, softmax_scale, causal, rotary_interleaved, return_softmax_lse, window_size, softcap,
        alibi_slopes, num_splits)
    if block_table is not None:
        raise NotImplementedError(f"{fn}: block_table (a paged KV cache) is not supported; pass "
                                  f"the caches as (batch_cache, seqlen_cache, nheads_k, headdim)")
    refuse_dtensors(fn, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)))
    s_c, h_kv = _check_q_and_caches(fn, q, k_cache, v_cache, ("k_cache", "v_cache"),
                                    "(batch_cache, seqlen_cache, nheads_k, headdim)", False)
    b, s_q, h, d = q.shape
    b_c = k_cache.shape[0]
    s_new = _check_new_kv(fn, q, k, v, h_kv)
    if k is not None and cache_seqlens is None:
        raise ValueError(f"{fn}: cache_seqlens is required with k and v: it says where the new "
                         f"keys go")
    if cache_seqlens is None:
        seqlens = torch.full((b,), s_c, dtype=torch.int32, device=q.device)
    else:
        seqlens = _row_ints(fn, "cache_seqlens", cache_seqlens, b, q.device, allow_int=True)
    bidx = None if cache_batch_idx is None else \
        _row_ints(fn, "cache_batch_idx", cache_batch_idx, b, q.device)
    leftpad = None if cache_leftpad is None else \
        _row_ints(fn, "cache_leftpad", cache_leftpad, b, q.device)
    if bidx is None and b_c < b:
        raise ValueError(f"{fn}: without cache_batch_idx the caches need a row per batch row of q "
                         f"({b}), got batch_cache = {b_c}")
    # Values are checked as given where reading them costs no device synchronization (ints,
    # CPU tensors): an int on CUDA is checked too.
    host = [s_c] * b if cache_seqlens is None else _given_values(cache_seqlens, b)
    if host is not None and any(n < 0 or n + s_new > s_c for n in host):
        raise ValueError(f"{fn}: cache_seqlens + seqlen_new must lie in [0, seqlen_cache = {s_c}] "
                         f"(the new keys must fit the cache), got cache_seqlens = {host} and "
                         f"seqlen_new = {s_new}")
    host_idx = None if bidx is None else _given_values(cache_batch_idx, b)
    if host_idx is not None and any(i < 0 or i >= b_c for i in host_idx):
        raise ValueError(f"{fn}: cache_batch_idx entries must lie in [0, batch_cache = {b_c}), got "
                         f"{host_idx}")
    pads = None if leftpad is None else _given_values(cache_leftpad, b)
    if host is not None and pads is not None:
        _check_leftpad(fn, pads, host, s_new, implied=cache_seqlens is None)
    _check_rotary(fn, rotary_cos, rotary_sin, q, k is not None, s_c)
    # a window at least as wide as the cache is none (flash-attn's rule, the kernels' too):
    # the queries are then rotated as unwindowed ones
    windowed = any(0 <= w < s_c for w in window)
    if host is not None:
        # the last position rotated: a new key's, or a query's when causal or windowed
        # (queries at cache_seqlens + i); flash-attn reads past its table there
        last = max(host, default=0)  # (batch 0: no rows)
        _check_rotary_rows(fn, rotary_cos, last + max(s_new, s_q if causal or windowed else 1))
    if k is not None:
        _check_writable(fn, k_cache, v_cache, k, v, rotary_cos is not None)
        if host_idx is not None and len(set(host_idx)) < len(host_idx):
            raise ValueError(f"{fn}: cache_batch_idx names a cache row twice ({host_idx}) while "
                             f"k and v are appended: both rows' new keys would be written into "
                             f"the same cache row")
    _check_forced_level(fn, q)
    scale = resolve_scale(softmax_scale, d)
    with torch.no_grad():
        q, k, v = _head_contiguous(q, k, v)
        if rotary_cos is not None:
            q = _rotate(q, rotary_cos, rotary_sin,
                        _rotary_q_positions(seqlens, s_q, causal or windowed),
                        rotary_interleaved)
            k = _rotate(k, rotary_cos, rotary_sin, _rotary_q_positions(seqlens, s_new, True),
                        rotary_interleaved)
        if k is not None:
            rows = (bidx.long() if bidx is not None else
                    torch.arange(b, device=q.device))[:, None].expand(b, s_new)
            cols = seqlens.long()[:, None] + torch.arange(s_new, device=q.device)[None, :]
            k_cache.index_put_((rows, cols), k)
            v_cache.index_put_((rows, cols), v)
            seqlens = seqlens + s_new
        out, lse = _attend_cache(q, k_cache, v_cache, seqlens, leftpad, bidx, scale, causal,
                                 window, softcap, num_splits)
    return (out, _flash_lse(lse)) if return_softmax_lse else out


# ------------------------------------------------------------------------------ context parallel
class _Homes:
    """Where each token position of a sharded KV cache lives (see ring_flash_attn_with_kvcache).

    Positions ``t < prefill_len`` are where ``layout`` put them: on the rank whose
    ``layout.positions(prefill_len, W, rank)`` lists t, at that list's index. Later positions
    are dealt round-robin: rank ``(t - prefill_len) % W``, local slot
    ``prefill_len / W + (t - prefill_len) // W``. A rank's slots hold increasing positions, so
    any range of positions ``[a, b)`` is the slot range ``[count(a), count(b))`` on every rank.
    """

    def __init__(self, layout: Layout, prefill_len: int, world: int, rank: int, device):
        self.P, self.W, self.rank = prefill_len, world, rank
        self.base = prefill_len // world
        self.device = device
        if prefill_len:
            pos = layout.positions(prefill_len, world, rank)
            if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
                raise ValueError(f"layout {layout.name!r}: a rank's positions must increase in its "
                                 f"local order for a sharded KV cache, got {pos[:8].tolist()}...")
            self.local_pos = pos.to(device)
            self.owner = _prefill_owner(layout, values_key(layout), prefill_len, world).to(
                device)
        else:
            self.local_pos = torch.zeros(0, dtype=torch.long, device=device)
            self.owner = torch.zeros(0, dtype=torch.long, device=device)

    def count(self, t: torch.Tensor) -> torch.Tensor:
        """Number of this rank's slots holding a position < t (t int64, any shape)."""
        t = t.long()
        pre = torch.searchsorted(self.local_pos, t.clamp(max=self.P).contiguous())
        later = torch.div(t - self.P - self.rank + self.W - 1, self.W, rounding_mode="floor")
        return pre + later.clamp(min=0)

    def home(self, t: torch.Tensor):
        """(rank, slot) of positions t (int64, any shape)."""
        t = t.long()
        late = t >= self.P
        rank = torch.where(late, (t - self.P) % self.W,
                           self.owner[t.clamp(max=max(self.P - 1, 0))] if self.P else t * 0)
        # a prefill position's slot is its index in its owner's list; for this rank's own
        # positions that is count(t)
        slot = torch.where(late, self.base + torch.div(t - self.P, self.W, rounding_mode="floor"),
                           self.count(t))
        return rank, slot


@functools.lru_cache(maxsize=16)
def _prefill_owner(layout: Layout, layout_values, prefill_len: int, world: int) -> torch.Tensor:
    # (``layout_values``: a user's layout edited after a call owns by its new values)
    owner = torch.empty(prefill_len, dtype=torch.long)
    for r in range(world):
        owner[layout.positions(prefill_len, world, r)] = r
    return owner


def _merge_partials(outs: torch.Tensor, lses: torch.Tensor):
    """Exact merge of partial attention results over disjoint key sets: outs (n, b, s, h, d),
    lses (n, b, h, s) in the accumulation dtype. Rows no part saw get out 0, lse -inf."""
    m = lses.amax(dim=0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m_safe)  # (n, b, h, s); 0 for parts with lse = -inf
    total = w.sum(dim=0)
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, float("-inf")))
    wn = torch.where(total > 0, w / total, torch.zeros_like(w))
    out = torch.einsum("nbhs,nbshd->bshd", wn, outs)
    return out, lse


@torch.compiler.disable(reason="ringseq's ring_flash_attn_with_kvcache runs between graphs "
                               "(host reads, and a ring call whose failure on one rank must "
                               "reach its peers): compile the code around it without "
                               "fullgraph=True")
def ring_flash_attn_with_kvcache(q, k_cache_shard, v_cache_shard, cache_seqlens, k=None, v=None,
                                 group=None, layout="contiguous", softmax_scale=None,
                                 causal=True, window_size=(-1, -1), softcap=0.0,
                                 rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                                 cache_leftpad=None, alibi_slopes=None, num_splits=0,
                                 return_softmax_lse=False, *, prefill_len):
    """Decoding over a KV cache that stays sharded across the ranks of ``group``.

    The cache of a long context lives where a ring prefill left it: the first ``prefill_len``
    positions as ``layout`` split them (``ringseq.shard``), later positions round-robin. Each
    call's queries (the same on every rank) attend locally to every rank's shard; the partial
    (out, lse) merge exactly by their log-sum-exp after one all-gather of
    ``batch * seqlen_q * nheads * (headdim + 1) + 1`` floats per rank (the last: whether the
    rank failed), made of an all-to-all on the ring's channel. No key or value moves. On
    several ranks it is a ring call like attention (``ringseq.engine.integrity``): the ring
    is bound to the first thread that calls it, a peer stalled in its part raises
    RingTimeoutError after the ring timeout (CPU tensors; on NCCL its watchdog, as for the
    ring's exchanges), and with the checks off the gather's headers catch ranks at other
    calls, with other arguments or under other call tags.
    With a group of ``ringseq.make_sp_groups`` (a hybrid or double ring prefill), pass
    ``group=sp.group`` and ``layout=sp.data_layout(layout)``. Runs between graphs under
    ``torch.compile``.

    Where tokens live (every rank computes every home from ``prefill_len``, ``W`` and
    ``layout``, nothing is exchanged): position ``t < prefill_len`` on the rank and at the
    local slot where ``layout`` put it; position ``t >= prefill_len`` on rank
    ``(t - prefill_len) % W`` at local slot ``prefill_len / W + (t - prefill_len) // W``
    (round-robin: the shards grow evenly, one token per rank every W tokens). New keys passed as
    ``k``, ``v`` are written to their homes in place (rank-local ``index_put_``).

    Args:
        q: (batch, seqlen_q, nheads, headdim), the same on every rank.
        k_cache_shard, v_cache_shard: (batch, capacity, nheads_k, headdim): this rank's slots
            (the layout's shard of the prefill in its first ``prefill_len / W`` slots; room for
            this rank's share of the new tokens after them).
        cache_seqlens: int or (batch,) int tensor: the GLOBAL number of tokens of each row in
            the whole cache before this call (the same on every rank); rows may differ.
        k, v: None or (batch, seqlen_new, nheads_k, headdim), the same on every rank: the keys
            and values of positions ``cache_seqlens + i``, appended to their homes.
        group: the process group (None: default group; no process group: one rank).
        layout: "contiguous", "zigzag", "stripe" or a Layout (its positions must increase in
            each rank's local order, as the built-in ones do): how the prefill was sharded.
            A layout bound to a packed prefill's documents (``Documents(cu_seqlens)``), with
            ``prefill_len`` > 0: the query attends to its own document alone (positions from
            ``prefill_len`` on continue the last one); then one query and at most one new
            token per call.
        softmax_scale, softcap, alibi_slopes (must be None), num_splits: as
            :func:`flash_attn_with_kvcache`.
        causal: queries are the LAST seqlen_q positions of the cache after the append; causal
            masks over global positions. With seqlen_q > 1 it needs ``seqlen_new >= seqlen_q``
            (the queries are new tokens); seqlen_q == 1 sees every earlier token either way.
        window_size: (left, right) over global positions; seqlen_q == 1 only.
        rotary_cos, rotary_sin, rotary_interleaved: as :func:`flash_attn_with_kvcache`, at
            GLOBAL positions.
        cache_leftpad: None or (batch,) int tensor: each row's first valid GLOBAL position.
        return_softmax_lse: also return lse (batch, nheads, seqlen_q) (+inf: no visible key).
        prefill_len (keyword-only, required): the global length the layout sharded (a
            multiple of ``layout.multiple(W)``; 0 when the cache started empty).

    Returns ``out`` (batch, seqlen_q, nheads, headdim) in q's dtype on every rank (the same
    values everywhere), or ``(out, lse)``. Not differentiable.

    Raises ValueError / TypeError / NotImplementedError as :func:`flash_attn_with_kvcache`,
    plus a slot past this rank's capacity and window_size with seqlen_q > 1; with the
    consistency checks on (the default, ``ringseq.set_consistency_check``), a failure on one
    rank raises on every rank (``ringseq.RingPeerError`` on the others), and ranks called with
    different shapes, dtypes, options, ``prefill_len``, layout or (CPU tensors or ints)
    ``cache_seqlens`` / ``cache_leftpad`` values raise ``ringseq.RingMismatchError`` (a
    ValueError) on every rank, naming what differs. A failure in one rank's part raises there
    and as ``ringseq.RingPeerError`` on the others, the checks off too; the ring stays usable.
    One control collective per call (its begin); with the checks off, only the gather, whose
    headers make ranks at other calls, with other arguments or under other call tags raise
    ``ringseq.RingDesyncError`` (the ring is then broken until ``ringseq.reset_ring``), where
    their sizes agree (other sizes can hang or abort in the transport, as for attention).
    """
    fn = _RING_FN
    # A refusal (a user layout's too; a group that is no process group: on the default
    # group's ring, where a group=None peer waits) meets the peers' begin below: they raise
    # RingPeerError naming this rank and its message instead of waiting, and the ring stays
    # usable.
    with refuse_on_error(group, FWD):
        world, rank = group_info(group, fn)
        plan = _ring_plan(fn, q, k_cache_shard, v_cache_shard, cache_seqlens, k, v, world, rank,
                          layout, softmax_scale, causal, window_size, softcap, rotary_cos,
                          rotary_sin, rotary_interleaved, cache_leftpad, alibi_slopes,
                          num_splits, return_softmax_lse, prefill_len)
    with torch.no_grad():
        return _ring_decode(plan, group, world)


def _check_options(fn, softmax_scale, causal, rotary_interleaved, return_softmax_lse,
                   window_size, softcap, alibi_slopes, num_splits):
    """The scalar options of both decoding functions; returns (softmax_scale, window, softcap,
    num_splits as an int)."""
    softmax_scale = check_softmax_scale(fn, softmax_scale)
    check_bool(fn, "causal", causal)
    check_bool(fn, "rotary_interleaved", rotary_interleaved)
    check_bool(fn, "return_softmax_lse", return_softmax_lse)
    window = parse_window(fn, window_size)
    softcap = check_softcap(softcap, fn)
    check_alibi_slopes(fn, alibi_slopes)
    # (an int of any kind, as the other counts; bounded: before, 2**63 failed inside the
    # operator after the new keys were written, or, in the ring, in packing the call's
    # signature on that rank alone, its peers waiting for the ring timeout)
    splits = as_int(num_splits)
    if splits is None:
        raise TypeError(f"{fn}: num_splits must be an int (0: chosen from the shape), got "
                        f"{given(num_splits)}")
    if not 0 <= splits < 2 ** 31:
        raise ValueError(f"{fn}: num_splits must be an int in [0, 2**31) (0: chosen from the "
                         f"shape), got {splits}")
    return softmax_scale, window, softcap, splits


def _check_new_kv(fn, q, k, v, h_kv):
    """The new keys and values (both or neither): (b, seqlen_new, h_kv, d) with q's dtype and
    device. Returns seqlen_new (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: pass both k and v (the new keys and values), or neither")
    if k is None:
        return 0
    b, _, _, d = q.shape
    for name, t in (("k", k), ("v", v)):
        _check_tensor(fn, name, t, 4, "(batch, seqlen_new, nheads_k, headdim)")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{fn}: {name} must have q's dtype and device ({q.dtype} on "
                             f"{q.device}), got {t.dtype} on {t.device}")
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (h_kv, d):
        raise ValueError(f"{fn}: k and v must both be (batch, seqlen_new, nheads_k, headdim) "
                         f"= ({b}, seqlen_new, {h_kv}, {d}), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    return k.shape[1]


def _ring_plan(fn, q, k_cache_shard, v_cache_shard, cache_seqlens, k, v, world, rank, layout,
               softmax_scale, causal, window_size, softcap, rotary_cos, rotary_sin,
               rotary_interleaved, cache_leftpad, alibi_slopes, num_splits, return_softmax_lse,
               prefill_len):
    """Checks a ring decoding call on this rank; returns what _ring_decode needs."""
    softmax_scale, window, softcap, num_splits = _check_options(
        fn, softmax_scale, causal, rotary_interleaved, return_softmax_lse, window_size, softcap,
        alibi_slopes, num_splits)
    # (resolved and checked as the other layout-taking entry points do: before, a user's
    # unhashable layout, or one whose multiple is 0, gave a bare TypeError / ZeroDivisionError)
    lay = named_layout(fn, layout, takes_documents=False)  # (no cu_seqlens argument)
    try:
        multiple = lay._checked_multiple(world)
    except ValueError as exc:
        raise named_for(fn, exc) from None
    rule = (f"0 or a positive multiple of {multiple} (layout {lay.name!r} over {world} "
            f"ranks)")
    length = as_int(prefill_len)
    if length is None:
        raise TypeError(f"{fn}: prefill_len must be an int, {rule}, got {given(prefill_len)}")
    if length < 0 or length % multiple:
        raise ValueError(f"{fn}: prefill_len must be {rule}, got {length}")
    prefill_len = length
    refuse_dtensors(fn, (("q", q), ("k_cache_shard", k_cache_shard),
                         ("v_cache_shard", v_cache_shard), ("k", k), ("v", v)))
    cap, h_kv = _check_q_and_caches(fn, q, k_cache_shard, v_cache_shard,
                                    ("k_cache_shard", "v_cache_shard"),
                                    "(batch, capacity, nheads_k, headdim)", True)
    (q,) = _head_contiguous(q)
    b, s_q, h, d = q.shape
    if prefill_len // world > cap:
        raise ValueError(f"{fn}: k_cache_shard / v_cache_shard on rank {rank} have capacity "
                         f"(dim 1) {cap}, fewer than the {prefill_len // world} slots of this "
                         f"rank's share of prefill_len = {prefill_len} ({world} ranks)")
    s_new = _check_new_kv(fn, q, k, v, h_kv)
    k, v = _head_contiguous(k, v)
    if causal and s_q > 1 and s_new < s_q:
        raise NotImplementedError(f"{fn}: causal with seqlen_q = {s_q} > 1 needs the queries' own "
                                  f"keys: pass k and v with seqlen_new >= seqlen_q, got "
                                  f"seqlen_new = {s_new}")
    if window != (-1, -1) and s_q > 1:
        raise NotImplementedError(f"{fn}: window_size {window} with seqlen_q = {s_q} > 1 is "
                                  f"not supported: pass one query per call, or "
                                  f"window_size=(-1, -1)")
    doc_starts = None
    if lay.documents is not None and len(lay.documents) > 2 and prefill_len:
        # (prefill_len 0: the layout placed no token, and no document was prefilled)
        # The query sees its own document only: one lower bound on the keys' positions, which
        # holds for one query whose new keys (at most itself) lie in its document. (Before:
        # a decode after a packed prefill attended to every document, without a word.)
        if s_q > 1 or s_new > 1:
            raise NotImplementedError(
                f"{fn}: layout {lay.name!r} holds {len(lay.documents) - 1} documents, whose "
                f"tokens attend to their own document alone; that is supported for one query "
                f"and at most one new token per call, got seqlen_q = {s_q}, seqlen_new = "
                f"{s_new}")
        doc_starts = torch.tensor(lay.documents[:-1], dtype=torch.long,
                                  device=q.device)  # (documents,)
    lengths = _row_ints(fn, "cache_seqlens", cache_seqlens, b, q.device, allow_int=True)
    starts = (torch.zeros(b, dtype=torch.int32, device=q.device) if cache_leftpad is None else
              _row_ints(fn, "cache_leftpad", cache_leftpad, b, q.device))
    _check_rotary(fn, rotary_cos, rotary_sin, q, k is not None, 0)
    try:
        homes = _Homes(lay, int(prefill_len), world, rank, q.device)
    except ValueError as exc:  # a layout whose positions this cache cannot use
        raise ValueError(f"{fn}: layout: {exc}") from None
    if k is not None:
        _check_writable(fn, k_cache_shard, v_cache_shard, k, v, rotary_cos is not None,
                        ("k_cache_shard", "v_cache_shard"))
    # values as given, where reading them costs no device synchronization (ints, CPU tensors;
    # before _row_ints moved them to q's device): checked here, compared across ranks below
    host = _given_values(cache_seqlens, b)
    pads = [0] * b if cache_leftpad is None else _given_values(cache_leftpad, b)
    if host is not None:
        if any(n < 0 for n in host):
            raise ValueError(f"{fn}: cache_seqlens must be >= 0, got {host}")
        if pads is not None:
            _check_leftpad(fn, pads, host, s_new)
        last = max(host, default=0) + s_new  # (batch 0: no rows)
        _check_rotary_rows(fn, rotary_cos, last)
        need = int(homes.count(torch.tensor(last, device=q.device)))
        if need > cap:
            raise ValueError(f"{fn}: k_cache_shard / v_cache_shard on rank {rank} have "
                             f"capacity (dim 1) {cap}, but {need} slots are needed on it for "
                             f"{last} tokens (max(cache_seqlens) + seqlen_new, prefill_len = "
                             f"{prefill_len}, {world} ranks)")
    _check_forced_level(fn, q)
    scale = resolve_scale(softmax_scale, d)
    # What every rank must pass alike (the docstring's "the same on every rank"; the cache
    # shards' capacity may differ). cache_seqlens and cache_leftpad are compared by a hash of
    # their values as given (host, pads above), and shown by their values where ranks differ.
    signature = (
        operation_field("ring kv-cache decoding"),
        ("batch", b), ("seqlen_q", s_q), ("nheads", h), ("headdim", d), ("nheads_k", h_kv),
        ("dtype", dtype_code(q.dtype), "dtype"), ("seqlen_new", s_new),
        ("prefill_len", int(prefill_len)), layout_field("layout", lay),
        ints_field("layout documents (cu_seqlens)", lay.documents),
        ("causal", causal, "bool"), ("window left", window[0]), ("window right", window[1]),
        float_field("softmax_scale", scale, q.dtype), float_field("softcap", softcap, q.dtype),
        ("rotary_dim", 0 if rotary_cos is None else 2 * rotary_cos.shape[1]),
        ("rotary_interleaved", rotary_interleaved, "bool"),
        ("return_softmax_lse", return_softmax_lse, "bool"), ("num_splits", num_splits),
        ints_field("cache_seqlens", host), ints_field("cache_leftpad", pads),
    )
    return dict(q=q, kc=k_cache_shard, vc=v_cache_shard, k=k, v=v, lengths=lengths,
                starts=starts, homes=homes, rank=rank, causal=causal, window=window,
                softcap=softcap, scale=scale, rotary=(rotary_cos, rotary_sin,
                rotary_interleaved), num_splits=num_splits, doc_starts=doc_starts,
                return_lse=return_softmax_lse, signature=signature)


@torch.compiler.disable
def _ring_decode(plan, group, world):
    """This rank's part of the call, gathered with the others' and merged. On several ranks a
    ring call (``Ring.open_call``), so the ring's protections hold as for attention: one
    thread per ring (its name in the signature), the begin control collective, the gather
    on the ring's channel (gloo: under the ring timeout; NCCL: its own watchdog, as the
    ring's exchanges) and, with the checks off, headers naming the call, its signature and
    its tag (before: a plain all-gather on the user's group, which paired two threads' calls
    across ranks and ranks a step apart, and waited for the process group's timeout). The
    caches are written after the call's begin: a call the ranks disagree on leaves them as
    they were. A rank whose part fails sends a payload whose last value says so (0 where 1
    says whole): every rank completes the call, the failing one raises its error, the
    others RingPeerError, and the ring stays usable; so the call has no end collective (a
    second control collective, about a third of a small decode step's time). A rank that
    cannot allocate the payload refuses the call at its begin. On one rank (no process
    group) no call is opened: decodes from several threads run side by side, as before.
    Never traced by dynamo: compiled, a failure raised as the graph ran skipped the
    ``except`` below, and the peers waited in the gather for a rank that had left."""
    q = plan["q"]
    b, s_q, h, d = q.shape
    acc = accum_dtype(q.dtype)
    # (out, lse) of this rank's part and, last, whether it is whole: gathered in one piece
    try:
        flat = torch.zeros(b * s_q * h * (d + 1) + 1, dtype=acc, device=q.device)
    except BaseException as exc:  # (out of memory): refused at the call's begin, where the
        if world > 1:  # peers raise RingPeerError naming this rank, instead of waiting
            get_ring(group).refuse(FWD, exc)
        raise
    payload = flat[:-1].view(b, s_q, h, d + 1)
    if world == 1:
        new_part = _local_decode(plan, payload)
        gathered = payload.unsqueeze(0)  # (W, b, s_q, h, d + 1)
    else:
        failure = new_part = None
        ring = get_ring(group)
        with ring.open_call(FWD, plan["signature"], q.device, name=_RING_FN) as call:
            # (before this rank's part writes the new keys: a call the ranks disagree on, or
            # another thread's, leaves the caches as they were)
            call.begin()
            try:
                new_part = _local_decode(plan, payload)
                flat[-1] = 1.0
            except BaseException as exc:  # re-raised below, after the gather (SystemExit too)
                failure = exc
            # every rank's flat from one all-to-all of W copies (what an all-gather moves); a
            # failure packing it here sends zeros, which the peers read as a part's failure
            # (a failure unpacking it, a view, would raise here alone: their outputs whole)
            parts, = all_to_all(ring.transport, [(flat.expand(world, -1), 0, 0)], call,
                                record_as="all_gather")  # (W, n + 1)
            if not call.ok:  # (reported through the payload: not at a call end, which breaks)
                failure, call.failure = failure or call.failure, None
            if not call.gathered:
                call.end()  # (checks off: no collective, the headers' verdict)
        if failure is not None:
            raise failure
        failed = (parts[:, -1] == 0).nonzero().flatten().tolist()
        if failed:
            raise RingPeerError(f"ringseq: ring_flash_attn_with_kvcache: rank(s) {failed} of the "
                                f"group failed computing their part of the call where this rank "
                                f"did not (see their errors); no output on any rank. Repeat the "
                                f"call with the same cache_seqlens on every rank", ranks=failed)
        gathered = parts[:, :-1].reshape(world, b, s_q, h, d + 1)
    outs, lses = gathered[..., :d], gathered[..., d].transpose(2, 3)  # (W, b, h, s_q)
    if new_part is not None:
        out_n, lse_n = new_part
        outs = torch.cat((outs, out_n.to(acc).unsqueeze(0)))
        lses = torch.cat((lses, lse_n.to(acc).unsqueeze(0)))
    out, lse = _merge_partials(outs, lses)
    out = out.to(q.dtype)
    return (out, _flash_lse(lse)) if plan["return_lse"] else out


def _local_decode(plan, payload):
    """This rank's part of a ring decode: (out, lse) of its cache shard written to ``payload``
    (b, s_q, h, d + 1) in the accumulation dtype; returns (out, lse) of the new tokens or None.
    The new tokens are written to the slots this rank holds."""
    q, kc, vc, k, v = plan["q"], plan["kc"], plan["vc"], plan["k"], plan["v"]
    lengths, starts, homes, rank = plan["lengths"], plan["starts"], plan["homes"], plan["rank"]
    causal, window, softcap, scale = plan["causal"], plan["window"], plan["softcap"], plan["scale"]
    b, s_q, h, d = q.shape
    s_new = 0 if k is None else k.shape[1]
    cos, sin, interleaved = plan["rotary"]
    if cos is not None:
        q = _rotate(q, cos, sin, _rotary_q_positions(lengths, s_q, causal or window != (-1, -1)),
                    interleaved)
        k = _rotate(k, cos, sin, _rotary_q_positions(lengths, s_new, True), interleaved)
    # Every earlier token precedes every query (seqlen_q == 1, or the queries are new tokens):
    # the local shard is one unmasked range of slots, [count(first visible), count(old end)).
    first = starts.long()
    if window[0] >= 0:  # one query, at position lengths + s_new - 1
        first = torch.maximum(first, lengths.long() + s_new - 1 - window[0])
    doc_starts = plan["doc_starts"]
    if doc_starts is not None:  # one query, at that position: the start of its document
        at = (lengths.long() + s_new - 1).clamp(min=0)  # (b,)
        first = torch.maximum(first, doc_starts[torch.searchsorted(doc_starts, at, right=True)
                                                - 1])
    end_old = lengths.long()
    local_end = homes.count(end_old).to(torch.int32)
    local_start = torch.minimum(homes.count(first), local_end.long()).to(torch.int32)
    # Partials in the accumulation dtype: rounding each to bf16 / fp16 before the merge cost
    # up to 15x plain attention's error where the ranks' partials cancel.
    out_r, lse_r = _attend_cache(q, kc, vc, local_end, local_start, None, scale, False, (-1, -1),
                                 softcap, plan["num_splits"], out_acc=True)
    new_part = None
    if k is not None:
        # The new tokens go to their homes; the block of queries x new keys is computed on
        # every rank from the replicated k, v (bottom-right causal / window within it).
        pos = end_old[:, None] + torch.arange(s_new, device=q.device)[None, :]  # (b, s_new)
        owner, slot = homes.home(pos)
        mine = owner == rank
        rows = torch.arange(b, device=q.device)[:, None].expand(b, s_new)
        kc.index_put_((rows[mine], slot[mine]), k[mine])
        vc.index_put_((rows[mine], slot[mine]), v[mine])
        new_len = torch.full((b,), s_new, dtype=torch.int32, device=q.device)
        # left padding that reaches into the new tokens (a left-padded prompt appended to an
        # empty cache) hides those keys here too
        new_start = (starts.long() - end_old).clamp(0, s_new).to(torch.int32)
        new_part = _attend_cache(q, k, v, new_len, new_start, None, scale, causal, window,
                                 softcap, 0, out_acc=True)
    payload[..., :d] = out_r
    payload[..., d] = lse_r.transpose(1, 2)
    return new_part


# torch.compile / meta support of the operator (shapes only; the binding checks the values).
if extension_available():

    @torch.library.register_fake("ringseq::fwd_kvcache")
    def _fwd_kvcache_fake(q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx,
                          softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0,
                          num_splits=0, out_acc=False):
        b, s_q, h, _ = q.shape
        out = torch.empty_like(q, dtype=accum_dtype(q.dtype) if out_acc else q.dtype,
                               memory_format=torch.contiguous_format)
        lse = q.new_empty((b, h, s_q), dtype=accum_dtype(q.dtype))
        return out, lse
