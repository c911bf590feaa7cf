"""What a boosted model's data-parallel reduction does when a step raises on some ranks: the
interface :class:`~ringseq.plugin.wrappers.FailureReporter` drives (implemented by
``ddp_sum.DdpSum``, ``fsdp_replay.FsdpReplay`` and ``tp_replay.TpReplay``), and the error,
note, bounded wait and status exchange they share."""
from __future__ import annotations

import datetime
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from .._dist import RingPeerError
from ..engine.integrity import describe_error

__all__ = ["Completion", "STATUS_MESSAGE_BYTES", "agree_on_status", "bounded",
           "completion_failed_note", "exchange_errors", "failed_in", "peers_failed_error",
           "quote_marked", "status_rows", "status_vector"]


class Completion:
    """One boosted model's reduction, seen by the FailureReporter. ``expecting``: the model's
    last forward with gradients enabled waits for a backward that has not ended (its
    collectives are the ones a rank whose backward raised must complete). Timeouts are in
    seconds. The defaults do nothing."""

    expecting = False
    #: the boosted model whose collectives these are, weakly (set by the plugin), or None
    model_ref = None

    def reached_by(self, leaves: set, hidden: bool) -> bool:
        """Whether a backward whose autograd graph accumulates into the leaf tensors
        ``leaves`` (their ids; ``hidden``: the graph holds a reentrant checkpoint, whose
        parameters it does not show: ``grad_agreement.graph_leaves``) runs this model's
        collectives on the ranks; True where it cannot be told."""
        model = self.model_ref() if self.model_ref is not None else None
        if model is None or hidden:
            return True
        return any(id(p) in leaves for p in model.parameters())

    def forward_started(self) -> None:
        """Before the boosted model's forward."""

    def forward_ran(self) -> None:
        """After the boosted model's forward ended."""

    def backward_started(self) -> None:
        """``booster.backward`` begins (a backward that reaches the model's outputs from
        elsewhere, ``torch.autograd.grad`` say, is not one the ranks complete)."""

    def backward_ended(self) -> None:
        """``booster.backward`` ended, raised or not (after :meth:`after_success` or
        :meth:`after_failure`)."""

    def reached(self) -> bool:
        """The running ``booster.backward`` reached this model although it expects none (a
        second backward of one forward): a failure there is noted, not completed."""
        return False

    def after_forward_failure(self, timeout: float) -> Optional[str]:
        """This rank's forward raised: completes the collectives of the forward it did not
        reach. Returns a note for this rank's error when they could not be completed; never
        raises (the rank's own error is what it raises)."""
        return None

    def after_failure(self, timeout: float, error: BaseException) -> Optional[str]:
        """This rank's backward raised ``error``: completes the backward's collectives and
        tells the other ranks (the status, then the start of ``error``:
        :func:`agree_on_status`). Returns a note as :meth:`after_forward_failure`; never
        raises."""
        return None

    def after_success(self) -> None:
        """This rank's backward ended: raises RingPeerError when another rank's did not."""

    def reset_refusal(self) -> Optional[str]:
        """Why :meth:`reset` cannot forget a failed step with this torch, or None; the
        plugin asks every reduction before it resets anything."""
        return None

    def reset(self) -> None:
        """On every rank (the plugin's reset): forgets the failed step."""


#: how much of a failed rank's error its status row carries (UTF-8 bytes; a row is one more)
STATUS_MESSAGE_BYTES = 191
_ERRORS_SHOWN = 4  # the errors a peer's RingPeerError quotes (the first ranks')


def status_vector(world: int, rank: int, device, failed: bool) -> torch.Tensor:
    """What one rank adds to the status all-reduce that ends every backward: (world,) int64,
    1 at this rank where its backward raised. Where any rank is marked, every rank of the
    group then runs :func:`exchange_errors` (the failed ranks know it from their own mark)."""
    vec = torch.zeros(world, dtype=torch.int64, device=device)  # (world,)
    if failed:
        vec[rank] = 1
    return vec


def status_rows(world: int, rank: int, device, error: Optional[BaseException]) -> torch.Tensor:
    """What one rank adds to the error exchange after a backward that raised somewhere:
    (world, 1 + STATUS_MESSAGE_BYTES) uint8, zeros but this rank's row when its backward
    raised ``error``: 1 (2 where the text was cut), then the start of ``"{type}: {message}"``
    in UTF-8. Each rank writes only its own row, so the sum over the ranks holds every rank's
    row as it wrote it, and the ranks whose backward ended can quote why the others' did
    not."""
    rows = torch.zeros(world, 1 + STATUS_MESSAGE_BYTES, dtype=torch.uint8,
                       device=device)  # (world, 1 + STATUS_MESSAGE_BYTES)
    if error is not None:
        text = describe_error(error).encode("utf-8", "replace")
        cut = len(text) > STATUS_MESSAGE_BYTES
        row = torch.tensor([1 + cut, *text[:STATUS_MESSAGE_BYTES]],
                           dtype=torch.uint8)  # (1 + len(text),)
        rows[rank, :row.numel()] = row.to(device)
    return rows


