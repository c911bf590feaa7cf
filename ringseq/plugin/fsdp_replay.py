"""The sharded (zero stage 2/3, tp 1) training step when a forward or backward raises on some
ranks: what keeps the others from waiting in FSDP's collectives.

FSDP2 all-gathers each unit's parameters in the forward (and, at zero stage 3, again in the
backward) and reduce-scatters each unit's gradients after its backward, every rank making the
same collectives in the same order. A rank whose forward or backward raised stops making
them, so every other rank would wait in the next one until the process group's timeout.
Here a rank whose forward raised runs the all-gathers of the units it did not reach
(:meth:`FsdpReplay.after_forward_failure`; the other ranks then raise at the loss, which
hears of the failure), and a rank whose backward raised runs the rest of FSDP's backward
itself, with zeros for the gradients it did not compute (:meth:`FsdpReplay.after_failure`),
through FSDP's own per-unit methods, so that its all-gathers and prefetches are the ones the
other ranks make. After every backward the ranks all-reduce a status vector in which a
rank whose backward raised marks itself: the others raise RingPeerError instead of stepping
on invalid gradients (:meth:`FsdpReplay.after_success`). ``booster.reset()`` then resets
FSDP's per-iteration state (``FSDPModule.reset_iter_state``) on every rank.

Assumes what the plugin's models do: the units run forward in the order ``units`` lists them
(the root, whose forward runs around the others, first, then the decoder layers), and every
parameter that requires a gradient gets one in a backward (a parameter unused on the other
ranks would make the replayed reduce-scatter larger than theirs).
"""
from __future__ import annotations

import datetime
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .._dist import RingPeerError

__all__ = ["FsdpReplay"]


class FsdpReplay:
    """FSDP's collectives for a rank whose forward or backward raised, and the status check of
    the ranks whose backward ended, for one boosted model (see the module doc).

    ``units``: the FSDP modules in forward order, the root first. ``group``: FSDP's process
    group (the dp x sp ranks). ``expecting``: the model's last forward (with gradients
    enabled) waits for a backward that has not ended."""

    def __init__(self, units: List[nn.Module], group):
        self.units = list(units)
        self.group = group
        self.expecting = False
        self._forward = 0           # forwards started
        self._gathered = {}         # unit index -> the forward that gathered it last
        for i, unit in enumerate(self.units):
            # after FSDP's own pre-forward hook (prepended): the unit's all-gather happened
            unit.register_forward_pre_hook(lambda *_, i=i: self._mark_gathered(i))

    def _mark_gathered(self, index: int) -> None:
        self._gathered[index] = self._forward

    def _groups(self, unit: nn.Module):
        return unit._get_fsdp_state()._fsdp_param_groups

    def forward_started(self) -> None:
        self._forward += 1

    def forward_ran(self) -> None:
        """After the boosted model's forward ended: a forward with gradients enabled waits for
        its backward (one under no_grad leaves the wait as it was)."""
        if torch.is_grad_enabled():
            self.expecting = True

    def reset(self) -> None:
        """On every rank (the plugin's reset): FSDP forgets the failed forward or backward
        (its units resharded, their per-iteration state cleared)."""
        self.units[0].reset_iter_state()
        self.expecting = False

    def after_forward_failure(self, timeout: float) -> Optional[str]:
        """This rank's forward raised: the all-gathers of the units its forward did not
        reach, each resharded at once. Returns a note for this rank's error when they could
        not be completed (never raises: the rank's own error is what it raises)."""
        missing = [u for i, u in enumerate(self.units)
                   if self._gathered.get(i) != self._forward]

        def replay():
            for unit in missing:
                for group in self._groups(unit):
                    group.unshard()
                    group.wait_for_unshard()
                    group.reshard()
        return self._bounded(replay, timeout, "forward's parameter all-gathers")

    def after_failure(self, timeout: float) -> Optional[str]:
        """This rank's backward raised: runs the rest of FSDP's backward (the all-gathers,
        prefetches and reduce-scatters the other ranks make, on zeros where this rank has no
        gradient) and marks this rank in the status vector. Returns a note for this rank's
        error when they could not be completed (never raises)."""
        if not self.expecting:
            return None
        self.expecting = False
        root, layers = self.units[0], self.units[1:]

        def replay():
            # the backward starts at the root's output (its pre-backward prefetches the last
            # layer) and ends with the root's reduce-scatter (FSDP's final callback)
            for group in self._groups(root):
                self._pre_backward(group)
            for unit in reversed(layers):
                for group in reversed(self._groups(unit)):
                    self._pre_backward(group)
                    self._post_backward(group)
            for group in reversed(self._groups(root)):
                self._post_backward(group)
            self._status(failed=True)
        return self._bounded(replay, timeout, "backward's gradient reduction")

    def after_success(self) -> None:
        """This rank's backward ended: raises RingPeerError when another rank's did not (its
        gradients are zeros in this rank's sums). One all-reduce of W int64 per backward."""
        if not self.expecting:
            return
        self.expecting = False
        failed = self._status(failed=False)
        if failed:
            raise RingPeerError(
                f"ringseq: the backward did not end on rank(s) {failed} (they raise their own "
                f"errors), so the gradients reduced on this rank are invalid. Skip the step: "
                f"optimizer.zero_grad() and booster.reset() on every rank", ranks=failed)

    @staticmethod
    def _pre_backward(group) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        if group._training_state != TrainingState.POST_BACKWARD:
            group.pre_backward(True)  # no-op where it ran; gathers and prefetches like FSDP

    @staticmethod
    def _post_backward(group) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        if group._training_state == TrainingState.POST_BACKWARD:
            return  # reduced before this rank raised
        for fsdp_param in group.fsdp_params:
            if not hasattr(fsdp_param, "_unsharded_param"):
                continue
            param = fsdp_param.unsharded_param
            if (param.requires_grad and param.grad is None
                    and fsdp_param.unsharded_accumulated_grad is None):
                param.grad = torch.zeros_like(param)
        group.post_backward()

    def _status(self, failed: bool) -> List[int]:
        ranks = dist.get_process_group_ranks(self.group)
        vec = torch.zeros(len(ranks), dtype=torch.int64,
                          device=self.units[0]._get_fsdp_state()._device)  # (group size,)
        if failed:
            vec[dist.get_rank(self.group)] = 1
        dist.all_reduce(vec, group=self.group)
        return [ranks[i] for i, s in enumerate(vec.tolist()) if s]

    def _bounded(self, replay, timeout: float, what: str) -> Optional[str]:
        # A peer that died never answers: on gloo the replay waits at most `timeout` (FSDP's
        # collectives take the group's own timeout, minutes), then the rank raises its error.
        backend = _gloo_backend(self.group)
        old = getattr(getattr(backend, "options", None), "_timeout", None)
        if backend is not None and old is not None:
            backend._set_default_timeout(datetime.timedelta(seconds=timeout))
        try:
            with torch.no_grad():
                replay()
        except Exception as exc:  # noqa: BLE001 - a peer gone, or too slow to answer
            return (f"ringseq: completing FSDP's {what} for the other ranks failed "
                    f"({type(exc).__name__}: {exc}); the process group may be unusable: "
                    f"restart from a checkpoint")
        finally:
            if backend is not None and old is not None:
                backend._set_default_timeout(old)
        return None


def _gloo_backend(group):
    try:
        from torch.distributed import ProcessGroupGloo
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no gloo, or no CPU backend in this group
        return None
    return backend if isinstance(backend, ProcessGroupGloo) else None
