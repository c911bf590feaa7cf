"""Sequence-parallel groups: which ranks form the Ulysses, ring and inner-ring groups, and how
the data is split over them (used by :mod:`ringseq.parallel.usp`).

A sequence-parallel group of ``W = U * R`` ranks is a 2-D grid: ``U`` = Ulysses degree
(all-to-all groups), ``R`` = ring degree (ring groups). Rank ``(g, u)`` is ring rank ``g`` of
its ring group and Ulysses rank ``u`` of its Ulysses group. Optionally the ring itself is a
double ring: ``R = O * I`` with inner rings of ``inner_ring_size = I`` consecutive ring ranks
(:mod:`ringseq.parallel.double_ring`).

Sharding rule (the data layout, :class:`SequenceParallelLayout`): the global sequence is split
over the ring dimension by the ring ``layout`` (contiguous, zigzag, stripe or any Layout) into
``R`` parts -- part ``g`` in the layout's local order -- and part ``g`` is split CONTIGUOUSLY
over the ``U`` Ulysses ranks: rank ``(g, u)`` holds tokens ``[u * n, (u + 1) * n)`` of part
``g`` (``n = s / (R U)``). The all-to-all over a Ulysses group thus reassembles exactly ring part
``g`` (for ``h / U`` heads), on which the ring engine runs the layout's schedule at world size
``R``: causal masks follow global positions for every layout. Pure Ulysses (``R = 1``) is a
contiguous split; pure ring (``U = 1``) is the layout itself.

Placement (which global ranks form which groups): with ``ulysses_inner=True`` (default) the
``U`` ranks of a Ulysses group are consecutive global ranks (intra-node: the all-to-all uses
the fast links, the ring crosses nodes); ``ulysses_inner=False`` puts the ring inside. Group
ranks follow global ranks (what ``torch.distributed.new_group`` does).

The K/V that travel the ring are the Ulysses head shards: ``h_kv * rep / U`` heads instead of
``h_kv`` (``rep`` per :mod:`ringseq.parallel.ulysses`'s head rule) of a ring part of ``s / R`` tokens, i.e.
``rep / U`` of what a ring of ``R`` over the same parts would move per step -- the block of the
plain ring of ``W`` (times ``rep``), for ``R - 1`` steps instead of ``W - 1``
(docs/sp_modes.md has the bytes of every mode).

    sp = ringseq.make_sp_groups(ulysses_size=2)                   # W = 2 x (W / 2), collective
    q = sp.shard(torch_full_q, "zigzag")                          # (b, s / W, h, d)
    out = ringseq.usp_attn_func(q, k, v, causal=True, sp=sp, layout="zigzag")
    batch = sp.shard_batch({"input_ids": ids, "labels": ids}, "zigzag")

This module: the sizes (:func:`resolve_sp_sizes`, :func:`check_model_heads`) and the groups
(:class:`SequenceParallelGroups`, :func:`make_sp_groups`). Attention on them:
:mod:`.usp`; the data layout: :mod:`.sp_layout`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._args import as_int, int_if_integer, is_bool, shown_divisors
from .._dist import (RingMismatchError, agree_on_fields, group_info, is_initialized,
                     with_message)
from .._hash import stable_hash_ints
from ..data import shard_batch
from ..layouts import Layout, PerBatchDocuments, get_layout, positions_local, shard_local
from .sp_layout import SequenceParallelLayout, ring_layout
from .ulysses import ulysses_heads, valid_ulysses_degrees

__all__ = ["SP_MODES", "SequenceParallelGroups", "check_model_heads", "check_sp_mode",
           "make_sp_groups", "resolve_sp_sizes", "sp_groups_from_tables"]


SP_MODES = ("ring", "ulysses", "hybrid")


def check_sp_mode(sp_mode, fn: str = "check_sp_mode") -> None:
    """ValueError unless ``sp_mode`` is one of :data:`SP_MODES`; the message starts with ``fn``
    (empty: the caller puts its own name in front)."""
    if sp_mode not in SP_MODES:
        raise ValueError(f"{fn + ': ' if fn else ''}sp_mode must be one of {list(SP_MODES)}, "
                         f"got {sp_mode!r}")


def resolve_sp_sizes(sp_mode: str, sp_size: int, ulysses_size: Optional[int] = None,
                     inner_ring_size: Optional[int] = None, fn: str = "resolve_sp_sizes"
                     ) -> Tuple[int, int, int]:
    """``(U, R, I)`` for a mode on ``sp_size`` ranks (``I = R``: no double ring).

    ``"ring"``: U = 1; ``"ulysses"``: U = sp_size (``ulysses_size`` None or equal), R = 1;
    ``"hybrid"``: ``ulysses_size`` required, dividing ``sp_size``, R = sp_size / U.
    ``inner_ring_size`` (ring and hybrid): must divide R. Raises ValueError naming the argument,
    the value and the values that would work, after ``fn``: the function the user called (empty:
    the caller puts its own name in front); nothing communicates.
    """
    pre = f"{fn}: " if fn else ""
    check_sp_mode(sp_mode, fn)
    # (NumPy's integers are sizes too)
    sp_size, ulysses_size, inner_ring_size = map(int_if_integer,
                                                 (sp_size, ulysses_size, inner_ring_size))
    # (True == 1 and 4.0 == 4 passed the comparisons below)
    _check_sizes(pre, sp_size=sp_size, ulysses_size=(ulysses_size, None),
                 inner_ring_size=(inner_ring_size, None))
    if sp_mode == "ring":
        if ulysses_size not in (None, 1):
            raise ValueError(f"{pre}sp_mode='ring' has no Ulysses dimension, got ulysses_size="
                             f"{ulysses_size!r}; use sp_mode='hybrid' (or 'ulysses')")
        U = 1
    elif sp_mode == "ulysses":
        if ulysses_size not in (None, sp_size):
            raise ValueError(f"{pre}sp_mode='ulysses' uses all {sp_size} sequence-parallel "
                             f"ranks for the all-to-all, got ulysses_size={ulysses_size!r}; use "
                             f"sp_mode='hybrid' for a Ulysses x ring split")
        if inner_ring_size not in (None, 1):
            raise ValueError(f"{pre}sp_mode='ulysses' has no ring, got inner_ring_size="
                             f"{inner_ring_size!r}")
        U = sp_size
    else:
        if ulysses_size is None:
            raise ValueError(f"{pre}sp_mode='hybrid' needs ulysses_size (one of "
                             f"{shown_divisors(sp_size)}, dividing sp_size={sp_size})")
        if sp_size % ulysses_size:
            raise ValueError(f"{pre}ulysses_size={ulysses_size!r} does not divide "
                             f"sp_size={sp_size}; the sequence-parallel group is ulysses_size x "
                             f"ring size, so ulysses_size must be one of {shown_divisors(sp_size)}")
        U = ulysses_size
    R = sp_size // U
    if inner_ring_size is None:
        I = R
    else:
        if isinstance(inner_ring_size, bool) or not isinstance(inner_ring_size, int) \
                or inner_ring_size < 1:
            raise ValueError(f"{pre}inner_ring_size must be a positive integer or None, got "
                             f"{inner_ring_size!r}")
        if R % inner_ring_size:
            raise ValueError(f"{pre}inner_ring_size={inner_ring_size!r} does not divide the ring "
                             f"size {R} (sp_size {sp_size} / ulysses_size {U}); the ring is "
                             f"outer x inner rings, so inner_ring_size must be one of "
                             f"{shown_divisors(R)}")
        I = inner_ring_size
    return U, R, I


def check_model_heads(nheads: int, nheads_kv: int, ulysses_size: int,
                      sp_size: Optional[int] = None, fn: str = "check_model_heads") -> None:
    """Raises ValueError when a model's ``nheads`` query heads (``nheads_kv`` K/V heads) cannot
    be split over ``ulysses_size`` ranks (a positive int), naming the Ulysses sizes that would
    work (those that also divide ``sp_size`` when given); messages start with ``fn``, the
    caller's name. Nothing communicates."""
    ulysses_size = int_if_integer(ulysses_size)  # (NumPy's integers are sizes too)
    _check_sizes(f"{fn}: ", ulysses_size=ulysses_size)
    if nheads % ulysses_size:
        raise ValueError(
            f"{fn}: num_attention_heads={nheads} cannot be split over "
            f"ulysses_size={ulysses_size}: each "
            f"rank of the all-to-all takes num_attention_heads / ulysses_size query heads; "
            f"ulysses_size values that divide num_attention_heads={nheads}"
            + (f" and the sequence-parallel size {sp_size}" if sp_size is not None else "")
            + f": {valid_ulysses_degrees(nheads, sp_size)}")
    ulysses_heads(nheads, nheads_kv, ulysses_size, what="num_attention_heads",
                  fn=fn, what_kv="num_key_value_heads")


