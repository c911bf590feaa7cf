"""Ring integrity: what makes a faulted or diverging ring raise instead of returning garbage.

Three mechanisms, all driven by :class:`RingCall` (one per ring forward or backward call):

* **Control collectives** (``Transport.control``; for ``RingComm`` a small all-gather on the
  ring's own gloo control group, host memory only). A ring call *begins* with one carrying
  its kind (forward/backward), the rank's sequence number, its status and the call's
  signature (shapes, dtype, layout, causal, scale, ...), and *ends* with one carrying its
  outcome. Ranks that disagree raise together before any payload moves, so no
  size-mismatched transfer is ever posted and nothing is computed from mismatched data:
  different arguments raise :class:`ringseq.RingMismatchError` (the ring stays usable), ranks
  at different calls (one skipped its backward, or raised outside ring attention)
  :class:`ringseq.RingDesyncError`.
* **Exchange headers**: every exchange carries an 8-word header (magic, call sequence number,
  kind, signature hash, exchange index) in the same buffer as its payload, checked after
  ``wait()``; the comparison runs where the buffer lives (on CUDA: on the device) and its
  verdict is read once, at the end of the call. A mismatch raises RingDesyncError naming both
  ranks' views. It is what still protects a ring whose control collectives are off.
* **Failure semantics**: an exception inside the call on one rank does not strand its peers.
  The rank stops computing but completes every remaining exchange of the call (same sizes, so
  the peers' transfers complete), reports the failure at the end collective and re-raises it;
  every other rank raises :class:`ringseq.RingBrokenError`. The ring is then *broken* on every
  rank: each later call raises RingBrokenError right after its begin collective (with the
  original cause chained on the rank that failed), until ``ringseq.reset_ring(group)`` is
  called on every rank. A failure outside a ring call is reported with
  ``Transport.report_failure`` (the plugin does this for exceptions in the model).

Rings of one rank have no peers: failures simply raise and nothing is marked broken.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch

from ._dist import (RingBrokenError, RingDesyncError, RingMismatchError, describe_field)

__all__ = ["CONTROL_WORDS", "HEADER_BYTES", "HEADER_WORDS", "KIND_NAMES", "RingCall", "control_vector",
           "signature_hash"]

HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8  # travels with every exchange (a multiple of 64: no padding)
_MAGIC = 0x52534551  # "RSEQ"
# Kinds of control operations (ring calls use FWD / BWD; the same numbers travel in headers).
FWD, BWD, FAIL, CHECK, END = 1, 2, 3, 4, 5
KIND_NAMES = {FWD: "forward", BWD: "backward", FAIL: "failure report", CHECK: "argument check",
              END: "end of call"}
# Status words of a control vector.
OK, FAILED, BROKEN, DESYNC = 0, 1, 2, 3
_N_FIELDS, _N_PAYLOAD = 20, 2
CONTROL_WORDS = 4 + _N_FIELDS + _N_PAYLOAD


def control_vector(kind: int, status: int, seq: int, fields: Sequence[int] = (),
                   payload: Sequence[float] = ()) -> List[float]:
    """[magic, status, kind, seq, fields (zero-padded to 20), payload (to 2)] as floats: the
    same length for every control operation, so ranks at different operations still meet in
    one collective and can tell each other apart."""
    if len(fields) > _N_FIELDS or len(payload) > _N_PAYLOAD:
        raise ValueError("ringseq: too many control fields")
    return ([float(_MAGIC), float(status), float(kind), float(seq)]
            + [float(f) for f in fields] + [0.0] * (_N_FIELDS - len(fields))
            + [float(p) for p in payload] + [0.0] * (_N_PAYLOAD - len(payload)))


def signature_hash(values: Sequence[int]) -> int:
    """A 31-bit FNV-1a hash of the call signature (pure Python: the same on every rank)."""
    h = 0x811C9DC5
    for v in values:
        for byte in int(v).to_bytes(8, "little", signed=True):
            h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h & 0x7FFFFFFF


def _call_name(kind: float, seq: float) -> str:
    return f"{KIND_NAMES.get(int(kind), f'operation {int(kind)}')} #{int(seq)}"


def judge(transport, rows: List[List[float]], kind: int, signature: Sequence[tuple] = ()) -> None:
    """Raises on this rank what the gathered control vectors say is wrong (the same verdict on
    every rank, since every rank sees the same rows); marks the ring broken where needed."""
    bad_magic = [r for r, row in enumerate(rows) if int(row[0]) != _MAGIC]
    if bad_magic:
        err = RingDesyncError(f"ringseq: control data from rank(s) {bad_magic} is not ringseq's "
                              f"(foreign or corrupted collective on the ring's control group)")
        transport.mark_broken(err)
        raise err
    failed = [r for r, row in enumerate(rows) if int(row[1]) != OK]
    if failed:
        what = {FAILED: "failed", BROKEN: "was already broken", DESYNC: "saw a desynchronized ring"}
        detail = ", ".join(f"rank {r} {what.get(int(rows[r][1]), 'failed')} "
                           f"({_call_name(rows[r][2], rows[r][3])})" for r in failed)
        own = transport.broken
        err = RingBrokenError(
            f"ringseq: the ring is broken: {detail}. The results of this call are invalid; "
            f"every rank raises until ringseq.reset_ring(group) is called on all of them"
            + (f" (this rank's original error: {type(own).__name__}: {own})" if own else ""))
        transport.mark_broken(err)
        raise err from own
    views = {(int(row[2]), int(row[3])) for row in rows}
    if len(views) > 1:
        detail = ", ".join(f"rank {r}: {_call_name(row[2], row[3])}" for r, row in enumerate(rows))
        err = RingDesyncError(
            f"ringseq: the ranks of the ring are at different ring calls ({detail}): a rank "
            f"skipped or repeated a call (e.g. its backward), or raised outside ring attention "
            f"without reporting it. Call ringseq.reset_ring(group) on every rank once they are "
            f"back in step")
        transport.mark_broken(err)
        raise err
    diffs = []
    for j, f in enumerate(signature):
        column = [int(row[4 + j]) for row in rows]
        if len(set(column)) > 1:
            fkind = f[2] if len(f) > 2 else "int"
            per_rank = ", ".join(f"rank {r}: {describe_field(fkind, c)}"
                                 for r, c in enumerate(column))
            diffs.append(f"{f[0]} ({per_rank})")
    if diffs:
        raise RingMismatchError(
            "ringseq: the ranks of the ring were called with different arguments: "
            + "; ".join(diffs) + ". Every rank of the group must pass shards of the same "
            "shape, dtype, layout and causal flag.")


class RingCall:
    """The bookkeeping of one ring call on one rank (see the module doc).

    The engine uses it as::

        with transport.open_call(FWD, plan.signature, device) as call:
            if call.ok: with call.guard(): ...prepare buffers...
            call.begin()                      # control collective; raises on disagreement
            for each step:
                pending = buffers.exchange(...)   # stamps and later checks a header
                if call.ok: with call.guard(): ...compute...
                pending.wait()
            call.end()                        # control collective; raises on any failure
    """

    def __init__(self, transport, kind: int, signature: Sequence[tuple], device):
        self.transport = transport
        self.kind = kind
        self.signature = tuple(signature)
        self.values = [int(f[1]) for f in self.signature]
        self.sig = signature_hash(self.values)
        self.device = torch.device(device)
        self.failure: Optional[BaseException] = None
        self.exchanges = 0
        self._seq = None
        self._base = None
        self._bad = None
        self._received: List[torch.Tensor] = []

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "RingCall":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.transport.last_exchanges = self.exchanges
            if exc is not None and not isinstance(exc, RingMismatchError):
                # Mismatches are found before any payload moves: the ring stays in step.
                self.transport.mark_broken(exc)
        finally:
            self.transport._lock.release()
        return False

    @property
    def ok(self) -> bool:
        """False once this rank failed: it then only completes the call's exchanges."""
        return self.failure is None

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc

    @contextlib.contextmanager
    def guard(self):
        """Turns an exception of this rank's own work into a recorded failure, so that the
        exchanges the peers wait for still happen."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - re-raised by end()/begin()
            self.fail(exc)

    def begin(self) -> None:
        """The begin control collective (see module doc). Raises this rank's own failure if
        preparing the call failed (the peers raise RingBrokenError)."""
        t = self.transport
        status = BROKEN if t.broken is not None else (FAILED if self.failure else OK)
        self._seq = t._seq
        rows = t.control(self.kind, status, self.values)
        if status == FAILED:  # the peers learn it from the rows and raise RingBrokenError
            t.mark_broken(self.failure)
            raise self.failure
        if rows is not None:
            judge(t, rows, self.kind, self.signature)
        elif t.broken is not None:
            raise RingBrokenError(f"ringseq: the ring is broken by an earlier failure "
                                  f"({type(t.broken).__name__}: {t.broken}); call "
                                  f"ringseq.reset_ring(group) on every rank") from t.broken
        # Filled element by element with Python scalars: on CUDA these are small kernels,
        # where a host->device copy of a (pageable) list would synchronize the stream.
        self._base = torch.empty(4, dtype=torch.int64, device=self.device)
        for i, value in enumerate((_MAGIC, self._seq, self.kind, self.sig)):
            self._base[i] = value
        self._bad = torch.zeros((), dtype=torch.bool, device=self.device)

    def end(self) -> None:
        """The end control collective: raises on every rank when any rank failed during the
        call or saw a desynchronized header; this rank's own exception on the failing rank."""
        t = self.transport
        desync = self._desync_message()
        status = FAILED if self.failure else (DESYNC if desync else OK)
        rows = t.control(END, status)
        if status == FAILED:
            t.mark_broken(self.failure)
            raise self.failure
        if desync:
            err = RingDesyncError(desync)
            t.mark_broken(err)
            raise err
        if rows is not None:
            judge(t, rows, END)

    # -- headers ---------------------------------------------------------------------------
    def stamp(self, header: torch.Tensor) -> int:
        """Writes this rank's header for its next exchange into the send buffer; returns the
        exchange's index."""
        step = self.exchanges
        self.exchanges += 1
        header[:4].copy_(self._base)
        header[4] = step
        header[5:] = 0
        return step

    def check(self, header: torch.Tensor, step: int) -> None:
        """Compares a received header with this rank's view of exchange ``step`` (no host
        synchronization: the verdict is read in end())."""
        got = header.clone()
        self._received.append(got)
        self._bad.logical_or_((got[:4] != self._base).any() | (got[4] != step))

    def _desync_message(self) -> Optional[str]:
        if self._bad is None or not bool(self._bad):
            return None
        t = self.transport
        prev = getattr(t, "prev_rank", (t.rank - 1) % t.world_size)
        base = self._base.tolist()
        for step, got in enumerate(self._received):
            g = got.tolist()
            if g[:4] != base or g[4] != step:
                theirs = (f"a header of its {_call_name(g[2], g[1])} (signature {g[3]}) at "
                          f"exchange {g[4]}" if g[0] == _MAGIC else
                          "data without a ringseq header (foreign or corrupted)")
                return (f"ringseq: ring desynchronized: rank {t.rank} was at exchange {step} of "
                        f"its {_call_name(self.kind, self._seq)} (signature {self.sig}) but the "
                        f"previous rank (global rank {prev}) sent {theirs}")
        return "ringseq: ring desynchronized (a received exchange header did not match)"
