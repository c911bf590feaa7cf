"""A resumed run continues its loader's epoch: ``ShardedDataLoader.state_dict`` saved after some
batches and ``load_state_dict`` in a new loader give the batches the uninterrupted run would
have handed out next (same samples, same shards, same batch numbers), without fetching the
ones already trained on; a state the new loader cannot resume is refused on every rank.

Before: the loader had no state; a resumed run started its epoch again, training twice on the
batches before the checkpoint."""
from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_ranks
from utils import error_text


class _Samples(torch.utils.data.Dataset):
    """20 samples of 8 tokens, sample i all i; records the indices it is asked for."""

    def __init__(self, n=20):
        self.n, self.fetched = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.fetched.append(i)
        return {"input_ids": torch.arange(8) + 100 * i, "idx": i}


class _WholeBatches(_Samples):
    """Items that are whole batches (``prepare_dataloader(batch_size=None)``): item i is one
    sample of 8 tokens, all i."""

    def __getitem__(self, i):
        self.fetched.append(i)
        return {"input_ids": (torch.arange(8) + 100 * i).view(1, 8), "idx": torch.tensor([i])}


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter({"input_ids": torch.arange(8) + 100 * i, "idx": i} for i in range(6))


def _batches(loader, n=None):
    """(sample ids, this rank's token shard) of the next n batches (all with n None)."""
    out = []
    for batch in loader:
        out.append((batch["idx"].tolist(), batch["input_ids"].tolist()))
        if n is not None and len(out) == n:
            break
    return out


