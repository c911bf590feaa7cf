"""The ring of a process group (or of a user's transport): its transport and its integrity
state, kept once per group.

A :class:`Ring` owns what must persist between the calls of one group -- the control
sequence number, the broken flag, the thread the group is bound to, the cached exchange
buffers, call counters -- and opens the :class:`ringseq.engine.integrity.RingCall` of each
forward or backward. Its :class:`ringseq.engine.transport.Transport` only moves bytes.

``get_ring(group)`` (also ``ringseq.get_comm``) returns the cached Ring of a process group,
of a :class:`Transport` passed as ``group=`` or of the local ring without torch.distributed.
"""
from __future__ import annotations

import contextlib
import re
import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._args import as_int, check_size_and_rank, given, is_bool
from .._hash import stable_code
from .._dist import (RESET_ADVICE, RingMismatchError, RingTimeoutError, consistency_check_mode,
                     defaults_for_malformed_settings,
                     group_info, is_initialized, named_for, real_object, ring_timeout)
from .integrity import (_N_FIELDS, BROKEN, CHECK, CONTROL_WORDS, FAIL, FAILED, FIELD0,
                        INVALID, OK, TEXT, THREAD_FIELD, RingCall, agreement_code,
                        broken_ring_error, control_name, control_vector, failure_report,
                        gather, judge, mismatch_error)
from .transport import RingComm, Transport, _timeout_exc

__all__ = ["Ring", "check_consistent", "get_comm", "get_ring", "group_info_or_refuse",
           "meet_as_failed", "refuse_on_error", "reset_ring", "ring_size"]


