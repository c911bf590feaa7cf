"""Measured communication: bytes each rank sends, counted where the bytes are handed over.

Sequence-parallel attention moves data in two ways: ring exchanges (the engine records each
one under its plan's label: ``"ring"``, or ``"ring_inner"`` / ``"ring_outer"`` in a double ring)
and all-to-alls (:mod:`ringseq.parallel.ulysses`). Both report to the counters that are
active on this thread of this process::

    import ringseq
    from ringseq import commstats

    with commstats.count_bytes() as c:
        out = ringseq.usp_attn_func(q, k, v, causal=True, sp=sp)
        out.backward(dout)
    c.bytes  # {"ring": ..., "all_to_all": ...}: bytes this rank sent to other ranks

Counted is what leaves the rank: every byte of a ring exchange's send buffer, and the
``(U - 1) / U`` of an all-to-all's send buffer that goes to the other ``U - 1`` ranks (the chunk a
rank keeps for itself is not sent). Not counted: the cross-rank consistency checks, two
control all-gathers of 31 int64 per rank at the begin and end of every forward and every
backward (none with the checks off). Counting costs a few Python operations per exchange.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator, List


__all__ = ["CommCounter", "count_bytes", "record"]

_local = threading.local()


def _active() -> List["CommCounter"]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class CommCounter:
    """Bytes sent (``bytes``) and the number of exchanges or all-to-alls that sent them
    (``calls``: one per ring exchange, several per attention call) per kind (``"ring"``,
    ``"ring_inner"``, ``"ring_outer"``, ``"all_to_all"``), on this rank."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    @property
    def total(self) -> int:
        """All bytes sent, every kind together."""
        return sum(self.bytes.values())

    def __repr__(self) -> str:
        return f"CommCounter(bytes={dict(self.bytes)}, calls={dict(self.calls)})"


@contextmanager
def count_bytes() -> Iterator[CommCounter]:
    """Counts the bytes this rank sends inside the block (nested blocks each count)."""
    counter = CommCounter()
    stack = _active()
    stack.append(counter)
    try:
        yield counter
    finally:
        stack.remove(counter)


def record(kind: str, nbytes: int) -> None:
    """Adds ``nbytes`` sent as ``kind`` to every active counter (nothing when none is)."""
    stack = getattr(_local, "stack", None)
    if stack:
        for c in stack:
            c.add(kind, nbytes)
