"""What moves the bytes of a ring: the step exchange and the small control collective.

A :class:`Transport` is the ring's wiring and nothing else (its integrity state -- call
sequence, broken flag, thread binding, buffers -- lives in :class:`ringseq.engine.ring.Ring`):

* ``world_size``, ``rank``: the ring;
* ``exchange(send, recv, reverse=False)``: post send-to-next and receive-from-previous of two
  equally sized contiguous tensors (``reverse``: the other way round); returns something with
  ``wait()`` (or None for a ring of one);
* ``control(words)``: all-gather one int64 vector per rank (the control collective of
  :mod:`ringseq.engine.integrity`), or None where ranks cannot disagree (one process);
* ``rebuild()``: after a failure broke the channels (a timeout), make new ones -- every rank
  calls it (through ``ringseq.reset_ring``) the same number of times.

:class:`RingComm` implements it over a torch.distributed process group; the simulator
(:mod:`ringseq.engine.sim`) with threads. A new transport subclasses :class:`Transport`, sets
``world_size`` / ``rank`` and implements ``exchange`` (and ``control`` when its ranks are
separate processes); the engine does not change.

Rank ``r`` of a group of ``W`` sends to ``(r + 1) % W`` and receives from ``(r - 1) % W``, so at
ring step ``i`` it holds the K/V shard that rank ``(r - i) % W`` started with. Everything a step
moves lives in one packed, contiguous byte buffer, so a step is one send and one receive posted
together. On NCCL the exchange is one ``batch_isend_irecv`` on the process group (it runs on
the group's own stream after waiting on the current stream -- an event, not a synchronize --
and ``Work.wait()`` makes the current stream wait for it, so compute overlaps the transfer).
On gloo (CPU) the exchange and the control collective each run on a gloo group of the ring's
members that ringseq creates from the default store under a name of its own: host memory only,
never mixed up with the user's collectives, and rebuilt by ``reset_ring`` when a timeout broke
it (gloo closes a pair that timed out).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import signal
import sys
import threading
import time
import weakref
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .._dist import (RESET_ADVICE, RingTimeoutError, global_rank, group_info, is_initialized,
                     ring_timeout)

__all__ = ["RingComm", "Transport"]


class Transport:
    """The interface between the ring engine and whatever moves the bytes (see module doc)."""

    world_size: int = 1
    rank: int = 0
    #: the ranks are threads of one process (the simulator): no thread binding, and the
    #: calling thread's name is not part of a call's signature
    ranks_are_threads: bool = False

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, reverse: bool = False):
        """Posts send-to-next and receive-from-previous of two contiguous tensors of equal size
        (``reverse``: send to the previous rank, receive from the next, which brings gradients
        home after a partial lap); returns the pending exchange (call ``wait()`` before reading
        ``recv`` or writing ``send``), or None for a ring of one."""
        raise NotImplementedError

    def control(self, words: torch.Tensor) -> Optional[torch.Tensor]:
        """All-gathers ``words`` (int64, the same length on every rank) into (world_size, n),
        or returns None where there is nothing to agree on (this default: ranks in one
        process)."""
        return None

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Blocking all-to-all of two contiguous (world_size, n) tensors: row ``r`` of ``send``
        goes to rank ``r``, row ``r`` of ``recv`` comes from rank ``r`` (Ulysses)."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")

    def rebuild(self) -> None:
        """Replaces channels a failure broke (nothing to do for this default)."""

    def who(self) -> str:
        """This rank, for error messages."""
        return f"rank {self.rank}"

    def describe_peers(self) -> str:
        """The peers, for error messages."""
        return f"ranks {[r for r in range(self.world_size) if r != self.rank]}"

    def peer_name(self, rank: int) -> str:
        """Member ``rank`` of the group, for error messages: its global rank where the
        transport knows its members' (``members``, as RingComm does)."""
        members = getattr(self, "members", None)
        return f"global rank {members[rank]}" if members else f"rank {rank} of its group"

    @property
    def ring_key(self):
        """The object the ring's integrity state is kept for (two transports over the same
        channel share it)."""
        return self


