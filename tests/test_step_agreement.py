"""A rank whose step inputs fail where the others' do not raises on every rank, at once, on 2
spawned gloo ranks (CPU):

* the plugin's criterion on a batch without targets (``shift_labels``) on one rank: that rank's
  ValueError, RingPeerError naming it on the other (before: the other waited in the loss's
  agreement until the ring timeout);
* the boosted loader when one data-parallel rank's data ends before the other's (a dataset or
  sampler that is not the same length on every rank): RingMismatchError on both, at the end of
  the shorter epoch (before: the longer rank waited for the next batch's agreement, or, over
  two epochs, the shorter rank's next epoch was paired silently with the other's batches);
* a backward onto gradients a step used is refused on every rank when the model's smallest
  parameter is a tensor-parallel shard whose gradient is zero on one rank only.
"""
from __future__ import annotations

import time

import torch

from dist_utils import run_ranks
from utils import error_text

TIMEOUT = 20  # the ring timeout of these ranks: an agreement that waits for it fails the test
FAST = 10     # seconds: every error must arrive within this


def _timed(fn):
    start = time.monotonic()
    return error_text(fn), time.monotonic() - start


def _worker():
    import torch.distributed as dist
    import ringseq
    from ringseq.plugin import RingSequenceParallelPlugin
    from ringseq.plugin.wrappers import SequenceParallelLoss
    rank, out = dist.get_rank(), {}

    criterion = SequenceParallelLoss()
    logits = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(rank))
    targets = {"shift_labels": torch.tensor([[1, 2, 3, -100]])}
    batch = targets if rank == 0 else {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    out["loss"] = _timed(lambda: criterion(logits, batch))
    ringseq.reset_ring()
    out["loss_after"] = float(criterion(logits, targets))

    plugin = RingSequenceParallelPlugin(sp_size=1, precision="fp32")  # dp = 2
    # each dp rank's DistributedSampler takes half of ITS dataset: 1 batch of one sample on
    # rank 0, 2 on rank 1
    n = 2 if rank == 0 else 3
    data = [{"input_ids": torch.full((4,), i), "labels": torch.full((4,), i)} for i in range(n)]
    loader = plugin.prepare_dataloader(data, batch_size=1)
    seen = []

    def two_epochs():
        for epoch in range(2):
            loader.set_epoch(epoch)
            for b in loader:
                seen.append(int(b["input_ids"][0, 0]))

    out["loader"] = _timed(two_epochs)
    out["seen"] = seen
    # a loader without a DistributedSampler (nothing to compare up front): the rank whose data
    # ends first meets the other's next batch at "end of the data"
    from torch.utils.data import DataLoader
    from ringseq.layouts import get_layout
    from ringseq.plugin.dataloader import ShardedDataLoader
    own = ShardedDataLoader(DataLoader(data[:n - 1], batch_size=1), None,
                            get_layout("contiguous"), dp_rank=rank, shared=False)
    plain_seen = []
    out["plain_loader"] = _timed(lambda: plain_seen.extend(
        int(b["input_ids"][0, 0]) for b in own))
    out["plain_seen"] = plain_seen
    out["uncleared"] = _uncleared_gradients_with_a_sharded_parameter(rank)
    return out


def _uncleared_gradients_with_a_sharded_parameter(rank):
    """A backward onto gradients the last step used, where the model's smallest parameter is
    a tensor-parallel shard whose gradient is all zeros on rank 1 only: the step's refusal must
    not depend on that shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from ringseq.plugin.wrappers import ReducedGrads
    mesh = init_device_mesh("cpu", (2,))
    shard = torch.nn.Parameter(distribute_tensor(torch.ones(2), mesh, [Shard(0)]))  # (2,)
    whole = torch.nn.Parameter(torch.ones(3))  # (3,): larger, the same on both ranks
    weight = torch.tensor([1.0 if rank == 0 else 0.0])  # rank 1's entry gets a zero gradient
    reduced = ReducedGrads()
    reduced.watch([shard, whole])

    def backward():
        ((shard.to_local() * weight).sum() + whole.sum()).backward()
        reduced.mark()

    backward()
    reduced.check_once()
    reduced.after_step()
    backward()  # no zero_grad in between
    return error_text(reduced.check_once)


def test_a_rank_without_its_step_inputs_raises_on_every_rank():
    ranks = run_ranks(_worker, 2, timeout=120, env={"RINGSEQ_TIMEOUT": str(TIMEOUT)})
    (own, t_own), (peer, t_peer) = ranks[1]["loss"], ranks[0]["loss"]
    assert own.startswith("ValueError: ") and "shift_labels" in own, own
    assert peer.startswith("RingPeerError: ") and "[1]" in peer, peer
    assert max(t_own, t_peer) < FAST, (t_own, t_peer)
    # after reset_ring the same criterion gives the same global loss on both ranks
    assert ranks[0]["loss_after"] == ranks[1]["loss_after"]

    for rank, got in enumerate(ranks):
        error, elapsed = got["loader"]
        # the samplers' dataset lengths differ: refused at the first batch, before any batch
        # pairs (a sampler of the user's that ends early still raises at "end of the data")
        assert error.startswith("RingMismatchError: ") and "dataset length" in error, error
        assert elapsed < FAST, elapsed
        assert got["seen"] == [], got["seen"]
        error, elapsed = got["plain_loader"]
        assert error.startswith("RingMismatchError: ") and "end of the data" in error, error
        assert elapsed < FAST, elapsed
        assert got["plain_seen"] == [0], got["plain_seen"]  # the common batch only
        # every rank refuses (before: the probe was the shard, and rank 1 stepped)
        assert got["uncleared"].startswith("ValueError: OptimizerWrapper.step: a backward "
                                           "added its gradients"), (rank, got["uncleared"])