def failed_in(rows: torch.Tensor, ranks: Sequence[int]) -> Dict[int, str]:
    """The ranks marked in summed :func:`status_rows` (``ranks[i]``: the global rank of row
    ``i``), each with the start of its error; one copy to the host."""
    host = rows.cpu()
    failed = {}
    for i, flag in enumerate(host[:, 0].tolist()):
        if flag:
            text = bytes(host[i, 1:].tolist()).rstrip(b"\0")
            failed[ranks[i]] = text.decode("utf-8", "ignore") + ("..." if flag == 2 else "")
    return failed


def exchange_errors(group, ranks: Sequence[int], index: int, device,
                    error: Optional[BaseException], timeout: float) -> Dict[int, str]:
    """The second collective, only after a status vector that marked a rank: every rank of
    ``group`` (``ranks``: its global ranks; this one ``ranks[index]``) all-reduces the
    :func:`status_rows`, the failed ones with their ``error``; returns :func:`failed_in`'s
    quotes. Waits at most ``timeout`` seconds; where the exchange fails, the marked ranks are
    not known here: the caller quotes nothing (an empty dict)."""
    rows = status_rows(len(ranks), index, device, error)  # (W, 1 + STATUS_MESSAGE_BYTES)
    try:
        dist.all_reduce(rows, group=group, async_op=True).wait(
            datetime.timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - a peer gone: the caller's error still names the ranks
        return {}
    return failed_in(rows, ranks)


def agree_on_status(group, ranks: Sequence[int], index: int, device,
                    error: Optional[BaseException], timeout: float) -> Dict[int, str]:
    """The status all-reduce that ends a backward over ``group`` (one of W int64), then, where
    it marked a rank, :func:`exchange_errors`. Returns the failed global ranks, each with the
    start of its error ("" where the exchange failed); empty when every backward ended."""
    vec = status_vector(len(ranks), index, device, error is not None)
    dist.all_reduce(vec, group=group)
    return quote_marked(vec, group, ranks, index, error, timeout)


def quote_marked(vec: torch.Tensor, group, ranks: Sequence[int], index: int,
                 error: Optional[BaseException], timeout: float) -> Dict[int, str]:
    """The ranks a summed :func:`status_vector` ``vec`` marks, each with the start of its
    error (:func:`exchange_errors`, run only where one is marked; "" where it failed)."""
    marked = [ranks[i] for i, s in enumerate(vec.tolist()) if s]
    if not marked:
        return {}
    quotes = exchange_errors(group, ranks, index, vec.device, error, timeout)
    return {r: quotes.get(r, "") for r in marked}


def peers_failed_error(failed: Dict[int, str]) -> RingPeerError:
    """The error of a rank whose backward ended while those of ``failed`` (global rank ->
    the start of its error, :func:`failed_in`) raised."""
    ranks = list(failed)
    quoted = "; ".join(f"rank {r}: {failed[r]}" for r in ranks[:_ERRORS_SHOWN] if failed[r])
    if len(ranks) > _ERRORS_SHOWN and quoted:
        quoted += f"; and {len(ranks) - _ERRORS_SHOWN} more"
    return RingPeerError(
        f"ringseq: the backward did not end on rank(s) {ranks} (they raise their own errors"
        f"{': ' + quoted if quoted else ''}), so the gradients reduced on this rank are "
        f"invalid. Skip the step: optimizer.zero_grad() and booster.reset() on every rank",
        ranks=ranks)


def completion_failed_note(what: str, exc: BaseException) -> str:
    """The note on a rank's own error when completing ``what`` for the other ranks raised
    ``exc`` (a peer gone, or too slow to answer)."""
    return (f"ringseq: completing {what} for the other ranks failed ({type(exc).__name__}: "
            f"{exc}); the process group may be unusable: restart from a checkpoint")


def bounded(replay: Callable[[], None], groups, timeout: float, what: str) -> Optional[str]:
    """Runs ``replay`` (a completion's collectives over ``groups``) under no_grad; returns the
    note of :func:`completion_failed_note` when it raised, else None. A peer that died never
    answers: on gloo each collective of the replay waits at most ``timeout`` seconds (or the
    group's own timeout, if shorter). (NCCL's collectives are asynchronous: there the other
    ranks' watchdog bounds the wait.)"""
    restore = []
    for group in groups:
        backend = _gloo_backend(group) if group is not None else None
        if backend is None or any(backend is b for b, _ in restore):
            continue  # (a group named twice: its own timeout is saved once)
        old = getattr(getattr(backend, "options", None), "_timeout", None)
        if old is not None:
            backend._set_default_timeout(min(old, datetime.timedelta(seconds=timeout)))
            restore.append((backend, old))
    try:
        with torch.no_grad():
            replay()
    except Exception as exc:  # noqa: BLE001 - a peer gone, or too slow to answer
        return completion_failed_note(what, exc)
    finally:
        for backend, old in restore:
            backend._set_default_timeout(old)
    return None


def _gloo_backend(group):
    try:
        from torch.distributed import ProcessGroupGloo
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no gloo, or no CPU backend in this group
        return None
    return backend if isinstance(backend, ProcessGroupGloo) else None
