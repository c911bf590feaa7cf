"""How a global sequence is split over the ranks of a ring, as data.

A layout answers two questions and nothing else:

* which global token positions rank ``r`` of ``W`` holds, in local order (``positions``), and
* for ring step ``i`` -- when rank ``r`` holds the K/V shard of rank ``src = (r - i) mod W`` --
  which block tasks ``(q rows, kv rows, causal)`` of local-shard rows must be computed
  (``tasks``). An empty list means the step has nothing to compute.

The ring engine in :mod:`ringseq.ring` executes any such schedule with one forward and one
backward loop, so a new layout is a new subclass of :class:`Layout`, never a new loop: define
``name``, ``_positions`` and ``_tasks`` (and ``multiple`` if needed), pass the instance as
``layout=`` anywhere (or ``register_layout`` it to use its name). Moving tokens
(``shard``/``scatter``) then works by index; override them only for speed.

Built-in layouts (``W`` = world size, ``s`` = global sequence length):

``contiguous``  rank ``r`` holds tokens ``[r*s/W, (r+1)*s/W)``. Causal work is unbalanced
                (rank ``W-1`` does ``W`` blocks, rank 0 one). Needs ``s % W == 0``.
``zigzag``      the sequence is cut into ``2W`` chunks; rank ``r`` holds chunks ``r`` and
                ``2W-1-r``, which balances causal work. Needs ``s % (2W) == 0``.
``stripe``      token ``t`` lives on rank ``t mod W`` (striped attention); causal work is
                balanced to within one diagonal. Needs ``s % W == 0``.

Full (non-causal) attention is permutation invariant, so every layout is valid for it: each
step is one non-causal task over all local rows. ``contiguous`` is the natural choice there
(zigzag and stripe only pay off for causal masks).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ._dist import group_info
from .masks import AttnMask, Run, span_tasks

__all__ = [
    "BlockTask", "Layout", "Contiguous", "Zigzag", "Stripe", "Documents", "DOCUMENTS",
    "document_positions", "documents_layout", "get_layout",
    "register_layout",
    "LAYOUTS", "AttnMask", "shard", "unshard", "positions", "shard_local", "unshard_local",
    "positions_local",
    "layout_name_of_code",
]


@dataclass(frozen=True)
class BlockTask:
    """One attention block: local query rows ``q`` against rows ``kv`` of the K/V shard held.

    ``causal`` uses the kernel's bottom-right alignment: key ``j`` is visible to query ``i``
    iff ``j <= i + len(kv) - len(q)``. With ``spans`` (windows, packed documents: see
    :mod:`ringseq.masks`) the block is a kernel call with those spans, relative to the ``q``
    and ``kv`` rows, and ``causal`` is False.
    """
    q: slice
    kv: slice
    causal: bool
    spans: Optional[tuple] = None


def _stable_code(name: str) -> int:
    """A 31-bit FNV-1a hash of ``name``: the same on every rank and run, pure Python (no
    zlib), so it can be computed anywhere, traced code included."""
    h = 0x811C9DC5
    for byte in name.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h & 0x7FFFFFFF


class Layout:
    """Base class. Subclasses define ``name``, ``_positions`` and ``_tasks`` (and ``multiple``
    when the length must be a multiple of more than ``W``). Everything else -- checks,
    schedules, ``shard`` / ``scatter`` by index -- is generic; built-in layouts override
    ``shard`` / ``scatter`` only to copy slices instead of gathering by index."""

    name: str = "?"

    @property
    def code(self) -> int:
        """A small integer naming this layout in cross-rank checks (stable across ranks)."""
        return _stable_code(self.name)

    def multiple(self, world_size: int) -> int:
        """The global sequence length must be a multiple of this."""
        return world_size

    def check_seqlen(self, seqlen: int, world_size: int) -> int:
        """Returns the local length; raises ValueError if ``seqlen`` cannot be split."""
        m = self.multiple(world_size)
        if seqlen <= 0 or seqlen % m != 0:
            raise ValueError(
                f"layout {self.name!r} with world size {world_size} needs a sequence length that "
                f"is a positive multiple of {m}; got {seqlen} (pad it to "
                f"{max(m, -(-seqlen // m) * m)})")
        return seqlen // world_size

    def check_local_seqlen(self, s_local: int, world_size: int) -> None:
        """Checks a local shard length (what one rank can see before any communication)."""
        multiple = self.multiple(world_size)
        if multiple % world_size:
            raise ValueError(f"layout {self.name!r}: multiple({world_size}) must be a multiple of "
                             f"the world size, got {multiple}")
        m = multiple // world_size
        if s_local <= 0 or s_local % m != 0:
            raise ValueError(
                f"layout {self.name!r} needs local shards whose length is a positive multiple of "
                f"{m} (global length a multiple of {m * world_size}); got a local length of "
                f"{s_local}")

    def positions(self, seqlen: int, world_size: int, rank: int) -> torch.Tensor:
        """Global position ids (int64, shape ``(seqlen // world_size,)``) of rank's tokens."""
        self.check_seqlen(seqlen, world_size)
        _check_rank(rank, world_size)
        return self._positions(seqlen, world_size, rank)

    def tasks(self, rank: int, src: int, world_size: int, s_local: int,
              causal: bool) -> List[BlockTask]:
        """Block tasks for ``rank`` holding the K/V shard of rank ``src``."""
        if not causal:
            # Full attention is permutation invariant: every pair is visible.
            return [BlockTask(slice(0, s_local), slice(0, s_local), False)]
        return self._tasks(rank, src, world_size, s_local)

    def schedule(self, rank: int, world_size: int, s_local: int,
                 causal) -> Tuple[Tuple[BlockTask, ...], ...]:
        """Tasks of every ring step ``i`` (K/V of rank ``(rank - i) % world_size``), cached:
        a layout is data, so the same arguments always give the same (immutable) schedule.
        ``causal`` is a bool or a :class:`ringseq.masks.AttnMask` (windows, documents)."""
        mask = causal if isinstance(causal, AttnMask) else AttnMask(causal=bool(causal))
        key = (rank, world_size, s_local, mask)
        cache = self.__dict__.setdefault("_schedules", {})
        sched = cache.get(key)
        if sched is None:
            if mask.plain:
                sched = tuple(tuple(self.tasks(rank, (rank - i) % world_size, world_size,
                                               s_local, mask.causal)) for i in range(world_size))
            else:
                q_runs = self.runs(s_local * world_size, world_size, rank)
                sched = tuple(tuple(_masked_tasks(q_runs, self.runs(
                    s_local * world_size, world_size, (rank - i) % world_size), mask, s_local))
                    for i in range(world_size))
            cache[key] = sched
        return sched

    def hops(self, world_size: int, s_local: int, causal) -> int:
        """How far K/V must travel: the last ring step with a task on ANY rank (the same on
        every rank). W - 1 for plain causal or full attention; fewer for short windows."""
        key = ("hops", world_size, s_local, causal)
        cache = self.__dict__.setdefault("_schedules", {})
        if key not in cache:
            last = 0
            for r in range(world_size):
                sched = self.schedule(r, world_size, s_local, causal)
                last = max([last] + [i for i, tasks in enumerate(sched) if tasks])
            cache[key] = last
        return cache[key]

    def kv_rows(self, world_size: int, s_local: int, causal):
        """What each rank's K/V block must carry around the ring, under a window or document
        mask: per source rank, the merged ``(start, end)`` intervals of its local rows that a
        task of a later step on another rank reads; None when nothing would be saved (plain
        causal / full attention, or some source is needed whole). Cached; the same on every
        rank. The engine then sends every block compacted to ``max`` of these lengths."""
        mask = causal if isinstance(causal, AttnMask) else AttnMask(causal=bool(causal))
        key = ("kv_rows", world_size, s_local, mask)
        cache = self.__dict__.setdefault("_schedules", {})
        if key not in cache:
            rows = None
            if not mask.plain and world_size > 1:
                need = [[] for _ in range(world_size)]
                for r in range(world_size):
                    sched = self.schedule(r, world_size, s_local, mask)
                    for i in range(1, world_size):
                        src = (r - i) % world_size
                        for t in sched[i]:
                            if t.spans is None:
                                need[src].append((t.kv.start, t.kv.stop))
                            else:
                                for sp in t.spans:
                                    a, b = span_keys(sp)
                                    need[src].append((t.kv.start + sp[2] + a, t.kv.start + sp[2] + b))
                merged = tuple(_merge_intervals(n) for n in need)
                longest = max(sum(b - a for a, b in m) for m in merged)
                if longest < s_local:
                    rows = merged
            cache[key] = rows
        return cache[key]

    def runs(self, seqlen: int, world_size: int, rank: int) -> Tuple[Run, ...]:
        """Rank's local rows as maximal runs of evenly spaced global positions (generic:
        compressed from ``positions``; built-in layouts say it directly)."""
        pos = self.positions(seqlen, world_size, rank).tolist()
        runs, a = [], 0
        while a < len(pos):
            b = a + 1
            stride = pos[b] - pos[a] if b < len(pos) else 1
            if stride <= 0:
                stride = 1
            while b < len(pos) and pos[b] - pos[b - 1] == stride:
                b += 1
            if b - a == 1:
                stride = 1
            runs.append(Run(a, b - a, pos[a], stride))
            a = b
        return tuple(runs)

    # -- moving tokens ---------------------------------------------------------------------
    def shard(self, x: torch.Tensor, world_size: int, rank: int, dim: int) -> torch.Tensor:
        """Rank's tokens of the full ``x`` along ``dim`` (a new contiguous tensor, in local
        order). Generic: gathers ``positions`` by index; ``dim`` is non-negative here."""
        idx = self.positions(x.shape[dim], world_size, rank).to(x.device)
        return x.index_select(dim, idx)

    def scatter(self, full: torch.Tensor, part: torch.Tensor, world_size: int, rank: int,
                dim: int) -> None:
        """Writes rank's shard ``part`` back into its places in ``full`` (inverse of
        :meth:`shard`)."""
        idx = self.positions(full.shape[dim], world_size, rank).to(full.device)
        full.index_copy_(dim, idx, part)

    def _positions(self, seqlen, world_size, rank):  # pragma: no cover - abstract
        raise NotImplementedError

    def _tasks(self, rank, src, world_size, s_local):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self):
        return f"Layout({self.name!r})"


class Contiguous(Layout):
    name = "contiguous"

    def _positions(self, seqlen, world_size, rank):
        n = seqlen // world_size
        return torch.arange(rank * n, (rank + 1) * n)

    def runs(self, seqlen, world_size, rank):
        n = seqlen // world_size
        return (Run(0, n, rank * n, 1),)

    def shard(self, x, world_size, rank, dim):
        n = self.check_seqlen(x.shape[dim], world_size)
        _check_rank(rank, world_size)
        return x.narrow(dim, rank * n, n).clone(memory_format=torch.contiguous_format)

    def scatter(self, full, part, world_size, rank, dim):
        n = full.shape[dim] // world_size
        full.narrow(dim, rank * n, n).copy_(part)

    def _tasks(self, rank, src, world_size, s_local):
        if src == rank:
            return [BlockTask(slice(0, s_local), slice(0, s_local), True)]
        if src < rank:  # an earlier chunk: fully visible
            return [BlockTask(slice(0, s_local), slice(0, s_local), False)]
        return []  # a later chunk: masked out entirely


class Zigzag(Layout):
    name = "zigzag"

    def multiple(self, world_size):
        return 2 * world_size

    def _positions(self, seqlen, world_size, rank):
        c = seqlen // (2 * world_size)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * world_size - 1 - rank) * c,
                                       (2 * world_size - rank) * c)])

    def runs(self, seqlen, world_size, rank):
        c = seqlen // (2 * world_size)
        return (Run(0, c, rank * c, 1), Run(c, c, (2 * world_size - 1 - rank) * c, 1))

    def shard(self, x, world_size, rank, dim):
        c = self.check_seqlen(x.shape[dim], world_size) // 2
        _check_rank(rank, world_size)
        return torch.cat([x.narrow(dim, rank * c, c),
                          x.narrow(dim, (2 * world_size - 1 - rank) * c, c)], dim=dim)

    def scatter(self, full, part, world_size, rank, dim):
        c = full.shape[dim] // (2 * world_size)
        full.narrow(dim, rank * c, c).copy_(part.narrow(dim, 0, c))
        full.narrow(dim, (2 * world_size - 1 - rank) * c, c).copy_(part.narrow(dim, c, c))

    def _tasks(self, rank, src, world_size, s_local):
        half = s_local // 2
        if src == rank:
            # Local order is increasing in global position on both sides, so the plain causal
            # mask over the concatenated chunks is exact.
            return [BlockTask(slice(0, s_local), slice(0, s_local), True)]
        if src < rank:
            # kv chunk src precedes both q chunks; kv chunk 2W-1-src follows both.
            return [BlockTask(slice(0, s_local), slice(0, half), False)]
        # src > rank: both kv chunks lie between q chunk `rank` and q chunk 2W-1-rank.
        return [BlockTask(slice(half, s_local), slice(0, s_local), False)]


