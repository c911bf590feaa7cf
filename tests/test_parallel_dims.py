"""ringseq.parallel.dims.ParallelDims: the sizes of a dp x sp x tp mesh, validated without any
process group (what every rank checks before the plugin creates one)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ringseq.parallel.dims import ParallelDims


def test_sizes_multiply_to_the_world():
    d = ParallelDims(world_size=8, sp_size=2, tp_size=2, zero_stage=3)
    assert (d.dp_size, d.sp_size, d.tp_size, d.dp_sp_size) == (2, 2, 2, 4)
    assert (d.ulysses_size, d.ring_size, d.inner_ring_size) == (1, 2, 2)
    assert d.sharded and not ParallelDims(world_size=8, sp_size=8).sharded
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.tp_size = 4


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=8, sp_size=2, tp_size=3), ["tp_size=3", "[1, 2, 4, 8]"]),
    (dict(world_size=8, sp_size=3, tp_size=2), ["sp_size=3 x tp_size=2", "[1, 2, 4]"]),
    (dict(world_size=8, sp_size=8, tp_size=2), ["sp_size=8 x tp_size=2", "[1, 2, 4]"]),
    (dict(world_size=8, sp_size=0), ["sp_size=0"]),
    # (before: "-2 ... does not divide the world size 4", which it does)
    (dict(world_size=4, sp_size=-2), ["sp_size=-2 must be a positive int (a number of ranks)"]),
    (dict(world_size=4, sp_size=2, tp_size=-1), ["tp_size=-1 must be a positive int"]),
    (dict(world_size=8, sp_size=2, tp_size=True), ["tp_size=True"]),
    (dict(world_size=8, sp_size=None), ["sp_size=None must be a positive int"]),
    (dict(world_size=8, sp_size=2, zero_stage=1), ["zero_stage=1", "[0, 2, 3]"]),
    (dict(world_size=8, sp_size=2, zero_stage=4), ["zero_stage=4", "[0, 2, 3]"]),
    (dict(world_size=8, sp_size=4, sp_mode="hybrid", ulysses_size=3), ["ulysses_size=3",
                                                                        "[1, 2, 4]"]),
    (dict(world_size=8, sp_size=4, sp_mode="tree"), ["'tree'", "'hybrid'"]),
    (dict(world_size=8, sp_size=4, inner_ring_size=3), ["inner_ring_size=3", "[1, 2, 4]"]),
])
def test_bad_sizes_name_the_sizes_that_would_work(kwargs, words):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("world, tp, heads, kv, words", [
    (8, 4, 8, 2, ["tp_size=4", "num_key_value_heads=2", "[1, 2]"]),   # K/V heads not split
    (8, 2, 6, 3, ["tp_size=2", "num_attention_heads=6", ": [1]"]),    # 3 does not divide 8
    (12, 3, 4, 4, ["tp_size=3", "[1, 2, 4]"]),
    # only the sizes that fit the mesh with this sp size (before: 3 and 6, which do not)
    (12, 4, 6, 6, ["tp_size=4", "sp_size=3): [1, 2]"]),
])
def test_heads_tensor_parallelism_cannot_split_raise(world, tp, heads, kv, words):
    d = ParallelDims(world_size=world, sp_size=3 if (world, tp) == (12, 4) else 1, tp_size=tp)
    with pytest.raises(ValueError) as e:
        d.with_model(heads, kv)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_ulysses_splits_the_heads_left_per_tp_rank():
    d = ParallelDims(world_size=8, sp_size=4, tp_size=2, sp_mode="ulysses")
    assert d.with_model(8, 2).num_heads == 8  # 8 / tp 2 = 4 heads over Ulysses 4: fine
    with pytest.raises(ValueError) as e:
        d.with_model(4, 2)  # 4 / tp 2 = 2 heads cannot go over Ulysses 4
    msg = str(e.value)
    # (in the Ulysses mode the degree is sp_size: the advice is the hybrid's degrees)
    assert "over all sp_size=4 ranks" in msg and "tp_size=2" in msg, msg
    assert "sp_mode='hybrid' with a ulysses_size that divides them and sp_size=4 ([2])" in msg
    with pytest.raises(ValueError, match=r"ulysses_size=4 cannot split .* \[1, 2\]"):
        ParallelDims(world_size=8, sp_size=4, tp_size=2, sp_mode="hybrid",
                     ulysses_size=4).with_model(4, 2)
    # K/V heads replicated inside the all-to-all (ringseq.ulysses' rule): 8:2 on tp 2 x U 4
    assert ParallelDims(world_size=8, sp_size=4, tp_size=2, sp_mode="hybrid",
                        ulysses_size=2).with_model(8, 2).ulysses_size == 2
    # validated copies keep the resolved sub-sizes
    h = ParallelDims(world_size=8, sp_size=4, sp_mode="hybrid", ulysses_size=2,
                     inner_ring_size=1)
    assert (h.ulysses_size, h.ring_size, h.inner_ring_size) == (2, 2, 1)
    assert h.with_model(4, 4) == dataclasses.replace(h, num_heads=4, num_kv_heads=4)


@pytest.mark.parametrize("kwargs, layout, multiple", [
    (dict(sp_size=2), "zigzag", 4),                 # 2 sp chunks each
    (dict(sp_size=2, tp_size=2), "zigzag", 4),      # s/sp split over tp: 4 divides
    (dict(sp_size=2, tp_size=4), "zigzag", 8),
    (dict(sp_size=4, tp_size=2), "contiguous", 8),
    (dict(sp_size=4, sp_mode="hybrid", ulysses_size=2), "zigzag", 4),  # 2 x 2 zigzag
    (dict(sp_size=4, sp_mode="hybrid", ulysses_size=2, tp_size=2), "zigzag", 8),
    (dict(sp_size=4, tp_size=2, sp_mode="ulysses"), "zigzag", 8),  # Ulysses: contiguous
    (dict(sp_size=2, tp_size=2), "documents", 4),
])
def test_sequence_multiple_per_layout(kwargs, layout, multiple):
    assert ParallelDims(world_size=8, **kwargs).seq_multiple(layout) == multiple


def test_fsdp2_and_tensor_parallelism_need_torch_2_12():
    """Measured: on torch 2.11 tensor parallelism fails inside DTensor and the plugin's FSDP2
    completions meet internals of another shape (an AttributeError or a DTensor RuntimeError
    in the first step); DDP (zero_stage 0, tp_size 1) runs there. The plugin refuses with this
    reason (tests/test_plugin_loader_options.py); the memory planner plans for any torch."""
    import torch
    import ringseq.parallel.dims as dims
    from ringseq.memory import estimate_memory

    old, new = (torch.torch_version.TorchVersion(v) for v in ("2.11.0+cu130", "2.12.1"))
    for zero, tp in ((2, 1), (3, 1), (0, 2)):
        assert dims.sharding_refusal(zero, tp) is None  # (this torch)
    for version, refused in ((old, True), (new, False)):
        dims_torch = dims.torch_version
        dims.torch_version = lambda: version
        try:
            for zero, tp in ((2, 1), (3, 1), (0, 2)):
                reason = dims.sharding_refusal(zero, tp)
                assert (reason == f"zero_stage={zero} / tp_size={tp} (FSDP2 / tensor "
                                  f"parallelism) need torch >= 2.12, found torch "
                                  f"{version}; zero_stage=0 with tp_size=1 (DDP) "
                                  f"runs on it") if refused else reason is None, reason
            assert dims.sharding_refusal(0, 1) is None
            config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
                      "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256,
                      "tie_word_embeddings": False}
            assert estimate_memory(config, seqlen=64, world_size=2, sp_size=2,
                                   zero_stage=3).total > 0
        finally:
            dims.torch_version = dims_torch


def test_fsdp2_recovery_without_reset_iter_state_says_to_restart_before_resetting_anything():
    """FSDP2 forgets a failed step through FSDPModule.reset_iter_state, which torch 2.13 added:
    without it the plugin's reset says what to do, before it resets any ring (before: an
    AttributeError 'FSDPLlamaForCausalLM' object has no attribute 'reset_iter_state',
    measured on torch 2.12, after the rings had been marked usable)."""
    from types import SimpleNamespace

    import torch
    from ringseq.plugin import RingSequenceParallelPlugin
    from ringseq.plugin.fsdp_replay import FsdpReplay

    class OldFsdpModule:  # FSDP2's root module as torch 2.12 has it: no reset_iter_state
        def _get_fsdp_state(self):
            return SimpleNamespace(_is_root=True)

    replay = object.__new__(FsdpReplay)
    replay.units, replay.tp = [SimpleNamespace(module=OldFsdpModule(), groups=[])], None
    message = (f"FSDP2 forgets a failed forward or backward through "
               f"FSDPModule.reset_iter_state, which torch 2.13 added; with torch "
               f"{torch.__version__} restart the processes from the last checkpoint")
    assert replay.reset_refusal() == message
    # a plugin whose rings would fail to reset (no process group): the refusal comes first
    plugin = SimpleNamespace(_reporter=None, reporter=SimpleNamespace(reductions=[replay]),
                             sp_group=object(), sp=None)
    with pytest.raises(RuntimeError) as refused:
        RingSequenceParallelPlugin.reset(plugin)
    assert str(refused.value) == f"booster.reset: {message}"


@pytest.mark.parametrize("args, words", [
    (("ring", True), "sp_size must be a positive integer, got True"),
    (("ring", 4, True), "ulysses_size must be a positive integer or None, got True"),
    (("ulysses", 4, 4.0), "ulysses_size must be a positive integer or None, got 4.0"),
    (("ring", 4, None, 2.0), "inner_ring_size must be a positive integer or None, got 2.0"),
])
def test_sp_sizes_are_integers_not_bools_or_floats(args, words):
    # (before: True == 1 and 4.0 == 4 passed, returning sizes of another mode)
    from ringseq.parallel.groups import resolve_sp_sizes
    with pytest.raises(ValueError, match=words):
        resolve_sp_sizes(*args)


@pytest.mark.parametrize("args", [("tree", 4), ("ring", True), ("ring", 4, 2), ("ulysses", 4, 2),
                                  ("ulysses", 4, None, 2), ("hybrid", 4), ("hybrid", 4, 3),
                                  ("ring", 4, None, 3)])
def test_sp_size_errors_name_the_function_called(args):
    # (before: the messages started with the argument, naming no function)
    from ringseq.parallel.groups import resolve_sp_sizes
    with pytest.raises(ValueError) as refused:
        resolve_sp_sizes(*args)
    assert str(refused.value).startswith("resolve_sp_sizes: ")
    with pytest.raises(ValueError) as renamed:
        resolve_sp_sizes(*args, fn="ParallelDims")
    assert str(renamed.value) == "ParallelDims: " + str(refused.value)[len("resolve_sp_sizes: "):]


def test_numpy_integer_sizes_are_sizes():
    np = pytest.importorskip("numpy")
    from ringseq.parallel.groups import resolve_sp_sizes
    assert resolve_sp_sizes("ulysses", np.int64(4), np.int64(4)) == (4, 1, 1)
    assert resolve_sp_sizes("ring", 4, None, np.int32(2)) == (1, 4, 2)


def test_group_sizes_and_layouts_without_a_process_group_name_the_problem():
    from ringseq import make_sp_groups
    with pytest.raises(ValueError, match="make_sp_groups: ulysses_size must be a positive "
                                         "integer, got 0"):
        make_sp_groups(0)  # (before: "need torch.distributed", as if 0 were valid with it)
    sp = make_sp_groups(1)
    for fn, call in (("shard", lambda: sp.shard(torch.zeros(1, 4), "zigzagg")),
                     ("positions", lambda: sp.positions(4, "zigzagg")),
                     ("data_layout", lambda: sp.data_layout("zigzagg"))):
        with pytest.raises(ValueError, match=f"^{fn}: unknown layout 'zigzagg'"):
            call()