class Ring:
    """One ring's transport and integrity state (see the module doc).

    Attributes: ``transport``, ``world_size``, ``rank``, ``calls`` (forward and backward calls
    opened on this rank), ``last_exchanges`` (exchanges posted by the last call, for tests and
    benchmarks), ``broken`` (the failure that broke the ring, or None)."""

    def __init__(self, transport: Transport):
        check_transport("Ring", transport)
        self.transport = transport
        self.world_size, self.rank = transport.world_size, transport.rank
        self._lock = threading.Lock()
        self._thread: Optional[int] = None  # the thread this ring is bound to (first forward)
        self._seq = 0  # control operations so far (the same on every rank of a healthy ring)
        self._broken: Optional[BaseException] = None
        self._buffers: Dict[Tuple[str, torch.device], List[torch.Tensor]] = {}
        self.peer_messages: Dict[int, str] = {}
        self.last_exchanges = 0
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

    # -- the control collective ------------------------------------------------------------
    @property
    def checks_on(self) -> bool:
        return self.world_size > 1 and consistency_check_mode() != "off"

    def control(self, words: torch.Tensor, kind: int, seq: int) -> Optional[torch.Tensor]:
        """The transport's control collective, with every failure of it turned into a ringseq
        error naming the operation (and the ring marked broken)."""
        if not self.checks_on:
            return None
        try:
            return self.transport.control(words)
        except KeyboardInterrupt as exc:
            # a Ctrl-C while this rank waited: the all-gather stays pending on the channel
            self.mark_broken(exc)
            raise
        except RuntimeError as exc:
            limit = getattr(self.transport, "control_timeout_s", None) or ring_timeout()
            # (a channel that could not be opened says why itself: its cause decides)
            source = exc.__cause__ if isinstance(exc, RingTimeoutError) and \
                exc.__cause__ is not None else exc
            what = (f"waited more than {limit:.0f} s for"
                    if _timeout_exc(source) else "lost the connection to")
            mismatch = getattr(self.transport, "reset_mismatch", lambda: None)()
            at = control_name(words, kind, seq)
            err = RingTimeoutError(
                f"ringseq: {self.transport.who()} {what} its ring peers "
                f"({self.transport.describe_peers()}) at {at} on the control channel: "
                f"a peer stopped calling (stalled, died, or "
                f"raised outside ringseq without reporting it), gave up waiting for this rank, "
                f"or passes another process group object with the same members "
                f"({type(exc).__name__}: {exc}). Once they are back in step, reset the ring: "
                f"{RESET_ADVICE} (ringseq.set_ring_timeout changes the limit)"
                + (f". Also, {mismatch}" if mismatch else ""))
            self.mark_broken(err)
            raise err from exc

    # -- calls -----------------------------------------------------------------------------
    def open_call(self, kind: int, signature: Sequence[tuple], device,
                  bind: bool = True, name: str = "") -> RingCall:
        """The bookkeeping of one call. Raises RuntimeError at once when another thread uses
        this ring: a ring is bound to the first thread that calls it (``bind``: forwards and
        checks made by user code; backwards, and forwards recomputed during a backward, may run
        on an autograd worker thread), and concurrent calls would interleave their
        exchanges."""
        self._read_settings(kind, name)
        # inside a backward (autograd's device threads; recomputed checkpointed forwards)
        bind = (bind and self.world_size > 1 and not self.transport.ranks_are_threads
                and torch._C._current_graph_task_id() == -1)
        if bind:
            me = threading.get_ident()
            if self._thread is None or not _alive(self._thread):
                self._thread = me
            elif self._thread != me:
                # (Raised here only: meeting the peers from this thread could pair with the
                # bound thread's next call, or with nothing when this thread exists on this
                # rank alone; the peers of a call that never comes wait for the ring timeout.)
                raise RuntimeError(
                    f"{name or 'ringseq'}: this ring (process group of {self.world_size} ranks) "
                    f"is bound to thread {self._thread}, which called it first; calls from "
                    f"other threads (this is {me}) are refused, since their exchanges would "
                    f"pair with the other thread's calls on the peers. Give each thread its "
                    f"own process group")
            # Two threads per rank on one group would pair one rank's thread with another
            # rank's other thread: the calling thread's name is part of the signature.
            thread = _thread_name()
            signature = tuple(signature) + ((THREAD_FIELD, stable_code(thread), TEXT, thread),)
        call = RingCall(self, kind, signature, device, name)
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "ringseq: a call on this ring is already running in another thread; concurrent "
                "calls on one process group are not supported (their exchanges would "
                "interleave). Serialize the calls or give each thread its own process group.")
        self.calls += 1
        return call

    def _release(self) -> None:
        self._lock.release()

    def _read_settings(self, kind: int, name: str = "", about: int = 0) -> None:
        """Reads the check mode and the timeout (RINGSEQ_CHECK_CONSISTENCY / RINGSEQ_TIMEOUT)
        before a call opens or an agreement runs: a malformed value raises ValueError naming
        ``name`` and leaves the ring usable once it is fixed (before, for the timeout: read
        inside the first control collective, it broke the ring, and named no function). The
        refusal meets the peers' call or agreement under the default settings, so that a value
        malformed on some ranks only makes the others raise RingPeerError (before, they
        waited, and their call paired with this rank's next one). Where the peers run with
        the checks off, this rank waits for the ring timeout (1800 s where RINGSEQ_TIMEOUT is
        the malformed one) before it raises."""
        try:
            consistency_check_mode()
            if self.world_size > 1:  # (a ring of one never waits for a peer)
                ring_timeout()
        except ValueError as exc:
            err = named_for(name, exc) if name else exc
            if self.world_size == 1:
                raise err from None
            with defaults_for_malformed_settings():
                self.refuse(kind, err, about=about)  # (raises err)

    def refuse(self, kind: int, exc: BaseException, failed: bool = False,
               about: int = 0) -> None:
        """This rank found a call's arguments invalid before the call began: meets the peers'
        begin collective with the refusal, so that they raise :class:`ringseq.RingPeerError`
        naming this rank and ``exc`` (the ring stays usable), then re-raises ``exc`` here.
        ``failed``: the call is part of an enclosing call whose data already moved (a Ulysses
        or double-ring call): the peers raise :class:`ringseq.RingBrokenError` instead and the
        ring is broken on every rank, as the enclosing call is. ``about``: the agreement word
        of the peers' control operation, when it is an agreement (``agreement_code``)."""
        if self.checks_on:
            # (a broken ring still meets its peers' begin: they raise RingBrokenError then)
            status = BROKEN if self._broken is not None else (FAILED if failed else INVALID)
            if failed:
                self.mark_broken(exc)
            # (outside torch.func's interpreters: a refusal made inside jvp or vmap would pass
            # the control collective's own tensors through their wrappers)
            with self._hold(), _outside_transforms():
                rows = gather(self, kind, status, (), failure_report(exc), about)
                if rows is not None:
                    others = [r for r, row in enumerate(rows) if r != self.rank and row[1] not in
                              (OK, INVALID)]
                    if others:  # a peer was broken or failed too: say so, keep ours
                        self.mark_broken(exc)
        else:  # (the peers' gather counts its control operation without running it)
            self._seq += 1
        raise exc

    @property
    def control_count(self) -> int:
        """Control operations so far (the same on every rank of a healthy ring): the number
        the next agreement runs under, which a later agreement can name to say which call it
        continues (``unshard``'s backward names its forward)."""
        return self._seq

    def agree(self, ok: bool, message: str, kind: int = CHECK,
              error: Optional[BaseException] = None, fields: Sequence[tuple] = (),
              raise_own: bool = True, about: Optional[str] = "argument check",
              called: str = "", hint: Optional[str] = None) -> Optional[List[List[int]]]:
        """Collective over the ring: returns on every rank when every rank is ``ok`` (and
        agrees on ``fields``, ``(name, int[, kind])``, and on ``about``, what the agreement
        is: one of ``integrity.AGREEMENTS``, or None for a call's begin, ``kind`` FWD: then a
        broken ring raises RingBrokenError on every rank, as an attention call's begin does),
        else raises on every rank --
        ``error`` (or a ValueError with ``message``) on the ranks that were not ok (unless
        ``raise_own`` is False: then they return, to re-raise their own error),
        :class:`ringseq.RingPeerError` naming them and their messages on the others,
        :class:`ringseq.RingMismatchError` when ``fields`` differ. Runs on the ring's control
        channel, so it meets a peer's failure report or call instead of waiting for it, and
        a missing peer raises RingTimeoutError after the ring timeout. The ring stays usable.
        ``called`` / ``hint``: the public function named by a mismatch, and what its message
        advises (default: the attention calls' rule).
        Returns every rank's ``fields`` values (a list per rank; ``ANY`` fields, which are not
        compared, for the caller to judge), or None where no control collective ran (a ring of
        one, checks off)."""
        code = 0 if about is None else agreement_code(about)
        self._read_settings(kind, called, code)
        if not self.checks_on:
            if not ok and raise_own:
                raise error if error is not None else ValueError(message)
            if about is None and self._broken is not None:  # (as a call's begin raises)
                raise broken_ring_error(self)
            return None
        status = INVALID if not ok else (
            BROKEN if about is None and self._broken is not None else OK)
        with self._hold():
            rows = gather(self, kind, status, [int(f[1]) for f in fields],
                          None if ok else message, code)
            if ok:
                # RingPeerError when another rank was not ok, or worse (under the lock: a
                # mismatch of listed values makes one more control exchange)
                judge(self, rows, kind, fields, called, hint)
        if not ok:
            if raise_own:
                raise error if error is not None else ValueError(message)
            return None
        return None if rows is None else [row[FIELD0:FIELD0 + len(fields)] for row in rows]

    def gather_ints(self, values: Sequence[int], about: str) -> Optional[List[List[int]]]:
        """Every rank's ``values`` (as many on every rank) for the agreement ``about`` that
        needs more than a control vector's fields: one control all-gather of a control
        vector's header and the values, under the ring's lock; RingDesyncError on every rank
        when a rank is at another control operation. None where no control collective runs."""
        if not self.checks_on:
            return None
        with self._hold():
            seq = self._seq
            self._seq += 1
            words = torch.cat([control_vector(CHECK, OK, seq, (), agreement_code(about)),
                               torch.tensor(list(values), dtype=torch.int64)])
            rows = self.control(words, CHECK, seq).tolist()
        judge(self, [row[:CONTROL_WORDS] for row in rows], CHECK, ())
        return [row[CONTROL_WORDS:] for row in rows]

    def check(self, fields: Sequence[tuple], about: str = "argument check",
              fn: str = "Ring.check") -> None:
        """One argument check outside a ring call: ``fields`` are at most 24 ``(name, int or
        bool[, kind])`` (or ``(name, code, "ints", values)``: ``ringseq._hash.ints_field``;
        ``(name, code, "layout", text)``: ``ringseq.layouts.layout_field``, each rank's text
        shown on a mismatch), the same names and kinds in the same order on every rank.
        Raises on every rank: ``RingMismatchError`` when ranks pass other values, or other
        names or another number of fields; TypeError / ValueError (naming ``fn``) for
        malformed fields on the ranks given them, RingPeerError on the others (and
        RingBrokenError / RingDesyncError as a call's begin would)."""
        code = agreement_code(about)
        self._read_settings(CHECK, about=code)
        try:
            fields = _checked_fields(fn, fields)
        except (TypeError, ValueError) as exc:
            self.refuse(CHECK, exc, about=code)  # (raises exc; the peers RingPeerError)
        names = [f[0] for f in fields]
        with self._hold():
            # (a code of the names and kinds goes first: ranks comparing fields by position
            # alone passed lists of other lengths or names on some ranks)
            # (and whether a field carries values or a text, which a mismatch exchanges)
            kinds = repr([(f[0], f[2] if len(f) > 2 else "int") + (("text",) if len(f) > 3 and
                                                                   f[2] == "layout" else ())
                          for f in fields])
            rows = gather(self, CHECK, BROKEN if self._broken is not None else OK,
                          [stable_code(kinds)] + [f[1] for f in fields], None, code)
            if rows is None:
                return
            judge(self, rows, CHECK, ())
            others = [r for r, row in enumerate(rows) if row[FIELD0] != rows[self.rank][FIELD0]]
            if others:
                raise RingMismatchError(
                    f"{fn}: the ranks passed other fields (names, kinds, order or count, or "
                    f"a layout field with a text on some ranks only): this "
                    f"rank (rank {self.rank} of the group) {names}, rank(s) {others} others")
            err = mismatch_error(self, [row[FIELD0 + 1:FIELD0 + 1 + len(fields)]
                                        for row in rows], fields, called=fn,
                                 hint="Every rank passes the same values.")
            if err is not None:
                raise err

    @contextlib.contextmanager
    def _hold(self):
        """The ring's lock for a control operation outside a call (waits for a running call)."""
        if not self._lock.acquire(timeout=ring_timeout()):
            raise RuntimeError("ringseq: the ring's lock is held by another thread")
        try:
            yield
        finally:
            self._lock.release()

    # -- failures --------------------------------------------------------------------------
    @property
    def broken(self) -> Optional[BaseException]:
        """The failure that broke this ring (None while it is healthy)."""
        return self._broken

    def mark_broken(self, cause: BaseException) -> None:
        if self.world_size > 1 and self._broken is None:
            self._broken = cause

    def report_failure(self, exc: BaseException) -> None:
        """Tells the peers that this rank failed outside a call (e.g. in the model before its
        first attention layer), so that their pending call or check raises instead of waiting
        for this rank. Marks the ring broken. A no-op for a ring that is already broken: a
        broken ring reports itself at its next control collective."""
        if self.world_size == 1 or self._broken is not None:
            return
        self._broken = exc
        with self._hold():
            gather(self, FAIL, 1, (), failure_report(exc))

    def take_failure_report(self, cause: BaseException) -> None:
        """Meets a peer's :meth:`report_failure` that waits on this ring's control channel:
        the peer reported while this rank had no ring call left, and this rank learnt of the
        failure elsewhere (the plugin's loss). Without it the peer would wait for the ring
        timeout and the report would pair with this rank's next call. Marks the ring broken
        (``cause``). Collective over the ring: only where the peer's report is known to wait."""
        if self.world_size == 1 or self._broken is not None:
            return
        with self._hold():
            gather(self, CHECK, OK, (), "", about=agreement_code("failure report taken"))
        self._broken = cause

    def reset(self) -> None:
        """Makes the ring usable again after a failure: clears the broken state and the
        sequence numbers and rebuilds the transport's channels (a timeout closes them). Call
        it on every rank of the group (e.g. in the ``except`` block that caught the error),
        before the next call, with the ranks back in step (the same next call)."""
        self._broken = None
        self._seq = 0
        self.peer_messages = {}
        self._thread = None
        self.transport.rebuild()

    def __repr__(self):
        return (f"Ring(rank {self.rank} of {self.world_size}, "
                f"{'broken' if self._broken else 'healthy'}, calls={self.calls})")


