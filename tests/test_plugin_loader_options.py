"""The plugin's loader and options, as a user gets them wrong: data-parallel groups whose
samplers differ (seed, epoch) are refused on every rank instead of duplicating and dropping
samples; a DataLoader's shuffling generator seeds the order; ``clip_grad_by_norm`` refuses a
max_norm that would reverse or poison the gradients; options that do not apply and
refusals name the plugin, ``boost`` or the function."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_utils import run_ranks
from utils import error_text


class _Net(torch.nn.Module):
    """A linear layer next to a RingAttention (what boost switches); forward uses the layer."""

    def __init__(self):
        import ringseq
        super().__init__()
        self.lin, self.attn = torch.nn.Linear(4, 4), ringseq.RingAttention()

    def forward(self, x):
        return self.lin(x)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(_data(4))


class _GetItems:
    """A map-style dataset read by batches only (torch's fetcher calls __getitems__)."""

    def __len__(self):
        return 16

    def __getitems__(self, indices):
        return [_data()[i] for i in indices]


class _NoLen(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return _data()[i]


class _EmptyStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([])


def _data(n=16):
    return [{"input_ids": torch.full((8,), i), "labels": torch.full((8,), i), "idx": i}
            for i in range(n)]


def _seen(loader):
    return [i for batch in loader for i in batch["idx"].tolist()]


def _worker():
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    out = {}
    plugin = RingSequenceParallelPlugin(sp_size=2)  # W=4: dp 2 x sp 2
    dp = plugin.dp_rank
    loader = plugin.prepare_dataloader(_data(), batch_size=2, shuffle=True, seed=100 + dp)
    out["seed"] = error_text(lambda: _seen(loader))
    loader = plugin.prepare_dataloader(_data(), batch_size=2, shuffle=True, seed=100)
    loader.set_epoch(dp)  # one dp group an epoch ahead
    out["epoch"] = error_text(lambda: _seen(loader))
    loader.set_epoch(3)
    out["same_epoch"] = sorted(_seen(loader))  # this dp group's half, no error
    uneven = plugin.prepare_dataloader(_data(4 if dp == 0 else 6), batch_size=2)
    out["uneven"] = error_text(lambda: _seen(uneven))
    prepare = plugin.prepare_dataloader
    out["prepare_shuffle_no"] = error_text(lambda: prepare(_data(), batch_size=2, shuffle="no"))
    out["prepare_seed_text"] = error_text(lambda: prepare(_data(), batch_size=2, seed="7"))
    out["prepare_batch_0"] = error_text(lambda: prepare(_data(), batch_size=0))
    out["prepare_unbatched_drop_last"] = error_text(lambda: prepare(_data(), batch_size=None,
                                                                    drop_last=True))
    out["prepare_no_samples"] = error_text(lambda: _seen(prepare([], batch_size=2)))
    out["prepare_too_few"] = error_text(lambda: _seen(prepare(_data(1), batch_size=2,
                                                              drop_last=True)))
    # one data-parallel group's loader empty: its ranks raise, the others hear why
    out["one_group_empty"] = error_text(lambda: _seen(prepare(_data(0 if dp == 0 else 4),
                                                              batch_size=2)))
    # (before: torch's "Overflow when unpacking long long" at the first batch; a bare
    # TypeError of len(); messages naming no function)
    out["prepare_seed_big"] = error_text(lambda: prepare(_data(), batch_size=2, seed=2 ** 64))
    out["prepare_iterable"] = error_text(lambda: prepare(_Stream(), batch_size=2))
    out["prepare_int"] = error_text(lambda: prepare(5, batch_size=2))
    out["boost_list"] = error_text(lambda: Booster(plugin).boost(_Net(), dataloader=[1]))
    # worker processes handing out batches as they finish them (before: taken, and the
    # ranks' orders and a resumed epoch's skipped batches could differ from those trained on)
    out["prepare_unordered_workers"] = error_text(lambda: prepare(
        _data(), batch_size=2, num_workers=1, in_order=False))
    out["boost_unordered_workers"] = error_text(lambda: Booster(plugin).boost(
        _Net(), dataloader=DataLoader(_data(), batch_size=2, num_workers=1, in_order=False)))
    out["unordered_without_workers"] = len(prepare(_data(), batch_size=2, in_order=False))
    # ColossalAI's prepare_dataloader(distributed_sampler_cls=...) (before: DataLoader's
    # "unexpected keyword argument", naming no call of ringseq's); None is its default
    out["prepare_sampler_cls"] = error_text(lambda: prepare(
        _data(), batch_size=2, distributed_sampler_cls=torch.utils.data.DistributedSampler))
    out["prepare_sampler_cls_none"] = len(prepare(_data(), batch_size=2,
                                                  distributed_sampler_cls=None))
    # a sampler over a part of the dataset (before: boost trained on all 16 samples)
    from torch.utils.data import RandomSampler, SequentialSampler
    for name, sampler in (("sequential", SequentialSampler(range(4))),
                          ("random", RandomSampler(range(4)))):
        part = DataLoader(_data(), batch_size=2, sampler=sampler)
        out[f"subset_{name}"] = error_text(lambda: Booster(plugin).boost(_Net(), dataloader=part))
    # a range over the whole dataset draws what the dataset does (accepted, as before)
    for name, sampler in (("sequential", SequentialSampler(range(16))),
                          ("random", RandomSampler(range(16)))):
        whole = DataLoader(_data(), batch_size=2, sampler=sampler)
        out[f"whole_range_{name}"] = len(Booster(plugin).boost(_Net(), dataloader=whole)[3])
    # torch reads a dataset with __getitems__ (no __getitem__) by batches
    out["getitems"] = len(prepare(_GetItems(), batch_size=2))
    out["boost_no_len"] = error_text(lambda: Booster(plugin).boost(
        _Net(), dataloader=DataLoader(_NoLen(), batch_size=2)))
    # an iterable dataset that yields nothing (before: a loop of no step, without a word)
    from ringseq.plugin.dataloader import ShardedDataLoader
    empty = ShardedDataLoader(DataLoader(_EmptyStream(), batch_size=2), plugin.sp_group,
                              plugin.data_layout, plugin.dp_rank)
    out["empty_stream"] = error_text(lambda: _seen(empty))
    # pack=True at sp 1 (dp 4), zigzag: each dp group's batch holds 5 + 4 tokens, padded to
    # what zigzag shards (before: padded to 1, and every batch refused for its odd length)
    docs = [{"input_ids": torch.arange(n)} for n in (5, 5, 5, 5, 4, 4, 4, 4)]
    packed = RingSequenceParallelPlugin(sp_size=1).prepare_dataloader(docs, batch_size=2,
                                                                        pack=True)
    shapes = []
    out["pack_sp1"] = error_text(lambda: shapes.extend(tuple(b["input_ids"].shape)
                                                       for b in packed))
    out["pack_sp1_shapes"] = shapes
    # collate_fn=None is DataLoader's default, not a collate of the user's (before: refused)
    out["pack_collate_none"] = len(plugin.prepare_dataloader(docs, batch_size=2, pack=True,
                                                             collate_fn=None))
    out["prepare_numpy_ok"] = len(prepare(_data(), batch_size=np.int64(2), seed=np.int32(3),
                                          shuffle=np.True_, drop_last=np.False_))
    # lengths 4, 4, 8, 8, 4, ...: each dp group's batch of 2 holds a 4 and an 8
    ragged = [{"input_ids": torch.arange(4 + 4 * (i % 4 >= 2))} for i in range(8)]
    out["ragged"] = error_text(lambda: _seen(prepare(ragged, batch_size=2)))
    # a plain DataLoader rebuilt by boost shuffles with seed 1024 on every rank, whatever its
    # generator (which seeds its workers): a generator seeded per rank (for the workers'
    # augmentations) is valid and splits the samples consistently
    for shuffle in (True, False):
        user = DataLoader(_data(), batch_size=2, shuffle=shuffle,
                          generator=torch.Generator().manual_seed(50 + dist.get_rank()))
        boosted = Booster(plugin).boost(_Net(), dataloader=user)[3]
        seen = []
        out[f"per_rank_generator_{shuffle}"] = error_text(lambda: seen.extend(_seen(boosted)))
        own = plugin.prepare_dataloader(_data(), batch_size=2, shuffle=shuffle, seed=1024)
        out[f"per_rank_generator_{shuffle}_as_1024"] = seen == _seen(own)
    # clip_grad_by_norm: a negative max_norm reversed the gradients, NaN poisoned the weights
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, *_ = Booster(plugin).boost(model, opt)
    model(torch.randn(2, 4)).sum().backward()
    for value in (-1.0, float("nan"), float("inf")):
        out[f"clip_{value}"] = error_text(lambda: opt.clip_grad_by_norm(value))
    out["clip_norm_type_0"] = error_text(lambda: opt.clip_grad_by_norm(1.0, norm_type=0))
    out["clip_ok"] = float(opt.clip_grad_by_norm(1.0)) > 0
    # options that do not apply, and their names
    out["ac_string"] = error_text(lambda: RingSequenceParallelPlugin(
        sp_size=2, activation_checkpointing="no"))
    out["ulysses_inner_ring"] = error_text(lambda: RingSequenceParallelPlugin(
        sp_size=2, ulysses_inner=False))
    out["sp_size_float"] = error_text(lambda: RingSequenceParallelPlugin(sp_size=2.0))
    # (before: a NumPy int refused with a ValueError, which the loss itself takes)
    out["ignore_index_numpy"] = RingSequenceParallelPlugin(
        sp_size=2, ignore_index=np.int64(-1)).ignore_index
    out["ignore_index_float"] = error_text(lambda: RingSequenceParallelPlugin(
        sp_size=2, ignore_index=-1.5))
    out["ignore_index_huge"] = error_text(lambda: RingSequenceParallelPlugin(
        sp_size=2, ignore_index=2**63))
    import ringseq.parallel.dims as dims
    real_version = dims.torch_version
    dims.torch_version = lambda: torch.torch_version.TorchVersion("2.11.0")
    try:  # (measured on torch 2.11: FSDP2 and tensor parallelism fail in the first step)
        out["old_torch_fsdp"] = error_text(lambda: RingSequenceParallelPlugin(sp_size=2,
                                                                              zero_stage=2))
        out["old_torch_ddp"] = type(RingSequenceParallelPlugin(sp_size=2)).__name__
    finally:
        dims.torch_version = real_version
    mixed = _Net()
    mixed.head = torch.nn.Linear(4, 4).double()
    out["fsdp_mixed_dtypes"] = error_text(lambda: Booster(RingSequenceParallelPlugin(
        sp_size=2, zero_stage=3)).boost(mixed))
    adapted = _Net()  # a frozen bf16 base beside float32 trainable weights: FSDP2 takes it
    adapted.base = torch.nn.Linear(4, 4).to(torch.bfloat16).requires_grad_(False)
    out["fsdp_frozen_other_dtype"] = error_text(lambda: Booster(RingSequenceParallelPlugin(
        sp_size=2, zero_stage=3)).boost(adapted))
    out["tp_plan_without_tp"] = error_text(lambda: RingSequenceParallelPlugin(
        sp_size=2, tp_plan={"lin": "colwise"}))
    out["iterable"] = error_text(lambda: Booster(plugin).boost(
        _Net(), dataloader=DataLoader(_Stream(), batch_size=2)))
    smoothing = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    out["criterion"] = error_text(lambda: Booster(plugin).boost(_Net(), criterion=smoothing))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "sp", "tp"))
    out["mesh_sp"] = error_text(lambda: RingSequenceParallelPlugin(sp_size=4, mesh=mesh))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def w4():
    return run_ranks(_worker, 4, timeout=240)


