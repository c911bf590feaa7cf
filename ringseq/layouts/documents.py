"""Packed documents: the :class:`Documents` layout (documents split or kept whole so that the
causal work is balanced) and ``layout="documents"``, which binds it per batch."""
from __future__ import annotations

import functools
from typing import Sequence, Tuple

import torch

from .._args import check_cu_seqlens
from .._hash import stable_code
from ..masks import AttnMask, Run
from .base import Layout, register_layout

__all__ = ["DOCUMENTS", "Documents", "DocumentsContiguous", "DocumentsZigzag",
           "PerBatchDocuments", "document_positions", "documents_layout"]


class _DocumentLayout(Layout):
    """A layout made for one packed sequence (GLOBAL boundaries ``cu_seqlens``): attention with
    it is always restricted to the documents, and its schedules come from its runs under the
    document mask."""

    def __init__(self, cu_seqlens):
        self.cu_seqlens = self.documents = check_cu_seqlens(type(self).__name__, "cu_seqlens",
                                                            cu_seqlens)

    @property
    def code(self) -> int:
        return stable_code(f"{self.name}{self.cu_seqlens}")

    @property
    def signature_code(self) -> int:
        # (a ring call's spec carries these boundaries as its documents, compared there: before,
        # a mismatch showed "layout #<code>" for every call whose boundaries differed). A
        # subclass that puts parameters of its own into its code keeps that code whole.
        if type(self).code is not _DocumentLayout.code:
            return self.code
        return self._class_code()  # (not its attributes: its boundaries are compared apart)

    def _positions(self, seqlen, world_size, rank):
        runs = self._runs(seqlen, world_size, rank)  # (positions checked the arguments)
        if not runs:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(r.start, r.start + r.length) for r in runs])

    def _tasks(self, rank, src, world_size, s_local):  # pragma: no cover - always masked
        raise RuntimeError(f"layout {self.name!r} schedules only through a document mask")

    def mask(self, causal, window=(-1, -1)) -> AttnMask:
        """``causal`` (a bool, or an AttnMask whose causal flag and window are kept) restricted
        to this layout's documents."""
        if isinstance(causal, AttnMask):
            causal, window = causal.causal, causal.window
        return AttnMask(causal=bool(causal), window=tuple(window), cu_seqlens=self.cu_seqlens)

    def schedule(self, rank, world_size, s_local, causal):
        return super().schedule(rank, world_size, s_local, self.mask(causal))

    def hops(self, world_size, s_local, causal):
        return super().hops(world_size, s_local, self.mask(causal))

    def kv_rows(self, world_size, s_local, causal):
        return super().kv_rows(world_size, s_local, self.mask(causal))

    def bind(self, cu_seqlens):
        if cu_seqlens is not None and tuple(int(c) for c in cu_seqlens) != self.cu_seqlens:
            raise ValueError(f"layout {self!r}: the batch's cu_seqlens {tuple(cu_seqlens)} differ "
                             f"from the document boundaries the layout was built with; pass "
                             f"one of them")
        return self

    def __repr__(self):
        return (f"{type(self).__name__}({len(self.cu_seqlens) - 1} documents, "
                f"{self.cu_seqlens[-1]} tokens)")