def _alive(ident: int) -> bool:
    return any(t.ident == ident for t in threading.enumerate())


_DEFAULT_NAME = re.compile(r"^Thread-\d+")


def _thread_name() -> str:
    """The calling thread's name, without the counter of a default name ("Thread-7 (run)" ->
    "Thread (run)"): ranks create their threads in different numbers, and threads that run the
    same function under default names are the same thread of the program. Threads that differ
    only in their data need names of their own (threading.Thread(name=...))."""
    return _DEFAULT_NAME.sub("Thread", threading.current_thread().name)


# ------------------------------------------------------------------------------------ cache
_RINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCAL: Dict[str, Ring] = {}


@torch.compiler.disable  # see below: never traced, always the cached Ring
def get_ring(group=None, fn: Optional[str] = None) -> Ring:
    """The cached :class:`Ring` of ``group``: a process group (None: the default group), or a
    :class:`Transport`. Process groups are held weakly, so destroyed groups do not keep their
    rings (and buffers) alive.

    Never traced by dynamo: traced, the lookup in ``_RINGS`` (a WeakKeyDictionary keyed by
    the process group) is guarded on the dictionary's type only, so the frame compiled at the
    first call (no ring yet) made a new Ring -- control counter 0, new channels under the
    old names -- at every later compiled call.

    Raises TypeError for a ``group`` that is no process group, Ring or Transport, and
    ValueError for a group this process is not in, both naming ``fn`` ("get_ring" when
    called directly: before, its errors named no function)."""
    fn = fn or "get_ring"
    group = real_object(group)
    if isinstance(group, Ring):
        return group
    if isinstance(group, Transport):
        check_transport(fn, group)
        key = group.ring_key
        ring = _RINGS.get(key)
        if ring is None:
            ring = _RINGS[key] = Ring(group)
        return ring
    group_info(group, fn)  # raises for a group this process is not in
    if not is_initialized():
        ring = _LOCAL.get("local")
        if ring is None:
            ring = _LOCAL["local"] = Ring(RingComm(None))
        return ring
    pg = group if group is not None else dist.group.WORLD
    ring = _RINGS.get(pg)
    if ring is None:
        ring = _RINGS[pg] = Ring(RingComm(group))
    return ring


