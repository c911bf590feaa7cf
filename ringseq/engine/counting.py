"""Measured communication: bytes each rank sends, counted where the bytes are handed over.

Sequence-parallel attention moves data in three ways: ring exchanges (the engine records each
one under its plan's label: ``"ring"``, or ``"ring_inner"`` / ``"ring_outer"`` in a double ring),
all-to-alls (:mod:`ringseq.parallel.ulysses`) and the all-gather of a context-parallel KV-cache
decode's partial results (``"all_gather"``, :func:`ringseq.ring_flash_attn_with_kvcache`). All
report to the counters the calling thread opened and, from a thread Python's ``threading``
did not start, to every counter open in the process: on a GPU, autograd runs the backward on a
device thread of its own, whose bytes so count in the block as the forward's do. Threads
started through ``threading`` (each running rings on a process group of its own, say) count
their own bytes, except on a GPU their backward passes', which count in every thread's open
counters::

    import ringseq
    from ringseq import commstats

    with commstats.count_bytes() as c:
        out = ringseq.usp_attn_func(q, k, v, causal=True, sp=sp)
        out.backward(dout)
    c.bytes  # {"ring": ..., "all_to_all": ...}: bytes this rank sent to other ranks

Counted is what leaves the rank: every byte of a ring exchange's send buffer, and the
``(U - 1) / U`` of an all-to-all's send buffer that goes to the other ``U - 1`` ranks (the chunk a
rank keeps for itself is not sent); a ring exchange's buffer holds its 64-byte header and pads
each segment but the last it sends to 64 bytes. Not counted: the cross-rank consistency
checks, two control all-gathers of 31 int64 per rank at the begin and end of every ring
call's forward and backward (a hybrid makes one ring call per ring it runs; a double ring one
for the whole ring, one for the outer ring and one per inner lap with work, so with laps
skipped the ranks make different numbers; none with the checks off). Counting costs a few Python
operations per exchange.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator, List


__all__ = ["CommCounter", "count_bytes", "record"]

# The counters open in this process by the thread that opened them; read without the lock on
# the hot path (a dict's truthiness is atomic), changed and added to under it.
_ACTIVE: Dict[int, List["CommCounter"]] = {}
_LOCK = threading.Lock()


class CommCounter:
    """Bytes sent (``bytes``) and the number of exchanges, all-to-alls or all-gathers that sent
    them (``calls``: one per ring exchange, several per attention call; an all-to-all with
    nothing to move is none; one all-gather per KV-cache decode) per kind (``"ring"``,
    ``"ring_inner"``, ``"ring_outer"``, ``"all_to_all"``, ``"all_gather"``), on this rank."""

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
    """Counts the bytes this rank sends inside the block from this thread and from threads
    Python's ``threading`` did not start (autograd's device threads; nested blocks each
    count)."""
    counter, me = CommCounter(), threading.get_ident()
    with _LOCK:
        _ACTIVE.setdefault(me, []).append(counter)
    try:
        yield counter
    finally:
        with _LOCK:
            _ACTIVE[me].remove(counter)
            if not _ACTIVE[me]:
                del _ACTIVE[me]


def record(kind: str, nbytes: int) -> None:
    """Adds ``nbytes`` sent as ``kind`` to the counters the calling thread opened (every open
    one, from a thread Python's ``threading`` did not start; nothing when none is).

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
        # (threading sees a thread it did not start as a dummy one: autograd's device threads)
        foreign = isinstance(threading.current_thread(), threading._DummyThread)
        with _LOCK:
            for c in ([c for cs in _ACTIVE.values() for c in cs] if foreign else
                      _ACTIVE.get(threading.get_ident(), ())):
                c.add(kind, nbytes)
