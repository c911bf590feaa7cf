"""The built-in layouts: ``contiguous``, ``zigzag`` and ``stripe`` (see the package doc)."""
from __future__ import annotations

import torch

from ..masks import Run
from .base import BlockTask, Layout, check_rank, register_layout

__all__ = ["Contiguous", "Stripe", "Zigzag"]


def _placed_as(layout, cls) -> bool:
    """Whether ``layout`` places tokens as the built-in ``cls`` does: a subclass of the
    user's that overrides ``_positions`` gets the generic runs, shard and scatter, which
    follow its positions (before: the built-in's, so a causal ring computed the subclass's
    tasks on tokens placed otherwise, 2.3 off without a word)."""
    return type(layout)._positions is cls._positions


class Contiguous(Layout):
    name = "contiguous"

    def _positions(self, seqlen, world_size, rank):
        n = seqlen // world_size
        return torch.arange(rank * n, (rank + 1) * n)

    def _runs(self, seqlen, world_size, rank):
        if not _placed_as(self, Contiguous):
            return super()._runs(seqlen, world_size, rank)
        n = seqlen // world_size
        return (Run(0, n, rank * n, 1),)

    def shard(self, x, world_size, rank, dim):
        if not _placed_as(self, Contiguous):
            return super().shard(x, world_size, rank, dim)
        n = self.check_seqlen(x.shape[dim], world_size)
        check_rank(rank, world_size)
        return x.narrow(dim, rank * n, n).clone(memory_format=torch.contiguous_format)

    def scatter(self, full, part, world_size, rank, dim):
        if not _placed_as(self, Contiguous):
            return super().scatter(full, part, world_size, rank, dim)
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

    def _runs(self, seqlen, world_size, rank):
        if not _placed_as(self, Zigzag):
            return super()._runs(seqlen, world_size, rank)
        c = seqlen // (2 * world_size)
        return (Run(0, c, rank * c, 1), Run(c, c, (2 * world_size - 1 - rank) * c, 1))

    def shard(self, x, world_size, rank, dim):
        if not _placed_as(self, Zigzag):
            return super().shard(x, world_size, rank, dim)
        c = self.check_seqlen(x.shape[dim], world_size) // 2
        check_rank(rank, world_size)
        # (contiguous as documented: torch.cat keeps the input's memory format, so a tensor
        # whose sequence dim has stride 1 would give a strided shard)
        return torch.cat([x.narrow(dim, rank * c, c),
                          x.narrow(dim, (2 * world_size - 1 - rank) * c, c)],
                         dim=dim).contiguous()

    def scatter(self, full, part, world_size, rank, dim):
        if not _placed_as(self, Zigzag):
            return super().scatter(full, part, world_size, rank, dim)
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

    def _runs(self, seqlen, world_size, rank):
        if not _placed_as(self, Stripe):
            return super()._runs(seqlen, world_size, rank)
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


for _layout in (Contiguous(), Zigzag(), Stripe()):
    register_layout(_layout)