@torch.compiler.assume_constant_result
def ring_size(group=None, fn: Optional[str] = None) -> int:
    """The world size of ``group``'s ring (under torch.compile: read once at trace time);
    ``fn`` as in :func:`get_ring`."""
    return get_ring(group, fn).world_size


def get_comm(group=None) -> Ring:
    """``ringseq.get_comm(group)``: the name the README documents for :func:`get_ring`: the
    :class:`Ring` of ``group`` (None: the default group). Raises (naming ``get_comm``)
    TypeError for a ``group`` that is not a process group, ValueError for one this process
    is not in or for any group but None while torch.distributed is not initialized."""
    return get_ring(group, "get_comm")


def check_consistent(fields, group=None) -> None:
    """:meth:`Ring.check` on the ring of ``group``."""
    get_ring(group, "check_consistent").check(fields, fn="check_consistent")


# the kinds a field of check_consistent may name (how a value is shown; "any": not compared)
_FIELD_KINDS = {"int", "bool", "dtype", "float", "layout", "operation", "any"}


def _checked_fields(fn: str, fields) -> Tuple[tuple, ...]:
    """``fields`` as ``(name, int[, kind])`` tuples with Python ints; TypeError / ValueError
    naming ``fn`` and the field otherwise."""
    if not isinstance(fields, (list, tuple)):
        raise TypeError(f"{fn}: fields must be a list of (name, int or bool) tuples, got "
                        f"{given(fields)}")
    if len(fields) > _N_FIELDS - 1:
        raise ValueError(f"{fn}: at most {_N_FIELDS - 1} fields, got {len(fields)}")
    out = []
    for i, f in enumerate(fields):
        value = None
        if isinstance(f, (list, tuple)) and (len(f) in (2, 3) or len(f) == 4 and (
                f[2] == "ints" or f[2] == "layout" and isinstance(f[3], str))):
            value = int(f[1]) if is_bool(f[1]) else as_int(f[1])  # (a flag: 0 or 1)
        if value is None or not isinstance(f[0], str):
            raise TypeError(f"{fn}: fields[{i}] must be a (name: str, value: int or bool) "
                            f"tuple (with a kind; or (name, value, \"ints\", values), "
                            f"(name, value, \"layout\", text: str)), got {f!r}")
        if not -2 ** 63 <= value < 2 ** 63:
            raise ValueError(f"{fn}: fields[{i}] ({f[0]!r}) must fit in int64, got {value}")
        if len(f) == 3 and not (isinstance(f[2], str) and f[2] in _FIELD_KINDS
                                or isinstance(f[2], tuple)):  # (and "ints", as 4)
            raise ValueError(f"{fn}: fields[{i}] ({f[0]!r}): a kind must be one of "
                             f"{sorted(_FIELD_KINDS)} or a tuple of choices, got {f[2]!r}")
        if len(f) == 4 and f[2] == "ints":  # (its values travel on a mismatch: checked here)
            values = [as_int(x) for x in f[3]] if isinstance(f[3], (list, tuple)) else [None]
            if any(x is None or not -2 ** 63 <= x < 2 ** 63 for x in values):
                raise TypeError(f"{fn}: fields[{i}] ({f[0]!r}): an \"ints\" field's values "
                                f"must be a list of int64 ints, got {f[3]!r}")
            f = (f[0], value, "ints", tuple(values))
        out.append((f[0], value, *f[2:]))
    return tuple(out)


