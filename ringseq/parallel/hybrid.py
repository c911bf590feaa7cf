"""Unified sequence parallelism (USP): Ulysses all-to-all × ring, and the double ring.

A sequence-parallel group of ``W = U * R`` ranks is a 2-D grid: ``U`` = Ulysses degree
(all-to-all groups), ``R`` = ring degree (ring groups). Rank ``(g, u)`` is ring rank ``g`` of
its ring group and Ulysses rank ``u`` of its Ulysses group. Optionally the ring itself is a
double ring: ``R = O * I`` with inner rings of ``inner_ring_size = I`` consecutive ring ranks
(:mod:`ringseq.double_ring`).

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
``h_kv`` (``rep`` per :mod:`ringseq.ulysses`'s head rule) of a ring part of ``s / R`` tokens, i.e.
``rep / U`` of what a ring of ``R`` over the same parts would move per step -- the block of the
plain ring of ``W`` (times ``rep``), for ``R - 1`` steps instead of ``W - 1``
(docs/sp_modes.md has the bytes of every mode).

    sp = ringseq.make_sp_groups(ulysses_size=2)                   # W = 2 x (W / 2), collective
    q = sp.shard(torch_full_q, "zigzag")                          # (b, s / W, h, d)
    out = ringseq.usp_attn_func(q, k, v, causal=True, sp=sp, layout="zigzag")
    batch = sp.shard_batch({"input_ids": ids, "labels": ids}, "zigzag")
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._args import autocast_inputs, check_dropout
from ._dist import dtype_code, is_initialized
from .comm import check_consistent, get_comm
from .commstats import CountingTransport
from .data import shard_batch
from .double_ring import double_ring_attention
from .kernels import check_qkv
from .layouts import Layout, get_layout, positions_local, shard_local
from .nn import ring_flash_attn_func
from .ops import flash_attn_func
from .ulysses import (ulysses_heads, ulysses_wrap,
                      valid_ulysses_degrees)

__all__ = ["SP_MODES", "SequenceParallelGroups", "SequenceParallelLayout", "check_model_heads",
           "make_sp_groups", "resolve_sp_sizes", "sp_groups_from_tables", "usp_attn_func",
           "usp_sdpa"]

SP_MODES = ("ring", "ulysses", "hybrid")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_sp_sizes(sp_mode: str, sp_size: int, ulysses_size: Optional[int] = None,
                     inner_ring_size: Optional[int] = None) -> Tuple[int, int, int]:
    """``(U, R, I)`` for a mode on ``sp_size`` ranks (``I = R``: no double ring).

    ``"ring"``: U = 1; ``"ulysses"``: U = sp_size (``ulysses_size`` None or equal), R = 1;
    ``"hybrid"``: ``ulysses_size`` required, dividing ``sp_size``, R = sp_size / U.
    ``inner_ring_size`` (ring and hybrid): must divide R. Raises ValueError naming the argument,
    the value and the values that would work; nothing communicates.
    """
    if sp_mode not in SP_MODES:
        raise ValueError(f"sp_mode must be one of {list(SP_MODES)}, got {sp_mode!r}")
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}")
    if sp_mode == "ring":
        if ulysses_size not in (None, 1):
            raise ValueError(f"sp_mode='ring' has no Ulysses dimension, got ulysses_size="
                             f"{ulysses_size!r}; use sp_mode='hybrid' (or 'ulysses')")
        U = 1
    elif sp_mode == "ulysses":
        if ulysses_size not in (None, sp_size):
            raise ValueError(f"sp_mode='ulysses' uses all {sp_size} sequence-parallel ranks for "
                             f"the all-to-all, got ulysses_size={ulysses_size!r}; use "
                             f"sp_mode='hybrid' for a Ulysses x ring split")
        if inner_ring_size not in (None, 1):
            raise ValueError(f"sp_mode='ulysses' has no ring, got inner_ring_size="
                             f"{inner_ring_size!r}")
        U = sp_size
    else:
        if ulysses_size is None:
            raise ValueError(f"sp_mode='hybrid' needs ulysses_size (one of "
                             f"{_divisors(sp_size)}, dividing sp_size={sp_size})")
        if not isinstance(ulysses_size, int) or ulysses_size < 1 or sp_size % ulysses_size:
            raise ValueError(f"ulysses_size={ulysses_size!r} does not divide sp_size={sp_size}; "
                             f"the sequence-parallel group is ulysses_size x ring size, so "
                             f"ulysses_size must be one of {_divisors(sp_size)}")
        U = ulysses_size
    R = sp_size // U
    if inner_ring_size is None:
        I = R
    else:
        if not isinstance(inner_ring_size, int) or inner_ring_size < 1 or R % inner_ring_size:
            raise ValueError(f"inner_ring_size={inner_ring_size!r} does not divide the ring "
                             f"size {R} (sp_size {sp_size} / ulysses_size {U}); the ring is "
                             f"outer x inner rings, so inner_ring_size must be one of "
                             f"{_divisors(R)}")
        I = inner_ring_size
    return U, R, I


def check_model_heads(nheads: int, nheads_kv: int, ulysses_size: int,
                      sp_size: Optional[int] = None) -> None:
    """Raises ValueError when a model's ``nheads`` query heads (``nheads_kv`` K/V heads) cannot
    be split over ``ulysses_size`` ranks, naming the Ulysses sizes that would work (those that
    also divide ``sp_size`` when given). Nothing communicates."""
    if ulysses_size < 1 or nheads % ulysses_size:
        raise ValueError(
            f"num_attention_heads={nheads} cannot be split over ulysses_size={ulysses_size}: each "
            f"rank of the all-to-all takes num_attention_heads / ulysses_size query heads; "
            f"ulysses_size values that divide num_attention_heads={nheads}"
            + (f" and the sequence-parallel size {sp_size}" if sp_size is not None else "")
            + f": {valid_ulysses_degrees(nheads, sp_size)}")
    ulysses_heads(nheads, nheads_kv, ulysses_size, what="num_attention_heads")


# ---------------------------------------------------------------------------- data layout
class SequenceParallelLayout(Layout):
    """Where the tokens of a 2-D (ring ``R`` × Ulysses ``U``) sequence-parallel group live
    (the sharding rule of the module doc), as a :class:`ringseq.layouts.Layout` over the whole
    group of ``R * U`` ranks in its rank order: ``ringseq.shard(x, this, sp.group)``,
    ``ringseq.positions``, ``ringseq.shard_batch`` and the plugin's loader use it unchanged.

    ``coords[f] = (ring rank, Ulysses rank)`` of rank ``f`` of the whole group. It places
    tokens only; attention on it is :func:`usp_attn_func` (its block schedule raises).
    """

    def __init__(self, base: Layout, ring_size: int, ulysses_size: int,
                 coords: Sequence[Tuple[int, int]]):
        self.base, self.ring_size, self.ulysses_size = base, ring_size, ulysses_size
        self.coords = tuple(tuple(c) for c in coords)
        order = "u" if all(c == (f // ulysses_size, f % ulysses_size)
                           for f, c in enumerate(self.coords)) else "r"
        self.name = f"{base.name}|sp[R={ring_size},U={ulysses_size},{order}-inner]"

    def multiple(self, world_size):
        self._check_world(world_size)
        mb = self.base.multiple(self.ring_size) // self.ring_size
        return self.ring_size * (mb * self.ulysses_size // math.gcd(mb, self.ulysses_size))

    def _check_world(self, world_size):
        if world_size != self.ring_size * self.ulysses_size:
            raise ValueError(f"layout {self.name!r} is for a group of {self.ring_size} x "
                             f"{self.ulysses_size} = {self.ring_size * self.ulysses_size} "
                             f"ranks, got world size {world_size}")

    def _positions(self, seqlen, world_size, rank):
        g, u = self.coords[rank]
        part = self.base.positions(seqlen, self.ring_size, g)
        n = part.numel() // self.ulysses_size
        return part[u * n:(u + 1) * n]

    def shard(self, x, world_size, rank, dim):
        self.check_seqlen(x.shape[dim], world_size)
        g, u = self.coords[rank]
        part = self.base.shard(x, self.ring_size, g, dim)
        n = part.shape[dim] // self.ulysses_size
        return part.narrow(dim, u * n, n).clone(memory_format=torch.contiguous_format)

    def _tasks(self, rank, src, world_size, s_local):
        raise ValueError(f"layout {self.name!r} places tokens for Ulysses x ring attention; "
                         f"run attention on it with ringseq.usp_attn_func, not the ring alone")


# ---------------------------------------------------------------------------- groups
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
        does not apply and the split is contiguous)."""
        lay = get_layout(layout) if self.ring_size > 1 else get_layout("contiguous")
        if self.ulysses_size == 1:
            return lay
        key = (id(lay), lay.name)
        cache = self.__dict__.setdefault("_layouts", {})
        hit = cache.get(key)
        if hit is None or hit.base is not lay:
            hit = SequenceParallelLayout(lay, self.ring_size, self.ulysses_size, self.coords)
            cache[key] = hit
        return hit

    def shard(self, x: torch.Tensor, layout="zigzag", dim: int = 1) -> torch.Tensor:
        """This rank's tokens of the full ``x`` along ``dim`` (ValueError for a length the
        split cannot take, before any communication)."""
        return shard_local(x, self.data_layout(layout), self.size, self.rank, dim)

    def positions(self, seqlen: int, layout="zigzag", device=None) -> torch.Tensor:
        """Global position ids (int64, ``(seqlen // size,)``) of this rank's tokens."""
        return positions_local(seqlen, self.data_layout(layout), self.size, self.rank, device)

    def shard_batch(self, batch, layout="zigzag", ignore_index: int = -100) -> dict:
        """:func:`ringseq.shard_batch` over :attr:`group` with :meth:`data_layout`."""
        return shard_batch(batch, group=self.group, layout=self.data_layout(layout),
                           ignore_index=ignore_index)

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


