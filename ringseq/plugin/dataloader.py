"""Data loading for (dp, sp) training: samples split over dp, sequences split over sp."""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ..data import shard_batch

__all__ = ["ShardedDataLoader"]


class ShardedDataLoader:
    """Iterates over this rank's sequence shards of its data-parallel group's batches.

    The wrapped ``loader`` samples with ``DistributedSampler(num_replicas=dp, rank=dp_rank)``,
    so the ``sp`` ranks of one ring load the SAME samples; each batch is then cut with
    ``ringseq.shard_batch(batch, sp_group, layout)`` in this process (not in loader workers,
    which have no process group).

    A batch is a mapping with ``input_ids`` (b, s) int64 (or ``inputs_embeds``), optionally
    ``labels`` (b, s) with ``ignore_index`` where there is no target, ``position_ids``,
    an all-ones ``attention_mask``. Yields dicts with ``input_ids`` (b, s / sp),
    ``position_ids`` (b, s / sp) (global positions), ``shift_labels`` (b, s / sp) (next-token
    targets, shifted before sharding) and the other keys as ``shard_batch`` returns them.

    Raises ValueError on EVERY rank when any rank's batch cannot be sharded (a length the
    layout cannot split, padding, a missing ``input_ids``): the ranks agree through one
    all-reduce of a flag per batch, since the dp groups hold different samples and a rank
    failing alone would leave the others waiting in the next collective.
    """

    def __init__(self, loader: DataLoader, sp_group, layout, dp_rank: int,
                 ignore_index: int = -100, check_group=None):
        self.loader = loader
        self.sp_group = sp_group
        self.layout = layout
        self.dp_rank = dp_rank
        self.ignore_index = ignore_index
        self.check_group = check_group

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_size(self) -> Optional[int]:
        """Samples per batch on this data-parallel group (global batch = this × dp)."""
        return self.loader.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Reshuffles (with ``shuffle=True``) consistently on all ranks; call once per epoch."""
        if isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def _shard(self, batch):
        error = None
        try:
            out = shard_batch(batch, group=self.sp_group, layout=self.layout,
                              ignore_index=self.ignore_index)
        except ValueError as exc:
            error, out = exc, None
        if dist.is_initialized() and dist.get_world_size(self.check_group) > 1:
            flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
            if str(dist.get_backend(self.check_group)) == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, group=self.check_group)
            if error is None and int(flag.item()):
                raise ValueError("a batch of another data-parallel group cannot be sharded for "
                                 "the ring (see that rank's error); this rank's batch was fine")
        if error is not None:
            raise ValueError(f"data-parallel rank {self.dp_rank}: {error}") from error
        return out

    def __iter__(self) -> Iterator[dict]:
        for batch in self.loader:
            if not isinstance(batch, dict):
                if hasattr(batch, "keys"):
                    batch = dict(batch)
                else:
                    raise ValueError(f"ShardedDataLoader needs batches that are mappings with "
                                     f"'input_ids' (b, s) (and optionally 'labels'), got a "
                                     f"{type(batch).__name__}")
            yield self._shard(batch)
