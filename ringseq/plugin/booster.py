"""Booster: the training-loop facade over a :class:`~ringseq.plugin.Plugin`."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

from ..engine.integrity import call_tag
from .base import Plugin

__all__ = ["Booster"]


class Booster:
    """Prepares training objects with ``plugin`` and routes backward, no_sync and checkpoints
    through it, so the loop does not depend on the parallel strategy::

        booster = Booster(plugin=RingSequenceParallelPlugin(sp_size=2))
        model, optimizer, criterion, loader, _ = booster.boost(model, optimizer,
                                                               dataloader=loader)
        for batch in loader:
            loss = criterion(model(**batch), batch)
            booster.backward(loss, optimizer)
            optimizer.step(); optimizer.zero_grad()

    Raises TypeError when ``plugin`` is not a :class:`Plugin`.
    """

    def __init__(self, plugin: Plugin):
        if not isinstance(plugin, Plugin):
            raise TypeError(f"Booster needs a ringseq.plugin.Plugin, got {type(plugin).__name__}")
        self.plugin = plugin
        self.checkpoint_io = plugin.get_checkpoint_io()

    def boost(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
              criterion: Optional[Callable] = None, dataloader=None, lr_scheduler=None):
        """Returns ``(model, optimizer, criterion, dataloader, lr_scheduler)`` wrapped by the
        plugin (see ``plugin.configure`` for what each becomes and what is raised)."""
        return self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """``optimizer.backward(loss)`` for a boosted optimizer (grad scaling for fp16), else
        ``loss.backward()``. First, one agreement of the ranks (``plugin.grad_agreement``):
        RingMismatchError on every rank when they disagree on ``no_sync`` or froze different
        parameters (``requires_grad=False`` on some ranks only), and zero gradients
        for the parameters other ranks use and this one does not (FSDP, tensor
        parallelism). An exception on one rank is reported to its ring peers when they
        may still be inside a ring call of the backward (see ``ModelWrapper``); this rank then
        completes the data-parallel collectives it did not reach (DDP's gradient buckets,
        ``ringseq.plugin.ddp_sum``; FSDP's all-gathers and reduce-scatters,
        ``ringseq.plugin.fsdp_replay``; the tp group's, ``ringseq.plugin.tp_replay``), and the
        ranks whose backward ended raise
        ``RingPeerError`` naming the ranks whose backward raised. Recover with
        ``optimizer.zero_grad()`` and ``booster.reset()`` on every rank."""
        reporter = getattr(self.plugin, "reporter", None)
        ctx = (reporter.watch("backward", loss=loss) if reporter is not None
               else contextlib.nullcontext())
        step = getattr(optimizer, "_step", None)
        # (the failure report, sent when the backward raised, carries the step's tag too)
        tag = step.value if step is not None else 0
        before = getattr(self.plugin, "before_backward", None)
        if before is not None:
            # before any collective of the backward, outside the failure reporting (it raises
            # on every rank or on none)
            with call_tag(tag):
                before(loss)
        with call_tag(tag), ctx:
            if hasattr(optimizer, "backward"):
                optimizer.backward(loss)
            else:
                loss.backward()

    def reset(self) -> None:
        """After a step that raised (on every rank): makes the plugin's ring usable again.
        Call it on every rank, e.g. in the ``except`` block that skips the failed step.
        RingSequenceParallelPlugin raises RuntimeError when the processes must be restarted
        instead (see its ``reset``)."""
        if hasattr(self.plugin, "reset"):
            self.plugin.reset()

    def no_sync(self, model: nn.Module = None, optimizer=None):
        """Context for gradient accumulation: backward passes inside it do not communicate;
        the first backward outside it reduces the accumulated gradients. Run each accumulated
        micro-batch's forward and backward inside it: under DDP torch decides at the forward
        whether the backward reduces (RingSequenceParallelPlugin at zero_stage 0 without
        tensor parallelism); FSDP and tensor parallelism decide at the backward. ``model``: the
        boosted model (RingSequenceParallelPlugin raises ValueError for anything else, None
        included: there would be no reduction to skip)."""
        if not self.plugin.support_no_sync():
            raise RuntimeError(f"{type(self.plugin).__name__} does not support no_sync")
        return self.plugin.no_sync(model, optimizer)

    def save_model(self, model: nn.Module, checkpoint: str, **kwargs) -> None:
        """Writes the full (unsharded) ``state_dict`` of the user's model, from any mesh (one
        file; ``max_shard_size=`` for transformers-style shards in a directory); collective."""
        self.checkpoint_io.save_model(model, checkpoint, **kwargs)

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True, **kwargs):
        """Loads a full ``state_dict`` (from ``save_model`` or a plain model) into any mesh."""
        return self.checkpoint_io.load_model(model, checkpoint, strict=strict, **kwargs)

    def save_optimizer(self, optimizer, checkpoint: str, **kwargs) -> None:
        """Writes the optimizer state; collective: the plain ``torch.optim`` state dict for
        replicated training, a ``torch.distributed.checkpoint`` directory for sharded
        (FSDP / tensor-parallel) training or with ``sharded=True``."""
        self.checkpoint_io.save_optimizer(optimizer, checkpoint, **kwargs)

    def load_optimizer(self, optimizer, checkpoint: str, **kwargs) -> None:
        """Loads either optimizer format into this mesh (dp, sp, tp or zero_stage may differ
        from the saving run's). Clears a boosted optimizer's refusal to step after a step that
        raised on some ranks (load the model too)."""
        self.checkpoint_io.load_optimizer(optimizer, checkpoint, **kwargs)
        if getattr(optimizer, "failed_step", None) is not None:
            optimizer.failed_step = None

    # (keywords passed on as save_model's are: one the call does not take is refused on every
    # rank, agreed on; before, Python's TypeError on the rank given it and the ring timeout on
    # the others)
    def save_lr_scheduler(self, lr_scheduler, checkpoint: str, **kwargs) -> None:
        """Writes ``lr_scheduler.state_dict()`` (one file); collective."""
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint, **kwargs)

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str, **kwargs) -> None:
        """Loads a state written by ``save_lr_scheduler``; collective."""
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint, **kwargs)
