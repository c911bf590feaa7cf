"""The plugin's checkpoints on one process: the fp16 grad scaler's state is saved and restored
with the optimizer in both formats (and its file missing is refused in both), another optimizer
class's checkpoint is refused naming what differs, the state of a parameter frozen after it
trained is kept,
and a checkpoint that cannot be read or does not fit changes nothing (the multi-rank
checkpoints, their votes and errors are in tests/test_plugin.py, tests/test_compose.py and
tests/test_checkpoint_all_or_nothing.py; here only a plain file read into FSDP shards)."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
from torch import nn

from ringseq.plugin.sharded_checkpoint import DistributedCheckpointIO
from ringseq.plugin.wrappers import OptimizerWrapper


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "directory"])
def test_optimizer_checkpoint_keeps_the_grad_scaler(tmp_path, sharded):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    scaler = torch.amp.GradScaler("cpu")
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters()), scaler, model=model)
    opt.backward(model(torch.ones(4, 3)).sum())
    opt.step()
    scaler.update(new_scale=8.0)
    saved_state = {k: v.clone() for k, v in opt.unwrap().state[model.weight].items()}
    path = str(tmp_path / ("optim" if sharded else "optim.pt"))
    io = DistributedCheckpointIO()
    io.save_optimizer(opt, path, sharded=sharded)
    assert os.path.isdir(path) == sharded

    scaler.update(new_scale=1024.0)  # what a later step may leave
    for v in opt.unwrap().state[model.weight].values():
        v.zero_()
    io.load_optimizer(opt, path)
    assert scaler.get_scale() == 8.0
    for k, v in opt.unwrap().state[model.weight].items():
        assert torch.equal(v, saved_state[k]), k


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "directory"])
def test_an_optimizer_checkpoint_whose_grad_scaler_file_is_gone_is_refused(tmp_path, sharded):
    """The save records that it wrote the grad scaler's state (the file in its save id, the
    directory in its metadata): a load without that file is refused, nothing changed (before:
    the directory loaded and kept the live loss scale, 1024 where 8 was saved)."""
    scaler = torch.amp.GradScaler("cpu")
    model, opt = _stepped_optimizer(scaler)
    scaler.update(new_scale=8.0)
    path = str(tmp_path / ("optim" if sharded else "optim.pt"))
    io = DistributedCheckpointIO()
    io.save_optimizer(opt, path, sharded=sharded)
    scaler_file = os.path.join(path, "grad_scaler.pt") if sharded else path + ".grad_scaler"
    os.remove(scaler_file)
    scaler.update(new_scale=1024.0)
    for v in opt.unwrap().state[model.weight].values():
        v.zero_()
    with pytest.raises(ValueError, match=r"^load_optimizer: rank 0: loading the checkpoint .*"
                                         r"nothing was loaded on any rank.*" +
                                         re.escape(f"{scaler_file!r} is missing, but the "
                                                   f"optimizer state in {path!r} was saved "
                                                   f"with the grad scaler's")):
        io.load_optimizer(opt, path)
    assert scaler.get_scale() == 1024.0
    assert all(not v.any() for v in opt.unwrap().state[model.weight].values())


def test_an_optimizer_directory_saved_before_the_scaler_record_still_loads(tmp_path,
                                                                             monkeypatch):
    """A directory written before ringseq recorded the grad scaler's file in its metadata:
    its grad_scaler.pt loads where it is there, and the optimizer state alone where it is not
    (as it did); one saved without a scaler loads into an optimizer that has one."""
    import torch.distributed.checkpoint as dcp

    from ringseq.plugin.checkpoint import _SAVE_KEY
    scaler = torch.amp.GradScaler("cpu")
    model, opt = _stepped_optimizer(scaler)
    scaler.update(new_scale=8.0)
    io = DistributedCheckpointIO()
    real_save = dcp.save

    def save_without_the_record(state, **kwargs):  # (what an earlier ringseq wrote)
        return real_save({k: v for k, v in state.items() if k != _SAVE_KEY}, **kwargs)
    monkeypatch.setattr(dcp, "save", save_without_the_record)
    old = str(tmp_path / "old")
    io.save_optimizer(opt, old, sharded=True)
    monkeypatch.undo()
    scaler.update(new_scale=1024.0)
    io.load_optimizer(opt, old)
    assert scaler.get_scale() == 8.0
    os.remove(os.path.join(old, "grad_scaler.pt"))
    scaler.update(new_scale=1024.0)
    io.load_optimizer(opt, old)
    assert scaler.get_scale() == 1024.0
    _, without = _stepped_optimizer(None)
    io.save_optimizer(without, str(tmp_path / "without"), sharded=True)
    assert not os.path.exists(tmp_path / "without" / "grad_scaler.pt")
    io.load_optimizer(opt, str(tmp_path / "without"))
    assert scaler.get_scale() == 1024.0


def test_plain_optimizer_file_of_a_sharded_model_is_refused(tmp_path, monkeypatch):
    """A plain file would hold rank 0's optimizer shards only, and every rank would load them
    without an error: sharded=False is refused for a sharded model (FSDP / tensor parallel)."""
    from ringseq.plugin import sharded_checkpoint
    model = nn.Linear(3, 2)
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters()), None, model=model)
    monkeypatch.setattr(sharded_checkpoint, "_is_sharded", lambda m: m is model)
    with pytest.raises(ValueError, match=r"save_optimizer\(sharded=False\): this model's "
                                         r"parameters are sharded"):
        DistributedCheckpointIO().save_optimizer(opt, str(tmp_path / "optim.pt"), sharded=False)
    assert not os.path.exists(tmp_path / "optim.pt")


def test_model_directory_that_does_not_fit_changes_nothing(tmp_path):
    """A checkpoint directory (max_shard_size) is checked whole before anything is copied:
    torch's load_state_dict copies the entries that fit before raising about one that does not,
    which would leave the first layer loaded and the second not."""
    io = DistributedCheckpointIO()
    misfit = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))
    io.save_model(misfit, str(tmp_path / "misfit"), max_shard_size=1)  # one file per tensor
    assert len(list((tmp_path / "misfit").glob("*.bin"))) == 4
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"nothing was loaded on any rank.*1\.weight: shape "
                                         r"\(5, 4\) in the checkpoint, \(2, 4\) in the model"):
        io.load_model(model, str(tmp_path / "misfit"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _stepped_optimizer(scaler):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters()), scaler, model=model)
    opt.backward(model(torch.ones(4, 3)).sum())
    opt.step()
    return model, opt


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "directory"])
def test_unreadable_grad_scaler_state_leaves_the_optimizer_unchanged(tmp_path, sharded):
    """The optimizer's state and the grad scaler's are read and checked before either is
    applied: a scaler file that cannot be read changes neither."""
    scaler = torch.amp.GradScaler("cpu")
    model, opt = _stepped_optimizer(scaler)
    path = str(tmp_path / ("optim" if sharded else "optim.pt"))
    io = DistributedCheckpointIO()
    io.save_optimizer(opt, path, sharded=sharded)
    scaler_file = os.path.join(path, "grad_scaler.pt") if sharded else path + ".grad_scaler"
    with open(scaler_file, "wb") as f:
        f.write(b"not a checkpoint")
    for v in opt.unwrap().state[model.weight].values():
        v.zero_()
    scaler.update(new_scale=4.0)
    with pytest.raises(Exception, match="nothing was loaded on any rank"):
        io.load_optimizer(opt, path)
    assert all(not v.any() for v in opt.unwrap().state[model.weight].values())
    assert scaler.get_scale() == 4.0


def test_unreadable_optimizer_directory_raises_a_value_error(tmp_path):
    """torch.distributed.checkpoint's loader raises a CheckpointException, which is a
    BaseException (an ``except Exception`` does not catch it): the plugin raises a ValueError
    naming the path, each failed rank's error and the file that is cut short or missing
    (before: "rank 0: EOFError: ", no file), or the metadata file it could not read (before:
    "UnpicklingError: pickle data was truncated" alone)."""
    model, opt = _stepped_optimizer(None)
    path = str(tmp_path / "optim")
    io = DistributedCheckpointIO()
    io.save_optimizer(opt, path, sharded=True)
    data = os.path.join(path, "__0_0.distcp")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match=r"torch\.distributed\.checkpoint could not load .*optim"
                                         r"'.*rank 0: ") as cut:
        io.load_optimizer(opt, path)
    assert f"__0_0.distcp holds {size // 2} bytes, its metadata places data up to byte " \
           f"{size} (truncated or removed after the save)" in str(cut.value), str(cut.value)
    os.remove(data)
    with pytest.raises(ValueError, match=r"__0_0\.distcp is missing \(truncated or removed"):
        io.load_optimizer(opt, path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(ValueError, match=re.escape(f"{os.path.join(path, '.metadata')!r} could "
                                                   f"not be read (UnpicklingError: ")):
        io.load_optimizer(opt, path)


def test_files_of_another_optimizer_class_or_scheduler_are_refused(tmp_path):
    """An AdamW file into an SGD optimizer (before: loaded, then KeyError 'momentum' at the next
    step), an optimizer or model file as a scheduler, another scheduler class, and a
    scheduler of another number of groups (before: all loaded without a word, as attributes)
    raise ValueError and change nothing; the right files load."""
    io = DistributedCheckpointIO()
    model = nn.Linear(3, 2)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    adamw.step()
    linear = torch.optim.lr_scheduler.LinearLR(adamw, total_iters=4)
    linear.step()
    paths = {name: str(tmp_path / name) for name in ("optim", "sched", "model")}
    io.save_optimizer(adamw, paths["optim"])
    io.save_lr_scheduler(linear, paths["sched"])
    io.save_model(model, paths["model"])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"lacks the settings \['dampening', 'momentum'\] "
                                         r"of SGD"):
        io.load_optimizer(sgd, paths["optim"])
    assert "betas" not in sgd.param_groups[0] and not sgd.state
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.SGD(model.parameters(),
                                                                        lr=0.1), T_max=3)
    two_groups = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    # chains of schedulers: a SequentialLR of other schedulers, or of another number of them
    # (before: loaded into them silently, or a bare IndexError after its own state was set)
    lr = torch.optim.lr_scheduler

    def sequential(*make):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        subs = [m(opt) for m in make]
        return lr.SequentialLR(opt, subs, milestones=[4 * (i + 1) for i in range(len(subs) - 1)])
    saved = sequential(lambda o: lr.LinearLR(o, total_iters=4), lambda o: lr.ExponentialLR(o, 0.9))
    saved.step()
    paths["chain"] = str(tmp_path / "chain")
    io.save_lr_scheduler(saved, paths["chain"])
    for sched, path, words in (
            (linear, paths["optim"], "not a state dict of this LinearLR"),
            (linear, paths["model"], "not a state dict of this LinearLR"),
            (cosine, paths["sched"], "not a state dict of this CosineAnnealingLR"),
            (torch.optim.lr_scheduler.LinearLR(two_groups, total_iters=4), paths["sched"],
             "1 parameter group(s), this one 2"),
            (sequential(lambda o: lr.ConstantLR(o), lambda o: lr.StepLR(o, 2)), paths["chain"],
             "its scheduler 0 (ConstantLR): the checkpoint is not a state dict of this "
             "ConstantLR"),
            (sequential(lambda o: lr.LinearLR(o), lambda o: lr.ExponentialLR(o, 0.9),
                        lambda o: lr.ConstantLR(o)), paths["chain"],
             "the checkpoint's SequentialLR chains 2 scheduler(s), this one 3"),
            (sequential(lambda o: lr.LinearLR(o)), paths["chain"],
             "the checkpoint's SequentialLR chains 2 scheduler(s), this one 1")):
        before = copy.deepcopy(sched.state_dict())
        with pytest.raises(ValueError, match=re.escape(words)):
            io.load_lr_scheduler(sched, path)
        assert sched.state_dict() == before  # (values too: nothing was set)
    same = sequential(lambda o: lr.LinearLR(o, total_iters=4), lambda o: lr.ExponentialLR(o, 0.9))
    io.load_lr_scheduler(same, paths["chain"])
    assert same.state_dict() == saved.state_dict()
    fresh = torch.optim.lr_scheduler.LinearLR(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                              total_iters=4)
    io.load_lr_scheduler(fresh, paths["sched"])
    assert fresh.last_epoch == 1 and fresh.state_dict() == linear.state_dict()
    # another torch version's file: its private keys and `verbose` differ, and still load
    other = dict(linear.state_dict(), verbose=False)
    other.pop("_is_initial", None)
    torch.save(other, paths["sched"])
    io.load_lr_scheduler(torch.optim.lr_scheduler.LinearLR(
        torch.optim.AdamW(model.parameters(), lr=1e-3), total_iters=4), paths["sched"])


def test_another_optimizer_classs_checkpoint_is_named_by_what_differs(tmp_path):
    """An Adam directory into Adamax names the state entries that differ and the class (before:
    "state for 2 parameter(s) this optimizer does not ...: a checkpoint of another model",
    though they are its parameters); an Adam file into SGD lists the settings the file holds
    (before: 'nesterov' too, which SGD's __setstate__ had added to the copy it checked)."""
    model, adam = _stepped_optimizer(None)
    io = DistributedCheckpointIO()
    directory, file = str(tmp_path / "adam"), str(tmp_path / "adam.pt")
    io.save_optimizer(adam, directory, sharded=True)
    io.save_optimizer(adam, file)
    adamax = OptimizerWrapper(torch.optim.Adamax(model.parameters()), None, model=model)
    with pytest.raises(ValueError, match=re.escape(
            "the checkpoint holds other optimizer state entries for 2 parameter(s) of this "
            "optimizer (['bias', 'weight']): 'bias' has ['exp_avg', 'exp_avg_sq', 'step'] "
            "there, this Adamax keeps ['exp_avg', 'exp_inf', 'step']: a checkpoint of another "
            "optimizer class")):
        io.load_optimizer(adamax, directory)
    assert not adamax.unwrap().state
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = sorted(k for k in torch.load(file, weights_only=True)["param_groups"][0]
                   if k != "params")
    with pytest.raises(ValueError, match=re.escape(f"lacks the settings ['dampening', "
                                                   f"'momentum'] of SGD (a state dict of "
                                                   f"another optimizer class? it has {saved})")):
        io.load_optimizer(sgd, file)
    assert "nesterov" not in saved


def test_a_parameter_that_never_had_state_round_trips_in_the_directory_format(tmp_path):
    """A parameter that never got a gradient (an embedding under inputs_embeds) has no
    optimizer state when it is saved: it loads back without state, into the same optimizer and
    into a fresh one (before: torch's "Missing optimizer state for parameter" after the vote,
    and ringseq's own refusal for a fresh optimizer); part of a parameter's state missing is
    still refused."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters()), None, model=model)
    opt.backward(model["used"](torch.ones(4, 3)).sum())
    opt.step()
    assert model["unused"].weight not in opt.unwrap().state
    saved = {k: v.clone() for k, v in opt.unwrap().state[model["used"].weight].items()}
    path = str(tmp_path / "optim")
    io = DistributedCheckpointIO()
    io.save_optimizer(opt, path, sharded=True)
    io.load_optimizer(opt, path)  # the same optimizer
    fresh_model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    fresh = OptimizerWrapper(torch.optim.AdamW(fresh_model.parameters()), None,
                             model=fresh_model)
    io.load_optimizer(fresh, path)
    state = fresh.unwrap().state
    assert fresh_model["unused"].weight not in state
    for key, value in saved.items():
        assert torch.equal(state[fresh_model["used"].weight][key], value), key
    del opt.unwrap().state[model["used"].weight]["exp_avg_sq"]  # part of its state only
    partial = str(tmp_path / "partial")
    io.save_optimizer(opt, partial, sharded=True)
    with pytest.raises(ValueError, match=r"holds only part of the optimizer state for 1 "
                                         r"parameter\(s\) of this optimizer \(\['used.weight'\]"):
        io.load_optimizer(fresh, partial)
    assert torch.equal(state[fresh_model["used"].weight]["exp_avg_sq"], saved["exp_avg_sq"])


class _TwoLayers(nn.Module):
    """Two linear layers and a RingAttention (what boost switches); ``a`` is frozen later."""

    def __init__(self):
        import ringseq
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.attn = nn.Linear(4, 4), nn.Linear(4, 4), ringseq.RingAttention()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _trained_then_frozen(opt, model):
    """Two steps of every parameter, then ``a`` frozen and one more step (``a`` keeps the
    optimizer state of its two steps)."""
    torch.manual_seed(1)
    for i in range(3):
        if i == 2:
            model.a.requires_grad_(False)
        opt.backward(model(torch.randn(3, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return {(name, k): v.clone() for name, p in model.named_parameters()
            for k, v in opt.unwrap().state[p].items()}


def _state_by_name(opt, model) -> dict:
    from torch.distributed.tensor import DTensor
    return {(name, k): (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for name, p in model.named_parameters()
            for k, v in opt.unwrap().state.get(p, {}).items()}


def test_the_state_of_a_parameter_frozen_after_it_trained_round_trips_in_the_directory_format(
        tmp_path):
    """(before: the load into an optimizer with the same parameter frozen was refused as "a
    checkpoint of another model or of more parameters": torch lays out optimizer state for
    parameters that require a gradient only)"""
    model = _TwoLayers()
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters(), lr=0.05), None, model=model)
    saved = _trained_then_frozen(opt, model)
    path = str(tmp_path / "optim")
    io = DistributedCheckpointIO()
    io.save_optimizer(opt, path, sharded=True)
    fresh_model = _TwoLayers()
    fresh_model.a.requires_grad_(False)
    fresh = OptimizerWrapper(torch.optim.AdamW(fresh_model.parameters(), lr=0.05), None,
                             model=fresh_model)
    io.load_optimizer(fresh, path)
    got = _state_by_name(fresh, fresh_model)
    assert sorted(got) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(got[key], value), key
    assert not fresh_model.a.weight.requires_grad  # (counted as trainable only meanwhile)


def test_frozen_parameters_without_state_stay_untouched_through_a_directory_round_trip(
        tmp_path):
    """A base frozen from the start (in the optimizer, never stepped) and a frozen integer
    parameter (quantized codes): saved and loaded without state, gradient or error (before:
    the load gave the frozen base a zero gradient and Adam's moments for a step at lr 0; the
    integer parameter failed with torch's "only Tensors of floating point dtype can require
    gradients")."""
    model = _TwoLayers()
    model.a.requires_grad_(False)
    model.codes = nn.Parameter(torch.arange(4, dtype=torch.int8), requires_grad=False)
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters(), lr=0.05), None, model=model)
    opt.backward(model(torch.randn(3, 4)).pow(2).mean())
    opt.step()
    path = str(tmp_path / "optim")
    io = DistributedCheckpointIO()
    io.save_optimizer(opt, path, sharded=True)
    fresh_model = _TwoLayers()
    fresh_model.a.requires_grad_(False)
    fresh_model.codes = nn.Parameter(torch.arange(4, dtype=torch.int8), requires_grad=False)
    fresh = OptimizerWrapper(torch.optim.AdamW(fresh_model.parameters(), lr=0.05), None,
                             model=fresh_model)
    io.load_optimizer(fresh, path)
    assert sorted(k[0] for k in _state_by_name(fresh, fresh_model)) == sorted(
        k[0] for k in _state_by_name(opt, model))
    for p in (fresh_model.a.weight, fresh_model.a.bias, fresh_model.codes):
        assert p not in fresh.unwrap().state and p.grad is None and not p.requires_grad