def check_transport(fn: str, transport) -> None:
    """TypeError / ValueError naming ``fn`` unless ``transport`` is a :class:`Transport` whose
    ``world_size`` is an int >= 1 and ``rank`` an int in ``[0, world_size)``."""
    if not isinstance(transport, Transport):
        raise TypeError(f"{fn}: transport must be a ringseq.comm.Transport, got "
                        f"{given(transport)}")
    check_size_and_rank(fn, "world_size", transport.world_size, "rank", transport.rank,
                        owner="the transport's ")


def reset_ring(group=None) -> None:
    """Makes the ring of ``group`` (None: the default group) usable again after a failure
    broke it (see :mod:`ringseq.engine.integrity`); call it on every rank of the group before
    the next call. Raises (naming ``reset_ring``) TypeError for a ``group`` that is not a
    process group, ValueError for one this process is not in or for any group but None
    while torch.distributed is not initialized."""
    get_ring(group, "reset_ring").reset()


def meet_as_failed(group, kind: int) -> None:
    """On a rank whose enclosing call already failed: meets the peers' begin of a call on
    ``group`` that this rank will not run, as a failure, so that they raise
    :class:`ringseq.RingBrokenError` instead of waiting (the enclosing call raises this rank's
    own failure at its end)."""
    try:
        get_ring(group).refuse(kind, RuntimeError("this rank failed earlier in the enclosing "
                                                  "call"), failed=True)
    except RuntimeError:
        pass