# ---------------------------------------------------------------------------------- RingComm
def _timeout_exc(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


# A wait on a collective returns to Python this often: Python runs its signal handlers only
# between bytecodes, so a Ctrl-C while this rank waits for a stalled peer would otherwise wait
# for the ring timeout (1800 s by default).
_WAIT_SLICE = datetime.timedelta(milliseconds=250)


def _wait_interruptibly(work) -> None:
    """``work.wait()`` in slices of ``_WAIT_SLICE`` (the collective's own timeout still ends
    it). Only for collectives run by gloo's worker threads (an all-gather): a slice that ends
    leaves them running, whereas a gloo send/recv whose wait times out closes its pair."""
    while True:
        try:
            work.wait(_WAIT_SLICE)
            return
        except RuntimeError as exc:
            # c10d's Work.wait(timeout) says this when the slice ended, not the collective
            if "Operation timed out!" not in str(exc):
                raise


_STORE_CLIENTS = threading.local()  # {id(default store): (store, this thread's clone)}
_STORE_TIMEOUT_LOCK = threading.Lock()  # one thread at a time lowers the default store's


def _meet_in_store(store, world_size: int, timeout_s: float) -> None:
    """Waits until every member of a new channel arrived at its rendezvous, counted in
    ``store``, before gloo connects them: gloo's own connect retried towards a peer that had
    already given up for up to 5 times the ring timeout, and a Ctrl-C waited for it. Raises
    RuntimeError ("timed out") after ``timeout_s``, leaving a mark that makes a member
    arriving later raise at once; polled, so a Ctrl-C interrupts the wait (and closes the
    rendezvous: the members still waiting raise at once)."""
    # One counter, changed atomically: the first member to give up closes it (takes it below
    # zero) and writes how many had arrived then; every member decides from that one number,
    # so none goes on into gloo's connect while another gave up (a member arriving after the
    # close finds it closed short of everyone; a later closer finds it closed already).
    arrived = store.add(_ARRIVED, 1)
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    try:
        while arrived < world_size:
            if arrived < 0 or time.monotonic() > deadline:
                if arrived >= 0:
                    _close_rendezvous(store, None)
                store.wait([_CLOSED_AT])  # (written right after the close)
                if int(store.get(_CLOSED_AT)) >= world_size:
                    return  # (everyone had come when it closed)
                raise RuntimeError(
                    f"timed out after {timeout_s:.0f} s at the channel's rendezvous"
                    if arrived >= 0 else "a peer gave up waiting for this rank at the channel's "
                    "rendezvous (it stopped waiting first, or was interrupted)")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
            arrived = store.add(_ARRIVED, 0)
    except (KeyboardInterrupt, SystemExit):  # (a Ctrl-C: the others need not wait for it)
        _close_rendezvous(store, -1)
        raise


_ARRIVED, _CLOSED_AT = "ringseq_arrived", "ringseq_closed_at"
_GONE = 1 << 40  # (takes the counter below zero: closed)


def _close_rendezvous(store, mark) -> None:
    """Closes the rendezvous counter; the first closer writes how many had arrived (``mark``
    instead, when given: -1 makes every member still waiting raise)."""
    closed = store.add(_ARRIVED, -_GONE) + _GONE
    if closed >= 0:  # (the first closer: a later one finds the counter below zero)
        store.set(_CLOSED_AT, str(closed if mark is None else mark))


def _own_store_client():
    """This thread's own client of the default store (a clone: one more connection per thread)
    for the channels' rendezvous: two threads of a process setting up their rings at once (one
    process group per thread) would otherwise share one client, and one thread's wait for a
    peer's key would hold it while the other thread's peer waits for a key this one cannot
    set. The default store itself where its type cannot be cloned.

    The clone waits at most the ring timeout (in force now) for the store and for a peer's
    key: the default store's own timeout (30 minutes under torchrun) would otherwise bound a
    channel's rendezvous with a peer that died, or a connection to a store host that is gone.
    """
    store = dist.distributed_c10d._get_default_store()
    clients = getattr(_STORE_CLIENTS, "by_store", None)
    if clients is None:
        clients = _STORE_CLIENTS.by_store = {}
    limit = datetime.timedelta(seconds=ring_timeout())
    held = clients.get(id(store))
    if held is None or held[0] is not store:
        try:
            # The clone connects with the timeout of the store it clones: the ring's, for the
            # clone only. The default store is shared (its timeout is every process group's,
            # a PrefixStore's writes through): one thread at a time lowers it, and puts back
            # what it found.
            with _STORE_TIMEOUT_LOCK:
                before = store.timeout
                store.set_timeout(limit)
                try:
                    held = clients[id(store)] = (store, store.clone())
                finally:
                    store.set_timeout(before)
        except (AttributeError, NotImplementedError):  # a store type without clone()
            return store
    held[1].set_timeout(limit)
    return held[1]


class InterruptedWait(KeyboardInterrupt):
    """A Ctrl-C held during a ring exchange whose wait then failed (timed out): raised with
    that failure as its cause, so the interrupt is not lost to it."""


@contextlib.contextmanager
def deferred_interrupts():
    """A SIGINT (Ctrl-C) that arrives inside the block is held until the block ends, then
    handed to the handler in force before it (Python's raises KeyboardInterrupt there). For
    the waits of a ring step's gloo send and receive, which do not return to Python before
    their transfer completes or times out: a KeyboardInterrupt raised as the first returned
    left the call with the other transfer never waited for, and the peers waited for this
    rank until the ring timeout. A held SIGINT is handed over also when the wait raises
    (:class:`InterruptedWait`). Only on the main thread (the only one signals reach)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN / SIG_DFL: nothing raises inside the wait
        yield
        return
    arrived = []

    def hold(signum, frame):
        if not arrived:
            sys.stderr.write("ringseq: Ctrl-C during a ring exchange: raised once the exchange "
                             "completes (its peers then raise too) or times out\n")
        arrived.append(frame)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    except BaseException as exc:
        signal.signal(signal.SIGINT, previous)
        if arrived:
            # the wait failed (a timeout) after a Ctrl-C: the Ctrl-C, with that as its cause
            if previous is signal.default_int_handler:
                raise InterruptedWait() from exc
            previous(signal.SIGINT, arrived[-1])
        raise
    signal.signal(signal.SIGINT, previous)
    if arrived:
        previous(signal.SIGINT, arrived[-1])


class _Pending:
    """The in-flight exchange of one ring step."""

    __slots__ = ("works", "comm", "timeout", "reverse")

    def __init__(self, works, comm: "RingComm", timeout: Optional[datetime.timedelta],
                 reverse: bool = False):
        self.works, self.comm, self.timeout, self.reverse = works, comm, timeout, reverse

    def wait(self) -> None:
        try:
            for w in self.works:
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)
        except RuntimeError as exc:
            raise exchange_error(self.comm, exc, self.timeout, self.reverse) from exc
        self.works = ()


def exchange_error(comm: "RingComm", exc: RuntimeError, timeout: Optional[datetime.timedelta],
                   reverse: bool = False) -> RingTimeoutError:
    """The ringseq error for a ring exchange (``reverse``: against the ring's direction, as a
    backward's returning dK/dV) that failed while posted or waited for."""
    what = ("waited more than {:.0f} s for".format(timeout.total_seconds())
            if timeout is not None and _timeout_exc(exc) else
            f"lost the connection ({type(exc).__name__}: {exc}) in")
    frm, to = (comm.next_rank, comm.prev_rank) if reverse else (comm.prev_rank, comm.next_rank)
    return RingTimeoutError(
        f"ringseq: {comm.who()} {what} a ring exchange with its peers "
        f"(receiving from global rank {frm}, sending to global rank "
        f"{to}): a peer stalled, died or left the ring call "
        f"(ringseq.set_ring_timeout changes the limit; {comm.recovery()})")


_EPOCHS: Dict[str, int] = {}  # ring channels made so far per process group name (this process)
_WITH_CHANNELS: "weakref.WeakSet" = weakref.WeakSet()  # RingComms holding gloo groups of ringseq's
_CHANNELS_CLOSED = False


@atexit.register
def _close_channels() -> None:
    """Drops ringseq's own gloo groups while the interpreter is still whole. torch's
    destroy_process_group does not know them, and a gloo group left to interpreter
    finalization can abort the process on its way out ("terminate called without an active
    exception") after a run that succeeded."""
    global _CHANNELS_CLOSED
    _CHANNELS_CLOSED = True  # a ring call after this (a later atexit handler) raises, not hangs
    for comm in list(_WITH_CHANNELS):
        comm._control_pg = comm._data_pg = None



def _runs_cpu_on_gloo(pg, backend: str) -> bool:
    """Whether process group ``pg`` (of backend name ``backend``) runs CPU tensors on gloo."""
    if backend == "gloo":
        return True
    try:  # (torch's per-device backends: "undefined" without a name, "cpu:gloo,cuda:nccl")
        return isinstance(pg._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)
    except Exception:  # noqa: BLE001 - no CPU backend, or another torch: the name decides
        return any(part.strip() in ("gloo", "cpu:gloo") for part in backend.split(","))

class RingComm(Transport):
    """Ring neighbours of ``group`` (None: the default group), its step exchange and its
    control collective.

    Attributes: ``world_size``, ``rank`` (in the group), ``next_rank`` / ``prev_rank`` (global
    ranks), ``backend`` (the process group's backend name). Without an initialized process
    group (and ``group=None``) it is a ring of one. Holds its process group weakly: a destroyed
    group takes its RingComm (and the channels ringseq made for it) with it.
    """

    def __init__(self, group=None):
        self._default = group is None
        self.world_size, self.rank = group_info(group)
        self._control_pg = self._data_pg = None
        self._pg_ref = None
        self.next_rank = self.prev_rank = 0
        self.backend, self.cpu_gloo = None, False
        if is_initialized():
            pg = group if group is not None else dist.group.WORLD
            self._pg_ref = weakref.ref(pg)
            self.next_rank = global_rank(group, (self.rank + 1) % self.world_size)
            self.prev_rank = global_rank(group, (self.rank - 1) % self.world_size)
            self.backend = str(dist.get_backend(group))
            #: whether the group runs CPU tensors on gloo ("gloo", "cpu:gloo,cuda:nccl", or
            #: init_process_group() without a backend, "undefined"): their exchanges then go
            #: through ringseq's own gloo channels, which the ring timeout bounds and
            #: reset_ring rebuilds (before: only for the exact name "gloo")
            self.cpu_gloo = _runs_cpu_on_gloo(pg, self.backend)
            self.members = dist.get_process_group_ranks(pg)
            self.name = getattr(pg, "group_name", None) or "?"
            self._epoch = _EPOCHS.get(self.name, 0)

    @property
    def group(self):
        """The process group (None for the default group)."""
        if self._default:
            return None
        pg = self._pg_ref() if self._pg_ref is not None else None
        if pg is None:
            raise RuntimeError("ringseq: the process group of this ring was destroyed")
        return pg

    @property
    def ring_key(self):
        return self._pg_ref() if self._pg_ref is not None else self

    def who(self) -> str:
        """This rank in the ring's group, with its global rank where they differ."""
        me = dist.get_rank() if is_initialized() else self.rank
        return f"rank {self.rank}" + (f" (global rank {me})" if me != self.rank else "")

    def describe_peers(self) -> str:
        me = dist.get_rank() if is_initialized() else 0
        return f"global ranks {[r for r in getattr(self, 'members', [0]) if r != me]}"

    # -- channels ------------------------------------------------------------------------------
    def _own_gloo(self, purpose: str):
        """A gloo group of the ring's members made from the default store under a name of
        ringseq's own: only the members take part (at their first use), and the name cannot
        collide with other groups over the same ranks."""
        if _CHANNELS_CLOSED:
            # a new group under the old name would meet the closed one's keys in the store
            raise RingTimeoutError(
                f"ringseq: rank {self.rank} called the ring after its channels were closed at "
                f"interpreter exit (an atexit handler or thread that outlived ringseq's)")
        self._publish_epoch()
        store = dist.PrefixStore(f"ringseq/{purpose}/{self.name}/{self._epoch}",
                                 _own_store_client())
        _meet_in_store(store, self.world_size, ring_timeout())
        _WITH_CHANNELS.add(self)
        return dist.ProcessGroupGloo(store, self.rank, self.world_size,
                                     datetime.timedelta(seconds=ring_timeout()))

    def _epoch_key(self, global_rank: int) -> str:
        return f"ringseq/epoch/{self.name}/{global_rank}"

    def _publish_epoch(self) -> None:
        """This rank's channel generation, in the default store for :meth:`reset_mismatch`."""
        try:
            dist.distributed_c10d._get_default_store().set(self._epoch_key(dist.get_rank()),
                                                           str(self._epoch))
        except Exception:  # noqa: BLE001 - a hint only (the store may be gone)
            pass

    def reset_mismatch(self) -> Optional[str]:
        """When the members' channels come from different numbers of resets (reset_ring called
        on some ranks only: their channels' names then never meet again), a sentence saying
        so and how to bring them level; None when they agree or it cannot be told."""
        if self._pg_ref is None:
            return None
        me = dist.get_rank()
        try:
            # A hint only, read through this thread's own client with a short limit: a store
            # host that stalled would hold the default store's client for its own timeout
            # (30 minutes under torchrun) after the ring's ran out
            store = _own_store_client()
            if store is dist.distributed_c10d._get_default_store():
                return None  # (no client of its own to bound)
            store.set_timeout(datetime.timedelta(seconds=min(2.0, ring_timeout())))
            seen = {r: int(store.get(self._epoch_key(r))) for r in self.members
                    if r != me and store.check([self._epoch_key(r)])}
        except Exception:  # noqa: BLE001 - a hint only: the store may be gone too
            return None
        seen[me] = self._epoch
        top = max(seen.values())
        if len(set(seen.values())) == 1:
            return None
        behind = {r: top - n for r, n in sorted(seen.items()) if n < top}
        return (f"the ranks' ring channels come from different numbers of reset_ring calls "
                f"(global rank: resets {dict(sorted(seen.items()))}): a rank has not reset yet, "
                f"or reset_ring was called on some ranks only, after which their channels never "
                f"meet again; then bring them level: ringseq.reset_ring(group) on "
                + ", ".join(f"global rank {r} alone {n} time(s)" for r, n in behind.items())
                + ", then once on every rank")

    def recovery(self) -> str:
        """What makes the ring usable again, for an error's message: reset_ring on every rank;
        where the ranks' channels come from different numbers of resets (reset_ring on some
        ranks only: then that advice never works, and the checks' agreement that would say so
        is off or not reached), how to bring them level first (:meth:`reset_mismatch`)."""
        return self.reset_mismatch() or f"{RESET_ADVICE} makes the ring usable again"

    def rebuild(self) -> None:
        # New channels under a new name: a gloo pair that timed out stays closed. Every rank
        # rebuilds as often as the others (reset_ring on every rank), so the names match;
        # reset_mismatch says so when they do not.
        if self._pg_ref is not None:
            self._epoch += 1
            _EPOCHS[self.name] = max(_EPOCHS.get(self.name, 0), self._epoch)
            self._publish_epoch()  # before the old channels close: a peer losing them can tell
        self._control_pg = self._data_pg = None

    # -- the exchange --------------------------------------------------------------------------
    def _data_channel(self):
        """The gloo group the payloads move on, made at its first use: its members meet in the
        store there, so a peer that never comes (checks off: nothing met it before) ends in
        RingTimeoutError as a stalled exchange does, not in the store's own error."""
        if self._data_pg is None:
            self._data_pg = self._opened("data")
        return self._data_pg

    def _opened(self, purpose: str):
        """A new channel (:meth:`_own_gloo`); RingTimeoutError when its members do not meet
        in the store within the ring timeout (a peer stalled or died, or the store's host is
        gone), as a stalled exchange ends."""
        try:
            return self._own_gloo(purpose)
        except RingTimeoutError:  # (channels closed at exit: says so itself)
            raise
        except RuntimeError as exc:  # (DistStoreError / DistNetworkError included)
            what = (f"waited more than {ring_timeout():.0f} s for" if _timeout_exc(exc)
                    else "could not reach")
            raise RingTimeoutError(
                f"ringseq: {self.who()} {what} its ring peers ({self.describe_peers()}) "
                f"opening the ring's {purpose} channel ({type(exc).__name__}: {exc}): a peer "
                f"stalled, died or left the ring call, or the store's host is gone "
                f"(ringseq.set_ring_timeout changes the limit; {self.recovery()})") from exc

    def exchange(self, send: torch.Tensor, recv: torch.Tensor,
                 reverse: bool = False) -> Optional[_Pending]:
        if self.world_size == 1:
            return None
        if self.cpu_gloo and send.device.type == "cpu":
            pg = self._data_channel()
            to, frm = ((self.rank - 1, self.rank + 1) if reverse else
                       (self.rank + 1, self.rank - 1))
            try:  # (posting fails too when a peer is gone, e.g. with the checks off)
                works = [pg.send([send], to % self.world_size, 0),
                         pg.recv([recv], frm % self.world_size, 0)]
            except RuntimeError as exc:
                raise exchange_error(self, exc, None, reverse) from exc
            return _Pending(works, self, datetime.timedelta(seconds=ring_timeout()), reverse)
        group = self.group
        to, frm = (self.prev_rank, self.next_rank) if reverse else (self.next_rank, self.prev_rank)
        ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
        # NCCL keeps its stream-ordered wait and its own watchdog (a timed host wait would
        # block the host).
        return _Pending(dist.batch_isend_irecv(ops), self, None, reverse)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if self.world_size == 1:
            recv.copy_(send)
            return
        gloo = self.cpu_gloo and send.device.type == "cpu"
        channel = self._data_channel() if gloo else None  # (raises its own RingTimeoutError)
        try:
            if gloo:
                channel.alltoall_base(recv, send, [], []).wait(
                    datetime.timedelta(seconds=ring_timeout()))
            else:
                dist.all_to_all_single(recv, send, group=self.group)
        except RuntimeError as exc:
            # (before: "lost its all-to-all peers" for a timeout too, and only reset_ring's
            # advice, which leaves a hybrid's Ulysses group closed)
            what = (f"waited more than {ring_timeout():.0f} s for" if _timeout_exc(exc) else
                    f"lost the connection ({type(exc).__name__}: {exc}) to")
            raise RingTimeoutError(
                f"ringseq: {self.who()} {what} its all-to-all peers ({self.describe_peers()}): "
                f"a peer stalled, died or left the call (ringseq.set_ring_timeout changes the "
                f"limit; {self.recovery()})") from exc

    # -- the control collective ----------------------------------------------------------------
    def control(self, words: torch.Tensor) -> Optional[torch.Tensor]:
        if self.world_size == 1:
            return None
        if self._control_pg is None:
            self._control_pg = self._opened("control")
        out = torch.empty((self.world_size, words.numel()), dtype=words.dtype)  # (W, n) int64
        # The limit in force now, not the one the channel was made with (set_ring_timeout may
        # have changed it since): gloo takes a per-operation timeout.
        self.control_timeout_s = ring_timeout()
        opts = dist.distributed_c10d.AllgatherOptions()
        opts.timeout = datetime.timedelta(seconds=self.control_timeout_s)
        _wait_interruptibly(self._control_pg.allgather([list(out.unbind(0))], [words], opts))
        return out
