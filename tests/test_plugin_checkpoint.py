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
