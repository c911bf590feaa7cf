"""The transport of the ring: neighbours, cached double buffers, one exchange per step.

The engine (:mod:`ringseq.ring`) talks to a :class:`Transport` only:

* ``world_size``, ``rank``: the ring;
* ``buffers(key, nbytes, device)``: two cached byte buffers, the double buffer of one loop;
* ``exchange(send, recv)``: post send-to-next and receive-from-previous of two equally sized
  contiguous tensors; returns something with ``wait()`` (or None for a ring of one);
* ``open_call(kind, signature, device)``: the :class:`ringseq.integrity.RingCall` that
  brackets one ring forward or backward (thread guard, control collectives, headers,
  failure semantics; see :mod:`ringseq.integrity`);
* ``control(kind, status, fields, payload)``: one control collective (None where ranks cannot
  disagree, e.g. the in-process simulator).

:class:`RingComm` implements it over a torch.distributed process group; the simulator
(:mod:`ringseq.sim`) implements it with threads. A new transport (a double ring, a custom
communicator) subclasses :class:`Transport`, sets ``world_size`` / ``rank`` and implements
``exchange`` (and ``control`` when its ranks are separate processes); the loops do not change.

Rank ``r`` of a group of ``W`` sends to ``(r + 1) % W`` and receives from ``(r - 1) % W``, so at
ring step ``i`` it holds the K/V shard that rank ``(r - i) % W`` started with. Everything a step
moves lives in one packed, contiguous byte buffer, so a step is one isend and one irecv posted
together. The same code runs on gloo (CPU) and NCCL (CUDA). On NCCL, ``batch_isend_irecv`` runs
on the process group's own stream after waiting on the current stream (an event, not a
synchronize), and ``Work.wait()`` makes the current stream wait for it, so compute on the
current stream overlaps the transfer with no device-wide synchronization. Control collectives
run on a separate gloo group of the same ranks (host memory: no device synchronization, and
never confused with the user's own collectives on the process group).
"""
from __future__ import annotations

import datetime
import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._dist import (RingTimeoutError, consistency_check_mode, global_rank, group_info,
                    is_initialized, ring_timeout)
from .integrity import BROKEN, CHECK, FAIL, KIND_NAMES, OK, RingCall, control_vector, judge

__all__ = ["Transport", "RingComm", "check_consistent", "get_comm", "reset_ring"]