def _check_table(t: torch.Tensor) -> None:
    rows_ok = bool((t[:, 1:] > t[:, :-1]).all()) if t.shape[1] > 1 else True
    cols_ok = bool((t[1:, :] > t[:-1, :]).all()) if t.shape[0] > 1 else True
    if not (rows_ok and cols_ok):
        raise ValueError(f"the global ranks of a sequence-parallel group must increase along its "
                         f"ring and Ulysses dims (process groups order their ranks by global "
                         f"rank), got the (ring, ulysses) table {t.tolist()}")


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

    Raises ValueError (before creating any group) for a bad table or ``inner_ring_size``.
    """
    me = dist.get_rank()
    tables = [torch.as_tensor(t, dtype=torch.long) for t in tables]
    R, U = tables[0].shape
    I = R if inner_ring_size is None else inner_ring_size
    if R % I:
        raise ValueError(f"inner_ring_size={inner_ring_size} does not divide the ring size {R}; "
                         f"use one of {_divisors(R)}")
    for t in tables:
        if tuple(t.shape) != (R, U):
            raise ValueError(f"all sequence-parallel tables must be {R} x {U}, got "
                             f"{tuple(t.shape)}")
        _check_table(t)
    mine = [i for i, t in enumerate(tables) if bool((t == me).any())]
    if len(mine) != 1:
        raise ValueError(f"rank {me} must be in exactly one sequence-parallel group, found in "
                         f"{len(mine)}")
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
        inner_ring_size=I, inner_group=inner, outer_group=outer, ulysses_inner=ulysses_inner,
        coords=tuple(coords))


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

    Raises ValueError naming the sizes that work, on every rank before any communication,
    when U does not divide the group size or I does not divide R.
    """
    if not is_initialized():
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not "
                             "initialized")
        if ulysses_size != 1 or inner_ring_size not in (None, 1):
            raise ValueError(f"ulysses_size={ulysses_size} / inner_ring_size={inner_ring_size} "
                             f"need torch.distributed (a group of one cannot be split)")
        return _local_groups(1, 1, 1)
    ranks = (list(range(dist.get_world_size())) if group is None
             else dist.get_process_group_ranks(group))
    n = len(ranks)
    mode = "ring" if ulysses_size == 1 else ("ulysses" if ulysses_size == n else "hybrid")
    resolve_sp_sizes(mode, n, ulysses_size, inner_ring_size)  # raises before communicating
    if group is None or n == dist.get_world_size():
        all_groups = [sorted(ranks)]
    else:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(ranks))
        all_groups = sorted({tuple(g) for g in gathered})
        if len({r for g in all_groups for r in g}) != sum(len(g) for g in all_groups):
            raise ValueError(f"the sequence-parallel groups passed by the ranks overlap: "
                             f"{all_groups}")
    tables = [_table(g, ulysses_size, ulysses_inner) for g in all_groups]
    return sp_groups_from_tables(tables, inner_ring_size, ulysses_inner)