@pytest.mark.parametrize("key, field", [("seed", "sampler seed"), ("epoch", "sampler epoch")])
def test_samplers_that_differ_between_dp_groups_are_refused(w4, key, field):
    """Before: 16 samples seen with 3 never and 3 twice, no error."""
    for r in w4:
        assert r[key].startswith("RingMismatchError") and field in r[key], r[key]
    halves = [r["same_epoch"] for r in w4]
    assert sorted(halves[0] + halves[2]) == list(range(16))  # dp ranks 0 and 1: one epoch


def test_frozen_parameters_of_another_dtype_boost_under_fsdp(w4):
    for r in w4:
        assert r["fsdp_frozen_other_dtype"] == "no error", r["fsdp_frozen_other_dtype"]


def test_loaders_of_different_lengths_are_named_with_their_batch(w4):
    """Before: "the ranks of the ring were called with different arguments ... must pass
    shards of the same shape", advice about attention, naming neither loader nor batch."""
    for r in w4:
        text = r["uneven"]
        assert text.startswith("RingMismatchError: ringseq: ShardedDataLoader (batch 1): the "
                               "ranks of the ring were called with different arguments: "), text
        assert "the same number of batches per epoch" in text, text


@pytest.mark.parametrize("key, expected", [
    # before: "no" is true (shuffled), "7" a TypeError about str + int at the first batch,
    # and an empty loader ran a training loop of no step
    ("prepare_shuffle_no", "TypeError: prepare_dataloader: shuffle must be a bool (True or "
                           "False), got 'no' (str)"),
    ("prepare_seed_text", "TypeError: prepare_dataloader: seed must be an int, got '7' (str)"),
    ("prepare_batch_0", "ValueError: prepare_dataloader: batch_size must be an int >= 1 or None, "
                        "got 0"),
    ("prepare_unbatched_drop_last", "ValueError: prepare_dataloader: batch_size=None (the "
                                    "dataset's items are whole batches) takes neither "
                                    "drop_last=True nor pack=True"),
])
def test_prepare_dataloader_refuses_settings_it_would_misread(w4, key, expected):
    for r in w4:
        assert r[key].startswith(expected), r[key]