class Stripe(Layout):
    name = "stripe"

    def _positions(self, seqlen, world_size, rank):
        return torch.arange(rank, seqlen, world_size)

    def runs(self, seqlen, world_size, rank):
        return (Run(0, seqlen // world_size, rank, world_size),)

    def _tasks(self, rank, src, world_size, s_local):
        # Local row a is global token rank + W*a; kv row b is src + W*b.
        if src <= rank:  # visible iff b <= a
            return [BlockTask(slice(0, s_local), slice(0, s_local), True)]
        # src > rank: visible iff b <= a - 1. With kv rows [0, s_local - 1) the bottom-right
        # aligned mask is exactly that (query row 0 sees nothing: lse -inf, out 0).
        if s_local == 1:
            return []
        return [BlockTask(slice(0, s_local), slice(0, s_local - 1), True)]


def span_keys(span) -> Tuple[int, int]:
    """The keys ``[a, b)`` (relative to the span's first kv row) that some query of the span
    ``(q_start, q_len, k_start, k_len, band_lo, band_hi)`` sees: ``j`` with
    ``band_lo <= j - i <= band_hi`` for some ``0 <= i < q_len``; (0, 0) when none."""
    _, nq, _, nk, lo, hi = span
    a, b = max(0, lo), min(nk, nq - 1 + hi + 1)
    return (a, b) if nq > 0 and a < b else (0, 0)


def _merge_intervals(intervals) -> Tuple[Tuple[int, int], ...]:
    """Sorted, merged (adjacent or overlapping joined) non-empty half-open intervals."""
    out: List[List[int]] = []
    for a, b in sorted(x for x in intervals if x[1] > x[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _masked_tasks(q_runs, k_runs, mask: AttnMask, s_local: int) -> List[BlockTask]:
    """Block tasks of one ring step under a window/document mask (see ringseq.masks). A batch
    of one span that is a plain dense or causal block becomes that simple task, so kernels
    without span support (and their fast paths) still serve it."""
    tasks = []
    for batch in span_tasks(q_runs, k_runs, mask):
        if len(batch) == 1:
            q0, nq, k0, nk, lo, hi = batch[0]
            q, kv = slice(q0, q0 + nq), slice(k0, k0 + nk)
            if lo <= -(nq - 1) and hi >= nk - 1:
                tasks.append(BlockTask(q, kv, False))
                continue
            if lo <= -(nq - 1) and hi == nk - nq:
                tasks.append(BlockTask(q, kv, True))
                continue
        whole = slice(0, s_local)
        tasks.append(BlockTask(whole, whole, False, spans=tuple(batch)))
    return tasks


LAYOUTS: Dict[str, Layout] = {}


def register_layout(layout: Layout) -> Layout:
    """Makes a layout available by name to every function taking ``layout=``."""
    LAYOUTS[layout.name] = layout
    return layout


for _l in (Contiguous(), Zigzag(), Stripe()):
    register_layout(_l)


def get_layout(layout: Union[str, Layout]) -> Layout:
    """Returns a :class:`Layout` for a name or passes a Layout through; ValueError otherwise."""
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, str) and layout in LAYOUTS:
        return LAYOUTS[layout]
    raise ValueError(f"unknown layout {layout!r}; expected one of {sorted(LAYOUTS)} or a "
                     f"ringseq.layouts.Layout instance")


def layout_name_of_code(code: int) -> str:
    """The registered layout name whose :attr:`Layout.code` is ``code`` (for messages)."""
    for name, lay in LAYOUTS.items():
        if lay.code == code:
            return repr(name)
    return f"layout #{code}"


def _check_rank(rank, world_size):
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")


def positions_local(seqlen: int, layout, world_size: int, rank: int,
                    device=None) -> torch.Tensor:
    """Like :func:`positions` for an explicit ``(world_size, rank)`` (no process group)."""
    return get_layout(layout).positions(seqlen, world_size, rank).to(device)


def shard_local(x: torch.Tensor, layout, world_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Like :func:`shard` for an explicit ``(world_size, rank)`` (no process group)."""
    lay = get_layout(layout)
    dim = dim % x.dim()
    lay.check_seqlen(x.shape[dim], world_size)
    _check_rank(rank, world_size)
    if world_size == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return lay.shard(x, world_size, rank, dim)


def shard(x: torch.Tensor, layout="contiguous", group=None, dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor ``x`` (same on every rank) along ``dim``.

    Args:
        x: any tensor whose ``dim`` is the global sequence (e.g. (b, s, h, d) tokens,
            (b, s) position ids or labels).
        layout: ``"contiguous"``, ``"zigzag"``, ``"stripe"`` or a :class:`Layout`.
        group: process group (None: default group; world size 1 without one).
        dim: the sequence dimension.

    Returns a new contiguous tensor with ``x.shape[dim] // W`` rows along ``dim`` (autograd
    flows back into ``x``). Raises ValueError, without communicating, when the length is not a
    multiple of what the layout needs (``W``; ``2W`` for zigzag).
    """
    world_size, rank = group_info(group)
    return shard_local(x, layout, world_size, rank, dim)


def positions(seqlen: int, layout="contiguous", group=None, device=None) -> torch.Tensor:
    """Global position ids (int64, ``(seqlen // W,)``) of this rank's tokens under ``layout``.

    Shard position ids with this (or ``shard(position_ids, layout)``) so rotary embeddings see
    the true positions. Raises ValueError when ``seqlen`` cannot be split.
    """
    world_size, rank = group_info(group)
    return positions_local(seqlen, layout, world_size, rank, device)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lay, group, world_size, rank, dim):
        ctx.lay, ctx.group, ctx.world_size, ctx.rank, ctx.dim = lay, group, world_size, rank, dim
        xc = x.contiguous()
        parts = [torch.empty_like(xc) for _ in range(world_size)]
        dist.all_gather(parts, xc, group=group)
        seqlen = x.shape[dim] * world_size
        shape = list(x.shape)
        shape[dim] = seqlen
        full = x.new_empty(shape)
        for r, part in enumerate(parts):
            lay.scatter(full, part, world_size, r, dim)
        return full

    @staticmethod
    def backward(ctx, grad):
        # Each rank's output depends on every rank's input: the gradient of a shard is the
        # sum over ranks of their gradient for it (gloo has no reduce_scatter, so all_reduce).
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return shard_local(g, ctx.lay, ctx.world_size, ctx.rank, ctx.dim), None, None, None, None, None


def unshard_local(parts, layout, dim: int = 1) -> torch.Tensor:
    """Reassembles the full tensor from every rank's shard (list in rank order), no comm."""
    lay = get_layout(layout)
    world_size = len(parts)
    dim = dim % parts[0].dim()
    shape = list(parts[0].shape)
    shape[dim] *= world_size
    full = parts[0].new_empty(shape)
    for r, part in enumerate(parts):
        lay.scatter(full, part, world_size, r, dim)
    return full


def unshard(x_local: torch.Tensor, layout="contiguous", group=None, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: all-gathers the shards of ``group`` into the full tensor.

    Every rank must pass a shard of the same shape. Differentiable: the gradient of the local
    shard is the sum over ranks of each rank's gradient for that shard (so when every rank
    computes the same loss on the result, scale it by 1/W). Without an initialized process
    group (world size 1) it returns ``x_local`` unchanged.
    """
    lay = get_layout(layout)
    world_size, rank = group_info(group)
    dim = dim % x_local.dim()
    if world_size == 1:
        return x_local
    lay.check_local_seqlen(x_local.shape[dim], world_size)
    return _Unshard.apply(x_local, lay, group, world_size, rank, dim)


class Documents(Layout):
    """Packed documents split for balanced causal work without any divisibility demand.

    A document of the packed sequence (boundaries ``cu_seqlens = (0, ..., total)``) is either
    split or kept whole. A split document is cut into ``2W`` pieces and rank ``r`` holds pieces
    ``r`` and ``2W-1-r`` of it (the zigzag of each document), so its causal work is the same on
    every rank: a document of length ``L`` has ``L // 2W`` tokens in each piece, its ``L % 2W``
    remaining tokens dealt round-robin over the ranks. A whole document goes to one rank:
    longest first, each to the least loaded rank with room left, and one that fits nowhere is
    cut over the ranks' remaining room, so every rank holds exactly ``total / W`` tokens.

    Which documents are split: the fewest longest ones such that the estimated causal work
    (visible pairs) of the busiest rank is within ``BALANCE`` of the mean (documents shorter
    than 2W tokens are never split). Whole documents run as long spans with no partial tiles
    from cutting; short ones are split only when few documents must fill many ranks.
    Needs only ``total % W == 0`` (any document lengths, 1 included). Local order is
    increasing in global position.

    ``cu_seqlens`` is part of the layout (ranks passing different boundaries raise
    RingMismatchError); attention with this layout is always restricted to documents.
    """

    name = "documents"
    BALANCE = 1.02  # accepted max / mean of the estimated causal work per rank

    def __init__(self, cu_seqlens):
        cu = tuple(int(c) for c in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist")
                                     else cu_seqlens))
        AttnMask(cu_seqlens=cu)  # validates: starts at 0, never decreases
        self.cu_seqlens = cu
        self._pieces = {}

    @property
    def code(self) -> int:
        return _stable_code(f"{self.name}{self.cu_seqlens}")

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

    def runs(self, seqlen, world_size, rank):
        self.check_seqlen(seqlen, world_size)
        runs, local = [], 0
        for start, n in self._layout(world_size)[rank]:
            runs.append(Run(local, n, start, 1))
            local += n
        return tuple(runs)

    def _positions(self, seqlen, world_size, rank):
        runs = self.runs(seqlen, world_size, rank)
        if not runs:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(r.start, r.start + r.length) for r in runs])

    def _tasks(self, rank, src, world_size, s_local):  # pragma: no cover - always masked
        raise RuntimeError("layout 'documents' schedules only through a document mask")

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

    def __repr__(self):
        return f"Documents({len(self.cu_seqlens) - 1} documents, {self.cu_seqlens[-1]} tokens)"


#: ``layout="documents"`` in shard_batch / apply / the plugin: each packed batch is split with
#: ``Documents(its cu_seqlens)``
DOCUMENTS = "documents"


@functools.lru_cache(maxsize=16)
def documents_layout(cu_seqlens: Tuple[int, ...]) -> Documents:
    """The (cached) :class:`Documents` layout of one packed batch: every layer of a model sees
    the same boundaries, so they share one layout and its cached schedules."""
    return Documents(cu_seqlens)


def document_positions(cu_seqlens: Sequence[int], global_positions: torch.Tensor) -> torch.Tensor:
    """Position ids within their document of the tokens at ``global_positions`` (what packed
    batches give rotary embeddings: positions restart at 0 in every document)."""
    starts = torch.tensor(cu_seqlens[:-1], dtype=torch.int64, device=global_positions.device)
    doc = torch.bucketize(global_positions, starts, right=True) - 1
    return global_positions - starts[doc]
