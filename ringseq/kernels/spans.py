"""Spans, bands and soft-capping: what one kernel call computes (docs/kernels.md).

A call computes one or more *spans* ``(q_start, q_len, k_start, k_len, band_lo, band_hi)``:
span t attends q rows ``[q_start, q_start + q_len)`` to kv rows ``[k_start, k_start + k_len)``,
and key j (0-based within the span's kv rows) is visible to query i (0-based within its q
rows) iff ``band_lo <= j - i <= band_hi``; ``-UNBOUNDED`` / ``UNBOUNDED`` mean no bound. All
spans of a call share the tensors and the soft-cap; their q row ranges are pairwise disjoint
and so are their kv row ranges. Rows no span covers: ``out = 0, lse = -inf`` and zero
gradients (``fwd`` / ``bwd``), untouched accumulators (``fwd_accum`` / ``bwd_accum``).
``spans=None`` is one span over everything with the causal band (or none): what every call
computed before spans existed.

Soft-capping (flash-attn's ``softcap``, Gemma 2): with ``softcap > 0`` the scaled score
``x = softmax_scale * q.k`` becomes ``softcap * tanh(x / softcap)`` before the softmax, so lse
is the log-sum-exp of the capped scores; the backward multiplies dS by ``1 - tanh(x/softcap)^2``
and dQ/dK keep the factor ``softmax_scale``. ``softcap = 0`` is off.

This module is the one place where spans given as Python objects become the int64 CPU
tensor the operators take (:func:`as_spans_tensor`), and where they are checked in Python
(:func:`check_spans`, the same rules as csrc/ops.cpp). :func:`window_band` and
:func:`document_spans` turn flash-attn's ``window_size`` (checked by :func:`parse_window`, as
at every entry point) and varlen documents into bands and spans.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Iterable, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .checks import check_bool, count_check, given

UNBOUNDED = 2 ** 62  # band_lo = -UNBOUNDED / band_hi = UNBOUNDED: no bound on that side


class Span(NamedTuple):
    """One span of a kernel call (see the module docstring)."""
    q_start: int
    q_len: int
    k_start: int
    k_len: int
    band_lo: int = -UNBOUNDED
    band_hi: int = UNBOUNDED


SpansLike = Union[None, torch.Tensor, Iterable[Sequence[int]]]

__all__ = ["UNBOUNDED", "Span", "as_spans_tensor", "check_spans", "check_softcap", "spans_given",
           "visible_mask", "covered_rows", "window_band", "document_spans"]


def as_spans_tensor(spans: SpansLike) -> Optional[torch.Tensor]:
    """``spans`` as the operators take it: None, or a contiguous int64 CPU tensor (n, 6).

    Accepts None, such a tensor (returned as is when already int64, CPU and contiguous), or an
    iterable of 6-sequences of ints (e.g. :class:`Span` tuples). Raises TypeError for anything
    else; the values themselves are checked by :func:`check_spans` (and by the binding)."""
    if spans is None:
        return None
    if isinstance(spans, torch.Tensor):
        if spans.dtype != torch.int64 or spans.dim() != 2 or spans.shape[1] != 6:
            raise ValueError(f"spans must be an int64 tensor of shape (n, 6), got {spans.dtype} "
                             f"of shape {tuple(spans.shape)}")
        if spans.device.type != "cpu":
            raise ValueError(f"spans must be a CPU tensor (the kernels copy it to the device), got "
                             f"a tensor on {spans.device}")
        return spans.contiguous()
    try:
        rows = [tuple(s) for s in spans]
    except TypeError:
        raise TypeError(f"spans must be None, an int64 (n, 6) tensor or a list of "
                        f"(q_start, q_len, k_start, k_len, band_lo, band_hi) tuples, got "
                        f"{type(spans).__name__}") from None
    for t, r in enumerate(rows):
        if len(r) != 6 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r):
            raise TypeError(f"spans[{t}] must be 6 ints (q_start, q_len, k_start, k_len, band_lo, "
                            f"band_hi), got {r!r}")
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 6)


def check_softcap(softcap, fn: str = "attention") -> float:
    """``softcap`` as a float: the one check of the soft-cap (every entry point and direct
    kernel call uses it). TypeError for a non-number (a bool included), ValueError unless finite
    and >= 0 (0 = off); both name ``fn``."""
    count_check("check_softcap")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"{fn}: softcap must be a float (0.0: off), got {given(softcap)}")
    try:
        softcap = float(softcap)
    except OverflowError:  # (an int or a Fraction past float's range: beyond float32's too)
        raise ValueError(f"{fn}: softcap must be 0.0 (off) or within float32's range "
                         f"[{_FLOAT32_TINY:.3g}, {_FLOAT32_MAX:.3g}], got a value past "
                         f"float's range ({type(softcap).__name__})") from None
    # (comparisons, not math.isfinite: under torch.compile(dynamic=True) a default float is a
    # symbolic float, which math.isfinite cannot take; NaN fails both comparisons)
    if not 0.0 <= softcap < math.inf:
        raise ValueError(f"{fn}: softcap must be a finite float >= 0 (0.0: off), got {softcap!r}")
    # The kernels cap in float32 for 16- and 32-bit inputs: a cap beyond its range became inf
    # (NaN outputs) or 0 (no capping at all) there.
    if softcap != 0.0 and not _FLOAT32_TINY <= softcap <= _FLOAT32_MAX:
        raise ValueError(f"{fn}: softcap must be 0.0 (off) or within float32's range "
                         f"[{_FLOAT32_TINY:.3g}, {_FLOAT32_MAX:.3g}], got {softcap!r}")
    return softcap


_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def spans_given(spans: Optional[torch.Tensor], softcap: float) -> bool:
    """Whether a call uses spans or a soft-cap (i.e. is not the plain dense call)."""
    return spans is not None or softcap > 0.0


def _rows(spans: torch.Tensor):
    return [tuple(int(x) for x in r) for r in spans.tolist()]


def _has_values(t: torch.Tensor) -> bool:
    """False for the fake / meta tensors of a trace (torch.compile, opcheck), whose values
    only the operators see at run time (and check there)."""
    if t.device.type == "meta":
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover
        return True
    return not is_fake(t)


def check_spans(spans: Optional[torch.Tensor], seqlen_q: int, seqlen_k: int, causal: bool) -> None:
    """ValueError unless ``spans`` (from :func:`as_spans_tensor`) fits the shapes: the rules of
    csrc/ops.cpp, with the same messages (ranges inside the tensors, band_lo <= band_hi,
    pairwise disjoint q and kv ranges, not combined with causal=True). Under tracing only the
    causal rule is checked here (the values are the operators' to check)."""
    if spans is None:
        return
    count_check("check_spans")
    if causal:
        raise ValueError("spans and causal=True cannot be combined: with spans, causal must be False "
                         "and each span's band says what it sees (causal is band_hi = k_len - q_len)")
    if not _has_values(spans):
        return
    rows = _rows(spans)
    for t, (qs, ql, ks, kl, lo, hi) in enumerate(rows):
        if not (qs >= 0 and ql >= 0 and qs + ql <= seqlen_q):
            raise ValueError(f"spans[{t}]: q rows [q_start, q_start + q_len) = [{qs}, {qs} + {ql}) must "
                             f"lie inside [0, seqlen_q = {seqlen_q})")
        if not (ks >= 0 and kl >= 0 and ks + kl <= seqlen_k):
            raise ValueError(f"spans[{t}]: kv rows [k_start, k_start + k_len) = [{ks}, {ks} + {kl}) must "
                             f"lie inside [0, seqlen_k = {seqlen_k})")
        if lo > hi:
            raise ValueError(f"spans[{t}]: band_lo must be <= band_hi, got band_lo = {lo}, band_hi = {hi} "
                             f"(use -2**62 / 2**62 for unbounded)")
    for col, what in ((0, "q"), (2, "kv")):
        order = sorted((t for t, r in enumerate(rows) if r[col + 1] > 0), key=lambda t: rows[t][col])
        for a, b in zip(order, order[1:]):
            ra, rb = rows[a], rows[b]
            if ra[col] + ra[col + 1] > rb[col]:
                raise ValueError(f"spans must have pairwise disjoint {what} row ranges, but span {a} covers "
                                 f"{what} rows [{ra[col]}, {ra[col] + ra[col + 1]}) and span {b} covers "
                                 f"[{rb[col]}, {rb[col] + rb[col + 1]})")


def visible_mask(spans: Optional[torch.Tensor], seqlen_q: int, seqlen_k: int, causal: bool,
                 device=None) -> torch.Tensor:
    """Boolean (s_q, s_k) mask, True where key j is visible to query i (the plain-math
    definition of a call: the reference and SDPA backends use it)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    if spans is None:
        return (j <= i + (seqlen_k - seqlen_q)) if causal else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool,
                                                                          device=device)
    mask = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    for qs, ql, ks, kl, lo, hi in _rows(spans):
        if ql == 0 or kl == 0:
            continue
        d = (j[:, ks:ks + kl] - ks) - (i[qs:qs + ql] - qs)
        mask[qs:qs + ql, ks:ks + kl] = (d >= lo) & (d <= hi)
    return mask


def covered_rows(spans: Optional[torch.Tensor], seqlen_q: int, seqlen_k: int):
    """(q rows, kv rows) some span covers, as boolean vectors (all True without spans)."""
    q = torch.zeros(seqlen_q, dtype=torch.bool)
    k = torch.zeros(seqlen_k, dtype=torch.bool)
    if spans is None:
        return q.fill_(True), k.fill_(True)
    for qs, ql, ks, kl, _, _ in _rows(spans):
        q[qs:qs + ql] = True
        k[ks:ks + kl] = True
    return q, k


def _window_entry(w):
    # flash-attn's own tests pass window sizes as ints, as a 2-element tensor, or as a tuple of
    # 0-d tensors; bools are never sizes
    # (integer dtypes with data only: a complex or meta tensor is no size)
    if isinstance(w, torch.Tensor) and w.numel() == 1 and not w.is_meta \
            and not w.is_floating_point() and not w.is_complex() and w.dtype != torch.bool:
        return _window_entry_on_host(w)
    if isinstance(w, numbers.Integral) and not isinstance(w, bool):
        # (operator.index, not int: under torch.compile an int argument that took other values
        # becomes symbolic, and index() is what dynamo specializes to a plain int -- the
        # operator's spec string cannot hold a symbol)
        return operator.index(w)
    return None


def parse_window(fn: str, window_size) -> Tuple[int, int]:
    """flash-attn's ``window_size=(left, right)``: ints (or integer tensors: a 2-element tensor
    or 0-d tensors), ``-1`` unbounded on that side. Returns ``(left, right)`` as ints;
    TypeError / ValueError naming ``window_size`` otherwise."""
    count_check("parse_window")
    items = window_size
    if isinstance(window_size, torch.Tensor):
        items = list(window_size.reshape(-1)) if window_size.numel() == 2 else None
    entries = ([_window_entry(w) for w in items]
               if isinstance(items, (tuple, list)) and len(items) == 2 else [None])
    if any(e is None for e in entries):
        why = ("" if not isinstance(window_size, torch.Tensor) else
               " on the meta device (no values)" if window_size.is_meta else
               f" of dtype {window_size.dtype}")
        raise TypeError(f"{fn}: window_size must be a pair (left, right) of ints or integer "
                        f"tensors, (-1, -1) for no window, got {given(window_size)}{why}")
    left, right = entries
    if left < -1 or right < -1:
        raise ValueError(f"{fn}: window_size entries must be >= 0, or -1 for unbounded, got "
                         f"({left}, {right})")
    # A window at least as wide as the keys is none (flash-attn's kernels clamp it; so does
    # spec.local_spans for the local calls); one of UNBOUNDED or more is that for every
    # sequence a tensor can hold, and the band's bounds (positions minus the width) would
    # leave int64 past it.
    return tuple(-1 if e >= UNBOUNDED else e for e in (left, right))


@torch.compiler.disable(reason="ringseq reads a window_size given as tensors on the host, "
                        "which a graph cannot: under torch.compile(fullgraph=True) pass ints")
def _window_entry_on_host(w: torch.Tensor) -> int:
    """A window entry given as a 1-element tensor, read on the host (under torch.compile a
    graph break whose reason names the way out, as for cu_seqlens: before, fullgraph=True
    failed tracing str() of an unbacked int, naming neither)."""
    return int(w.item())


def window_band(seqlen_q: int, seqlen_k: int, window_size: Tuple[int, int] = (-1, -1),
                causal: bool = False) -> Tuple[int, int]:
    """(band_lo, band_hi) of flash-attn's ``window_size=(left, right)`` (-1: unbounded) and
    ``causal``, bottom-right aligned: query i sees key j iff
    ``i + s_k - s_q - left <= j <= i + s_k - s_q + right`` (and ``j <= i + s_k - s_q`` when causal).
    Raises TypeError / ValueError naming ``window_size`` or ``causal`` as the attention entry
    points do (before: ``(-2, 0)`` became an unbounded side and ``causal="no"`` a causal band)."""
    return _band(seqlen_q, seqlen_k, parse_window("window_band", window_size),
                 check_bool("window_band", "causal", causal))


def _band(seqlen_q: int, seqlen_k: int, window_size: Tuple[int, int], causal: bool
          ) -> Tuple[int, int]:
    # window_band for a window and flag already checked (spec.local_spans' clamped windows)
    left, right = window_size
    off = seqlen_k - seqlen_q
    lo = -UNBOUNDED if left < 0 else off - left
    hi = UNBOUNDED if right < 0 else off + right
    if causal:
        hi = min(hi, off)
    return lo, hi


def _boundaries(name: str, cu) -> list:
    """document_spans' ``name`` as a list of ints, checked (before: 2.7 became 2, and a
    decreasing boundary a span of negative length, refused later as ``spans[1]``)."""
    try:
        items = list(cu)
    except TypeError:
        raise TypeError(f"document_spans: {name} must be a sequence of ints or a 1-D integer "
                        f"tensor, got {type(cu).__name__}") from None
    if not items:
        raise ValueError(f"document_spans: {name} needs at least one boundary (0), got none")
    out = []
    for x in items:
        whole = (torch.is_tensor(x) and not x.is_floating_point() and x.dtype != torch.bool
                 and x.numel() == 1) or (isinstance(x, numbers.Integral)
                                         and not isinstance(x, bool))
        if not whole:
            raise TypeError(f"document_spans: {name} must hold ints, got {x!r}")
        out.append(int(x))
    if out[0] != 0 or any(b < a for a, b in zip(out, out[1:])):
        raise ValueError(f"document_spans: {name} must start at 0 and never decrease, got "
                         f"{tuple(out)}")
    return out


def document_spans(cu_seqlens_q: Sequence[int], cu_seqlens_k: Sequence[int], causal: bool = False,
                   window_size: Tuple[int, int] = (-1, -1)) -> list:
    """One span per document of a packed batch (flash-attn varlen semantics: each document is
    its own bottom-right aligned problem). ``cu_seqlens_*`` are the cumulative boundaries
    ``[0, n_0, n_0 + n_1, ...]`` of the documents' q and kv rows: ints (or integer tensors),
    starting at 0, never decreasing; ``causal`` and ``window_size`` as in
    :func:`window_band`. Raises TypeError / ValueError naming the argument."""
    return spans_of_documents(cu_seqlens_q, cu_seqlens_k,
                              check_bool("document_spans", "causal", causal),
                              parse_window("document_spans", window_size))


def spans_of_documents(cu_seqlens_q, cu_seqlens_k, causal: bool, window: Tuple[int, int]) -> list:
    """:func:`document_spans` with ``causal`` and ``window`` already checked (an entry point's
    spec; spec.local_spans clamps the window to widths the public check would refuse)."""
    cq, ck = (_boundaries(n, cu) for n, cu in (("cu_seqlens_q", cu_seqlens_q),
                                                ("cu_seqlens_k", cu_seqlens_k)))
    if len(cq) != len(ck):
        raise ValueError(f"document_spans: cu_seqlens_q and cu_seqlens_k must have the same "
                         f"length (documents + 1), got {len(cq)} and {len(ck)}")
    out = []
    for d in range(len(cq) - 1):
        ql, kl = cq[d + 1] - cq[d], ck[d + 1] - ck[d]
        out.append(Span(cq[d], ql, ck[d], kl, *_band(ql, kl, window, causal)))
    return out
