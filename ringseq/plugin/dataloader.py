"""Data loading for (dp, sp) training: samples split over dp, sequences split over sp."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from .._args import as_int, check_ignore_index, given
from .._dist import RingMismatchError
from ..data import shard_batch
from ..engine.integrity import ANY
from ..engine.ring import get_ring
from .digest import BATCH_KEYS, batch_digest, differing_digests
from .loader_state import (INT64_LIMIT, LoaderPosition, ResumableDistributedSampler,
                           loader_settings, read_loader_state, state_of)

__all__ = ["ShardedDataLoader", "pack_documents"]

# The tensor-parallel plans of transformers models (and ringseq's own) split the sequence over
# the tp ranks at the input embedding's output, which inputs_embeds bypasses.
INPUTS_EMBEDS_UNDER_TP = ("inputs_embeds is not supported with tp_size > 1 (the "
                          "tensor-parallel plan splits the sequence over the tp ranks at the "
                          "input embedding's output, which inputs_embeds bypasses); pass "
                          "input_ids, or use tp_size=1")


_SAME_BATCHES = (
    "Every rank must iterate its loader in step with the others: the same number of batches "
    "per epoch (data-parallel groups' dataset shards of one size: a DistributedSampler pads "
    "them, or set drop_last=True), the same sampler settings (seed, shuffle, drop_last, "
    "set_epoch on every rank) and one dataset length.")



def _valid_epoch(epoch, called: str) -> int:
    """``epoch`` as an int within [0, 2**63) (the sampler seeds a generator with seed + epoch,
    and a saved state holds it as int64); TypeError / ValueError naming ``called``."""
    value = as_int(epoch)
    if value is None:
        raise TypeError(f"{called}: epoch must be an int within [0, 2**63), got {given(epoch)}")
    if not 0 <= value < INT64_LIMIT:
        raise ValueError(f"{called}: epoch must be an int within [0, 2**63), got {value}")
    return value

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
    targets, shifted before sharding) and the other keys as ``shard_batch`` returns them. A
    loader boosted with its model numbers the batches it hands out, and the model tags its ring
    calls with that number (``ringseq.call_tag``).

    ``seq_multiple``: every sequence length must be a multiple of it (checked with the rest).
    Built with a ``seq_multiple`` that is no int >= 1 or an ``ignore_index`` that is no int, it
    raises TypeError / ValueError at once.

    With ``device``, each sharded batch is moved there (``non_blocking`` when the loader pins
    memory).

    Iterating a loader of no batch per epoch (no samples, or fewer per data-parallel group
    than ``batch_size`` with ``drop_last``) raises ValueError, agreed on like a batch.

    Raises on EVERY rank when any rank's batch cannot be loaded, collated or sharded (a length
    the layout cannot split, padding, a missing ``input_ids``, an exception of the dataset or
    ``collate_fn``): the ranks agree once per batch on the control channel of ``check_group``
    (one small gloo all-gather), since the dp groups hold different samples and a rank failing
    alone would leave the others waiting in the next collective. The failing rank raises its
    own error (a ValueError naming its dp rank for sharding problems, the loader's exception
    otherwise); the others ``ringseq.RingPeerError`` naming the failed ranks and their errors.
    Ranks fetching different batches (one skipped a step), or ranks of one data-parallel group
    whose batches differ (:func:`batch_digest`: another seed or sampler on one of them), raise
    ``RingMismatchError``.

    :meth:`state_dict` / :meth:`load_state_dict` save and restore where the loader stands, so
    a resumed run continues its epoch after the batches already handed out (see there).
    """

    def __init__(self, loader: DataLoader, sp_group, layout, dp_rank: int,
                 ignore_index: int = -100, check_group=None, device=None,
                 seq_multiple: int = 1, shared: bool = True):
        self.loader = loader
        # (checked here: unchecked, they failed at the first batch with Python's messages)
        multiple = as_int(seq_multiple)
        if multiple is None:
            raise TypeError(f"ShardedDataLoader: seq_multiple must be an int >= 1, got "
                            f"{given(seq_multiple)}")
        if multiple < 1:
            raise ValueError(f"ShardedDataLoader: seq_multiple must be an int >= 1, got "
                             f"{seq_multiple!r}")
        ignored = check_ignore_index("ShardedDataLoader", ignore_index)
        #: what every sequence length must be a multiple of beyond the layout's own rule
        #: (sp x tp with tensor parallelism: ParallelDims.seq_multiple)
        self.seq_multiple = multiple
        self.device = None if device is None else torch.device(device)
        self.sp_group = sp_group
        self.layout = layout
        self.dp_rank = dp_rank
        self.ignore_index = ignored
        self.check_group = check_group
        #: whether other ranks load this rank's samples too (sequence / tensor parallelism):
        #: then each batch's digest is compared among them
        self.shared = shared
        #: set by ``Booster.boost`` when the model's tensor-parallel plan needs input_ids:
        #: batches with inputs_embeds are then refused here, agreed on by every rank
        self.needs_input_ids = False
        self.step = 0  # batches yielded so far, over all epochs (the same on every rank)
        #: the iteration whose position the state holds while it can still yield (a token of
        #: the latest one started; None when it ended), and whether set_epoch was called
        #: while it ran (its position then gives way to the set epoch's start when it ends)
        self._current: Optional[object] = None
        self._epoch_set_while_live = False
        self._epoch = 0  # the epoch set last (set_epoch), which the next iteration runs
        #: the sampler's set_epoch calls (ResumableDistributedSampler.epoch_calls) as of the
        #: loader's last look: more since are the sampler idiom's, the same epoch's too
        self._sampler_calls = getattr(loader.sampler, "epoch_calls", 0)
        #: the epoch of the latest iteration and the batches it handed out (None: none yet)
        self._iterated: Optional[LoaderPosition] = None
        #: a position inside an epoch that load_state_dict restored, for the next iteration
        self._resume: Optional[LoaderPosition] = None
        #: set by ``Booster.boost``: the boosted model's StepTag, which tags its ring calls
        #: with the number of the batch this loader handed out last
        self.tag = None

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
        """Reshuffles (with ``shuffle=True``) consistently on all ranks; call once per epoch.

        After an iteration (a whole one, or one left with ``break``), the loader stands at the
        start of ``epoch``, which its next iteration runs from its first batch:
        :meth:`state_dict` saves that, not the batches of the iteration left behind. Called
        while an iteration can still yield (a loop running, or an iterator kept), the sampler's
        epoch and :attr:`epoch` change at once, but the running iteration goes on with its
        own samples and :meth:`state_dict` saves its position until it ends (CPython ends a
        loop's iteration at ``break``; elsewhere at garbage collection). A position restored
        by :meth:`load_state_dict` is kept: ``set_epoch(loader.epoch)`` resumes it.

        ``loader.sampler.set_epoch(epoch)`` (DistributedSampler's idiom) counts as this call:
        the loader takes the sampler's epoch when iterated or asked for its :attr:`epoch` or
        :meth:`state_dict`.

        Raises TypeError for an ``epoch`` that is not an int, ValueError for one below 0 or
        from 2**63 on (neither the sampler's seed nor a saved state takes it)."""
        epoch = _valid_epoch(epoch, "ShardedDataLoader.set_epoch")
        if self._current is not None:  # (the running iteration goes on: saved as it stands)
            self._epoch_set_while_live = True
        else:
            self._iterated = None  # (the next iteration starts the set epoch from its start)
        self._epoch = epoch
        if isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(epoch)
            self._sampler_calls = getattr(self.loader.sampler, "epoch_calls", 0)

    def _take_sampler_epoch(self, called: str) -> None:
        """Takes an epoch set on the DistributedSampler itself (``loader.sampler.set_epoch``,
        which orders the samples) as :meth:`set_epoch`: without it the loader kept saving
        the epoch it set last, and a resumed run followed another epoch's order, training
        twice on some samples and never on others. TypeError / ValueError, naming
        ``called``, for an epoch :meth:`set_epoch` refuses."""
        sampler = self.loader.sampler
        # (the same epoch set again counts too: after a loop left with `break`, it restarts
        # that epoch, as loader.set_epoch does; before, the loader kept the broken loop's
        # position, and a resumed run skipped batches the uninterrupted one trained on. A
        # sampler not the plugin's shows its calls by a changed epoch only)
        if isinstance(sampler, DistributedSampler) and (
                sampler.epoch != self._epoch
                or getattr(sampler, "epoch_calls", 0) != self._sampler_calls):
            self.set_epoch(_valid_epoch(sampler.epoch, f"{called}: loader.sampler's epoch"))

    @property
    def epoch(self) -> int:
        """The epoch set last (:meth:`set_epoch`, on the sampler too, or restored by
        :meth:`load_state_dict`)."""
        self._take_sampler_epoch("ShardedDataLoader.epoch")
        return self._epoch

    def state_dict(self) -> dict:
        """Where this loader stands: the epoch of its latest iteration (or the epoch set, before
        any), the batches of it handed out, the batches handed out in all, and the settings
        that decide which samples a batch holds (batch size, data-parallel groups, shuffle,
        seed, drop_last, dataset length). A batch handed out counts as trained on: save after
        its optimizer step. The same on every rank (save it from any one); plain ints and
        bools, for ``torch.save``, json or ``torch.distributed.checkpoint`` (the loader is a
        ``Stateful``). TypeError for a loader whose dataset has no length (an
        ``IterableDataset``): where its epochs end cannot be saved."""
        self._take_sampler_epoch("ShardedDataLoader.state_dict")
        # (a restored position not iterated yet is still where the loader stands)
        position = self._resume or self._iterated or LoaderPosition(self.step, self._epoch, 0)
        try:
            batches_per_epoch = len(self.loader)
        except TypeError:
            raise TypeError(f"ShardedDataLoader.state_dict: the loader's dataset "
                            f"({type(self.loader.dataset).__name__}) has no length, so where "
                            f"its epochs end (and this loader's position) cannot be saved; "
                            f"save the position of the dataset's own stream instead") from None
        sampler = self.loader.sampler
        if (position.batches and position.batches == batches_per_epoch
                and isinstance(sampler, ResumableDistributedSampler) and not sampler.epoch_set):
            # A loop that never set the epoch runs the ended one again (DistributedSampler's
            # order without set_epoch): its next iteration starts that epoch, which a state
            # that says it ended would resume as the next (before: other samples than the
            # uninterrupted run's). The plugin's sampler records its set_epoch (this loader's
            # and the sampler idiom's); other samplers' states assume the next epoch is set.
            position = LoaderPosition(position.step, position.epoch, 0)
        return state_of(LoaderPosition(self.step, position.epoch, position.batches),
                        batches_per_epoch, loader_settings(self.loader))

    def load_state_dict(self, state) -> None:
        """Restores :meth:`state_dict`'s position; collective (every rank, before iterating).

        The batch count continues from the saved one, and :attr:`epoch` becomes the saved
        epoch (the next one when the saved epoch had ended). A state saved inside an epoch
        makes the next iteration hand out that epoch's remaining batches, the same samples
        the uninterrupted run would have trained on, without loading the others; it needs the
        plugin's sampler (a loader from ``prepare_dataloader`` or ``boost``) and the saved
        settings, and that iteration raises ValueError on every rank if another epoch was set
        since (``set_epoch(loader.epoch)`` is fine). A state at an epoch boundary loads under
        any settings (another mesh, batch size or dataset).

        Raises on every rank: TypeError / ValueError for a state this loader cannot resume
        (see :func:`ringseq.plugin.loader_state.read_loader_state`) on the ranks given it,
        ``RingPeerError`` on the others; ``RingMismatchError`` when ranks load different
        positions."""
        sampler = self.loader.sampler
        try:
            position, error = read_loader_state(
                state, loader_settings(self.loader),
                resumable=isinstance(sampler, ResumableDistributedSampler)), None
        except (TypeError, ValueError) as exc:
            position, error = LoaderPosition(0, 0, 0), exc
        if dist.is_initialized():
            get_ring(self.check_group).agree(
                error is None, str(error), error=error, about="loader state",
                called="ShardedDataLoader.load_state_dict",
                hint="Every rank loads the same loader state (state_dict() is the same on "
                     "every rank: save it from one).",
                fields=(("batches handed out", position.step), ("epoch", position.epoch),
                        ("batches of the epoch", position.batches)))
        elif error is not None:
            raise error
        self.step = position.step
        self._current = None  # (an iterator from before the load no longer saves its place)
        self.set_epoch(position.epoch)
        if isinstance(sampler, ResumableDistributedSampler):
            sampler.epoch_set = False  # (this set_epoch is the load's, not the loop's)
        self._iterated = None
        self._resume = position if position.batches else None

    def __len__(self) -> int:
        return len(self.loader)

    def _to_device(self, batch: dict) -> dict:
        if self.device is None:
            return batch
        # pinned host memory makes the copy asynchronous; the model's first kernel on the
        # same stream orders after it
        non_blocking = bool(getattr(self.loader, "pin_memory", False))
        return {k: v.to(self.device, non_blocking=non_blocking) if torch.is_tensor(v) else v
                for k, v in batch.items()}

    def _next_shard(self, it, error: Optional[BaseException] = None):
        """This rank's next sharded batch, or None at the end; raises on every rank when any
        rank's batch fails to load, collate or shard (or ``error`` is given: a failure before
        the batch, agreed on like one of the batch)."""
        out, ended = None, False
        try:
            if error is not None:
                raise error
            batch = next(it)
        except StopIteration:
            # DistributedSampler gives every dp group the same number of batches, but a
            # sampler or dataset of the user's may not: the end is agreed on like a batch, so
            # a rank that ends early raises with the others instead of leaving them waiting
            # (or pairing its next epoch's batches with their current one's).
            ended = True
        except Exception as exc:  # noqa: BLE001 - re-raised on this rank after agreeing
            error = exc
            if isinstance(exc, RuntimeError) and self.loader.collate_fn is default_collate \
                    and "stack expects each tensor to be equal size" in str(exc):
                # (torch's default collate, given samples of other lengths)
                error = ValueError(f"ShardedDataLoader (batch {self.step + 1}): the batch's "
                                   f"samples have different lengths, which the default collate "
                                   f"cannot stack ({exc}); prepare_dataloader(..., pack=True) "
                                   f"packs them into one row of documents, or pad them to one "
                                   f"length")
                error.__cause__ = exc
        if error is None and not ended:
            try:
                if not isinstance(batch, dict):
                    if not hasattr(batch, "keys"):
                        raise ValueError(f"ShardedDataLoader needs batches that are mappings "
                                         f"with 'input_ids' (b, s) (and optionally 'labels'), "
                                         f"got a {type(batch).__name__}")
                    batch = dict(batch)
                if self.needs_input_ids and batch.get("inputs_embeds") is not None:
                    raise ValueError(INPUTS_EMBEDS_UNDER_TP)
                out = shard_batch(batch, group=self.sp_group, layout=self.layout,
                                  ignore_index=self.ignore_index)
                ids = batch.get("input_ids")
                if self.seq_multiple > 1 and torch.is_tensor(ids) and \
                        ids.shape[-1] % self.seq_multiple:
                    raise ValueError(f"ShardedDataLoader (batch {self.step + 1}): a sequence of "
                                     f"{ids.shape[-1]} tokens cannot be split over the "
                                     f"sequence- and tensor-parallel ranks: its length must be "
                                     f"a multiple of {self.seq_multiple} (seq_multiple)")
            except ValueError as exc:
                error = ValueError(f"data-parallel rank {self.dp_rank}: {exc}")
                error.__cause__ = exc
            except Exception as exc:  # noqa: BLE001 - re-raised on this rank after agreeing
                error = exc
        # A rank failing alone (its dp group reads other samples) would leave the others
        # waiting in their next collective, so every batch is agreed on, errors of the loader
        # itself (dataset, collate_fn) included -- on the control channel, with the batch's
        # number: ranks at different batches raise instead of pairing their steps.
        # The batch's digest and the rank's dp rank travel along, not compared there (the dp
        # groups load different samples): the ranks of one dp group must hold the same samples,
        # or each ring would pair shards of different sequences without a word.
        if dist.is_initialized():
            ring = get_ring(self.check_group)
            compare = self.shared and ring.checks_on and out is not None
            rows = ring.agree(
                error is None, str(error), error=error, about="batch",
                called=f"ShardedDataLoader (batch {self.step + 1})", hint=_SAME_BATCHES,
                fields=(("batch number", self.step + 1), ("end of the data", int(ended)),
                        ("data-parallel rank", self.dp_rank, ANY),
                        ("batch digest", batch_digest(batch) if compare else 0, ANY))
                + self._sampler_fields())
            if rows is not None:
                self._check_same_samples(rows)
        elif error is not None:
            raise error
        return None if ended else self._to_device(out)

    def _no_batches(self) -> bool:
        """Whether the wrapped loader has a length, and it is 0 batches."""
        try:
            return len(self.loader) == 0
        except TypeError:  # (an iterable-style dataset without a length)
            return False

    def _sampler_fields(self) -> tuple:
        """The DistributedSampler's settings, compared over every rank with each batch: dp
        groups whose samplers differ in seed, epoch (set_epoch on some ranks only), shuffle,
        drop_last or dataset length would split the data inconsistently, some samples seen
        twice and others never, which no batch digest can tell (they hold other samples by
        design)."""
        s = getattr(self.loader, "sampler", None)
        if not isinstance(s, DistributedSampler):  # (the same words on every rank: zeros)
            return (("sampler seed", 0), ("sampler epoch", 0), ("sampler shuffle", 0),
                    ("sampler drop_last", 0), ("dataset length", 0))
        # seed and epoch order the samples only when shuffling (the loader's epoch: the
        # sampler's once taken, and an int where the sampler was given something else)
        return (("sampler seed", int(s.seed) % (1 << 62) if s.shuffle else 0),
                ("sampler epoch", self._epoch if s.shuffle else 0),
                ("sampler shuffle", int(bool(s.shuffle))),
                ("sampler drop_last", int(bool(s.drop_last))),
                ("dataset length", len(s.dataset)))

    def _check_same_samples(self, rows) -> None:
        """RingMismatchError (on every rank: every rank judges the same gathered rows) when
        ranks of one data-parallel group loaded different batches."""
        split = differing_digests([(row[2], row[3]) for row in rows])  # (dp rank, digest)
        if split:
            detail = "; ".join(f"data-parallel rank {dp}: {ranks}" for dp, ranks in split.items())
            raise RingMismatchError(
                f"ShardedDataLoader: batch {self.step + 1} differs between the ranks of one "
                f"data-parallel group (digests of its {' / '.join(BATCH_KEYS)}: {detail}); "
                f"its sequence- and tensor-parallel ranks must load the same samples (the same "
                f"dataset order, sampler and seed: prepare_dataloader's sampler does), or each "
                f"ring pairs shards of different sequences")

    def __iter__(self) -> Iterator[dict]:
        resume, skipped, error = self._resume, 0, None
        try:
            self._take_sampler_epoch("ShardedDataLoader")
        except (TypeError, ValueError) as exc:  # (agreed on like a failed batch)
            error = exc
        if error is not None:
            pass
        elif self._no_batches():
            # (agreed on like a failed batch: another dp group's loader may have batches)
            error = ValueError(
                f"ShardedDataLoader: data-parallel rank {self.dp_rank}'s loader gives no batch "
                f"per epoch ({len(self.dataset)} samples, batch_size {self.batch_size}, "
                f"drop_last={bool(self.loader.drop_last)}): a training loop over it would do "
                f"nothing")
        elif resume is not None and resume.epoch != self._epoch:  # (kept for a retry)
            error = ValueError(
                f"ShardedDataLoader: load_state_dict restored epoch {resume.epoch} after batch "
                f"{resume.batches}, then set_epoch({self._epoch}) was called: resume epoch "
                f"{resume.epoch} (loader.epoch) first, or load the state after set_epoch")
        elif resume is not None:
            # the sampler starts this epoch's order after the batches handed out: they are not
            # fetched (nor their samples read) again
            skipped, self._resume = resume.batches, None
            # (batch_size=None: each index the sampler gives is one batch)
            self.loader.sampler.skip = skipped * (self.loader.batch_size or 1)
        # (the position counts this iteration's epoch and batches: a set_epoch while it runs
        # changes the next iteration, not this one)
        epoch, batches = self._epoch, skipped
        if error is None:
            self._iterated = LoaderPosition(self.step, epoch, batches)
        it = iter(self.loader) if error is None else None  # (no workers started to refuse)
        # (the latest iteration started owns the position: an older one still running, e.g.
        # an outer loop around an inner one, no longer writes it)
        token = self._current = object()
        self._epoch_set_while_live = False
        try:
            while True:
                out = self._next_shard(it, error)
                if out is None and batches == 0:
                    # (a loader without a length, an iterable dataset, that yielded nothing: the
                    # end was agreed on at batch 1 by every rank, which all raise here)
                    raise ValueError(
                        f"ShardedDataLoader: data-parallel rank {self.dp_rank}'s loader gave no "
                        f"batch this epoch (its dataset, {type(self.dataset).__name__}, yielded "
                        f"nothing): a training loop over it would do nothing")
                if out is None:
                    return
                self.step += 1
                batches += 1
                if self._current is token:
                    self._iterated = LoaderPosition(self.step, epoch, batches)
                if self.tag is not None:
                    self.tag.value = self.step
                yield out
        finally:
            # (also on `break`: the loop drops the generator, which closes it here)
            if self._current is token:
                self._current = None
                if self._epoch_set_while_live:  # the next iteration starts the set epoch
                    self._iterated = None


