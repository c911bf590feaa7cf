"""Where a :class:`~ringseq.plugin.dataloader.ShardedDataLoader` stands within its epoch, saved
and restored: a resumed run continues the epoch after the batches the saved run handed out,
without loading them again."""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from torch.utils.data import DistributedSampler

from .._args import as_int, given

__all__ = ["ResumableDistributedSampler", "LoaderPosition", "loader_settings", "state_of",
           "read_loader_state"]

_FORMAT = "ringseq.ShardedDataLoader"
_VERSION = 1
_LOAD = "ShardedDataLoader.load_state_dict"
#: seeds and epochs stay below this: the sampler seeds a torch.Generator with seed + epoch,
#: which takes [-2**63, 2**64)
INT64_LIMIT = 1 << 63


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` whose next iteration can start after this rank's first ``skip``
    indices of the epoch's order (the epoch's order itself is DistributedSampler's: seed,
    epoch, shuffle, padding and drop_last as there). The skip applies to one iteration; the
    skipped samples are never fetched (the indices are drawn in the loader's own process,
    also with worker processes)."""

    skip = 0
    #: whether the loop called set_epoch since the loader was made or loaded (the same epoch
    #: as before too, which ShardedDataLoader cannot see on the epoch itself)
    epoch_set = False
    #: set_epoch calls so far: ShardedDataLoader takes a call on the sampler
    #: (``loader.sampler.set_epoch(e)``) by this, an epoch set again as well as a new one
    epoch_calls = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch_set = True
        self.epoch_calls += 1
        super().set_epoch(epoch)

    def __iter__(self):
        # (a generator: the skip is taken when the iteration starts. A DataLoader with worker
        # processes and batch_size=None calls iter() on this sampler twice and discards the
        # first iterator unread, which would have taken the skip: the epoch restarted)
        skip, self.skip = self.skip, 0
        yield from itertools.islice(super().__iter__(), skip, None)


@dataclass(frozen=True)
class LoaderPosition:
    """A loader's place: ``step`` batches handed out in all (the ring calls' tags count them),
    ``batches`` of them in epoch ``epoch`` (the epoch its next iteration runs, or the one it
    is running)."""
    step: int
    epoch: int
    batches: int


def loader_settings(loader) -> dict:
    """The settings of a DataLoader that decide which samples its k-th batch holds, which a
    resumed epoch must share with the saved one: samples per batch, data-parallel groups,
    shuffling (and its seed), drop_last and the dataset's length."""
    s = loader.sampler
    sampled = isinstance(s, DistributedSampler)
    return {"batch_size": loader.batch_size,
            "dp_size": int(s.num_replicas) if sampled else 1,
            "shuffle": bool(s.shuffle) if sampled else False,
            "seed": int(s.seed) if sampled and s.shuffle else 0,
            "drop_last": bool(loader.drop_last),
            "dataset_length": len(loader.dataset) if hasattr(loader.dataset, "__len__") else -1}


def state_of(position: LoaderPosition, batches_per_epoch: int, settings: dict) -> dict:
    """The state dict of ``position`` in a loader of ``settings`` with ``batches_per_epoch``
    batches (plain ints and bools: torch.save, json and torch.distributed.checkpoint take it
    as it is)."""
    return {"format": _FORMAT, "version": _VERSION, "step": position.step,
            "epoch": position.epoch, "batches_in_epoch": position.batches,
            "batches_per_epoch": batches_per_epoch, **settings}


def _int_entry(state: Mapping, key: str) -> int:
    value = as_int(state[key])
    if value is None:
        raise TypeError(f"{_LOAD}: state[{key!r}] must be an int within [0, 2**63), got "
                        f"{given(state[key])}")
    if not 0 <= value < INT64_LIMIT:
        raise ValueError(f"{_LOAD}: state[{key!r}] must be an int within [0, 2**63), got "
                         f"{value}")
    return value


def read_loader_state(state, settings: dict, resumable: bool) -> LoaderPosition:
    """The position ``state`` (from ``ShardedDataLoader.state_dict``) restores into a loader of
    ``settings`` (:func:`loader_settings`).

    A position inside an epoch (some of its batches handed out, not all) resumes only where
    the loader draws the same samples for the same batch: ``resumable`` (the plugin's
    :class:`ResumableDistributedSampler`) and every setting equal to the saved one. A position
    at an epoch's start restores that epoch and the batch count under any settings; one at an
    epoch's end, the next epoch.

    Raises TypeError for a state that is not a mapping or an entry that is no int; ValueError
    for a negative entry, another format or version, a missing entry, more batches than its
    epoch has, or a position inside an epoch that this loader cannot resume (naming each
    setting that differs)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{_LOAD}: state must be the mapping ShardedDataLoader.state_dict() "
                        f"returned, got {given(state)}")
    if state.get("format") != _FORMAT or state.get("version") != _VERSION:
        raise ValueError(f"{_LOAD}: state is not a ShardedDataLoader state of version "
                         f"{_VERSION} (format {state.get('format')!r}, version "
                         f"{state.get('version')!r})")
    missing = [k for k in ("step", "epoch", "batches_in_epoch", "batches_per_epoch", *settings)
               if k not in state]
    if missing:
        raise ValueError(f"{_LOAD}: state lacks {', '.join(map(repr, missing))}")
    position = LoaderPosition(_int_entry(state, "step"), _int_entry(state, "epoch"),
                              _int_entry(state, "batches_in_epoch"))
    saved_per_epoch = _int_entry(state, "batches_per_epoch")
    if position.batches > min(position.step, saved_per_epoch):
        raise ValueError(f"{_LOAD}: state has {position.batches} batches handed out in its "
                         f"epoch, more than its epoch's {saved_per_epoch} or its "
                         f"{position.step} in all")
    if position.batches == 0:  # (first: an epoch of no batches has not ended before one)
        return position
    if position.batches == saved_per_epoch:  # the epoch ended: the next one starts afresh
        return LoaderPosition(position.step, position.epoch + 1, 0)
    if not resumable:
        raise ValueError(f"{_LOAD}: the state stopped after batch {position.batches} of "
                         f"{saved_per_epoch} in epoch {position.epoch}; resuming inside an "
                         f"epoch needs the plugin's sampler (a loader from prepare_dataloader "
                         f"or boost), which can start the epoch's order after the batches "
                         f"handed out: resume this loader at an epoch boundary")
    differ = [f"{k}: saved {state[k]!r}, this loader {v!r}" for k, v in settings.items()
              if state[k] != v]
    if differ:
        raise ValueError(f"{_LOAD}: the state stopped after batch {position.batches} of "
                         f"{saved_per_epoch} in epoch {position.epoch}, and this loader would "
                         f"not draw the same samples for the epoch's other batches "
                         f"({'; '.join(differ)}); build the loader with the saved settings, "
                         f"or resume at an epoch boundary")
    return position
