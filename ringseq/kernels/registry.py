"""Backends by name: the string that stands for an :class:`AttentionBackend` in a custom
operator's arguments (operators take strings, not objects).

The built-in backends are registered when they are created, at import, so a traced call
(``torch.compile``) only reads an attribute; a user's backend instance is registered on first
use (under tracing through ``torch.compiler.assume_constant_result``, which runs it once at
trace time and guards on the object).
"""
from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["backend_by_key", "backend_key"]

# Weak: a backend made for one call dies with it; the autograd graph keeps the ones its
# backward needs alive.
_BY_KEY: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count()


@torch.compiler.assume_constant_result
def _register(be) -> str:
    # the name only labels the key: '|' separates the fields of the keys that carry it
    key = f"{str(be.name).replace('|', '/')}#{next(_NEXT_KEY)}"
    _BY_KEY[key] = be
    be._registry_key = key
    return key


def backend_key(be) -> str:
    """The string that names ``be`` in the custom ops (registered on first use)."""
    key = be.__dict__.get("_registry_key")
    return key if key is not None else _register(be)


def backend_by_key(key: str):
    """The backend named ``key``; RuntimeError when it no longer exists."""
    be = _BY_KEY.get(key)
    if be is None:
        raise RuntimeError(f"ringseq: the attention backend {key!r} of this call no longer "
                           f"exists; keep it alive until the backward has run")
    return be
