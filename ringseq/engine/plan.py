"""The plan of one ring-attention call: what each ring step computes, derived once.

:func:`make_plan` turns an :class:`ringseq.spec.AttnSpec` (the call's validated options), a
layout and the ring's size and rank into a :class:`RingPlan`: this rank's block schedule,
how far K/V travel, which rows travel and the kernel spans of every task, plus the call's
cross-rank signature. It checks nothing (the entry point validated) and is cached: the
forward and the backward of a call, and every later call of the same shape, share one plan.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..kernels.spans import as_spans_tensor
from .integrity import operation_field
from ..layouts import BlockTask, Layout, layout_field, span_keys
from ..layouts.base import values_key
from ..spec import AttnSpec, check_user_layout

__all__ = ["PlannedTask", "RingPlan", "make_plan"]


@dataclass(frozen=True)
class PlannedTask:
    """One kernel call of a ring step: local query rows ``q`` against rows ``kv`` of the K/V
    block held, bottom-right ``causal``, or the kernel ``spans`` (an int64 (n, 6) tensor,
    relative to those rows; then ``causal`` is False). ``kernel``: the block kernel of this
    task when it is not the spec's backend (the double ring's outer steps run a lap of the
    inner ring, :mod:`ringseq.parallel.double_ring`)."""

    q: slice
    kv: slice
    causal: bool
    spans: Optional[torch.Tensor] = None
    kernel: Optional[object] = None


@dataclass(frozen=True)
class RingPlan:
    """What a ring call runs on this rank, besides its tensors.

    Attributes:
        spec: the call's options (scale, mask, softcap, backend, dtypes).
        layout: how the global sequence is split (a :class:`ringseq.layouts.Layout`).
        world_size, rank: the ring.
        schedule: this rank's kernel calls per ring step (step ``i`` holds the K/V of rank
            ``(rank - i) % world_size``).
        hops: how far K/V travel (the last step with a task on any rank; W - 1 unless a
            window or documents make later steps empty everywhere).
        signature: ``(name, value[, kind])`` fields every rank must agree on, compared by the
            begin collective of each call (:mod:`ringseq.engine.integrity`).
        kv_rows: per source rank, the ``(start, end)`` intervals of its local K/V rows that
            travel (``layout.kv_rows``: windows and documents need only part of a shard
            remotely), or None: every row travels. With it, every K/V block and dK/dV
            accumulator moves compacted to ``kv_len`` rows and the tasks of steps >= 1 in
            ``schedule`` index those compacted rows.
        kv_len: rows of a travelling block (the longest ``kv_rows`` entry; the local length
            when ``kv_rows`` is None).
        comm_kind: the label of its exchanges in byte counters (:mod:`ringseq.engine.counting`).
    """

    spec: AttnSpec
    layout: Layout
    world_size: int
    rank: int
    schedule: Tuple[Tuple[PlannedTask, ...], ...]
    hops: int
    signature: Tuple[tuple, ...]
    kv_rows: Optional[Tuple[Tuple[Tuple[int, int], ...], ...]] = None
    kv_len: int = 0
    comm_kind: str = "ring"

    @property
    def softmax_scale(self) -> float:
        return self.spec.softmax_scale

    @property
    def backend(self):
        return self.spec.backend

    @property
    def grad_comm_dtype(self) -> torch.dtype:
        return self.spec.grad_comm_dtype

    @property
    def softcap(self) -> float:
        return self.spec.softcap

    def kernel_kwargs(self, task: PlannedTask) -> dict:
        """The mask arguments of a block kernel call for ``task`` (none for plain blocks)."""
        kw = {}
        if task.spans is not None:
            kw["spans"] = task.spans
        if self.spec.softcap:
            kw["softcap"] = self.spec.softcap
        return kw

    def _travelling(self, src: int):
        """(local start, local end, compacted start) of every row interval rank ``src``'s
        block carries."""
        at = 0
        for a, b in self.kv_rows[src]:
            yield a, b, at
            at += b - a

    def pack_rows(self, x: torch.Tensor, out: torch.Tensor, src: Optional[int] = None) -> None:
        """Writes the rows of rank ``src``'s (default: this rank's) shard ``x`` (b, s_local, h,
        d) that travel into the first rows of ``out`` (b, kv_len, h, d), in order, and zeros
        after them (all rows, without ``kv_rows``)."""
        if self.kv_rows is None:
            out.copy_(x)
            return
        end = 0
        for a, b, at in self._travelling(self.rank if src is None else src):
            out[:, at:at + b - a].copy_(x[:, a:b])
            end = at + b - a
        # Blocks of other ranks may carry more rows; the rest of ours must hold numbers (the
        # buffers are reused), since a dense kernel multiplies masked rows by zero.
        out[:, end:].zero_()

    def carried(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """What the block of rank ``src`` carries of its (b, s_local, h, d) shard ``x``: a new
        (b, kv_len, h, d) tensor (``x`` itself without kv_rows)."""
        if self.kv_rows is None:
            return x
        out = x.new_empty((x.shape[0], self.kv_len, *x.shape[2:]))
        self.pack_rows(x, out, src)
        return out

    def add_home_rows(self, full: torch.Tensor, block: torch.Tensor) -> None:
        """``full`` (b, s_local, h, d) += this rank's travelled rows of ``block`` (b, kv_len,
        h, d), at their local places (the inverse of :meth:`pack_rows`)."""
        if self.kv_rows is None:
            full.add_(block)
            return
        for a, b, at in self._travelling(self.rank):
            full[:, a:b].add_(block[:, at:at + b - a])


def make_plan(spec: AttnSpec, layout: Layout, world_size: int, rank: int,
              q_shape: Tuple[int, ...], nheads_kv: int, dtype: torch.dtype,
              comm_kind: str = "ring") -> RingPlan:
    """The (cached) plan of a ring call with ``spec`` on shards of shape ``q_shape`` (b,
    s_local, h, d) with ``nheads_kv`` K/V heads of ``dtype``, placed by ``layout`` (already
    bound to the call's documents) on rank ``rank`` of ``world_size``. Checks only a user's
    layout, whose schedule it takes (:func:`ringseq.spec.check_user_layout`: ValueError or
    NotImplementedError naming ``spec.fn``): here, where every ring call plans at run time,
    also under torch.compile, whose trace of the checks broke the graph."""
    # (keyed by a user's layout's values too: one edited after a call is planned, and compared
    # across ranks, by its new values; its object alone hashes by identity)
    return _make_plan(spec, layout, values_key(layout), world_size, rank, tuple(q_shape),
                      nheads_kv, dtype, comm_kind)


@functools.lru_cache(maxsize=128)
def _make_plan(spec, layout, layout_values, world_size, rank, q_shape, nheads_kv, dtype,
               comm_kind):
    b, s, h, d = q_shape
    check_user_layout(spec, layout, world_size, s)  # (cached with the plan)
    mask = spec.mask
    layout_mask = mask if not mask.plain else mask.causal
    sched = layout.schedule(rank, world_size, s, layout_mask)
    hops = layout.hops(world_size, s, layout_mask)
    kv_rows = layout.kv_rows(world_size, s, layout_mask) if hops > 0 else None  # nothing
    kv_len = s                                                              # travels at 0 hops
    if kv_rows is not None:
        kv_len = max(sum(e - a for a, e in m) for m in kv_rows)
        sched = compact_schedule(sched, rank, world_size, kv_rows, kv_len)
    schedule = tuple(tuple(PlannedTask(t.q, t.kv, t.causal, as_spans_tensor(t.spans))
                           for t in step) for step in sched)
    signature = (operation_field("ring attention"),) + spec.signature(
        q_shape, nheads_kv, dtype, extra=(layout_field("layout", layout),
                                          ("world size", world_size)))
    return RingPlan(spec=spec, layout=layout, world_size=world_size, rank=rank,
                    schedule=schedule, hops=hops, signature=signature, kv_rows=kv_rows,
                    kv_len=kv_len, comm_kind=comm_kind)


_COMPACT_CACHE: dict = {}


def compact_schedule(schedule, rank: int, world_size: int, kv_rows, kv_len: int):
    """``schedule`` with the tasks of every step ``i >= 1`` moved to the compacted rows of
    their source ``(rank - i) % world_size`` (``kv_rows``): a plain task's kv slice and a
    span's first kv row are mapped; every row a task reads travels, and rows that are
    contiguous locally stay contiguous compacted (``kv_rows`` merges touching intervals).
    Cached (schedules are immutable)."""
    key = (id(schedule), rank, world_size, kv_rows)
    hit = _COMPACT_CACHE.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]

    def mapper(intervals):
        starts, at = [], 0
        for a, b in intervals:
            starts.append((a, b, at))
            at += b - a

        def where(x, n):  # compacted index of local row x, for n rows that must all travel
            if n <= 0:
                return 0
            for a, b, off in starts:
                if a <= x and x + n <= b:
                    return off + x - a
            raise AssertionError(f"rows [{x}, {x + n}) do not travel")  # kv_rows covers them
        return where

    out = [schedule[0]]
    for i in range(1, len(schedule)):
        where = mapper(kv_rows[(rank - i) % world_size])
        tasks = []
        for t in schedule[i]:
            if t.spans is None:
                a = where(t.kv.start, t.kv.stop - t.kv.start)
                tasks.append(BlockTask(t.q, slice(a, a + t.kv.stop - t.kv.start), t.causal))
            else:
                # each span trimmed to the keys it sees (the rows that travel), its band
                # shifted with its first key
                spans = []
                for sp in t.spans:
                    q0, nq, k0, nk, lo, hi = sp
                    a, b = span_keys(sp)
                    if b > a:
                        spans.append((q0, nq, where(t.kv.start + k0 + a, b - a), b - a,
                                      lo - a, hi - a))
                if spans:
                    tasks.append(BlockTask(t.q, slice(0, kv_len), False, spans=tuple(spans)))
        out.append(tuple(tasks))
    result = tuple(out)
    if len(_COMPACT_CACHE) > 256:
        _COMPACT_CACHE.clear()
    _COMPACT_CACHE[key] = (schedule, result)
    return result