class Transport:
    """The interface between the ring engine and whatever moves the bytes (see module doc).

    Subclasses set ``world_size`` and ``rank`` and implement :meth:`exchange`; the buffer
    cache, the call bookkeeping and the broken state are shared."""

    world_size: int = 1
    rank: int = 0

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, torch.device], List[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._seq = 0  # control operations so far (the same on every rank of a healthy ring)
        self._broken: Optional[BaseException] = None
        #: exchanges posted by the last ring call on this rank (for tests and benchmarks)
        self.last_exchanges = 0
        #: ring calls (forward or backward) opened on this rank so far
        self.calls = 0

    # -- buffers ---------------------------------------------------------------------------
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
        """Drops the cached exchange buffers (they are re-allocated on the next call): call it
        to give their memory back between phases that do not use ring attention."""
        self._buffers.clear()

    # -- the exchange ----------------------------------------------------------------------
    def exchange(self, send: torch.Tensor, recv: torch.Tensor, reverse: bool = False):
        """Posts send-to-next and receive-from-previous of two contiguous tensors of equal size
        (``reverse``: send to the previous rank, receive from the next, which brings gradients
        home after a partial lap); returns the pending exchange (call ``wait()`` before reading
        ``recv`` or writing ``send``), or None for a ring of one."""
        raise NotImplementedError

    # -- integrity -------------------------------------------------------------------------
    def control(self, kind: int, status: int, fields: Sequence[int] = (),
                payload: Sequence[float] = ()) -> Optional[List[List[float]]]:
        """One control collective: every rank's control vector (see integrity.control_vector),
        or None where there is nothing to agree on (this default: ranks in one process)."""
        return None

    def open_call(self, kind: int, signature: Sequence[tuple], device) -> RingCall:
        """The bookkeeping of one ring call; raises RuntimeError if another thread is inside a
        ring call on this transport (concurrent calls would interleave their exchanges)."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "ringseq: ring attention on this process group is already running in another "
                "thread; concurrent ring calls on one process group are not supported (their "
                "exchanges would interleave). Serialize the calls or give each thread its own "
                "process group.")
        self.calls += 1
        return RingCall(self, kind, signature, device)

    @property
    def broken(self) -> Optional[BaseException]:
        """The failure that broke this ring (None while it is healthy)."""
        return self._broken

    def mark_broken(self, cause: BaseException) -> None:
        if self.world_size > 1 and self._broken is None:
            self._broken = cause

    def report_failure(self, exc: BaseException) -> None:
        """Tells the peers that this rank failed outside a ring call (e.g. in the model before
        its first attention layer), so that their pending ring call raises instead of waiting
        for this rank. Marks the ring broken. A no-op for a ring that is already broken: a
        broken ring reports itself at its next control collective."""
        if self.world_size == 1 or self._broken is not None:
            return
        self._broken = exc
        with self._lock:
            self.control(FAIL, 1)

    def reset(self) -> None:
        """Makes a broken ring usable again; call it on every rank of the group (e.g. in the
        ``except`` block that caught the error), before the next ring call."""
        self._broken = None
        self._seq = 0


# ---------------------------------------------------------------------------------- RingComm
class _Pending:
    """The in-flight exchange of one ring step."""

    __slots__ = ("works", "comm", "timeout")

    def __init__(self, works, comm: "RingComm", timeout: Optional[datetime.timedelta]):
        self.works, self.comm, self.timeout = works, comm, timeout

    def wait(self) -> None:
        try:
            for w in self.works:
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)
        except RuntimeError as exc:
            if "imed out" not in str(exc):
                raise
            raise RingTimeoutError(
                f"ringseq: rank {self.comm.rank} waited more than "
                f"{self.timeout.total_seconds():.0f} s for a ring exchange with its peers "
                f"(receiving from global rank {self.comm.prev_rank}, sending to global rank "
                f"{self.comm.next_rank}): a peer stalled, died or left the ring call "
                f"(ringseq.set_ring_timeout changes the limit)") from exc
        self.works = ()


class RingComm(Transport):
    """Ring neighbours of ``group`` (None: the default group), the step exchange and the
    control collectives.

    Attributes: ``world_size``, ``rank`` (in the group), ``next_rank`` / ``prev_rank`` (global
    ranks, what P2P ops take), ``backend`` (the process group's backend name). Without an
    initialized process group (and ``group=None``) it is a ring of one. Holds its process group
    weakly: a destroyed group takes its RingComm (and the RingComm's control group) with it.
    """

    def __init__(self, group=None):
        super().__init__()
        self._default = group is None
        self.world_size, self.rank = group_info(group)
        self._control_group = None
        if is_initialized():
            pg = group if group is not None else dist.group.WORLD
            self._pg_ref = weakref.ref(pg)
            self.next_rank = global_rank(group, (self.rank + 1) % self.world_size)
            self.prev_rank = global_rank(group, (self.rank - 1) % self.world_size)
            self.backend = str(dist.get_backend(group))
        else:
            self._pg_ref = None
            self.next_rank = self.prev_rank = 0
            self.backend = None

    @property
    def group(self):
        """The process group (None for the default group)."""
        if self._default:
            return None
        pg = self._pg_ref() if self._pg_ref is not None else None
        if pg is None:
            raise RuntimeError("ringseq: the process group of this ring was destroyed")
        return pg

    def exchange(self, send: torch.Tensor, recv: torch.Tensor,
                 reverse: bool = False) -> Optional[_Pending]:
        if self.world_size == 1:
            return None
        group = self.group
        to, frm = (self.prev_rank, self.next_rank) if reverse else (self.next_rank, self.prev_rank)
        ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
        # A timed wait blocks the host; only gloo (host memory anyway) gets one, NCCL keeps its
        # stream-ordered wait and its own watchdog.
        timeout = (datetime.timedelta(seconds=ring_timeout()) if self.backend == "gloo"
                   else None)
        return _Pending(dist.batch_isend_irecv(ops), self, timeout)

    def _control_pg(self):
        if self._control_group is None:
            pg = self._pg_ref()
            # A gloo group of the ring's members made straight from the default store under a
            # prefix of our own: only the members take part (at their first ring call), and
            # the name cannot collide with other groups over the same ranks (torch's
            # locally-synchronized groups are named by their ranks alone).
            name = getattr(pg, "group_name", None) or "?"
            generation = _CONTROL_GENERATIONS.get(name, 0)
            _CONTROL_GENERATIONS[name] = generation + 1
            store = dist.PrefixStore(f"ringseq/control/{name}/{generation}",
                                     dist.distributed_c10d._get_default_store())
            self._control_group = dist.ProcessGroupGloo(
                store, self.rank, self.world_size, datetime.timedelta(seconds=ring_timeout()))
        return self._control_group

    def _timeout(self, kind, seq, exc) -> RingTimeoutError:
        err = RingTimeoutError(
            f"ringseq: rank {self.rank} waited more than {ring_timeout():.0f} s for its ring "
            f"peers (global ranks {self._peer_ranks()}) at the {KIND_NAMES.get(kind, kind)} step "
            f"of control operation #{seq}: a peer stopped calling ring attention, raised "
            f"outside ringseq without reporting it, or hangs (ringseq.set_ring_timeout changes "
            f"the limit)")
        self.mark_broken(err)
        return err

    def _peer_ranks(self):
        try:
            return [r for r in dist.get_process_group_ranks(self._pg_ref()) if r != dist.get_rank()]
        except Exception:  # noqa: BLE001 - only for the message
            return "?"

    def control(self, kind, status, fields=(), payload=()):
        if self.world_size == 1 or consistency_check_mode() == "off":
            return None
        mine = torch.tensor(control_vector(kind, status, self._seq, fields, payload),
                            dtype=torch.float64)  # (CONTROL_WORDS,)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        seq = self._seq
        self._seq += 1
        try:
            self._control_pg().allgather([gathered], [mine]).wait()
        except RuntimeError as exc:  # gloo's timeouts, and the store's while connecting
            if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                raise
            raise self._timeout(kind, seq, exc) from exc
        return [g.tolist() for g in gathered]


_CONTROL_GENERATIONS: Dict[str, int] = {}


_COMMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCAL: Dict[str, RingComm] = {}


def get_comm(group=None) -> RingComm:
    """The cached :class:`RingComm` of ``group`` (None: the default group). The cache holds
    process groups weakly, so destroyed groups do not keep their rings (and buffers) alive."""
    group_info(group)  # raises for a group this process is not in
    if not is_initialized():
        comm = _LOCAL.get("local")
        if comm is None:
            comm = _LOCAL["local"] = RingComm(None)
        return comm
    pg = group if group is not None else dist.group.WORLD
    comm = _COMMS.get(pg)
    if comm is None or comm._default != (group is None):
        comm = RingComm(group)
        _COMMS[pg] = comm
    return comm


def check_consistent(fields, group=None, device=None) -> None:
    """One argument check over ``group`` outside a ring call (e.g. before an all-to-all):
    ``fields`` are ``(name, int[, kind])`` pairs; raises ``RingMismatchError`` on every rank
    when ranks disagree (and RingBrokenError/RingDesyncError as a ring call's begin would).
    Uses the group's control collective, so it counts in the group's sequence of calls."""
    comm = get_comm(group)
    rows = comm.control(CHECK, BROKEN if comm.broken is not None else OK,
                        [int(f[1]) for f in fields])
    if rows is not None:
        judge(comm, rows, CHECK, fields)


def reset_ring(group=None) -> None:
    """Makes the ring of ``group`` usable again after a failure broke it (see
    :mod:`ringseq.integrity`); call it on every rank of the group before the next ring call."""
    get_comm(group).reset()

