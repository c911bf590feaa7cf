"""A layout that is not built in, for tests that a user's own Layout works end to end:
contiguous chunks in reverse rank order (rank r holds chunk W-1-r). Module-level so spawned
ranks can unpickle it."""
from __future__ import annotations

import torch

from ringseq.layouts import BlockTask, Layout


class ReversedContiguous(Layout):
    name = "reversed_test"

    def _positions(self, seqlen, world_size, rank):
        n = seqlen // world_size
        rr = world_size - 1 - rank
        return torch.arange(rr * n, (rr + 1) * n)

    def _tasks(self, rank, src, world_size, s_local):
        if src == rank:
            return [BlockTask(slice(0, s_local), slice(0, s_local), True)]
        if src > rank:  # a higher rank holds an earlier chunk
            return [BlockTask(slice(0, s_local), slice(0, s_local), False)]
        return []


class Rotated(Layout):
    """Contiguous chunks rotated by ``k`` ranks (rank r holds chunk (r + k) % W): a layout with
    a parameter, set in ``__init__``, that does not override ``code``."""

    name = "rotated_test"

    def __init__(self, k: int):
        self.k = k

    def __hash__(self):
        return hash((type(self), self.k))

    def __eq__(self, other):
        return type(other) is type(self) and other.k == self.k

    def _positions(self, seqlen, world_size, rank):
        n = seqlen // world_size
        c = (rank + self.k) % world_size
        return torch.arange(c * n, (c + 1) * n)

    def _tasks(self, rank, src, world_size, s_local):
        return [BlockTask(slice(0, s_local), slice(0, s_local), False)]  # (full attention only)


class RotatedCausal(Layout):
    """:class:`Rotated` with causal tasks, compared by identity (no ``__eq__``): what a
    user's layout with a parameter usually is."""

    name = "rotated_causal_test"

    def __init__(self, k: int):
        self.k = k

    def _positions(self, seqlen, world_size, rank):
        n = seqlen // world_size
        c = (rank + self.k) % world_size
        return torch.arange(c * n, (c + 1) * n)

    def _tasks(self, rank, src, world_size, s_local):
        mine, theirs = (rank + self.k) % world_size, (src + self.k) % world_size
        if theirs == mine:
            return [BlockTask(slice(0, s_local), slice(0, s_local), True)]
        if theirs < mine:  # an earlier chunk: seen whole
            return [BlockTask(slice(0, s_local), slice(0, s_local), False)]
        return []
