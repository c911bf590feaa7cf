"""The transport of the ring: neighbours, cached double buffers, one exchange per step.

The engine (:mod:`ringseq.ring`) talks to a :class:`Transport` only:

* ``world_size``, ``rank``: the ring;
* ``buffers(key, nbytes, device)``: two cached byte buffers, the double buffer of one loop;
* ``exchange(send, recv)``: post send-to-next and receive-from-previous of two equally sized
  contiguous tensors; returns something with ``wait()`` (or None for a ring of one);
* ``check_consistent(fields, device)``: make ranks that disagree on a call raise together
  (a no-op where ranks cannot disagree).

:class:`RingComm` implements it over a torch.distributed process group; the in-process
simulator (:mod:`ringseq.sim`) implements it with threads. A new transport (say, a double
ring or a custom NCCL communicator) subclasses :class:`Transport` and implements
``exchange``; the ring loops do not change.

Rank ``r`` of a group of ``W`` sends to ``(r + 1) % W`` and receives from ``(r - 1) % W``, so at
ring step ``i`` it holds the K/V shard that rank ``(r - i) % W`` started with. Everything a step
moves lives in one packed, contiguous byte buffer, so a step is one isend and one irecv posted
together. The same code runs on gloo (CPU) and NCCL (CUDA). On NCCL, ``batch_isend_irecv`` runs
on the process group's own stream after waiting on the current stream (an event, not a
synchronize), and ``Work.wait()`` makes the current stream wait for it, so compute on the
current stream overlaps the transfer with no device-wide synchronization.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._dist import check_consistent, global_rank, group_info, is_initialized

__all__ = ["Transport", "RingComm", "get_comm"]


class Transport:
    """The interface between the ring engine and whatever moves the bytes (see module doc).

    Subclasses set ``world_size`` and ``rank`` and implement :meth:`exchange`; the buffer
    cache is shared."""

    world_size: int = 1
    rank: int = 0

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, torch.device], List[torch.Tensor]] = {}

    def buffers(self, key: str, nbytes: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Two uint8 buffers of ``nbytes`` (the double buffer of a ring loop), cached per
        ``(key, device)`` and grown when needed, so repeated calls do not allocate. The
        caller must not keep views of them past its own return."""
        device = torch.device(device)
        slot = self._buffers.get((key, device))
        if slot is None or slot[0].numel() < nbytes:
            pair = torch.empty((2, nbytes), dtype=torch.uint8, device=device)  # one allocation
            slot = [pair[0], pair[1]]
            self._buffers[(key, device)] = slot
        return slot[0][:nbytes], slot[1][:nbytes]

    def release_buffers(self) -> None:
        """Drops the cached buffers (they are re-allocated on the next call)."""
        self._buffers.clear()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor):
        """Posts send-to-next and receive-from-previous of two contiguous tensors of equal size;
        returns the pending exchange (call ``wait()`` before reading ``recv`` or writing
        ``send``), or None for a ring of one."""
        raise NotImplementedError

    def check_consistent(self, fields: Sequence[tuple], device=None) -> None:
        """Raises on every rank when ranks disagree on ``fields``; nothing to do by default."""


class _Pending:
    """The in-flight exchange of one ring step."""

    __slots__ = ("works",)

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = ()


class RingComm(Transport):
    """Ring neighbours of ``group`` (None: the default group) and the step exchange.

    Attributes: ``world_size``, ``rank`` (in the group), ``next_rank`` / ``prev_rank`` (global
    ranks, what P2P ops take), ``backend`` (the process group's backend name). Without an
    initialized process group (and ``group=None``) it is a ring of one.
    """

    def __init__(self, group=None):
        super().__init__()
        self.group = group
        self.world_size, self.rank = group_info(group)
        if is_initialized():
            self.next_rank = global_rank(group, (self.rank + 1) % self.world_size)
            self.prev_rank = global_rank(group, (self.rank - 1) % self.world_size)
            self.backend = str(dist.get_backend(group))
        else:
            self.next_rank = self.prev_rank = 0
            self.backend = None
        self._checked: set = set()  # call signatures already agreed on (mode "first")

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> Optional[_Pending]:
        if self.world_size == 1:
            return None
        ops = [dist.P2POp(dist.isend, send, self.next_rank, self.group),
               dist.P2POp(dist.irecv, recv, self.prev_rank, self.group)]
        return _Pending(dist.batch_isend_irecv(ops))

    def check_consistent(self, fields: Sequence[tuple], device=None) -> None:
        """Raises :class:`ringseq.RingMismatchError` on every rank when ranks disagree on
        ``fields``; see :func:`ringseq.set_consistency_check` for when it communicates."""
        check_consistent(fields, self.group, device, self._checked)


_COMMS: Dict[object, RingComm] = {}


def get_comm(group=None) -> RingComm:
    """The cached :class:`RingComm` of ``group`` (None: the default group)."""
    world, _ = group_info(group)  # raises for a group this process is not in
    key = None if not is_initialized() else (group if group is not None else dist.group.WORLD)
    comm = _COMMS.get(key)
    if comm is None:
        comm = RingComm(group)
        _COMMS[key] = comm
    return comm
