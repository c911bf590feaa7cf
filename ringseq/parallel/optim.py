"""Moving a user's optimizer onto the parameters that sharding put in place of the originals.

Users build the optimizer over the model they wrote (``AdamW(model.parameters(), ...)``);
tensor parallelism and FSDP then replace every parameter with a DTensor. The optimizer object
is kept (so an lr scheduler built on it keeps working) and its param groups are pointed at the
new parameters, matched by name: same groups, same order, same hyperparameters.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

__all__ = ["parameter_names", "rebind_optimizer"]


def parameter_names(model: nn.Module) -> Dict[int, str]:
    """``id(parameter) -> name`` (a tied parameter under its first name)."""
    return {id(p): n for n, p in model.named_parameters()}


def _stepped(state: dict) -> bool:
    """Whether a parameter's optimizer state comes from a step: a ``step`` count above 0, or
    state without a count (SGD's momentum buffer, made by the first step). Adagrad's
    constructor makes state of step 0."""
    step = state.get("step")
    return bool(state) if step is None else float(step) > 0


def check_rebindable(optimizer: torch.optim.Optimizer, names: Dict[int, str],
                     moved: bool) -> None:
    """Raises ValueError when ``optimizer`` holds a tensor that is not a parameter of the model
    (``names``: :func:`parameter_names`): nothing would sum its gradient over the ranks, so
    each rank would step it with its own part and the replicas would drift apart (and under
    sharding it could not be moved); also when it has state already (a step was taken: under
    sharding the state is of the unsharded parameters, and under DDP each rank's state is
    its own while every rank starts from rank 0's weights); with ``moved`` (the parameters
    will be replaced by shards) any state, a constructor's too (Adagrad's). Checked before
    anything is modified."""
    stepped = any(_stepped(s) for s in optimizer.state.values())
    if stepped or (moved and any(len(s) for s in optimizer.state.values())):
        name = type(optimizer).__name__
        if not stepped:
            raise ValueError(f"boost: {name} makes state in its constructor, of the unsharded "
                             f"parameters, which sharding (zero_stage >= 2 or tp_size > 1) "
                             f"replaces without it; use an optimizer that makes its state at "
                             f"its first step (SGD, Adam, AdamW), or zero_stage 0 without "
                             f"tensor parallelism")
        raise ValueError(f"boost: {name} already has state (a step was taken, or a state "
                         f"loaded, before boost: each rank's own, or of the unsharded "
                         f"parameters); boost the model and optimizer first, then load a "
                         f"checkpoint with booster.load_optimizer")
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"boost: param group {gi} of {type(optimizer).__name__} holds "
                                 f"a tensor of shape {tuple(p.shape)} that is not a parameter "
                                 f"of the boosted model (nothing would sum its gradient over "
                                 f"the ranks); make it a parameter of the model, or give it an "
                                 f"optimizer of its own")


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: Dict[int, str],
                     model: nn.Module) -> torch.optim.Optimizer:
    """Points every param group of ``optimizer`` at ``model``'s current parameter of the same
    name (``names``: :func:`parameter_names` taken before the model was sharded); returns
    ``optimizer``. Call :func:`check_rebindable` first."""
    now = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [now[names[id(p)]] for p in group["params"]]
    optimizer.state.clear()
    return optimizer
