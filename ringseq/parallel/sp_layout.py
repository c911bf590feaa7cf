"""Where the tokens of a 2-D (ring x Ulysses) sequence-parallel group live (the sharding rule of
:mod:`ringseq.parallel.groups`), as a :class:`ringseq.layouts.Layout` over the whole group."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from .._hash import stable_code
from ..layouts import Layout, get_layout

__all__ = ["SequenceParallelLayout", "ring_layout", "sp_multiple"]


def ring_layout(layout, ring_size: int, fn: str = "ring_layout") -> Layout:
    """The layout of a ring of ``ring_size`` ranks for ``layout`` (a name or a Layout, checked
    even where it does not apply, by :func:`get_layout` named for ``fn``): contiguous for a
    ring of one."""
    lay = get_layout(layout, fn)
    return get_layout("contiguous") if ring_size == 1 else lay


def sp_multiple(base: Layout, ring_size: int, ulysses_size: int) -> int:
    """What a sequence over ring ``ring_size`` x Ulysses ``ulysses_size`` ranks must be a
    multiple of: each ring shard (``base`` over the ring) splits into ``ulysses_size`` equal
    parts. (Without building the group's coordinates: the memory planner asks this of meshes
    of millions of ranks.)"""
    mb = base.multiple(ring_size) // ring_size
    return ring_size * (mb * ulysses_size // math.gcd(mb, ulysses_size))


class SequenceParallelLayout(Layout):
    """Where the tokens of a 2-D (ring ``R`` × Ulysses ``U``) sequence-parallel group live
    (the sharding rule of the module doc), as a :class:`ringseq.layouts.Layout` over the whole
    group of ``R * U`` ranks in its rank order: ``ringseq.shard(x, this, sp.group)``,
    ``ringseq.positions``, ``ringseq.shard_batch`` and the plugin's loader use it unchanged.

    ``coords[f] = (ring rank, Ulysses rank)`` of rank ``f`` of the whole group. It places
    tokens only; attention on it is :func:`usp_attn_func` (its block schedule raises).
    ``documents``: the global document boundaries of the user's layout (a
    ``Documents(cu_seqlens)``) where ``base`` does not carry them (a ring of one splits
    contiguously), else None: ``shard_batch`` still stops positions and targets at them.
    ``per_batch_documents``: the name of the user's per-batch documents layout (``"documents"``,
    ``"documents_zigzag"``, ...) where a ring of one replaced it by contiguous, else None:
    ``shard_batch`` still takes each batch's boundaries (and refuses rows without them) as
    under the other modes.
    """

    def __init__(self, base: Layout, ring_size: int, ulysses_size: int,
                 coords: Sequence[Tuple[int, int]], documents=None,
                 per_batch_documents: Optional[str] = None):
        self.base, self.ring_size, self.ulysses_size = base, ring_size, ulysses_size
        self.coords = tuple(tuple(c) for c in coords)
        self.documents = documents if getattr(base, "documents", None) is None else None
        self.per_batch_documents = per_batch_documents
        order = "u" if all(c == (f // ulysses_size, f % ulysses_size)
                           for f, c in enumerate(self.coords)) else "r"
        self.name = f"{base.name}|sp[R={ring_size},U={ulysses_size},{order}-inner]"

    @property
    def code(self) -> int:
        # the wrapped layout's code too: a Documents layout's boundaries are not in its name
        return stable_code(f"{self.name}#{self.base.code}#{self.documents}")

    def multiple(self, world_size):
        self._check_world(world_size)
        return sp_multiple(self.base, self.ring_size, self.ulysses_size)

    def check_seqlen(self, seqlen: int, world_size: int) -> int:
        n = super().check_seqlen(seqlen, world_size)
        # the wrapped layout's own rules over the ring (packed documents cut into equal
        # chunks), before any token moves
        self.base.check_seqlen(seqlen, self.ring_size)
        return n

    def check_local_seqlen(self, s_local: int, world_size: int) -> None:
        super().check_local_seqlen(s_local, world_size)
        # ... and from a local length, before unshard's all-gather (a per-batch documents
        # layout that was never bound: before, refused after it, naming no function)
        self.base.check_local_seqlen(s_local * self.ulysses_size, self.ring_size)

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

    def bind(self, cu_seqlens):
        base = self.base.bind(cu_seqlens)
        if base is self.base:
            return self
        cache = self.__dict__.setdefault("_bound", {})
        hit = cache.get(id(base))
        if hit is None or hit.base is not base:
            if len(cache) > 16:
                cache.clear()
            hit = cache[id(base)] = SequenceParallelLayout(base, self.ring_size,
                                                           self.ulysses_size, self.coords,
                                                           self.documents,
                                                           self.per_batch_documents)
        return hit

    def _tasks(self, rank, src, world_size, s_local):
        raise ValueError(f"layout {self.name!r} places tokens for Ulysses x ring attention; "
                         f"run attention on it with ringseq.usp_attn_func, not the ring alone")
