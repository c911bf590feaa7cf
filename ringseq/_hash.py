"""Stable 31-bit hashes: the same on every rank, run and Python version (pure Python FNV-1a,
no ``hash()`` randomization, no zlib), so they can name layouts, masks and call signatures in
cross-rank checks and be computed anywhere, traced code included."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

__all__ = ["INTS", "ints_field", "stable_code", "stable_hash_ints"]

INTS = "ints"  # the kind of a cross-rank signature field that compares a list of ints

_OFFSET, _PRIME, _MASK = 0x811C9DC5, 0x01000193, 0xFFFFFFFF


def _fnv(data: Iterable[int]) -> int:
    h = _OFFSET
    for byte in data:
        h = ((h ^ byte) * _PRIME) & _MASK
    return h & 0x7FFFFFFF


def stable_code(name: str) -> int:
    """A 31-bit hash of a string."""
    return _fnv(name.encode())


def stable_hash_ints(values: Iterable[int]) -> int:
    """A 31-bit hash of a sequence of (signed 64-bit) ints."""
    return _fnv(b for v in values for b in int(v).to_bytes(8, "little", signed=True))


def ints_field(name: str, values: Optional[Sequence[int]]) -> tuple:
    """A cross-rank signature field comparing a list of ints (``None``: no list, e.g. no
    documents): ``(name, hash, INTS, values)``; a mismatch shows the values themselves."""
    # (a spec's documents are a tuple of ints already: no copy on every call's signature)
    listed = (() if values is None else values if type(values) is tuple
              else tuple(int(v) for v in values))
    return (name, 0 if values is None else stable_hash_ints(listed), INTS, listed)