def _file_into_fsdp_worker(path):
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    booster = Booster(RingSequenceParallelPlugin(sp_size=1))
    net = _TwoLayers()
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=0.05))
    saved = _trained_then_frozen(opt, model.unwrap())
    booster.save_optimizer(opt, path)  # a plain torch.optim file (replicated training)
    booster = Booster(RingSequenceParallelPlugin(sp_size=1, zero_stage=3))
    net = _TwoLayers()
    net.a.requires_grad_(False)
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=0.05))
    booster.load_optimizer(opt, path)
    return saved, _state_by_name(opt, model.unwrap())


def test_a_plain_file_keeps_the_state_of_frozen_parameters_loaded_into_fsdp_shards(tmp_path):
    """(before: the state of the frozen ``a`` was dropped without a word: torch's full-state
    load keeps the state of parameters that require a gradient only)"""
    from dist_utils import run_ranks
    for saved, got in run_ranks(_file_into_fsdp_worker, 2, str(tmp_path / "optim.pt"),
                                timeout=120):
        assert sorted(got) == sorted(saved) and any(name.startswith("a.") for name, _ in saved)
        for key, value in saved.items():
            assert torch.equal(got[key], value), key


def _file_into_partial_state_worker(path):
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    booster = Booster(RingSequenceParallelPlugin(sp_size=1))
    net = _TwoLayers()
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=0.05))
    opt.backward(model(torch.randn(3, 4)).pow(2).mean())
    opt.step()
    saved = _state_by_name(opt, model.unwrap())
    booster.save_optimizer(opt, path)
    booster = Booster(RingSequenceParallelPlugin(sp_size=1, zero_stage=2))
    net = _TwoLayers()
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=0.05))
    net.b.requires_grad_(False)  # a step in which b gets no gradient: no state for it here
    opt.backward(model(torch.randn(3, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    net.b.requires_grad_(True)
    booster.load_optimizer(opt, path)
    got = _state_by_name(opt, model.unwrap())
    opt.backward(model(torch.randn(3, 4)).pow(2).mean())
    opt.step()  # (before: a whole tensor as b's state; this step raised DTensor's mixed error)
    return saved, got


def test_a_plain_file_loads_into_sharded_parameters_of_which_some_have_no_state_yet(tmp_path):
    from dist_utils import run_ranks
    for saved, got in run_ranks(_file_into_partial_state_worker, 2,
                                str(tmp_path / "optim.pt"), timeout=120):
        assert sorted(got) == sorted(saved)
        for key, value in saved.items():
            assert torch.equal(got[key], value), key


def test_a_plain_optimizer_file_with_part_of_a_parameters_state_is_refused(tmp_path):
    """A plain (replicated) optimizer file in which one parameter lacks part of its state
    (``exp_avg_sq`` deleted) is refused before anything loads, into a fresh optimizer and into
    the one that saved it (before: it loaded, and the next step raised torch's KeyError). A
    parameter without any state loads stateless; Adafactor's entries, which differ between
    matrices and vectors in name and shape, load as saved (before: refused, "state 'row_var'
    of parameter 0 has shape (2, 1), the parameter (2, 3)"); state of another shape is
    refused."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters()), None, model=model)
    opt.backward(model["used"](torch.ones(4, 3)).sum())
    opt.step()
    io = DistributedCheckpointIO()
    whole = str(tmp_path / "whole.pt")
    io.save_optimizer(opt, whole, sharded=False)
    fresh_model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    fresh = OptimizerWrapper(torch.optim.AdamW(fresh_model.parameters()), None,
                             model=fresh_model)
    io.load_optimizer(fresh, whole)
    assert fresh_model["unused"].weight not in fresh.unwrap().state
    fresh.backward(fresh_model["used"](torch.ones(4, 3)).sum())
    fresh.step()  # the loaded state is complete

    kept = opt.unwrap().state[model["used"].weight]["exp_avg_sq"].clone()
    state = opt.unwrap().state_dict()
    state["state"][0] = {k: v for k, v in state["state"][0].items()  # (the optimizer's own
                         if k != "exp_avg_sq"}  # dict): part of used.weight's state only
    partial = str(tmp_path / "partial.pt")
    torch.save(state, partial)
    for target in (OptimizerWrapper(torch.optim.AdamW(fresh_model.parameters()), None,
                                    model=fresh_model), opt):
        with pytest.raises(ValueError, match=r"holds only part of the optimizer state of "
                                             r"parameter 0 \(group 0\): it lacks "
                                             r"\['exp_avg_sq'\], which AdamW's step with "
                                             r"the saved settings needs"):
            io.load_optimizer(target, partial)
    assert torch.equal(opt.unwrap().state[model["used"].weight]["exp_avg_sq"], kept)
    # the saved groups' settings decide the entries (they replace the optimizer's on load):
    # a file of AdamW without amsgrad loads into one built with it, and steps
    other = torch.optim.AdamW(fresh_model.parameters(), amsgrad=True)
    io.load_optimizer(other, whole)
    assert other.param_groups[0]["amsgrad"] is False
    fresh_model["used"](torch.ones(4, 3)).sum().backward()
    other.step()
    wider = nn.ModuleDict({"used": nn.Linear(4, 2), "unused": nn.Linear(4, 2)})
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 has shape \(2, 3\), "
                                         r"AdamW gives it \(2, 4\) for a parameter of shape"):
        io.load_optimizer(torch.optim.AdamW(wider.parameters()), whole)

    # matrices (row_var, col_var) and vectors (variance), two of each shape
    ada_model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ada = OptimizerWrapper(torch.optim.Adafactor(ada_model.parameters()), None, model=ada_model)
    ada.backward(ada_model(torch.ones(4, 3)).sum())
    ada.step()
    state = ada.unwrap().state
    assert set(state[ada_model[0].weight]) != set(state[ada_model[0].bias])
    path = str(tmp_path / "adafactor.pt")
    io.save_optimizer(ada, path, sharded=False)
    io.load_optimizer(OptimizerWrapper(torch.optim.Adafactor(ada_model.parameters()), None,
                                       model=ada_model), path)
    state = ada.unwrap().state_dict()
    state["state"][0] = {k: v for k, v in state["state"][0].items() if k != "row_var"}
    torch.save(state, path)  # Adafactor cannot step on the meta device: compared with the
    with pytest.raises(ValueError, match=r"parameter 0 \(group 0\): it lacks \['row_var'\], "
                                         r"which other parameters of shape \(3, 3\)"):
        io.load_optimizer(ada, path)  # other matrix's entries


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_files_get_the_mode_torch_save_gives(tmp_path, umask):
    """New files 0666 less the umask, an existing file its own mode, as torch.save leaves them
    (before: always 0600, mkstemp's, which also made an existing world-readable checkpoint
    private)."""
    import stat
    model = torch.nn.Linear(3, 3)
    path, private = tmp_path / "model.pt", tmp_path / "private.pt"
    torch.save(model.state_dict(), private)
    os.chmod(private, 0o600)
    old = os.umask(umask)
    try:
        DistributedCheckpointIO().save_model(model, str(path))
        DistributedCheckpointIO().save_model(model, str(path))  # over it: its mode kept
        DistributedCheckpointIO().save_model(model, str(private))
        DistributedCheckpointIO().save_model(model, str(tmp_path / "shards"), max_shard_size=64)
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    assert stat.S_IMODE(os.stat(path).st_mode) == expected
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    for name in os.listdir(tmp_path / "shards"):
        assert stat.S_IMODE(os.stat(tmp_path / "shards" / name).st_mode) == expected, name