@pytest.mark.parametrize("key, expected", [
    ("prepare_seed_big", "ValueError: prepare_dataloader: seed must be an int within [-2**63, "
                         "2**63), got 18446744073709551616"),
    ("prepare_iterable", "ValueError: prepare_dataloader: dataset must be a map-style dataset "
                         "(len and indexing) to split its samples over the data-parallel "
                         "groups, got an IterableDataset (_Stream)"),
    ("prepare_int", "TypeError: prepare_dataloader: dataset must be a map-style dataset (len "
                    "and indexing), got 5 (int)"),
    ("boost_list", "ValueError: boost: dataloader must be a torch DataLoader or the result of "
                   "plugin.prepare_dataloader, got list"),
    ("prepare_unordered_workers", "ValueError: prepare_dataloader: in_order must be True "
                                  "(DataLoader's default) with worker processes, got False "
                                  "(bool) with num_workers=1: batches handed out as the workers "
                                  "finish them come in another order on each rank and cannot "
                                  "be resumed"),
    ("prepare_sampler_cls", "ValueError: prepare_dataloader: distributed_sampler_cls= cannot be "
                            "used: the plugin splits the samples over the data-parallel groups "
                            "with its own DistributedSampler (shuffle, seed, drop_last); got "
                            "DistributedSampler."),
    ("boost_unordered_workers", "ValueError: boost: dataloader's in_order must be True "
                                "(DataLoader's default) with worker processes, got False"),
    ("subset_sequential", "ValueError: boost: dataloader: the plugin rebuilds the loader with "
                          "its own DistributedSampler over the data-parallel groups, which "
                          "would drop this loader's sampler SequentialSampler (it draws from "
                          "range of 4 items, not from the loader's dataset of 16)"),
    ("subset_random", "ValueError: boost: dataloader: the plugin rebuilds the loader with its "
                      "own DistributedSampler over the data-parallel groups, which would drop "
                      "this loader's sampler RandomSampler (it draws from range of 4 items"),
    ("boost_no_len", "TypeError: boost: dataloader's dataset must be a map-style dataset (len "
                     "and indexing), got"),
])
def test_datasets_and_samplers_the_plugin_would_misread_are_refused(w4, key, expected):
    for r in w4:
        assert r[key].startswith(expected), r[key]


