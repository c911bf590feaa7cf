"""Checkpoints of a sharded model load all or nothing, on 2 spawned gloo ranks (CPU):

* a model checkpoint directory (``max_shard_size``) whose last shard does not fit the model
  raises on every rank and no rank's parameter shard changes (torch's loaders copy the entries
  that fit before raising about the one that does not);
* an optimizer checkpoint (a torch.distributed.checkpoint directory) one rank's file of which
  is cut short raises a ValueError on every rank and no rank's optimizer state changes (the
  loader had already copied the other rank's part into its live state);
* an optimizer without state keeps none after a failed load, and a rank that cannot stage
  the state (out of memory) makes every rank raise instead of waiting in the collective load;
* the user's own optimizer object (not the boosted one) is refused for sharded checkpoints;
* the intact checkpoints then load exactly;
* (one process) a model file with an entry of the model's shape that load_state_dict cannot
  copy (a meta, sparse, quantized or complex tensor) is refused before anything is copied.

The model is FSDP2 (``fully_shard``) over both ranks: every parameter is a DTensor whose local
shard is half of it.
"""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from torch import nn

from dist_utils import run_ranks
from utils import error_text

WORLD = 2


def _sharded_model():
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 6))  # (out, in) weights: dim 0 sharded
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def _local(tensors):
    return {name: t.to_local().clone() for name, t in tensors}