# ---------------------------------------------------------------------------- attention
def _ring_part(q, k, v, *, sp: SequenceParallelGroups, layout: Layout, softmax_scale, causal,
               backend, grad_comm_dtype):
    """Attention of the ring dimension on (head-sharded) ring parts: (out, lse)."""
    if sp.ring_size == 1:
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               return_lse=True, backend=backend)
    if sp.double_ring:
        return double_ring_attention(q, k, v, inner_group=sp.inner_group,
                                     outer_group=sp.outer_group, layout=layout,
                                     softmax_scale=softmax_scale, causal=causal, backend=backend,
                                     grad_comm_dtype=grad_comm_dtype)
    return ring_flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                group=CountingTransport(get_comm(sp.ring_group), "ring"),
                                layout=layout, return_lse=True, backend=backend,
                                grad_comm_dtype=grad_comm_dtype)


def usp_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale=None, causal: bool = False, *,
                  sp: SequenceParallelGroups, layout="zigzag", return_lse: bool = False,
                  backend=None, grad_comm_dtype=None):
    """Exact attention over a sequence split over a Ulysses × ring group (any mode of ``sp``).

    Args:
        q: (batch, s_local, nheads, headdim); k, v: (batch, s_local, nheads_kv, headdim):
            this rank's shard under ``sp.data_layout(layout)`` (e.g. ``sp.shard(x, layout)``
            or ``sp.shard_batch``). float32, float64, bfloat16 or float16; only the last
            dimension must be contiguous; under autocast cast to its dtype first.
        dropout_p: must be 0.0.
        softmax_scale: defaults to ``headdim ** -0.5``.
        causal: causal mask over global positions.
        sp: the groups (:func:`make_sp_groups`, or the plugin's ``plugin.sp``).
        layout: the layout of the ring dimension (``"zigzag"``, ``"contiguous"``,
            ``"stripe"`` or a Layout); it must be the one the data was sharded with. Ignored
            without a ring (R = 1: the Ulysses split is contiguous).
        return_lse: also return lse.
        backend: block kernel (ring steps, or the local attention when R = 1).
        grad_comm_dtype: dtype of the travelling dK/dV accumulators of the ring (see
            :func:`ringseq.ring_flash_attn_func`).

    Returns out (batch, s_local, nheads, headdim) in q's dtype; with ``return_lse`` also lse
    (batch, nheads, s_local) float32 (float64 for float64). Differentiable (q, k, v, lse).

    Raises:
        ValueError (before any communication): ``nheads`` not divisible by U (naming the
            degrees that work), a local length the ring layout cannot use, bad shapes or
            dtypes, ``dropout_p > 0``.
        RingMismatchError (a ValueError): ranks called with different arguments (every rank).
    """
    check_dropout("usp_attn_func", dropout_p)
    q, k, v = autocast_inputs(q, k, v)
    lay = get_layout(layout) if sp.ring_size > 1 else get_layout("contiguous")
    with torch.autocast(q.device.type, enabled=False):
        check_qkv(q, k, v)
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"sequence-parallel attention needs q and k/v shards of the same "
                             f"local length, got q {tuple(q.shape)} and k {tuple(k.shape)}")
        U, R = sp.ulysses_size, sp.ring_size
        b, s, h, d = q.shape
        ulysses_heads(h, k.shape[2], U)
        lay.check_local_seqlen(s * U, R)
        ring = functools.partial(_ring_part, sp=sp, layout=lay, softmax_scale=softmax_scale,
                                 causal=causal, backend=backend,
                                 grad_comm_dtype=grad_comm_dtype)
        if U == 1:
            out, lse = ring(q, k, v)
        else:
            check_consistent([("batch", b), ("local seqlen", s), ("nheads", h),
                              ("nheads_kv", k.shape[2]), ("headdim", d),
                              ("dtype", dtype_code(q.dtype), "dtype"),
                              ("causal", bool(causal), "bool"), ("layout", lay.code, "layout"),
                              ("Ulysses degree", U), ("ring degree", R),
                              ("inner ring", sp.inner_ring_size)],
                             group=sp.group, device=q.device)
            out, lse = ulysses_wrap(q, k, v, group=sp.ulysses_group, degree=U, attend=ring,
                                    return_lse=return_lse)
    return (out, lse) if return_lse else out


def usp_sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
             scale=None, enable_gqa: bool = True, *, sp: SequenceParallelGroups,
             layout="zigzag", backend=None, grad_comm_dtype=None):
    """:func:`usp_attn_func` in ``F.scaled_dot_product_attention``'s layout and positional
    order: query (b, h, s_local, d), key/value (b, h_kv, s_local, d) -> (b, h, s_local, d).
    ``attn_mask`` must be None and ``dropout_p`` 0 (ValueError otherwise)."""
    if attn_mask is not None:
        raise ValueError("usp_sdpa does not support attn_mask; use is_causal")
    check_dropout("usp_sdpa", dropout_p)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, nheads, seqlen, headdim), got "
                             f"{tuple(t.shape)}")
    out = usp_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                        softmax_scale=scale, causal=is_causal, sp=sp, layout=layout,
                        backend=backend, grad_comm_dtype=grad_comm_dtype)
    return out.transpose(1, 2)