@dataclass(eq=False)
class SequenceParallelGroups:
    """The process groups of a (ring ``R`` × Ulysses ``U``) sequence-parallel group, from this
    rank (build with :func:`make_sp_groups`; the plugin builds one from its mesh).

    Attributes:
        group: the whole group (``R * U`` ranks; None without torch.distributed). Shard data
            over it with :meth:`data_layout` (or :meth:`shard` / :meth:`shard_batch`).
        size, rank: of ``group``.
        ulysses_size, ulysses_rank, ulysses_group: the all-to-all group (None when size 1).
        ring_size, ring_rank, ring_group: the ring (None when size 1).
        inner_ring_size: ``I``; ``1 < I < R`` makes the ring a double ring over
            ``inner_group`` (``I`` consecutive ring ranks) and ``outer_group`` (ring ranks
            ``j, j + I, ...``); otherwise both are None.
        ulysses_inner: whether Ulysses groups are the consecutive global ranks.
        coords: ``(ring rank, Ulysses rank)`` of every rank of ``group``, in its rank order.
    """

    group: Any
    size: int
    rank: int
    ulysses_size: int
    ulysses_rank: int
    ulysses_group: Any
    ring_size: int
    ring_rank: int
    ring_group: Any
    inner_ring_size: int
    inner_group: Any
    outer_group: Any
    ulysses_inner: bool
    coords: Tuple[Tuple[int, int], ...]

    @property
    def mode(self) -> str:
        """``"ring"`` (U = 1), ``"ulysses"`` (R = 1) or ``"hybrid"``."""
        if self.ulysses_size == 1:
            return "ring"
        return "ulysses" if self.ring_size == 1 else "hybrid"

    @property
    def double_ring(self) -> bool:
        return 1 < self.inner_ring_size < self.ring_size

    def data_layout(self, layout="zigzag") -> Layout:
        """The layout of the tokens over :attr:`group` for ring layout ``layout`` (the layout
        itself when U = 1, else a :class:`SequenceParallelLayout`; with R = 1 the ring layout
        does not apply and the split is contiguous, but a ``Documents(cu_seqlens)`` layout's
        boundaries still stop the positions and targets of ``shard_batch``, and a per-batch
        documents layout (``"documents"``, ``"documents_zigzag"``, ...) still makes it take
        each batch's boundaries and refuse rows without them). ValueError for an unknown
        layout."""
        if isinstance(layout, SequenceParallelLayout) and layout.coords == self.coords and \
                (layout.ring_size, layout.ulysses_size) == (self.ring_size, self.ulysses_size):
            return layout  # (this group's data layout already: plugin.data_layout, say)
        lay = ring_layout(layout, self.ring_size, "data_layout")
        # (a ring of one splits contiguously; a Documents layout's boundaries still stop the
        # positions and targets: shard_batch reads them from the layout)
        docs = getattr(get_layout(layout), "documents", None)
        if self.ulysses_size == 1:
            # (a group of one: the Documents layout itself, which keeps every token in place)
            return lay if docs is None else get_layout(layout)
        # (before: under Ulysses alone shard_batch saw the contiguous split only: a one-row
        # batch without boundaries got none, which usp_attn_func then asked for, and unpacked
        # rows were taken)
        user = get_layout(layout)
        per_batch = user.name if isinstance(user, PerBatchDocuments) and lay is not user \
            else None
        key = (id(lay), lay.name, docs, per_batch)
        cache = self.__dict__.setdefault("_layouts", {})
        hit = cache.get(key)
        if hit is None or hit.base is not lay:
            if len(cache) > 16:  # (a Documents layout per batch would grow it without end)
                cache.clear()
            hit = SequenceParallelLayout(lay, self.ring_size, self.ulysses_size, self.coords,
                                         docs, per_batch)
            cache[key] = hit
        return hit

    def _data_layout_for(self, fn: str, layout) -> Layout:
        """:meth:`data_layout`, its refusal named for ``fn``, the method the user called."""
        try:
            return self.data_layout(layout)
        except (TypeError, ValueError) as exc:
            text = str(exc)
            text = text[len("data_layout: "):] if text.startswith("data_layout: ") else text
            raise with_message(exc, f"{fn}: {text}") from None

    def shard(self, x: torch.Tensor, layout="zigzag", dim: int = 1) -> torch.Tensor:
        """This rank's tokens of the full ``x`` along ``dim`` (ValueError for a length the
        split cannot take, before any communication)."""
        return shard_local(x, self._data_layout_for("shard", layout), self.size, self.rank, dim,
                           fn="shard")

    def positions(self, seqlen: int, layout="zigzag", device=None) -> torch.Tensor:
        """Global position ids (int64, ``(seqlen // size,)``) of this rank's tokens."""
        return positions_local(seqlen, self._data_layout_for("positions", layout), self.size,
                               self.rank, device, fn="positions")

    def shard_batch(self, batch, layout="zigzag", ignore_index: int = -100) -> dict:
        """:func:`ringseq.shard_batch` over :attr:`group` with :meth:`data_layout`."""
        lay = self._data_layout_for("shard_batch", layout)
        return shard_batch(batch, group=self.group, layout=lay, ignore_index=ignore_index)

    def process_groups(self) -> list:
        """The distinct process groups of this sequence-parallel group: the whole group, its
        Ulysses, ring, inner and outer rings (those the mode has)."""
        distinct = {}
        for g in (self.group, self.ulysses_group, self.ring_group, self.inner_group,
                  self.outer_group):
            if g is not None:
                distinct.setdefault(id(g), g)
        return list(distinct.values())

    def reset(self) -> None:
        """``ringseq.reset_ring`` of every group of this sequence-parallel group
        (:meth:`process_groups`): what a failure or a timeout broke in any mode. Call it on
        every rank."""
        from ..engine.ring import reset_ring
        for g in self.process_groups():
            reset_ring(g)

    def __deepcopy__(self, memo):  # process groups cannot be copied; a copy runs on them too
        return self

    def __repr__(self):
        return (f"SequenceParallelGroups(mode={self.mode!r}, ulysses={self.ulysses_size}, "
                f"ring={self.ring_size}, inner_ring={self.inner_ring_size}, rank={self.rank}, "
                f"ulysses_inner={self.ulysses_inner})")


