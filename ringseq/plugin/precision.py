"""Mixed precision of the plugin: autocast for the forward, a grad scaler for fp16.

Parameters, gradients and optimizer state stay float32 (the master weights); autocast runs
matrix products and the ring attention blocks in bf16/fp16, and the loss is computed in float32
(``sharded_cross_entropy`` upcasts).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["PRECISIONS", "Precision", "check_precision_name"]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision_name(name) -> None:
    """Raises ValueError for a name that is not one of :data:`PRECISIONS`."""
    if not isinstance(name, str) or name not in PRECISIONS:  # (a list: unhashable)
        raise ValueError(f"precision={name!r} is not supported; expected one of "
                         f"{sorted(PRECISIONS)}")


class Precision:
    """``autocast()`` context for the forward and, for fp16, :meth:`new_scaler` (a GradScaler
    per boosted optimizer).

    Supported: fp32 everywhere; bf16 through autocast on CPU and CUDA; fp16 through autocast
    and ``torch.amp.GradScaler`` on CUDA, and on CPU where this torch has CPU fp16 autocast
    and a CPU GradScaler (torch >= 2.3; checked at construction).

    Raises ValueError for an unknown precision name, or fp16/bf16 on a device type whose
    autocast or grad scaler this torch lacks (at construction, on every rank alike).
    """

    def __init__(self, name: str, device_type: str):
        check_precision_name(name)
        self.name, self.device_type, self.dtype = name, device_type, PRECISIONS[name]
        if name == "fp32":
            return
        try:
            with torch.autocast(device_type, dtype=self.dtype):
                pass
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"precision={name!r} needs torch.autocast on {device_type!r} with "
                             f"{self.dtype}, which this torch {torch.__version__} refuses: "
                             f"{exc}") from exc
        if name == "fp16":
            try:
                self.new_scaler()
            except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
                raise ValueError(f"precision='fp16' needs a GradScaler for {device_type!r} "
                                 f"(torch >= 2.3 on CPU); use 'bf16' or 'fp32' instead: "
                                 f"{exc}") from exc

    def new_scaler(self):
        """A GradScaler of its own for one boosted optimizer (fp16), else None. One scaler
        shared by two optimizers was updated at each one's step: the first halved the scale
        after an overflow, and the second then unscaled its gradients (scaled by the old
        scale) by the new one, stepping with twice its gradients."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)
