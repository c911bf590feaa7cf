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

__all__ = ["backend_by_key", "backend_key", "refuse_made_while_tracing"]

# Weak: a backend made for one call dies with it; the autograd graph keeps the ones its
# backward needs alive.
_BY_KEY: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count()


def refuse_made_while_tracing(obj, what: str) -> None:
    """RuntimeError when torch.compile is tracing the code that made ``obj`` and set
    attributes on it (a backend or a layout with parameters made inside the compiled
    function): the key registered at trace time names dynamo's copy of it, whose attributes
    the compiled code sets on another object when it runs, so the operator would find an
    object without them (before: a backend's or a layout's class defaults used silently, or an
    AttributeError at run time). One without attributes of its own is the same object either
    way, and passes. Best effort: nothing where torch's tracer internals are not the ones
    read here."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import AttributeMutationNew
        side_effects = InstructionTranslator.current_tx().output.side_effects
        var = side_effects.id_to_variable.get(id(obj))
        set_here = (var is not None and isinstance(var.mutation_type, AttributeMutationNew)
                    and bool(side_effects.store_attr_mutations.get(var)))
    except Exception:  # noqa: BLE001 - not tracing, or another torch
        return
    if set_here:
        raise RuntimeError(
            f"ringseq: the {what} {type(obj).__name__} is made, and its attributes set, inside "
            f"the function torch.compile compiles; the compiled attention call would look it up "
            f"at run time without them. Make it outside that function (a module-level object, "
            f"an argument, a closure) and pass it in")


@torch.compiler.assume_constant_result
def _register(be) -> str:
    refuse_made_while_tracing(be, "attention backend")
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