def _worker(tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ringseq.plugin import RingSequenceParallelPlugin
    from ringseq.plugin.dataloader import ShardedDataLoader
    rank, out = dist.get_rank(), {}
    plugin = RingSequenceParallelPlugin(sp_size=2)  # W=4: dp 2 x sp 2

    def loader(batch_size=2, data=None):
        return plugin.prepare_dataloader(data or _Samples(), batch_size=batch_size,
                                         shuffle=True, seed=7)

    full = loader()  # the uninterrupted run: epochs 0 and 1
    out["full"] = {}
    for epoch in (0, 1):
        full.set_epoch(epoch)
        out["full"][epoch] = _batches(full)
    out["full_step"] = full.step

    run = loader()  # the interrupted run: epoch 0, then 2 batches of epoch 1
    run.set_epoch(0)
    _batches(run)
    out["end_of_epoch_0"] = run.state_dict()
    run.set_epoch(1)
    out["before_checkpoint"] = _batches(run, 2)
    inside = run.state_dict()
    out["inside"] = inside
    path = os.path.join(tmp, "loader.pt")
    if rank == 0:
        torch.save(inside, path)
    dist.barrier()

    data = _Samples()
    resumed = loader(data=data)
    resumed.load_state_dict(torch.load(path))
    out["resumed_epoch"] = resumed.epoch
    out["saved_again_before_iterating"] = resumed.state_dict()  # (before: batch 0 of the epoch)
    resumed.set_epoch(resumed.epoch)  # a loop's set_epoch(loader.epoch) is fine
    out["resumed"] = _batches(resumed)
    out["resumed_step"] = resumed.step
    out["fetched"] = sorted(data.fetched)
    resumed.set_epoch(2)  # the next epoch is whole again
    out["next_epoch_length"] = len(_batches(resumed))

    left = loader()  # an epoch left with `break`, then the next epoch set and saved
    left.set_epoch(0)
    _batches(left, 2)
    left.set_epoch(1)
    out["after_break"] = left.state_dict()  # (before: epoch 0 after batch 2)
    again = loader()
    again.load_state_dict(out["after_break"])
    again.set_epoch(again.epoch)
    out["after_break_resumed"] = _batches(again)
    left.set_epoch(1)  # the same epoch set again: its next iteration runs it from its start
    _batches(left, 1)
    left.set_epoch(1)
    out["same_epoch_again"] = left.state_dict()
    # set_epoch inside the loop (a callback near the epoch's end): the running epoch is saved
    # as it stands while it runs, and the set epoch's start once the loop is left
    looped = loader()
    looped.set_epoch(0)
    for i, _ in enumerate(looped):
        if i == 1:
            looped.set_epoch(1)
            out["set_inside_running"] = looped.state_dict()
        if i == 2:
            break
    out["set_inside_left"] = looped.state_dict()
    # a step loop's kept iterator: its position while it can yield, the set epoch's start
    # once it is dropped
    kept = loader()
    kept.set_epoch(0)
    it = iter(kept)
    next(it), next(it)
    kept.set_epoch(1)
    out["kept_iterator"] = kept.state_dict()
    del it
    out["kept_iterator_dropped"] = kept.state_dict()

    stateful = loader()  # torch.distributed.checkpoint takes the loader as a Stateful
    dcp.save({"loader": run}, checkpoint_id=os.path.join(tmp, "dcp"))
    dcp.load({"loader": stateful}, checkpoint_id=os.path.join(tmp, "dcp"))
    out["resumed_through_dcp"] = _batches(stateful)

    boundary = loader(batch_size=4)  # an epoch's end loads under other settings
    boundary.load_state_dict(out["end_of_epoch_0"])
    out["boundary"] = (boundary.epoch, boundary.step, len(_batches(boundary)))

    out["other_batch_size"] = error_text(lambda: loader(batch_size=4).load_state_dict(inside))
    retry = loader()
    retry.load_state_dict(inside)
    retry.set_epoch(0)
    out["other_epoch"] = error_text(lambda: _batches(retry))
    retry.set_epoch(1)
    out["after_other_epoch"] = _batches(retry)
    out["different_states"] = error_text(lambda: loader().load_state_dict(
        inside if rank else out["end_of_epoch_0"]))
    out["one_rank_bad"] = error_text(lambda: loader().load_state_dict(
        {k: v for k, v in inside.items() if k != "seed"} if rank == 1 else inside))
    out["not_a_state"] = error_text(lambda: loader().load_state_dict(5))
    out["negative_step"] = error_text(lambda: loader().load_state_dict({**inside, "step": -1}))
    plain = ShardedDataLoader(torch.utils.data.DataLoader(_Samples(), batch_size=2),
                              plugin.sp_group, plugin.data_layout, plugin.dp_rank)
    out["plain_sampler"] = error_text(lambda: plain.load_state_dict(inside))
    # items that are whole batches resume inside an epoch too (before: refused, telling to
    # use prepare_dataloader, which made the loader)
    whole = loader(batch_size=None, data=_WholeBatches())
    whole.set_epoch(1)
    out["whole_full"] = _batches(whole)
    whole.set_epoch(1)
    _batches(whole, 3)
    whole_resumed = loader(batch_size=None, data=_WholeBatches())
    whole_resumed.load_state_dict(whole.state_dict())
    whole_resumed.set_epoch(whole_resumed.epoch)
    out["whole_resumed"] = _batches(whole_resumed)
    # (before: torch's or the sampler's errors, later; a negative epoch saved, then refused)
    out["epoch_str"] = error_text(lambda: loader().set_epoch("1"))
    out["epoch_negative"] = error_text(lambda: loader().set_epoch(-1))
    # (before: accepted, then torch's "Overflow when unpacking long long" at the first batch)
    out["epoch_big"] = error_text(lambda: loader().set_epoch(2 ** 64))
    state = loader().state_dict()
    state["epoch"] = 2 ** 64
    out["state_epoch_big"] = error_text(lambda: loader().load_state_dict(state))
    stream = ShardedDataLoader(torch.utils.data.DataLoader(_Stream(), batch_size=2),
                               plugin.sp_group, plugin.data_layout, plugin.dp_rank)
    out["stream_batches"] = len(_batches(stream))
    out["stream_state"] = error_text(stream.state_dict)  # (before: len()'s bare TypeError)
    # DistributedSampler's idiom, loader.sampler.set_epoch, sets the loader's epoch (before:
    # the state saved epoch 0, and the resumed run followed epoch 0's order)
    idiom = loader()
    idiom.sampler.set_epoch(1)
    out["sampler_idiom_epoch"] = idiom.epoch
    out["sampler_idiom_before"] = _batches(idiom, 2)
    idiom_resumed = loader()
    idiom_resumed.load_state_dict(idiom.state_dict())
    idiom_resumed.sampler.set_epoch(idiom_resumed.epoch)
    out["sampler_idiom_resumed"] = _batches(idiom_resumed)
    # a loop that never calls set_epoch repeats epoch 0's order, live and after a resume
    # (before: a state saved at the epoch's end resumed epoch 1's order, other samples)
    unset = loader()
    out["unset_live"] = [_batches(unset), _batches(unset)]
    out["unset_epoch"] = unset.epoch
    unset = loader()
    _batches(unset)
    state = unset.state_dict()  # (the start of the epoch the loop runs again)
    out["unset_state"] = (state["epoch"], state["batches_in_epoch"])
    unset_resumed = loader()
    unset_resumed.load_state_dict(state)
    out["unset_resumed"] = _batches(unset_resumed)
    unset_resumed.set_epoch(0)  # (set after the load: its end now resumes epoch 1)
    _batches(unset_resumed)
    after_set = loader()
    after_set.load_state_dict(unset_resumed.state_dict())
    out["unset_set_after_load"] = after_set.epoch
    # the sampler idiom with the epoch the loader already has is a set epoch too
    idiom0 = loader()
    idiom0.sampler.set_epoch(0)
    _batches(idiom0)
    after_idiom0 = loader()
    after_idiom0.load_state_dict(idiom0.state_dict())
    out["idiom0_resumed_epoch"] = after_idiom0.epoch
    # the sampler idiom setting the epoch it has again, after a loop left with break
    again = loader()
    again.sampler.set_epoch(1)
    _batches(again, 2)
    again.sampler.set_epoch(1)
    out["idiom_again_state"] = again.state_dict()
    again_resumed = loader()
    again_resumed.load_state_dict(out["idiom_again_state"])
    again_resumed.sampler.set_epoch(again_resumed.epoch)
    out["idiom_again_resumed"] = _batches(again_resumed)
    bad = loader()
    bad.sampler.set_epoch(-1 if rank == 1 else 0)
    out["sampler_epoch_bad"] = error_text(lambda: _batches(bad))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    return run_ranks(_worker, 4, str(tmp_path_factory.mktemp("loader")), timeout=240)


def test_a_resumed_epoch_hands_out_the_uninterrupted_runs_remaining_batches(w4):
    for r in w4:
        assert r["before_checkpoint"] == r["full"][1][:2]
        assert r["resumed_epoch"] == 1
        assert r["saved_again_before_iterating"] == r["inside"]
        assert r["resumed"] == r["full"][1][2:]
        assert r["resumed_through_dcp"] == r["full"][1][2:]
        assert r["after_other_epoch"] == r["full"][1][2:]
        assert r["resumed_step"] == r["full_step"]  # the ring calls' tags continue
        assert r["next_epoch_length"] == len(r["full"][0])
    # the two dp groups together still see every sample once in the resumed epoch
    ids = sorted(i for r in w4[::2] for b in r["before_checkpoint"] + r["resumed"] for i in b[0])
    assert ids == list(range(20))


def test_items_that_are_whole_batches_resume_inside_an_epoch(w4):
    for r in w4:
        assert len(r["whole_full"]) == 10 and r["whole_resumed"] == r["whole_full"][3:], r


def test_bad_epochs_and_a_loader_without_a_length_are_named(w4):
    for r in w4:
        assert r["epoch_str"] == ("TypeError: ShardedDataLoader.set_epoch: epoch must be an "
                                  "int within [0, 2**63), got '1' (str)"), r["epoch_str"]
        assert r["epoch_negative"] == ("ValueError: ShardedDataLoader.set_epoch: epoch must be "
                                       "an int within [0, 2**63), got -1"), r["epoch_negative"]
        assert r["epoch_big"] == ("ValueError: ShardedDataLoader.set_epoch: epoch must be an "
                                  "int within [0, 2**63), got 18446744073709551616"), r
        assert r["state_epoch_big"] == ("ValueError: ShardedDataLoader.load_state_dict: "
                                        "state['epoch'] must be an int within [0, 2**63), got "
                                        "18446744073709551616"), r["state_epoch_big"]
        assert r["stream_batches"] == 3
        assert r["stream_state"].startswith("TypeError: ShardedDataLoader.state_dict: the "
                                            "loader's dataset (_Stream) has no length"), r


def test_an_epoch_set_on_the_sampler_is_the_loaders_epoch(w4):
    """``loader.sampler.set_epoch(e)`` (DistributedSampler's idiom) counts as
    ``loader.set_epoch(e)``: the loader's epoch, the state it saves and the resumed run."""
    for rank, r in enumerate(w4):
        assert r["sampler_idiom_epoch"] == 1
        assert r["sampler_idiom_before"] + r["sampler_idiom_resumed"] == r["full"][1]
        expected = ("ValueError: ShardedDataLoader: loader.sampler's epoch: epoch must be an "
                    "int within [0, 2**63), got -1") if rank == 1 else "RingPeerError"
        assert r["sampler_epoch_bad"].startswith(expected), (rank, r["sampler_epoch_bad"])


def test_the_sampler_idiom_setting_the_same_epoch_again_restarts_it(w4):
    """After a loop left with ``break``, ``loader.sampler.set_epoch(e)`` with the epoch the
    loader has restarts epoch ``e``, as ``loader.set_epoch(e)`` does (before: the left loop's
    position was saved, and the resumed run skipped the epoch's first two batches, which the
    uninterrupted run trains on)."""
    for r in w4:
        state = r["idiom_again_state"]
        assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (2, 1, 0)
        assert r["idiom_again_resumed"] == r["full"][1]


def test_the_batches_before_the_checkpoint_are_not_fetched_again(w4):
    for r in w4:
        assert r["fetched"] == sorted(i for b in r["full"][1][2:] for i in b[0])


def test_the_state_is_the_same_on_every_rank_and_plain(w4):
    assert all(r["inside"] == w4[0]["inside"] for r in w4)
    state = w4[0]["inside"]
    assert (state["step"], state["epoch"], state["batches_in_epoch"],
            state["batches_per_epoch"]) == (7, 1, 2, 5)
    assert {type(v) for v in state.values()} <= {int, bool, str}


def test_an_epoch_left_with_break_is_not_resumed_after_the_next_epoch_is_set(w4):
    """Before: the state kept the left epoch's position, and the resumed run trained on its
    three remaining batches, which the uninterrupted run never saw."""
    for r in w4:
        state = r["after_break"]
        assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (2, 1, 0)
        assert r["after_break_resumed"] == r["full"][1]
        state = r["same_epoch_again"]
        assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (3, 1, 0)
        # (before: epoch 1 while epoch 0 still ran, so its other batches were lost on resume)
        state = r["set_inside_running"]
        assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (2, 0, 2)
        state = r["set_inside_left"]
        assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (3, 1, 0)
        state = r["kept_iterator"]
        assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (2, 0, 2)
        state = r["kept_iterator_dropped"]
        assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (2, 1, 0)


def test_a_loop_without_set_epoch_runs_the_epochs_a_resumed_run_runs(w4):
    for r in w4:
        assert r["unset_live"] == [r["full"][0], r["full"][0]]
        assert r["unset_epoch"] == 0
        assert r["unset_resumed"] == r["full"][0]
        assert r["unset_state"] == (0, 0), r["unset_state"]
        assert r["unset_set_after_load"] == 1
        assert r["idiom0_resumed_epoch"] == 1


def test_a_state_of_an_epoch_with_no_batches_keeps_its_epoch():
    """Before: 0 batches handed out of 0 read as an ended epoch, and every save / load round
    trip of such a loader moved it one epoch on."""
    from ringseq.plugin.loader_state import LoaderPosition, read_loader_state, state_of
    settings = {"batch_size": 2, "dp_size": 1, "shuffle": False, "seed": 0, "drop_last": True,
                "dataset_length": 1}
    state = state_of(LoaderPosition(0, 3, 0), 0, settings)
    assert read_loader_state(state, settings, resumable=True) == LoaderPosition(0, 3, 0)


def test_a_state_at_an_epochs_end_starts_the_next_epoch_under_any_settings(w4):
    for r in w4:
        assert r["boundary"] == (1, 5, 3)  # epoch 1, 5 batches so far, 10 samples / 4 a batch


@pytest.mark.parametrize("key, own, peers", [
    ("other_batch_size", "ValueError: ShardedDataLoader.load_state_dict: the state stopped "
                         "after batch 2 of 5 in epoch 1, and this loader would not draw the "
                         "same samples", None),
    ("other_epoch", "ValueError: ShardedDataLoader: load_state_dict restored epoch 1 after "
                    "batch 2, then set_epoch(0) was called", None),
    ("different_states", "RingMismatchError", None),
    ("not_a_state", "TypeError: ShardedDataLoader.load_state_dict: state must be the mapping",
     None),
    ("negative_step", "ValueError: ShardedDataLoader.load_state_dict: state['step'] must be "
                      "an int within [0, 2**63), got -1", None),
    ("plain_sampler", "ValueError: ShardedDataLoader.load_state_dict: the state stopped after "
                      "batch 2 of 5 in epoch 1; resuming inside an epoch needs the plugin's "
                      "sampler", None),
    ("one_rank_bad", "ValueError: ShardedDataLoader.load_state_dict: state lacks 'seed'",
     "RingPeerError"),
])
def test_a_state_the_loader_cannot_resume_is_refused_on_every_rank(w4, key, own, peers):
    for rank, r in enumerate(w4):
        expected = own if peers is None or rank == 1 else peers
        assert r[key].startswith(expected), (rank, r[key])
    if key == "other_batch_size":
        assert "batch_size: saved 2, this loader 4" in w4[0][key], w4[0][key]
    if key == "different_states":
        assert "ShardedDataLoader.load_state_dict" in w4[0][key], w4[0][key]


def test_the_samplers_skip_holds_with_worker_processes():
    """The indices are drawn in the loader's process and the samples fetched in its workers:
    a skip of 4 samples starts the epoch at its third batch of 2 (the test ranks are daemons,
    which cannot start workers: checked here, in pytest's process)."""
    from ringseq.plugin.loader_state import ResumableDistributedSampler
    sampler = ResumableDistributedSampler(_Samples(), num_replicas=2, rank=1, shuffle=True,
                                          seed=7)
    sampler.set_epoch(3)

    def epoch():
        loader = torch.utils.data.DataLoader(_Samples(), batch_size=2, sampler=sampler,
                                             num_workers=1)
        return [b["idx"].tolist() for b in loader]

    whole = epoch()
    sampler.skip = 4
    assert epoch() == whole[2:]
    assert epoch() == whole  # the skip applies to one iteration


def test_the_samplers_skip_holds_with_worker_processes_and_whole_batch_items():
    """With ``batch_size=None`` the sampler is the loader's index sampler, and a loader with
    workers calls iter() on it twice, discarding the first iterator unread. The skip is taken
    by the iteration that runs. (Before: the discarded iterator took it, and the resumed epoch
    started again at its first batch, training twice on the batches before the checkpoint.)"""
    from ringseq.plugin.loader_state import ResumableDistributedSampler
    sampler = ResumableDistributedSampler(_WholeBatches(), num_replicas=2, rank=0, shuffle=True,
                                          seed=3)

    def epoch():
        loader = torch.utils.data.DataLoader(_WholeBatches(), batch_size=None, sampler=sampler,
                                             num_workers=2)
        return [b["idx"].tolist() for b in loader]

    whole = epoch()
    assert len(whole) == 10
    sampler.skip = 3
    assert epoch() == whole[3:]
    assert epoch() == whole