def _optimizer_state(opt):
    """{(parameter index, name): this rank's part} of the optimizer's tensors."""
    from torch.distributed.tensor import DTensor
    state = opt.unwrap().state
    return {(i, k): (v.to_local() if isinstance(v, DTensor) else v).clone()
            for i, p in enumerate(opt.unwrap().param_groups[0]["params"])
            for k, v in state[p].items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _worker(tmp):
    import torch.distributed as dist
    from ringseq.plugin.sharded_checkpoint import DistributedCheckpointIO
    from ringseq.plugin.wrappers import OptimizerWrapper
    rank, io, out = dist.get_rank(), DistributedCheckpointIO(), {}
    model = _sharded_model()
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters()), None, model=model)
    opt.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    saved_params = _local(model.named_parameters())
    saved_state = _optimizer_state(opt)
    good_model, good_opt = os.path.join(tmp, "model"), os.path.join(tmp, "optim")
    io.save_model(model, good_model, max_shard_size=1)  # one file per tensor
    io.save_optimizer(opt, good_opt)
    out["optimizer_is_dcp"] = os.path.isfile(os.path.join(good_opt, ".metadata"))

    # the model: the last layer's shapes differ; its files come after the first layer's
    misfit = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 5))
    nn.init.constant_(misfit[0].weight, 7.0)
    io.save_model(misfit, os.path.join(tmp, "misfit"), max_shard_size=1)
    out["misfit_error"] = error_text(lambda: io.load_model(model, os.path.join(tmp, "misfit")))
    out["params_kept"] = _same(_local(model.named_parameters()), saved_params)

    # the optimizer: rank 1's file cut short; rank 0's part reads fine
    bad_opt = os.path.join(tmp, "optim_cut")
    if rank == 0:
        shutil.copytree(good_opt, bad_opt)
    dist.barrier()
    if rank == 1:
        cut = os.path.join(bad_opt, "__1_0.distcp")
        with open(cut, "r+b") as f:
            f.truncate(os.path.getsize(cut) // 2)
    dist.barrier()
    for p in model.parameters():
        for v in opt.unwrap().state[p].values():
            v.zero_()
    zeroed = _optimizer_state(opt)
    out["cut_error"] = error_text(lambda: io.load_optimizer(opt, bad_opt))
    out["state_kept"] = _same(_optimizer_state(opt), zeroed)

    # an optimizer without state yet (a resume before the first step): torch's staging gives
    # it state (a step at lr 0), which a failed load takes back
    for p in model.parameters():
        p.grad = None
    fresh = OptimizerWrapper(torch.optim.AdamW(model.parameters()), None, model=model)
    out["fresh_cut_error"] = error_text(lambda: io.load_optimizer(fresh, bad_opt))
    out["fresh_kept"] = not fresh.unwrap().state and \
        all(p.grad is None for p in model.parameters())

    # staging fails on rank 1 only (out of memory): every rank raises, none waits in dcp.load
    import ringseq.plugin.sharded_checkpoint as sharded
    staging = sharded._empty_like_state

    def out_of_memory(state):
        raise MemoryError("injected: no memory for the staged optimizer state")
    sharded._empty_like_state = out_of_memory if rank == 1 else staging
    try:
        out["staging_error"] = error_text(lambda: io.load_optimizer(opt, good_opt))
    finally:
        sharded._empty_like_state = staging
    out["staging_state_kept"] = _same(_optimizer_state(opt), zeroed)

    # the user's own optimizer object (boost rebinds it to the shards): a plain file would hold
    # rank 0's shards only, which every rank would load without an error (before: written)
    out["raw_save"] = error_text(lambda: io.save_optimizer(opt.unwrap(), bad_opt + ".pt"))
    out["raw_save_file"] = os.path.exists(bad_opt + ".pt")
    out["raw_load"] = error_text(lambda: io.load_optimizer(opt.unwrap(), good_opt))

    # checkpoints of another optimizer (dcp.load reads only what it is asked for, so these
    # loaded without an error): other groups, other group members, another class, a larger
    # model; each raises on every rank and changes nothing
    layer0, layer1 = list(model[0].parameters()), list(model[1].parameters())

    def wrapped(groups, cls=torch.optim.AdamW):
        return OptimizerWrapper(cls(groups, lr=1e-3), None, model=model)

    two = wrapped([{"params": layer0}, {"params": layer1, "weight_decay": 0.0}])
    out["groups_error"] = error_text(lambda: io.load_optimizer(two, good_opt))
    two_opt = os.path.join(tmp, "optim_two_groups")
    two.backward(model(torch.ones(2, 4)).sum())
    two.step()
    io.save_optimizer(two, two_opt)
    moved = wrapped([{"params": layer0[:1]}, {"params": layer0[1:] + layer1,
                                               "weight_decay": 0.0}])
    out["members_error"] = error_text(lambda: io.load_optimizer(moved, two_opt))
    out["members_kept"] = not moved.unwrap().state
    sgd = wrapped([{"params": layer0}, {"params": layer1}], torch.optim.SGD)
    out["class_error"] = error_text(lambda: io.load_optimizer(sgd, two_opt))
    larger = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 6), nn.Linear(6, 6))
    from torch.distributed.fsdp import fully_shard
    for layer in larger:
        fully_shard(layer)
    fully_shard(larger)
    big = OptimizerWrapper(torch.optim.AdamW(larger.parameters()), None, model=larger)
    big.backward(larger(torch.ones(2, 4)).sum())
    big.step()
    io.save_optimizer(big, os.path.join(tmp, "optim_larger"))
    out["larger_error"] = error_text(lambda: io.load_optimizer(opt, os.path.join(tmp,
                                                                                 "optim_larger")))
    out["larger_kept"] = _same(_optimizer_state(opt), zeroed)
    # a sharded save onto a path that holds a file: torch's CheckpointException is a
    # BaseException (before: it went past `except Exception`)
    out["save_onto_file"] = error_text(lambda: io.save_optimizer(
        opt, os.path.join(good_model, "pytorch_model.bin.index.json")))

    # the intact checkpoints load exactly
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    io.load_model(model, good_model)
    io.load_optimizer(opt, good_opt)
    out["params_restored"] = _same(_local(model.named_parameters()), saved_params)
    out["state_restored"] = _same(_optimizer_state(opt), saved_state)
    return out