def _outside_transforms():
    """A context with torch.func's interpreter stack cleared (torch's private helper; a no-op
    where this torch lacks it or it fails)."""
    try:
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
        return temporarily_clear_interpreter_stack()
    except Exception:  # noqa: BLE001 - another torch's internals: tell the peers as we are
        return contextlib.nullcontext()


@contextlib.contextmanager
def refuse_on_error(group, kind: int, failed: bool = False):
    """Runs an entry point's checks for a call on ``group``'s ring: an exception raised inside
    is this rank's refusal of the call, re-raised here after it met the peers' begin
    collective, where they raise :class:`ringseq.RingPeerError` naming this rank and the
    message (the ring stays usable; see :mod:`ringseq.engine.integrity`); with ``failed``
    (a call inside an enclosing one, see :meth:`Ring.refuse`) RingBrokenError. Under
    ``torch.compile`` the checks run at trace time and simply raise."""
    if torch.compiler.is_compiling():
        yield
        return
    try:
        yield
    except BaseException as exc:  # Ctrl-C, sys.exit() too: the peers would wait
        try:
            ring = get_ring(group)
        except ValueError:  # a group this rank is not in: its members are not waiting on it
            raise exc from None
        except TypeError:
            # Not a group at all (a typo, a name): the peers passed one this rank cannot know.
            # Left untold, they would pair this call with this rank's next one (wrong numbers
            # on both); the default group's ring is where a group=None peer waits, and where a
            # peer of another group times out rather than pairing.
            if not is_initialized():
                raise exc from None
            _refuse(get_ring(None), kind, exc, failed)
        _refuse(ring, kind, exc, failed)


def group_info_or_refuse(group, fn: str, about: str):
    """``group_info(group, fn)`` for a collective whose ranks meet first in the agreement
    ``about``: a ``group`` that is no process group at all (a typo, a name) raises TypeError
    after meeting that agreement on the default group's ring as a refusal, where a group=None
    peer waits (RingPeerError there; a peer of another group times out rather than pairing),
    as :func:`refuse_on_error` does for the attention calls."""
    try:
        return group_info(group, fn)
    except TypeError as exc:
        if not is_initialized():
            raise
        try:
            get_ring(None).refuse(CHECK, exc, about=agreement_code(about))
        except RingTimeoutError as timeout:
            if timeout is exc:
                raise
            raise exc from timeout
        raise


def _refuse(ring: Ring, kind: int, exc: BaseException, failed: bool) -> None:
    """:meth:`Ring.refuse`: raises ``exc`` once the peers met the refusal; where they wait on
    another ring and this one times out, ``exc`` still, the timeout as its cause (this rank's
    own error is what its user must see)."""
    try:
        ring.refuse(kind, exc, failed)
    except RingTimeoutError as timeout:
        if timeout is exc:
            raise
        raise exc from timeout