def pack_documents(samples, multiple: int = 1, ignore_index: int = -100) -> dict:
    """Collate function packing samples of any lengths into ONE row of documents.

    ``samples``: mappings with ``input_ids`` (s_i,) or (1, s_i) (a list, array or integer
    tensor; a tokenizer's ``return_tensors="pt"`` gives (1, s_i)) and optionally ``labels`` of
    the same shape (None: the input ids). Returns int64 ``input_ids`` / ``labels`` (1, total),
    ``position_ids`` (1, total) restarting at 0 in every
    document, and ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 boundaries) -- the format of
    transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, which
    ``ringseq.shard_batch`` shards. ``labels`` default to the input ids. When ``total`` is not
    a multiple of ``multiple`` (the ring's size), a padding document of the missing tokens is
    appended: token id 0, labels ``ignore_index``; as its own document it is seen by no real
    token, so the real documents' attention and loss are unchanged.

    Raises ValueError for no samples, samples without a token in all, a sample without
    ``input_ids``, ids or labels of another shape or of floats / bools, and ``multiple`` < 1;
    TypeError for a sample that is not a mapping and a ``multiple`` or ``ignore_index`` that
    is not an int.
    """
    round_to = as_int(multiple)
    if round_to is None:
        raise TypeError(f"pack_documents: multiple must be an int, got {given(multiple)}")
    ignore = check_ignore_index("pack_documents", ignore_index)
    if round_to < 1:
        raise ValueError(f"pack_documents: multiple must be an int >= 1 (what the packed "
                         f"length is rounded up to), got {round_to}")
    try:
        # (one sample given alone was iterated by its keys: "samples[0] ... got 'input_ids'";
        # None gave Python's "'NoneType' object is not iterable")
        if isinstance(samples, (Mapping, str, bytes)):
            raise TypeError
        samples = list(samples)  # (a sequence with __getitem__ only, e.g. a Subset, too)
    except TypeError:
        raise TypeError(f"pack_documents: samples must be a list of mappings with 'input_ids' "
                        f"(s,), got {given(samples)}") from None
    if not samples:
        raise ValueError("pack_documents: samples is empty; a batch needs at least one sample")
    ids, labels, cu = [], [], [0]
    for i, sample in enumerate(samples):
        if not isinstance(sample, Mapping) or sample.get("input_ids") is None:
            kind = ValueError if isinstance(sample, Mapping) else TypeError
            got = (f"keys {sorted(map(str, sample))}" if isinstance(sample, Mapping)
                   else given(sample))
            raise kind(f"pack_documents: samples[{i}] must be a mapping with 'input_ids' (s,), "
                       f"got {got}")
        x = _token_ids(sample["input_ids"], f"samples[{i}]['input_ids']")
        given_labels = sample.get("labels")
        y = x if given_labels is None else _token_ids(given_labels, f"samples[{i}]['labels']")
        if y.shape != x.shape:
            raise ValueError(f"pack_documents: samples[{i}]['labels'] has {y.numel()} tokens, "
                             f"its input_ids {x.numel()}")
        ids.append(x)
        labels.append(y)
        cu.append(cu[-1] + x.numel())
    if cu[-1] == 0:
        raise ValueError(f"pack_documents: the {len(samples)} samples hold no token; a batch "
                         f"needs at least one")
    pad = (-cu[-1]) % round_to
    if pad:
        ids.append(torch.zeros(pad, dtype=torch.long))
        labels.append(torch.full((pad,), ignore, dtype=torch.long))
        cu.append(cu[-1] + pad)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    position_ids = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])  # (total,)
    return {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
            "position_ids": position_ids[None], "cu_seq_lens_q": cu_t, "cu_seq_lens_k": cu_t}


def _token_ids(value, name: str) -> torch.Tensor:
    """``value`` (a list, array or tensor of token ids or labels, (s,) or (1, s)) as an int64
    (s,) tensor: an empty list is not torch's default float32, which would turn the whole
    packed row into floats; a narrow type (uint8) would wrap the padding's ignore_index into
    a real target; float or bool ids are refused (truncating 2.7 would pick another token), and
    so are other shapes (a (2, s) sample flattened would run two sequences as one document)."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"pack_documents: {name} must be a list, array or tensor of token ids "
                         f"(s,), got {given(value)}: {exc}") from None
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"pack_documents: {name} must have shape (s,) or (1, s), got "
                         f"{tuple(t.shape)}")
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"pack_documents: {name} must hold integer token ids, got {t.dtype}")
    return t.to(torch.long)