def test_samplers_over_the_whole_dataset_and_batch_read_datasets_are_taken(w4):
    for r in w4:  # 16 samples / 2 dp groups / 2 a batch
        assert r["whole_range_sequential"] == r["whole_range_random"] == r["getitems"] == 4, r
        # (in_order=False without worker processes changes nothing: taken)
        assert r["unordered_without_workers"] == r["prepare_sampler_cls_none"] == 4, r


def test_an_iterable_dataset_that_yields_nothing_raises_on_every_rank(w4):
    """As the docstring says of a loader of no batch per epoch."""
    for rank, r in enumerate(w4):
        assert r["empty_stream"].startswith(
            f"ValueError: ShardedDataLoader: data-parallel rank {rank // 2}'s loader gave no "
            f"batch this epoch (its dataset, _EmptyStream, yielded nothing)"), r["empty_stream"]


def test_packing_without_sequence_parallelism_pads_to_what_the_layout_shards(w4):
    for r in w4:
        assert r["pack_sp1"] == "no error" and r["pack_sp1_shapes"] == [(1, 10)], r
        assert r["pack_collate_none"] == 2  # 8 documents / 2 dp groups / 2 a batch


def test_prepare_dataloader_takes_numpy_ints_and_bools(w4):
    for r in w4:
        assert r["prepare_numpy_ok"] == 4  # 16 samples / 2 dp groups / 2 a batch


