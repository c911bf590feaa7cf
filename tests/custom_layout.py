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
