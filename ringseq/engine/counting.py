"""Measured communication: bytes each rank sends, counted where the bytes are handed over.

Sequence-parallel attention moves data in two ways: ring exchanges (the engine records each
one under its plan's label: ``"ring"``, or ``"ring_inner"`` / ``"ring_outer"`` in a double ring)
and all-to-alls (:mod:`ringseq.parallel.ulysses`). Both report to the counters that are
active in this process (this rank), from any of its threads: on a GPU, autograd runs the
backward on a worker thread of its own, whose bytes count in the block as its forward's do::

    import ringseq
    from ringseq import commstats

    with commstats.count_bytes() as c:
        out = ringseq.usp_attn_func(q, k, v, causal=True, sp=sp)
        out.backward(dout)
    c.bytes  # {"ring": ..., "all_to_all": ...}: bytes this rank sent to other ranks

Counted is what leaves the rank: every byte of a ring exchange's send buffer, and the
``(U - 1) / U`` of an all-to-all's send buffer that goes to the other ``U - 1`` ranks (the chunk a
rank keeps for itself is not sent); a ring exchange's buffer holds its 64-byte header and pads
each segment to 64 bytes. Not counted: the cross-rank consistency checks, two control
all-gathers of 31 int64 per rank at the begin and end of every ring call's forward and
backward (a hybrid or double ring makes one ring call per ring it runs: 4 and 8 pairs a pass
at 2 x 2; none with the checks off). Counting costs a few Python operations per exchange.
Threads of one process that count at once each count the others' bytes too.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator, List


__all__ = ["CommCounter", "count_bytes", "record"]

# The counters open in this process; read without the lock on the hot path (a list's
# truthiness is atomic), changed and added to under it.
_ACTIVE: List["CommCounter"] = []
_LOCK = threading.Lock()


class CommCounter:
    """Bytes sent (``bytes``) and the number of exchanges or all-to-alls that sent them
    (``calls``: one per ring exchange, several per attention call; an all-to-all with nothing
    to move is none) per kind (``"ring"``, ``"ring_inner"``, ``"ring_outer"``,
    ``"all_to_all"``), on this rank."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    @property
    def total(self) -> int:
        """All bytes sent, every kind together."""
        return sum(self.bytes.values())

    def __repr__(self) -> str:
        return f"CommCounter(bytes={dict(self.bytes)}, calls={dict(self.calls)})"


@contextmanager
def count_bytes() -> Iterator[CommCounter]:
    """Counts the bytes this rank sends inside the block, from any thread (nested blocks
    each count)."""
    counter = CommCounter()
    with _LOCK:
        _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        with _LOCK:
            _ACTIVE.remove(counter)


def record(kind: str, nbytes: int) -> None:
    """Adds ``nbytes`` sent as ``kind`` to every active counter (nothing when none is).

    Raises:
        TypeError: ``kind`` is no str, or ``nbytes`` no int.
        ValueError: ``kind`` is empty, or ``nbytes`` below 0."""
    fn = "ringseq.commstats.record"
    if not isinstance(kind, str):
        raise TypeError(f"{fn}: kind must be a str (such as 'ring'), got {kind!r}")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise TypeError(f"{fn}: nbytes must be an int (bytes sent), got {nbytes!r} "
                        f"({type(nbytes).__name__})")
    if not kind or nbytes < 0:
        raise ValueError(f"{fn}: kind must be non-empty and nbytes >= 0, got kind={kind!r}, "
                         f"nbytes={nbytes!r}")
    if _ACTIVE:
        with _LOCK:
            for c in _ACTIVE:
                c.add(kind, nbytes)