def test_sharded_checkpoints_load_all_or_nothing(tmp_path):
    ranks = run_ranks(_worker, WORLD, str(tmp_path), timeout=120)
    for rank, got in enumerate(ranks):
        assert got["optimizer_is_dcp"], rank
        error = got["misfit_error"]
        assert error.startswith("ValueError: "), (rank, error)
        assert "1.weight: shape (5, 8) in the checkpoint, (6, 8) in the model" in error, error
        assert got["params_kept"], f"rank {rank}: a parameter shard changed on a failed load"
        # rank 1 names its own cut file; rank 0 (whose read succeeded) names the failed rank
        error = got["cut_error"]
        assert error.startswith("ValueError: ") and "optim_cut" in error, (rank, error)
        assert "rank 1" in error, (rank, error)
        assert got["state_kept"], f"rank {rank}: optimizer state changed on a failed load"
        assert "optim_cut" in got["fresh_cut_error"], (rank, got["fresh_cut_error"])
        assert got["fresh_kept"], f"rank {rank}: a failed load left state in a fresh optimizer"
        error = got["staging_error"]
        expected = "MemoryError: " if rank == 1 else "ValueError: "
        assert error.startswith(expected) and "nothing was loaded" in error, (rank, error)
        assert ("injected" in error) == (rank == 1), (rank, error)
        assert got["staging_state_kept"], rank
        assert got["params_restored"] and got["state_restored"], rank
        assert got["raw_save"].startswith("ValueError: save_optimizer: a sharded optimizer "
                                          "checkpoint needs the boosted optimizer"), got
        assert not got["raw_save_file"]
        assert got["raw_load"].startswith("ValueError: load_optimizer: ") and \
            "pass the boosted optimizer" in got["raw_load"], got
        for key, words in (("groups_error", "the checkpoint has 1 parameter group(s), the "
                                            "optimizer 2"),
                           ("members_error", "group 0 holds other parameters in the checkpoint"),
                           ("class_error", "lacks the settings ['dampening', 'momentum', "
                                           "'nesterov']"),
                           ("larger_error", "optimizer state for 2 parameter(s) this optimizer "
                                            "does not (['2.bias', '2.weight']")):
            assert got[key].startswith("ValueError: ") and words in got[key], (rank, got[key])
            assert "nothing was loaded" in got[key], (rank, got[key])
        assert got["members_kept"] and got["larger_kept"], rank
        # (refused by name before any write; before: torch.distributed.checkpoint's
        # FileExistsError, naming no call)
        assert got["save_onto_file"].startswith("ValueError: save_optimizer: "), got
        assert "is a file; this checkpoint is a directory" in got["save_onto_file"], got


@pytest.mark.parametrize("kind, found", [
    ("meta", "a meta float32 tensor in the checkpoint, a float32 one in the model: a meta "
             "tensor holds no data"),
    ("sparse", "a sparse_coo float32 tensor in the checkpoint, a float32 one in the model: "
               "load_state_dict cannot copy one layout into the other"),
    ("quantized", "a qint8 tensor in the checkpoint, a float32 one in the model: "
                  "load_state_dict cannot copy a quantized tensor into an unquantized one"),
    ("complex", "a complex64 tensor in the checkpoint, a float32 one in the model: copying it "
                "would discard the imaginary part")],
                         ids=["meta", "sparse", "quantized", "complex"])
def test_an_entry_load_state_dict_cannot_copy_changes_nothing(tmp_path, kind, found):
    """One process, the replicated path: a file whose last entry has the model's shape but
    cannot be copied into it (no data, another layout, quantized) is refused before anything
    is copied, naming load_model, the file, the entry, what it found and what the model holds
    (before: torch's own RuntimeError after the three entries before it were copied; a complex
    entry loaded with its imaginary part dropped)."""
    import warnings

    from ringseq.plugin.sharded_checkpoint import DistributedCheckpointIO
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    state = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (quantized tensors: deprecated)
        state["1.bias"] = {
            "meta": lambda: torch.empty(3, device="meta"),
            "sparse": lambda: torch.zeros(3).to_sparse(),
            "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.qint8),
            "complex": lambda: torch.zeros(3, dtype=torch.complex64)}[kind]()
    path = str(tmp_path / f"{kind}.pt")
    torch.save(state, path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"^load_model: rank 0: loading the checkpoint "
                                         f"{re.escape(repr(path))} failed \\(nothing was loaded "
                                         f"on any rank\\): .*1\\.bias: {re.escape(found)}"):
        DistributedCheckpointIO().load_model(model, path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
