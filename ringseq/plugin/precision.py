"""Mixed precision of the plugin: autocast for the forward, a grad scaler for fp16.

Parameters, gradients and optimizer state stay float32 (the master weights); autocast runs
matrix products and the ring attention blocks in bf16/fp16, and the loss is computed in float32
(``sharded_cross_entropy`` upcasts).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["PRECISIONS", "Precision", "check_precision_name", "settle_scaler", "update_due"]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision_name(name) -> None:
    """Raises ValueError for a name that is not one of :data:`PRECISIONS`."""
    if not isinstance(name, str) or name not in PRECISIONS:  # (a list: unhashable)
        raise ValueError(f"precision={name!r} is not supported; expected one of "
                         f"{sorted(PRECISIONS)}")


class Precision:
    """``autocast()`` context for the forward and, for fp16, ``scaler``: one GradScaler for
    every optimizer the plugin boosts. As in torch's recipe for several optimizers, each
    steps through it and it is updated once per iteration: :func:`update_due` after each
    step, :func:`settle_scaler` before the next loss is scaled (or the scaler saved). An
    update at each optimizer's step halved the scale after the first one's overflow, and the
    next one then unscaled its gradients (scaled by the old scale) by the new one, stepping
    with twice its gradient; a scaler per optimizer mis-scaled a loss over two models.

    Supported: fp32 everywhere; bf16 through autocast on CPU and CUDA; fp16 through autocast
    and ``torch.amp.GradScaler`` on CUDA, and on CPU where this torch has CPU fp16 autocast
    and a CPU GradScaler (torch >= 2.3; checked at construction).

    Raises ValueError for an unknown precision name, or fp16/bf16 on a device type whose
    autocast or grad scaler this torch lacks (at construction, on every rank alike).
    """

    def __init__(self, name: str, device_type: str):
        check_precision_name(name)
        self.name, self.device_type, self.dtype = name, device_type, PRECISIONS[name]
        self.scaler = None
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
                self.scaler = torch.amp.GradScaler(device_type)
            except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
                raise ValueError(f"precision='fp16' needs a GradScaler for {device_type!r} "
                                 f"(torch >= 2.3 on CPU); use 'bf16' or 'fp32' instead: "
                                 f"{exc}") from exc

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def update_due(scaler) -> None:
    """After an optimizer stepped through ``scaler``: its update is due before the next loss
    is scaled (:func:`settle_scaler`)."""
    scaler._ringseq_update_due = True


def found_inf(scaler, optim) -> bool:
    """Whether the unscale of ``optim``'s gradients through ``scaler`` found an inf or NaN on
    this rank."""
    state = scaler._per_optimizer_states.get(id(optim), {})
    return any(bool(inf) for inf in state.get("found_inf_per_device", {}).values())


def mark_inf(scaler, optim) -> None:
    """Another rank's unscaled gradients hold an inf or NaN: ``optim``'s step through
    ``scaler`` skips on this rank too, and the update backs off as there (before: only that
    rank skipped and lowered its scale; the replicas parted, and every sum after mixed two
    scales)."""
    for inf in scaler._per_optimizer_states[id(optim)]["found_inf_per_device"].values():
        inf.fill_(1.0)


def overflowed(scaler) -> None:
    """An overflow no step will record (``clip_grad_by_norm(error_if_nonfinite=True)`` raised
    on it): as for a step that skipped, the update before the next loss scaled through
    ``booster.backward`` backs off once for it. (Not at once: the other optimizers of the
    iteration may hold gradients of the current scale still to be unscaled. Like a step's,
    the update also comes before another optimizer's next micro-batch.)"""
    scaler._ringseq_overflow = True
    update_due(scaler)


def settle_scaler(scaler) -> None:
    """Runs the update the steps since the last one left due (once, however many optimizers
    stepped): the scale for the next loss, or for a checkpoint, reflects every overflow of
    the iteration, one a clip raised on (:func:`overflowed`) included. Nothing where no step
    recorded its inf checks and no clip an overflow (GradScaler asserts on an update without
    them)."""
    if scaler is None or not getattr(scaler, "_ringseq_update_due", False):
        return
    scaler._ringseq_update_due = False
    overflow, scaler._ringseq_overflow = getattr(scaler, "_ringseq_overflow", False), False
    found = [inf for state in scaler._per_optimizer_states.values()
             for inf in state.get("found_inf_per_device", {}).values()]
    if found and (not overflow or any(bool(inf) for inf in found)):
        scaler.update()  # (an overflow a step recorded as well backs off once)
    elif overflow:
        # GradScaler's own backoff for an inf, which no step recorded here
        scaler.update(new_scale=float(scaler.get_scale()) * scaler.get_backoff_factor())
        scaler._growth_tracker.fill_(0)
