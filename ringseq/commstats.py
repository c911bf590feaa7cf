"""Measured communication: bytes each rank sends, counted where the bytes are handed over.

Sequence-parallel attention moves data in two ways: ring exchanges (a
:class:`ringseq.comm.Transport`'s ``exchange``) and all-to-alls (:mod:`ringseq.ulysses`).
Both report to the counters that are active on this thread of this process::

    with ringseq.commstats.count_bytes() as c:
        out = ringseq.usp_attn_func(q, k, v, causal=True, sp=sp)
        out.backward(dout)
    c.bytes  # {"ring": ..., "all_to_all": ...}: bytes this rank sent to other ranks

Counted is what leaves the rank: every byte of a ring exchange's send buffer, and the
``(U - 1) / U`` of an all-to-all's send buffer that goes to the other ``U - 1`` ranks (the chunk a
rank keeps for itself is not sent). Cross-rank consistency checks (a few int64s on the first
call per signature) are not counted. Counting costs a few Python operations per exchange.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch

from .comm import Transport

__all__ = ["CommCounter", "CountingTransport", "count_bytes", "record"]

_local = threading.local()


def _active() -> List["CommCounter"]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class CommCounter:
    """Bytes sent and number of calls per kind (``"ring"``, ``"ring_inner"``, ``"ring_outer"``,
    ``"all_to_all"``), on this rank."""

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
    for c in _active():
        c.add(kind, nbytes)


class CountingTransport(Transport):
    """A :class:`~ringseq.comm.Transport` that forwards everything to ``inner`` and records the
    bytes of each exchange's send buffer as ``kind``.

    The buffer cache, the consistency check and any other attribute are ``inner``'s, so a
    wrapped :class:`~ringseq.comm.RingComm` behaves exactly like the bare one.
    """

    def __init__(self, inner: Transport, kind: str = "ring") -> None:
        # no super().__init__(): the buffer cache is inner's
        self.inner = inner
        self.kind = kind
        self.world_size = inner.world_size
        self.rank = inner.rank

    def buffers(self, key: str, nbytes: int, device):
        return self.inner.buffers(key, nbytes, device)

    def release_buffers(self) -> None:
        self.inner.release_buffers()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, reverse: bool = False):
        if self.world_size > 1:
            record(self.kind, send.numel() * send.element_size())
        return self.inner.exchange(send, recv, reverse=reverse)

    # The call bookkeeping (lock, sequence number, broken state, control collectives) is
    # inner's: a counted ring is the same ring.
    def open_call(self, kind, signature, device):
        call = self.inner.open_call(kind, signature, device)
        return call

    def control(self, *args, **kwargs):
        return self.inner.control(*args, **kwargs)

    @property
    def broken(self):
        return self.inner.broken

    def mark_broken(self, cause) -> None:
        self.inner.mark_broken(cause)

    def report_failure(self, exc) -> None:
        self.inner.report_failure(exc)

    def reset(self) -> None:
        self.inner.reset()

    def __getattr__(self, name):
        if name == "inner":  # not yet set (unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
