"""Gradient reduction of a replicated (zero_stage=0) tensor-parallel model.

DDP cannot take DTensor parameters, so at zero_stage 0 with tp_size > 1 the plugin reduces
gradients itself, with DDP's timing (at the end of every backward outside ``no_sync``) and the
plugin's exact-sum rule: each DTensor gradient is first brought to its parameter's placement
(a tp-``Partial`` gradient of a replicated parameter is summed over tp), then the local
tensors of all gradients are summed over the dp x sp ranks in one all-reduce per dtype.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ReplicatedGradSync"]


class ReplicatedGradSync:
    """Sums the gradients of ``model``'s parameters over ``group`` (the dp x sp ranks of this
    tp index) at the end of each backward in which any of them received a gradient.

    ``no_sync()`` skips the reduction for the backward passes inside it (their gradients
    accumulate locally; the next reduced backward sums the accumulation). Keep the object
    alive as long as the model trains (the plugin stores it on the model wrapper).
    """

    def __init__(self, model: nn.Module, group, reduced=None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group = group
        self.reduced = reduced  # marked at each reduction (see plugin.wrappers.ReducedGrads)
        self.enabled = True
        # The backward (autograd graph task) whose end runs sync: one per backward. Keyed by
        # the task, not a flag, so that a backward that raised before its end (its callback
        # never ran) does not leave every later backward unreduced.
        self._queued_task = None
        #: the all-reduces over ``group`` the current (or last) ``sync`` has sent: what a
        #: rank whose backward raised inside it still owes the others
        self.sent = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _param) -> None:
        task = torch._C._current_graph_task_id()
        if self.enabled and task != self._queued_task:
            self._queued_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.sync)

    @torch.no_grad()
    def sync(self) -> None:
        """Reduces the current gradients now (collective over ``group``)."""
        self._queued_task = None
        self.sent = 0
        if self.reduced is not None:
            self.reduced.mark()
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                if g.placements != p.placements:
                    g = g.redistribute(placements=p.placements)  # Partial -> summed over tp
                    p.grad = g
                g = g.to_local()
            by_dtype.setdefault(g.dtype, []).append(g)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            for grads in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.group)
                self.sent += 1
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()

    @contextlib.contextmanager
    def no_sync(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True
