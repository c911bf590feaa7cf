"""The plugin's optimizer checkpoints on one process: the fp16 grad scaler's state is saved
and restored with the optimizer in both formats (the multi-rank checkpoints, their votes and
errors are in tests/test_plugin.py and tests/test_compose.py)."""
from __future__ import annotations

import os

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