class Documents(_DocumentLayout):
    """Packed documents split for balanced causal work without any divisibility demand.

    A document of the packed sequence (boundaries ``cu_seqlens = (0, ..., total)``) is either
    split or kept whole. A split document is cut into ``2W`` pieces and rank ``r`` holds pieces
    ``r`` and ``2W-1-r`` of it (the zigzag of each document), so its causal work is the same on
    every rank: a document of length ``L`` has ``L // 2W`` tokens in each piece, its ``L % 2W``
    remaining tokens dealt round-robin over the ranks. A whole document goes to one rank:
    longest first, each to the least loaded rank with room left, and one that fits nowhere is
    cut over the ranks' remaining room, so every rank holds exactly ``total / W`` tokens.

    Which documents are split: the ``k`` longest, for a small ``k`` such that the estimated
    causal work (visible pairs) of the busiest rank is within ``BALANCE`` of the mean
    (documents shorter than 2W tokens are never split). ``k`` is found by doubling, then
    bisection, a few placements however many documents there are; since splitting one more
    document does not always improve the balance, it is not always the fewest that would do.
    Whole documents run as long spans with no partial tiles from cutting; short ones are split
    only when few documents must fill many ranks.
    Needs only ``total % W == 0`` (any document lengths, 1 included). Local order is
    increasing in global position.

    ``cu_seqlens`` is part of the layout (ranks passing different boundaries raise
    RingMismatchError); attention with this layout is always restricted to documents.
    """

    name = "documents"
    BALANCE = 1.02  # accepted max / mean of the estimated causal work per rank

    def __init__(self, cu_seqlens):
        super().__init__(cu_seqlens)
        self._pieces = {}

    def _layout(self, world_size: int):
        """Per rank: its (global start, length) runs, sorted by position (see class doc)."""
        if world_size not in self._pieces:
            W = world_size
            docs = list(zip(self.cu_seqlens, self.cu_seqlens[1:]))
            # split candidates, longest first (ties: earlier first, for a stable plan)
            cand = sorted((d for d in docs if d[1] - d[0] >= 2 * W),
                          key=lambda d: (d[0] - d[1], d[0]))

            plans = {}

            def plan(k):  # split the k longest candidates
                if k not in plans:
                    plans[k] = self._place(docs, set(cand[:k]), W)
                return plans[k]

            def balanced(k):  # splitting every candidate is the fallback
                return k >= len(cand) or plan(k)[1] <= self.BALANCE

            # The smallest balanced k: doubling, then bisection between the last unbalanced
            # and the first balanced k seen.
            lo, hi = -1, 0
            while not balanced(hi):
                lo, hi = hi, min(2 * hi + 1, len(cand))
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if balanced(mid) else (mid, hi)
            self._pieces[world_size] = plan(hi)[0]
        return self._pieces[world_size]

    @staticmethod
    def _place(docs, split, W):
        """(runs per rank, estimated max / mean work) with the documents in ``split`` cut in
        2W pieces and the rest kept whole (see the class doc)."""
        total = docs[-1][1] if docs else 0
        cap = total // W
        runs = [[] for _ in range(W)]
        tokens, work = [0] * W, [0.0] * W
        extra = 0
        whole = []
        for a, b in docs:
            L = b - a
            if (a, b) not in split:
                whole.append((a, b))
                continue
            base, rem = divmod(L, 2 * W)
            front, back = [base] * W, [base] * W
            for t in range(rem):  # round-robin over the ranks, across documents
                r = (extra + t) % W
                (front if t < W else back)[r] += 1
            extra += rem
            sizes = front + back[::-1]  # piece k < W: rank k's front; k >= W: rank 2W-1-k
            starts = [a]
            for n in sizes[:-1]:
                starts.append(starts[-1] + n)
            for r in range(W):
                for start, n in ((starts[r], front[r]), (starts[2 * W - 1 - r], back[r])):
                    runs[r].append((start, n))
                    tokens[r] += n
                work[r] += L * L / (2 * W)
        for a, b in sorted(whole, key=lambda d: (d[0] - d[1], d[0])):
            L = b - a
            fits = [r for r in range(W) if tokens[r] + L <= cap]
            if fits:
                r = min(fits, key=lambda r: (work[r], r))
                runs[r].append((a, L))
                tokens[r] += L
                work[r] += L * L / 2
                continue
            start = a
            for r in range(W):
                n = min(cap - tokens[r], b - start)
                if n > 0:
                    runs[r].append((start, n))
                    tokens[r] += n
                    work[r] += n * (start - a) + n * n / 2  # its queries see the earlier parts too
                    start += n
        mean = sum(work) / W
        balance = max(work) / mean if mean > 0 else 1.0
        return [sorted(x for x in rr if x[1] > 0) for rr in runs], balance

    def check_seqlen(self, seqlen: int, world_size: int) -> int:
        if seqlen != self.cu_seqlens[-1]:
            raise ValueError(f"layout 'documents' was built for a packed sequence of "
                             f"{self.cu_seqlens[-1]} tokens (cu_seqlens), got {seqlen}")
        return super().check_seqlen(seqlen, world_size)

    def check_local_seqlen(self, s_local: int, world_size: int) -> None:
        total = self.cu_seqlens[-1]
        if total % world_size or s_local != total // world_size:
            raise ValueError(f"layout 'documents' with {total} packed tokens and world size "
                             f"{world_size} needs local shards of {total / world_size:g} tokens "
                             f"(the total must be a multiple of the world size), got "
                             f"{s_local}")

    def _runs(self, seqlen, world_size, rank):
        runs, local = [], 0
        for start, n in self._layout(world_size)[rank]:
            runs.append(Run(local, n, start, 1))
            local += n
        return tuple(runs)


