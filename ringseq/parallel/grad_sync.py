"""Gradient reduction of a replicated (zero_stage=0) tensor-parallel model.

DDP cannot take DTensor parameters, so at zero_stage 0 with tp_size > 1 the plugin reduces
gradients itself, with DDP's timing (at the end of every backward outside ``no_sync``) and the
plugin's exact-sum rule: each DTensor gradient is first brought to its parameter's placement
(a tp-``Partial`` gradient of a replicated parameter is summed over tp), then the local
tensors of all gradients are summed over the dp x sp ranks in one all-reduce per dtype.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .modules import grad_tensors

__all__ = ["ReplicatedGradSync"]


class ReplicatedGradSync:
    """Sums the gradients of ``model``'s parameters over ``group`` (the dp x sp ranks of this
    tp index) at the end of each backward in which any of them received a gradient.

    ``no_sync()`` skips the reduction for the backward passes inside it (their gradients
    accumulate locally; the next reduced backward sums the accumulation). Keep the object
    alive as long as the model trains (the plugin stores it on the model wrapper).

    One sync per backward also when layers are checkpointed reentrantly (transformers'
    ``use_reentrant=True``): each recomputed layer runs a backward of its own inside the
    backward, and a sync at the end of each would sum the gradients again. A backward that
    reaches the model's outputs queues the sync at its own end (run if a gradient was
    accumulated: ``torch.autograd.grad`` accumulates none); backward passes nested in it
    queue none.
    """

    def __init__(self, model: nn.Module, group, reduced=None):
        # (all of them: one frozen now may be unfrozen later; sync skips the frozen ones)
        self.params = list(model.parameters())
        self.group = group
        self.reduced = reduced  # marked at each reduction (see plugin.wrappers.ReducedGrads)
        self.enabled = True
        # The backward (autograd graph task) whose end runs sync: one per backward. Keyed by
        # the task, not a flag, so that a backward that raised before its end (its callback
        # never ran) does not leave every later backward unreduced.
        self._queued_task = None
        # A backward that began at the model's outputs and whose sync has not run yet (reset
        # by the next forward, should that backward have raised before its end).
        self._outer_pending = False
        self._accumulated = False  # a gradient was accumulated since that backward began
        #: the all-reduces over ``group`` the current (or last) ``sync`` has sent: what a
        #: rank whose backward raised inside it still owes the others
        self.sent = 0
        #: the ids of the parameters that got no gradient (unused in the forward) at the last
        #: sync in which they required one; the sync leaves them out
        self.unused: Set[int] = set()
        for p in self.params:
            frozen = not p.requires_grad
            p.requires_grad_(True)  # (torch registers the hook only then; it stays)
            p.register_post_accumulate_grad_hook(self._on_grad)
            p.requires_grad_(not frozen)
        model.register_forward_pre_hook(self._on_forward)
        model.register_forward_hook(self._on_output)

    def __deepcopy__(self, memo):
        # Reached through the model's hooks (bound methods of this object): a copy would share
        # the original's step state and the tp hooks' (closures over the original's), so that
        # a teacher's forward between the original's forward and backward would mix the two.
        raise TypeError(
            "copy.deepcopy: a model with tensor parallelism (tp_size > 1) at zero_stage 0 cannot "
            "be copied: its gradient reduction and tensor-parallel hooks hold this model's "
            "process groups and per-step state. Build the copy from a state dict instead: boost "
            "a fresh model with the same plugin, then load_state_dict(model.unwrap().state_dict())")

    def _on_forward(self, _module, _args) -> None:
        if torch._C._current_graph_task_id() == -1:  # (not a recompute inside a backward)
            self._outer_pending = False

    def _on_output(self, _module, _args, out) -> None:
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            for t in grad_tensors(out):
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad):
        task = torch._C._current_graph_task_id()
        if self.enabled and task != self._queued_task:
            self._accumulated = False
            self._queue(task, self._outer_end)
        self._outer_pending = self._queued_task is not None
        return grad

    def _outer_end(self) -> None:
        if self._accumulated:
            self.sync()
        else:
            self._queued_task, self._outer_pending = None, False

    def _on_grad(self, _param) -> None:
        self._accumulated = True
        if not self._outer_pending:  # (else a backward nested in one that syncs at its end)
            self._queue(torch._C._current_graph_task_id(), self.sync)

    def _queue(self, task, callback) -> None:
        if self.enabled and task != self._queued_task:
            self._queued_task = task
            torch.autograd.Variable._execution_engine.queue_callback(callback)

    @torch.no_grad()
    def sync(self) -> None:
        """Reduces the current gradients now (collective over ``group``)."""
        self._queued_task, self._outer_pending, self._accumulated = None, False, False
        self.sent = 0
        if self.reduced is not None:
            self.reduced.mark()
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        # (one frozen now keeps its record: it may be unfrozen and still unused)
        self.unused = ((self.unused - {id(p) for p in self.params if p.requires_grad})
                       | {id(p) for p in self.params if p.grad is None and p.requires_grad})
        for p in self.params:
            g = p.grad
            if g is None or not p.requires_grad:  # (a frozen one's leftover gradient too)
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
        # (restores what it found: a block nested in another leaves the sum off until the
        # outer one ends, as DDP's no_sync; before, the inner block's end turned it on)
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before