def test_a_loader_of_no_batch_raises_when_iterated_on_every_rank(w4):
    """(before: the training loop ran no step, without a word)"""
    for rank, r in enumerate(w4):
        dp = rank // 2
        for key, n, drop_last in (("prepare_no_samples", 0, False), ("prepare_too_few", 1, True)):
            assert r[key].startswith(
                f"ValueError: ShardedDataLoader: data-parallel rank {dp}'s loader gives no batch "
                f"per epoch ({n} samples, batch_size 2, drop_last={drop_last})"), r[key]
        if dp == 0:
            assert r["one_group_empty"].startswith("ValueError: ShardedDataLoader: "
                                                   "data-parallel rank 0's loader gives no "
                                                   "batch"), r["one_group_empty"]
        else:  # (before this check: RingMismatchError "end of the data (rank 0: 1, ...)")
            assert r["one_group_empty"].startswith("RingPeerError") and \
                "data-parallel rank 0's loader gives no batch" in r["one_group_empty"], \
                r["one_group_empty"]


def test_samples_of_other_lengths_without_packing_are_named(w4):
    """(before: torch's "stack expects each tensor to be equal size", no word of packing)"""
    for r in w4:
        assert r["ragged"].startswith(
            "ValueError: ShardedDataLoader (batch 1): the batch's samples have different "
            "lengths, which the default collate cannot stack"), r["ragged"]
        assert "pack=True" in r["ragged"], r["ragged"]


