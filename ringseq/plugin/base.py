"""The plugin surface a :class:`~ringseq.plugin.Booster` talks to (ColossalAI-shaped)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Callable, List, Optional, Tuple

import torch
from torch.optim import Optimizer
from torch.utils.data import DataLoader

__all__ = ["Plugin"]


class Plugin(ABC):
    """What a Booster needs from a parallel training strategy.

    A plugin decides the device and precision (``control_device`` / ``control_precision``),
    wraps the training objects (:meth:`configure`), builds the data loader
    (:meth:`prepare_dataloader`), and owns checkpoint I/O (:meth:`get_checkpoint_io`), so that
    a training loop written against the Booster does not change with the strategy.
    """

    @abstractmethod
    def supported_devices(self) -> List[str]:
        """Device types the plugin can train on, e.g. ``["cpu", "cuda"]``."""

    @abstractmethod
    def supported_precisions(self) -> List[str]:
        """Precision names accepted by the constructor, e.g. ``["fp32", "bf16", "fp16"]``."""

    @abstractmethod
    def control_device(self) -> bool:
        """True when :meth:`configure` moves the model to the plugin's device."""

    @abstractmethod
    def control_precision(self) -> bool:
        """True when :meth:`configure` applies mixed precision (autocast, grad scaling)."""

    @abstractmethod
    def support_no_sync(self) -> bool:
        """True when :meth:`no_sync` can skip gradient synchronization (accumulation)."""

    @abstractmethod
    def configure(self, model: torch.nn.Module, optimizer: Optional[Optimizer] = None,
                  criterion: Optional[Callable] = None, dataloader: Optional[DataLoader] = None,
                  lr_scheduler=None) -> Tuple:
        """Returns the wrapped ``(model, optimizer, criterion, dataloader, lr_scheduler)``;
        ``None`` inputs stay ``None`` except the criterion, which a plugin may supply."""

    @abstractmethod
    def prepare_dataloader(self, dataset, batch_size: int, shuffle: bool = False,
                           seed: int = 1024, drop_last: bool = False, pin_memory: bool = False,
                           num_workers: int = 0, **kwargs):
        """A data loader that gives every rank its part of each global batch."""

    @abstractmethod
    def no_sync(self, model: torch.nn.Module,
                optimizer: Optional[Optimizer] = None) -> AbstractContextManager:
        """Context in which backward passes accumulate gradients without communicating."""

    @abstractmethod
    def get_checkpoint_io(self):
        """The object with ``save_model/load_model/save_optimizer/load_optimizer``."""