class _SplitEveryDocument(_DocumentLayout):
    """Every document cut into ``pieces(W)`` equal chunks, rank r holding ``chunks(r, W)`` of each
    (ring-flash-attention's varlen shards: its ``extract_local``); every document length must
    divide by ``pieces(W)``. Local order: document by document, chunks in increasing order."""

    def pieces(self, world_size: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def chunks(self, rank: int, world_size: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def check_seqlen(self, seqlen: int, world_size: int) -> int:
        n = self.pieces(world_size)
        lengths = [b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:])]
        bad = [(i, n_i) for i, n_i in enumerate(lengths) if n_i % n]
        if seqlen != self.cu_seqlens[-1] or bad:
            # (the ring's size: under the hybrid the ring of Ulysses groups, not the group)
            shown = ", ".join(f"document {i}: {n_i}" for i, n_i in bad[:5])
            shown += ", ..." if len(bad) > 5 else ""
            raise ValueError(
                f"layout {self.name!r} cuts every document into {n} equal chunks (a ring of "
                f"{world_size} ranks): it needs a packed sequence of {self.cu_seqlens[-1]} "
                f"tokens (cu_seqlens) whose every document length is a multiple of {n}; got "
                f"{seqlen} tokens" + (f" and {len(bad)} of {len(lengths)} documents whose "
                                      f"length is not a multiple of {n} ({shown})" if bad else ""))
        return seqlen // world_size

    def check_local_seqlen(self, s_local: int, world_size: int) -> None:
        self.check_seqlen(s_local * world_size, world_size)

    def _runs(self, seqlen, world_size, rank):
        n = self.pieces(world_size)
        runs, local = [], 0
        for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]):
            c = (b - a) // n
            for j in self.chunks(rank, world_size):
                if c:
                    runs.append(Run(local, c, a + j * c, 1))
                    local += c
        return tuple(runs)


class DocumentsContiguous(_SplitEveryDocument):
    """Every document cut into W chunks, rank r holding chunk r of each: ring-flash-attention's
    ``ring_flash_attn_varlen_func`` shards (``value[start:end].chunk(W)[r]`` per document).
    Causal work is unbalanced within each document, as in the plain ring."""

    name = "documents_contiguous"

    def pieces(self, world_size):
        return world_size

    def chunks(self, rank, world_size):
        return (rank,)


class DocumentsZigzag(_SplitEveryDocument):
    """Every document cut into 2W chunks, rank r holding chunks r and 2W-1-r of each:
    ring-flash-attention's ``zigzag_ring_flash_attn_varlen_func`` shards. (``Documents``
    balances the same work without any divisibility demand.)"""

    name = "documents_zigzag"

    def pieces(self, world_size):
        return 2 * world_size

    def chunks(self, rank, world_size):
        return (rank, 2 * world_size - 1 - rank)


class PerBatchDocuments(Layout):
    """A documents layout of packed batches, each bound to its own boundaries:
    ``"documents"`` (:class:`Documents`), ``"documents_contiguous"`` and ``"documents_zigzag"``
    (ring-flash-attention's varlen shards). It places no tokens itself: an entry point binds it
    to a batch's GLOBAL ``cu_seqlens`` (:meth:`Layout.bind`), which gives that batch's (cached)
    layout."""

    def __init__(self, cls):
        self.cls, self.name = cls, cls.name if cls is not Documents else "documents"

    def bind(self, cu_seqlens):
        if cu_seqlens is None:
            raise ValueError(f"layout {self.name!r} splits packed batches by their documents and "
                             f"needs the batch's GLOBAL document boundaries: pass cu_seqlens (or "
                             f"the cu_seq_lens_q / position_ids of "
                             f"ringseq.shard_batch(batch, layout={self.name!r}))")
        return documents_layout(tuple(int(c) for c in cu_seqlens), self.cls)

    def _unbound(self, *args, **kwargs):
        raise ValueError(f"layout {self.name!r} is per batch: bind it to the batch's document "
                         f"boundaries first (layout.bind(cu_seqlens), or pass "
                         f"ringseq.layouts.{self.cls.__name__}(cu_seqlens))")

    def multiple(self, world_size: int) -> int:
        return world_size  # a batch's total divides W (each layout checks its own documents)

    check_seqlen = check_local_seqlen = positions = runs = _unbound
    schedule = hops = kv_rows = shard = scatter = _unbound

    def __repr__(self):
        return f"Layout({self.name!r}: per batch)"


@functools.lru_cache(maxsize=16)
def documents_layout(cu_seqlens: Tuple[int, ...], cls=Documents) -> Layout:
    """The (cached) documents layout of one packed batch: every layer of a model sees the same
    boundaries, so they share one layout and its cached schedules."""
    return cls(cu_seqlens)


#: ``layout="documents"``: the per-batch documents layout (``get_layout("documents")``)
DOCUMENTS = register_layout(PerBatchDocuments(Documents))
register_layout(PerBatchDocuments(DocumentsContiguous))
register_layout(PerBatchDocuments(DocumentsZigzag))


def document_positions(cu_seqlens: Sequence[int], global_positions: torch.Tensor) -> torch.Tensor:
    """Position ids within their document of the tokens at ``global_positions`` (what packed
    batches give rotary embeddings: positions restart at 0 in every document)."""
    starts = torch.tensor(cu_seqlens[:-1], dtype=torch.int64, device=global_positions.device)
    doc = torch.bucketize(global_positions, starts, right=True) - 1
    return global_positions - starts[doc]
