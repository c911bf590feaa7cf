"""reset_ring called on one rank only (e.g. in an except block only that rank reached) gives
its channels a name the other rank's never meet again: the next call fails on every rank
within the ring timeout, and the error says which ranks reset how often and how to bring
them level; after that the ring is exact again. Two spawned gloo ranks (CPU)."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from utils import error_text

TIMEOUT = 4  # seconds: the ring timeout of these ranks


def _worker(checks):
    import torch.distributed as dist
    import ringseq
    ringseq.set_consistency_check(checks)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 2, 16, generator=g, dtype=torch.float64)
    local = ringseq.shard(q, "zigzag")

    def call():
        return ringseq.ring_flash_attn_func(local, local, local, causal=True, layout="zigzag")

    first = call()
    if rank == 1:
        ringseq.reset_ring()  # this rank alone
    out = {"mismatch": error_text(call)}
    dist.barrier()  # back in step (each rank's failed call ended at its own time)
    # as the message says: the rank behind (0) resets alone, then every rank
    if rank == 0:
        ringseq.reset_ring()
    ringseq.reset_ring()
    out["after"] = float((call() - first).abs().max())
    return out


@pytest.mark.parametrize("checks", ["on", "off"])
def test_a_reset_on_one_rank_is_named_and_can_be_levelled(checks):
    """With the checks off the data channel's and the exchange's errors say it (before: they
    advised reset_ring on every rank, after which the channels still never met)."""
    ranks = run_ranks(_worker, 2, checks, timeout=120, env={"RINGSEQ_TIMEOUT": str(TIMEOUT)})
    for rank, got in enumerate(ranks):
        error = got["mismatch"]
        assert error.startswith("RingTimeoutError: "), (rank, error)
        assert "different numbers of reset_ring calls" in error and \
            "{0: 0, 1: 1}" in error and "global rank 0 alone 1 time(s)" in error, (rank, error)
        assert got["after"] == 0.0, (rank, got["after"])
