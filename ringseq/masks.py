"""Attention masks beyond plain causal: sliding windows and packed documents, as data.

An :class:`AttnMask` says which (query, key) pairs of the GLOBAL sequence are visible:
``causal``, a flash-attn ``window=(left, right)`` (key j visible to query i iff
``i - left <= j <= i + right``, -1 = unbounded; combined with causal) and, for packed
documents, ``cu_seqlens`` (the global document boundaries ``(0, ..., total)``: a query sees
only keys of its own document).

Kernels take a block as a list of *spans* ``(q_start, q_len, k_start, k_len, band_lo,
band_hi)`` (see ``ringseq.kernels.base``): span rows are contiguous local rows, key j of the
span is visible to its query i iff ``band_lo <= j - i <= band_hi``. :func:`span_tasks` turns a
mask and the two shards of a ring step into such spans -- generic for every layout, from the
layout's *runs* (maximal stretches of local rows whose global positions advance by a fixed
stride: one per contiguous chunk, one strided run for stripe) -- and groups them into block
tasks whose spans have pairwise disjoint q rows and kv rows (what one kernel call may hold).
Whole runs, documents and bands that see nothing produce no span, so work and communication
follow the visible area.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ._hash import stable_code
from .kernels.spans import UNBOUNDED, Span, document_spans  # noqa: F401  (re-exported)

__all__ = ["AttnMask", "UNBOUNDED", "Run", "Span", "document_spans", "span_tasks",
           "split_runs_at_documents"]




@dataclass(frozen=True)
class Run:
    """Local rows ``[local, local + length)`` at global positions ``start + stride * a``."""

    local: int
    length: int
    start: int
    stride: int = 1


@dataclass(frozen=True)
class AttnMask:
    """Visible pairs of the global sequence (see module doc). ``window`` uses flash-attn's
    convention (two ints); ``cu_seqlens`` is a tuple of ints (0, ..., total) or None. Plain
    data: the entry points validate (``ringseq._args``) before they build one."""

    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    cu_seqlens: Optional[Tuple[int, ...]] = None

    @property
    def plain(self) -> bool:
        """Only causal (or nothing): the layouts' own hand-written schedules apply."""
        return self.window == (-1, -1) and self.cu_seqlens is None

    def band(self) -> Tuple[int, int]:
        """(lo, hi) on global ``j - i`` (UNBOUNDED where open)."""
        left, right = self.window
        lo = -left if left >= 0 else -UNBOUNDED
        hi = right if right >= 0 else UNBOUNDED
        if self.causal:
            hi = min(hi, 0)
        return lo, hi

    def code(self) -> int:
        """A small integer naming the mask in cross-rank checks."""
        return stable_code(repr((self.causal, self.window, self.cu_seqlens)))


def _floor_div(a: int, b: int) -> int:
    return a // b


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def split_runs_at_documents(runs: Sequence[Run], cu_seqlens) -> List[Tuple[Run, int]]:
    """Pieces of ``runs`` that each lie in one document: ``(run, document index)``."""
    if cu_seqlens is None:
        return [(r, 0) for r in runs]
    import bisect
    out = []
    for r in runs:
        a = 0
        while a < r.length:
            g = r.start + r.stride * a
            d = bisect.bisect_right(cu_seqlens, g) - 1  # document holding global position g
            end = cu_seqlens[d + 1]  # first position of the next document
            n = min(r.length - a, _ceil_div(end - g, r.stride))
            out.append((Run(r.local + a, n, g, r.stride), d))
            a += n
    return out


def _span(q: Run, k: Run, lo_g: int, hi_g: int) -> Optional[Span]:
    """The span of the pairs of q-run x k-run inside the global band, or None if empty.
    Both runs have the same stride st: j_g - i_g = (k0 - q0) + st * (b - a)."""
    st = q.stride
    off = k.start - q.start
    lo = -UNBOUNDED if lo_g <= -UNBOUNDED else _ceil_div(lo_g - off, st)
    hi = UNBOUNDED if hi_g >= UNBOUNDED else _floor_div(hi_g - off, st)
    # b - a ranges over [-(q_len - 1), k_len - 1] inside the rectangle
    lo, hi = max(lo, -(q.length - 1)), min(hi, k.length - 1)
    if lo > hi:
        return None
    return (q.local, q.length, k.local, k.length, lo, hi)


def span_tasks(q_runs: Sequence[Run], k_runs: Sequence[Run], mask: AttnMask):
    """Block tasks (as lists of spans with pairwise disjoint q and kv rows) computing, for
    the shard of ``q_runs`` against the shard of ``k_runs``, exactly the visible pairs."""
    lo_g, hi_g = mask.band()
    by_doc = {}
    for k, dk in split_runs_at_documents(k_runs, mask.cu_seqlens):
        by_doc.setdefault(dk, []).append(k)
    spans = []
    for q, dq in split_runs_at_documents(q_runs, mask.cu_seqlens):
        for k in by_doc.get(dq, ()):
            if q.length == 0 or k.length == 0:
                continue
            if q.stride == k.stride:
                pieces = [q]
            else:
                # No common stride (a custom layout's generic runs): one query row at a time,
                # as a run of k's stride (a single position fits any stride). Built-in layouts
                # give every rank runs of one stride, so they never come here.
                pieces = [Run(q.local + i, 1, q.start + i * q.stride, k.stride)
                          for i in range(q.length)]
            for piece in pieces:
                sp = _span(piece, k, lo_g, hi_g)
                if sp is not None:
                    spans.append(sp)
    # Greedy grouping: a span joins the first batch where its q rows and kv rows are new.
    batches: List[List[Span]] = []
    used: List[Tuple[list, list]] = []
    for sp in spans:
        qr, kr = (sp[0], sp[0] + sp[1]), (sp[2], sp[2] + sp[3])
        for batch, (qs, ks) in zip(batches, used):
            if all(qr[1] <= a or b <= qr[0] for a, b in qs) and \
                    all(kr[1] <= a or b <= kr[0] for a, b in ks):
                batch.append(sp)
                qs.append(qr)
                ks.append(kr)
                break
        else:
            batches.append([sp])
            used.append(([qr], [kr]))
    return batches