@pytest.mark.parametrize("samples, kwargs, expected", [
    ([{"ids": [1]}], {}, "ValueError: pack_documents: samples[0] must be a mapping with "
                         "'input_ids' (s,), got keys ['ids']"),
    ([[1, 2]], {}, "TypeError: pack_documents: samples[0] must be a mapping with 'input_ids' "
                   "(s,), got [1, 2] (list)"),
    ([{"input_ids": [[1, 2], [3, 4]]}], {}, "ValueError: pack_documents: "
                                            "samples[0]['input_ids'] must have shape (s,) or "
                                            "(1, s), got (2, 2)"),
    ([{"input_ids": [1, 2], "labels": [1, 2, 3]}], {},
     "ValueError: pack_documents: samples[0]['labels'] has 3 tokens, its input_ids 2"),
    ([{"input_ids": ["a"]}], {}, "ValueError: pack_documents: samples[0]['input_ids'] must be a "
                                 "list, array or tensor of token ids (s,), got ['a'] (list)"),
    ([{"input_ids": []}, {"input_ids": []}], {},
     "ValueError: pack_documents: the 2 samples hold no token; a batch needs at least one"),
    ([{"input_ids": [1]}], {"multiple": 0},
     "ValueError: pack_documents: multiple must be an int >= 1"),
    ([{"input_ids": [1]}], {"multiple": 2.5},
     "TypeError: pack_documents: multiple must be an int, got 2.5 (float)"),
    # (before: one sample given alone was iterated by its keys, and blamed on 'input_ids';
    # None gave Python's bare "'NoneType' object is not iterable")
    ({"input_ids": [1, 2]}, {}, "TypeError: pack_documents: samples must be a list of mappings "
                                "with 'input_ids' (s,), got {'input_ids': [1, 2]} (dict)"),
    (None, {}, "TypeError: pack_documents: samples must be a list of mappings with 'input_ids' "
               "(s,), got None (NoneType)"),
])
def test_pack_documents_names_the_sample_it_cannot_pack(samples, kwargs, expected):
    """Before: a bare KeyError 'input_ids', torch's indexing errors, a (2, s) sample packed as
    one document, multiple=0 or -4 taken as 1, and a row of no token that failed in
    shard_batch with torch's reshape error."""
    from ringseq.plugin.dataloader import pack_documents
    assert error_text(lambda: pack_documents(samples, **kwargs)).startswith(expected)


def test_pack_documents_takes_a_sequence_that_only_indexes():
    """A Subset-like sequence (__getitem__ and __len__, no __iter__) is packed, as before the
    check of samples' kind (a review's repro)."""
    from ringseq.plugin.dataloader import pack_documents

    class Indexed:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            if i >= 2:
                raise IndexError(i)
            return {"input_ids": [i + 1, i + 2]}
    assert pack_documents(Indexed())["input_ids"].tolist() == [[1, 2, 2, 3]]


def test_pack_documents_takes_tokenizer_rows_and_keeps_the_padding_label():
    """(1, s) tensors (a tokenizer's return_tensors="pt"), labels=None and uint8 ids: the
    result is int64, and the padding's ignore_index stays -100 (before: uint8 wrapped it to
    156, a real target)."""
    from ringseq.plugin.dataloader import pack_documents
    batch = pack_documents([{"input_ids": torch.tensor([[3, 4]]), "labels": None},
                            {"input_ids": np.array([5], dtype=np.uint8)}], multiple=4)
    assert batch["input_ids"].tolist() == [[3, 4, 5, 0]]
    assert batch["labels"].tolist() == [[3, 4, 5, -100]]
    assert batch["labels"].dtype == batch["input_ids"].dtype == torch.int64


def test_pack_documents_keeps_token_ids_integer():
    """An empty sample packed beside others (before: the whole row turned float32) and what
    cannot be token ids (before: torch's unnamed errors, or floats passed on)."""
    from ringseq.plugin.dataloader import pack_documents
    batch = pack_documents([{"input_ids": [5, 6, 7]}, {"input_ids": []}], multiple=2)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 3, 4]
    with pytest.raises(ValueError, match=r"^pack_documents: samples is empty"):
        pack_documents([])
    with pytest.raises(ValueError, match=r"^pack_documents: samples\[1\]\['labels'\] must "
                                         r"hold integer token ids, got torch.float32"):
        pack_documents([{"input_ids": [1]}, {"input_ids": [2], "labels": [2.7]}])


