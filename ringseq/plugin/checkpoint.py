"""Full (unsharded) checkpoints of replicated training state.

Under the ring plugin every rank holds the whole model and the whole optimizer state (only
activations are sharded), so a checkpoint is the plain ``state_dict`` written once by global
rank 0: it loads into the same model built without ringseq (``model.load_state_dict``) and a
plain ``torch.optim`` optimizer. Paths must be on a file system every rank can read when
loading.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .._dist import agree_or_raise

__all__ = ["ReplicatedCheckpointIO"]


def _unwrap(obj):
    return obj.unwrap() if hasattr(obj, "unwrap") else obj


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _save(obj, path: str) -> None:
    error = None
    if _is_writer():
        try:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            tmp = path + ".tmp"
            torch.save(_to_cpu(obj), tmp)
            os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint
        except Exception as exc:  # noqa: BLE001 - re-raised on this rank after agreeing
            error = exc
    # Doubles as the barrier (nobody reads the file before it exists) and makes a failed
    # write raise on every rank, not only on rank 0 while the others train on.
    if dist.is_initialized():
        agree_or_raise(error is None, f"saving {path!r} failed: {error!r}", error=error,
                       peer_message=f"rank 0 failed to write the checkpoint {path!r} (see its "
                                    f"error)")
    elif error is not None:
        raise error


class ReplicatedCheckpointIO:
    """``save_model/load_model/save_optimizer/load_optimizer/save_lr_scheduler/
    load_lr_scheduler`` for replicated state. Saving is collective: rank 0 writes, then the
    ranks agree on its success, so a failed write raises on every rank (rank 0 its own error,
    the others a ValueError). Loading reads the file on every rank (tensors to CPU, then the
    model's / the optimizer's own device placement). The fp16 grad scaler's state goes next to the optimizer
    checkpoint as ``<path>.grad_scaler`` and is restored from there when present.

    Raises FileNotFoundError for a missing file and whatever ``load_state_dict`` raises for
    mismatching keys or shapes (``strict=True`` by default).
    """

    def save_model(self, model, checkpoint: str, **_) -> None:
        _save(_unwrap(model).state_dict(), checkpoint)

    def load_model(self, model, checkpoint: str, strict: bool = True, **_):
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        return _unwrap(model).load_state_dict(state, strict=strict)

    def save_optimizer(self, optimizer, checkpoint: str, **_) -> None:
        _save(_unwrap(optimizer).state_dict(), checkpoint)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            _save(scaler.state_dict(), checkpoint + ".grad_scaler")

    def load_optimizer(self, optimizer, checkpoint: str, **_) -> None:
        _unwrap(optimizer).load_state_dict(
            torch.load(checkpoint, map_location="cpu", weights_only=True))
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and os.path.exists(checkpoint + ".grad_scaler"):
            scaler.load_state_dict(torch.load(checkpoint + ".grad_scaler", weights_only=True))

    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        _save(lr_scheduler.state_dict(), checkpoint)

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        lr_scheduler.load_state_dict(torch.load(checkpoint, map_location="cpu",
                                                weights_only=False))