def _local_groups(U: int, R: int, I: int) -> SequenceParallelGroups:
    return SequenceParallelGroups(group=None, size=1, rank=0, ulysses_size=U, ulysses_rank=0,
                                  ulysses_group=None, ring_size=R, ring_rank=0, ring_group=None,
                                  inner_ring_size=I, inner_group=None, outer_group=None,
                                  ulysses_inner=True, coords=((0, 0),))


def ranks_increase(t: torch.Tensor) -> bool:
    """Whether an (R, U) table's global ranks increase along both dims (what process groups,
    ordering their ranks by global rank, need of a sequence-parallel group)."""
    return bool((t[:, 1:] > t[:, :-1]).all()) and bool((t[1:, :] > t[:-1, :]).all())


def _check_table(t: torch.Tensor) -> None:
    if not ranks_increase(t):
        raise ValueError(f"sp_groups_from_tables: tables: the global ranks of a "
                         f"sequence-parallel group must increase along its ring and Ulysses "
                         f"dims (process groups order their ranks by global rank), got the "
                         f"(ring, ulysses) table {t.tolist()}")


def sp_groups_from_tables(tables: Sequence[torch.Tensor], inner_ring_size: Optional[int] = None,
                          ulysses_inner: bool = True) -> SequenceParallelGroups:
    """Creates the process groups of every sequence-parallel group and returns this rank's.

    Collective over the default group: every rank must call it with the same ``tables``.

    Args:
        tables: one int tensor (R, U) of global ranks per sequence-parallel group (e.g. per
            data-parallel index): entry ``[g, u]`` is the rank with ring rank ``g`` and Ulysses
            rank ``u``. Ranks must increase along both dims; together the tables must hold
            this rank exactly once.
        inner_ring_size: ``I`` dividing R (None: R, a plain ring).
        ulysses_inner: recorded (the tables already encode the placement).

    Raises ValueError (TypeError for ``ulysses_inner`` that is not a bool) on every rank,
    before creating any group, for a bad table or ``inner_ring_size``, or tables that do not
    hold every rank of the default group exactly once; RingMismatchError on every rank when
    the ranks pass different tables or options.
    """
    me = dist.get_rank()
    problem, digest = None, 0
    try:
        tables, R, U, I = _checked_tables(tables, inner_ring_size, ulysses_inner,
                                          dist.get_world_size())
        digest = stable_hash_ints([R, U, I, int(ulysses_inner)]
                                  + [int(x) for t in tables for x in t.flatten()])
    except (TypeError, ValueError) as exc:
        problem = exc
    # Every rank must create the same groups (new_group is collective over the default
    # group): a rank refusing alone, or ranks given other tables, would leave the rest
    # waiting in new_group.
    try:
        agree_on_fields(problem is None, str(problem), (("tables and options", digest, None),),
                        error=problem, what="sp_groups_from_tables")
    except RingMismatchError as exc:  # (raised on every rank alike: all exchange the tables)
        raise _with_every_ranks_tables(exc, tables, ulysses_inner, inner_ring_size) from None
    mine = [i for i, t in enumerate(tables) if bool((t == me).any())]
    double = 1 < I < R
    out = {}
    for ti, t in enumerate(tables):  # same order on every rank
        def make(ranks, key):
            ranks = sorted(int(x) for x in ranks)
            pg = dist.new_group(ranks)
            if me in ranks:
                out[key] = pg
        for g in range(R):
            if U > 1:
                make(t[g, :], ("ulysses", ti, g))
        for u in range(U):
            if R > 1:
                make(t[:, u], ("ring", ti, u))
            if double:
                for o in range(R // I):
                    make(t[o * I:(o + 1) * I, u], ("inner", ti, u, o))
                for j in range(I):
                    make(t[j::I, u], ("outer", ti, u, j))
        if (U > 1 and R > 1) or U * R == 1:  # else the whole group is the ring / Ulysses one
            make(t.flatten(), ("flat", ti))
    t = tables[mine[0]]
    ti = mine[0]
    g, u = [int(x) for x in (t == me).nonzero()[0]]
    flat = sorted(int(x) for x in t.flatten())
    coords = []
    for x in flat:
        gg, uu = [int(y) for y in (t == x).nonzero()[0]]
        coords.append((gg, uu))
    ring_group = out.get(("ring", ti, u))
    ulysses_group = out.get(("ulysses", ti, g))
    whole = out.get(("flat", ti), ring_group if U == 1 else ulysses_group)
    inner = outer = None
    if double:
        inner, outer = out[("inner", ti, u, g // I)], out[("outer", ti, u, g % I)]
    return SequenceParallelGroups(
        group=whole, size=R * U, rank=flat.index(me), ulysses_size=U, ulysses_rank=u,
        ulysses_group=ulysses_group, ring_size=R, ring_rank=g, ring_group=ring_group,
        inner_ring_size=I, inner_group=inner, outer_group=outer, ulysses_inner=bool(ulysses_inner),
        coords=tuple(coords))


def _with_every_ranks_tables(exc, tables, ulysses_inner, inner_ring_size) -> Exception:
    """``exc`` (the ranks' tables or options differ) with every rank's tables and options
    (before: their hashes alone), gathered from every rank, the first that differ from rank
    0's shown."""
    mine = ([torch.as_tensor(t).tolist() for t in tables], repr(inner_ring_size),
            repr(ulysses_inner))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    other = next((r for r in range(len(every)) if every[r] != every[0]), 0)

    def shown(r):
        text = (f"tables {every[r][0]}, inner_ring_size {every[r][1]}, ulysses_inner "
                f"{every[r][2]}")
        return text if len(text) <= 300 else text[:300] + "..."
    return RingMismatchError(f"{exc}: rank 0 passed {shown(0)}; rank {other} passed "
                             f"{shown(other)}")


def _checked_tables(tables, inner_ring_size, ulysses_inner, world_size: int):
    """``(tables as int64 tensors, R, U, I)``; TypeError / ValueError naming
    sp_groups_from_tables for what cannot make one set of groups over ``world_size`` ranks."""
    fn = "sp_groups_from_tables"
    if not is_bool(ulysses_inner):
        raise TypeError(f"{fn}: ulysses_inner must be a bool, got {ulysses_inner!r}")
    try:
        given_tables = [torch.as_tensor(t) for t in tables]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{fn}: tables must be a list of (R, U) int tensors of global ranks "
                         f"({type(exc).__name__}: {exc})") from None
    for i, t in enumerate(given_tables):  # (before: 0.6 and 1.7 were taken as ranks 0 and 1)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{fn}: tables[{i}] must hold int global ranks, got dtype "
                             f"{t.dtype}")
    tables = [t.to(torch.long) for t in given_tables]
    if not tables or tables[0].dim() != 2 or tables[0].numel() == 0:
        raise ValueError(f"{fn}: tables must be a non-empty list of (R, U) int tensors of global "
                         f"ranks, got {[tuple(t.shape) for t in tables]}")
    R, U = tables[0].shape
    if inner_ring_size is not None and (as_int(inner_ring_size) or 0) < 1:
        raise ValueError(f"{fn}: inner_ring_size must be a positive integer or None, got "
                         f"{inner_ring_size!r}")
    I = R if inner_ring_size is None else as_int(inner_ring_size)
    if R % I:
        raise ValueError(f"{fn}: inner_ring_size={inner_ring_size} does not divide the ring size "
                         f"{R}; use one of {shown_divisors(R)}")
    for t in tables:
        if tuple(t.shape) != (R, U):
            raise ValueError(f"{fn}: all sequence-parallel tables must be {R} x {U}, got "
                             f"{tuple(t.shape)}")
        _check_table(t)
    every = torch.cat([t.flatten() for t in tables])
    if sorted(every.tolist()) != list(range(world_size)):
        # (clamping counted -1 as rank 0: rank 0 was then not "missing")
        inside = every[(every >= 0) & (every < world_size)]
        counts = torch.bincount(inside, minlength=world_size)
        missing = [r for r in range(world_size) if counts[r] == 0]
        twice = [r for r in range(world_size) if counts[r] > 1]
        outside = sorted({int(x) for x in every if not 0 <= int(x) < world_size})
        raise ValueError(f"{fn}: the tables together must hold every rank of the default group "
                         f"(0 to {world_size - 1}) exactly once; missing {missing}, more than "
                         f"once {twice}, outside the group {outside}")
    return tables, R, U, I


def _check_sizes(prefix: str, **sizes) -> None:
    """ValueError (``prefix`` in front: the function's name) for a size that is not a
    positive integer; ``name=(value, None)`` marks a size that may also be None."""
    for name, given in sizes.items():
        optional = isinstance(given, tuple)
        v = given[0] if optional else given
        if not (v is None and optional) and (
                isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{prefix}{name} must be a positive integer"
                             f"{' or None' if optional else ''}, got {v!r}")


def _table(ranks: Sequence[int], U: int, ulysses_inner: bool) -> torch.Tensor:
    ranks = torch.tensor(sorted(ranks), dtype=torch.long)
    R = ranks.numel() // U
    return ranks.view(R, U) if ulysses_inner else ranks.view(U, R).t().contiguous()


def make_sp_groups(ulysses_size: int = 1, inner_ring_size: Optional[int] = None, *, group=None,
                   ulysses_inner: bool = True) -> SequenceParallelGroups:
    """The Ulysses × ring groups of the sequence-parallel group ``group``.

    Args:
        ulysses_size: U, dividing the group size (1: ring only; the group size: Ulysses
            only).
        inner_ring_size: I dividing the ring size R = size / U for a double ring (None: a
            plain ring).
        group: the whole sequence-parallel group (None: the default group). When it is a
            subgroup (e.g. one data-parallel replica's), every rank of the default group
            must call this with its own group: the groups are all-gathered first, since
            creating process groups is collective over the default group.
        ulysses_inner: True (default): the U ranks of a Ulysses group are consecutive ranks of
            ``group`` (the all-to-all stays inside a node); False: the ring ranks are.

    Returns this rank's :class:`SequenceParallelGroups`. Collective (group creation).
    Without torch.distributed it returns a group of one (U and I must then be 1).

    Raises, on every rank of the default group before any process group is created (one
    small all-gather of the sizes comes first; under NCCL, set this rank's CUDA device before
    calling): on the ranks whose sizes are wrong (U not dividing the group size, I not
    dividing R, not positive integers) a ValueError naming the sizes that work; on the other
    ranks ``RingPeerError`` naming the ranks that failed; when the ranks pass different sizes,
    or groups of different sizes, ``RingMismatchError`` naming each rank's. A ``group`` that
    does not hold this rank is such a ValueError on that rank (every rank passes its own).
    """
    ulysses_size, inner_ring_size = int_if_integer(ulysses_size), int_if_integer(inner_ring_size)
    if not is_initialized():
        if group is not None:
            raise ValueError(f"make_sp_groups: group={group!r} was passed but "
                             f"torch.distributed is not initialized")
        # (0 is wrong with or without a group)
        _check_sizes("make_sp_groups: ", ulysses_size=ulysses_size,
                     inner_ring_size=(inner_ring_size, None))
        if ulysses_size != 1 or inner_ring_size not in (None, 1):
            raise ValueError(f"make_sp_groups: ulysses_size={ulysses_size} / inner_ring_size="
                             f"{inner_ring_size} need torch.distributed (without it the group is "
                             f"this process alone, which cannot be split): initialize it, or "
                             f"pass 1 / None")
        return _local_groups(1, 1, 1)
    problem = None
    try:
        if group is not None and not isinstance(group, dist.ProcessGroup):
            # torch's placeholder for ranks outside a new_group (an int): get_process_group_ranks
            # would answer with another group's ranks
            group_info(group)  # raises, naming it
        ranks = (list(range(dist.get_world_size())) if group is None
                 else dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:  # not a group of the default one
        problem = ValueError(f"make_sp_groups: group={group!r} is not a process group of this "
                             f"rank's default group ({type(exc).__name__}: {exc})")
        ranks = []
    n = len(ranks)
    try:
        if problem is not None:
            raise problem
        if not is_bool(ulysses_inner):
            raise TypeError(f"make_sp_groups: ulysses_inner must be a bool, got "
                            f"{ulysses_inner!r}")
        _check_sizes("make_sp_groups: ", ulysses_size=ulysses_size,
                     inner_ring_size=(inner_ring_size, None))
        if dist.get_rank() not in ranks:
            raise ValueError(f"make_sp_groups: group holds ranks {sorted(ranks)[:8]}"
                             f"{' ...' if n > 8 else ''}, not this rank {dist.get_rank()}: every "
                             f"rank passes the sequence-parallel group it belongs to")
        if n % ulysses_size:
            raise ValueError(f"make_sp_groups: ulysses_size={ulysses_size} does not divide the "
                             f"group's {n} ranks; one of {shown_divisors(n)}")
        ring = n // ulysses_size
        if inner_ring_size is not None and ring % inner_ring_size:
            raise ValueError(f"make_sp_groups: inner_ring_size={inner_ring_size} does not divide "
                             f"the ring size {ring} ({n} ranks / ulysses_size {ulysses_size}); "
                             f"one of {shown_divisors(ring)}, or None for a plain ring")
        mode = "ring" if ulysses_size == 1 else ("ulysses" if ulysses_size == n else "hybrid")
        resolve_sp_sizes(mode, n, ulysses_size, None if ring == 1 else inner_ring_size,
                         fn="make_sp_groups")
    except (TypeError, ValueError) as exc:
        problem = exc
        ulysses_size, inner_ring_size = -1, -1  # (the fields below; this rank raises)
    # Group creation is collective over the default group: ranks that pass other sizes (or
    # fail above) would create different groups and wait in each other's forever.
    agree_on_fields(problem is None, str(problem),
                    (("ulysses_size", int(ulysses_size), None),
                     ("inner_ring_size", int(inner_ring_size or 0), None),
                     ("ulysses_inner", int(bool(ulysses_inner)), None),
                     # ranks passing groups of other sizes (one the default group, the others
                     # subgroups) would go different ways below and wait in each other's
                     ("group size", n, None)),
                    error=problem, what="make_sp_groups")
    if group is None or n == dist.get_world_size():
        all_groups = [sorted(ranks)]
    else:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(ranks))
        all_groups = sorted({tuple(g) for g in gathered})
        if len({r for g in all_groups for r in g}) != sum(len(g) for g in all_groups):
            raise ValueError(f"make_sp_groups: the sequence-parallel groups passed by the "
                             f"ranks overlap: {all_groups}")
    tables = [_table(g, ulysses_size, ulysses_inner) for g in all_groups]
    return sp_groups_from_tables(tables, inner_ring_size, ulysses_inner)