def test_a_rebuilt_loader_shuffles_alike_on_every_rank(w4):
    for r in w4:
        for shuffle in (True, False):
            assert r[f"per_rank_generator_{shuffle}"] == "no error", r
            assert r[f"per_rank_generator_{shuffle}_as_1024"], r


def test_clip_grad_by_norm_refuses_what_would_reverse_or_poison_gradients(w4):
    for r in w4:
        for value in ("-1.0", "nan", "inf"):
            assert r[f"clip_{value}"].startswith(
                "ValueError: clip_grad_by_norm: max_norm must be a finite number >= 0"), r
        assert "clip_grad_by_norm: norm_type must be a number > 0" in r["clip_norm_type_0"]
        assert r["clip_ok"]


def test_the_plugin_takes_an_ignore_index_of_any_int_kind_as_the_loss_does(w4):
    for r in w4:
        assert r["ignore_index_numpy"] == -1 and type(r["ignore_index_numpy"]) is int, r


@pytest.mark.parametrize("key, needle", [
    ("ac_string", "TypeError: RingSequenceParallelPlugin: activation_checkpointing must be a "
                  "bool, got 'no'"),
    ("ulysses_inner_ring", "RingSequenceParallelPlugin: ulysses_inner=False orders the Ulysses "
                           "and ring dims of sp_mode='hybrid' only"),
    ("sp_size_float", "RingSequenceParallelPlugin: sp_size=2.0 must be a "
                      "positive int, not a float"),
    ("ignore_index_float", "TypeError: RingSequenceParallelPlugin: ignore_index must be an int, "
                           "got -1.5 (float)"),
    # (before: "Overflow when unpacking long long" in packing the options agreement)
    ("ignore_index_huge", "ValueError: RingSequenceParallelPlugin: ignore_index must be an int64 "
                          "(labels are int64), got 9223372036854775808"),
    ("old_torch_fsdp", "ValueError: RingSequenceParallelPlugin: zero_stage=2 / tp_size=1 "
                       "(FSDP2 / tensor parallelism) need torch >= 2.12, found torch 2.11.0"),
    ("old_torch_ddp", "RingSequenceParallelPlugin"),
    ("criterion", "ValueError: boost: criterion: only a plain nn.CrossEntropyLoss"),
    # (before: "would drop this loader's sampler _InfiniteConstantSampler; pass a DataLoader
    # with batch_size and shuffle=True/False only", which it was)
    # (before: boost passed, the first forward raised FSDP's bare AssertionError "FSDP expects
    # uniform original parameter dtype")
    ("fsdp_mixed_dtypes", "ValueError: boost: zero_stage=3: FSDP2 shards each decoder layer "
                          "and the rest of the model as one unit whose trainable parameters "
                          "must share one dtype; the rest of the model (the root unit) holds "
                          "torch.float32: "
                          "['lin.weight', 'lin.bias']; torch.float64: ['head.weight', "
                          "'head.bias']"),
    ("tp_plan_without_tp", "ValueError: RingSequenceParallelPlugin: tp_plan is a "
                           "tensor-parallel plan, applied only with tp_size > 1; got tp_size=1"),
    ("iterable", "ValueError: boost: dataloader: the plugin rebuilds the loader with its own "
                 "DistributedSampler over the data-parallel groups, which needs a map-style "
                 "dataset (len and indexing); got an IterableDataset (_Stream)"),
    ("mesh_sp", "ValueError: RingSequenceParallelPlugin: sp_size=4 but the mesh's 'sp' dim"),
])
def test_options_that_do_not_apply_are_refused_by_name(w4, key, needle):
    for r in w4:
        assert needle in r[key], r[key]
