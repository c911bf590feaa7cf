"""The entry of every checkpoint call (``save_model``, ``load_optimizer``, ...): its arguments
checked, and every rank agreeing that it makes the same call with the same path before any file
is touched.

Ranks given different paths would otherwise each write or read their own: a save lost the
other ranks' shards, or a load mixed two steps' states without an error."""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import re
import reprlib
import threading
from typing import Optional

import torch.distributed as dist

from .._args import is_bool
from .._dist import RingMismatchError, named_for
from .._hash import stable_code
from ..engine.ring import get_ring

__all__ = ["checkpoint_call", "current_call", "shard_bytes"]

_CALL = threading.local()  # the checkpoint call this thread is inside (nested calls agree once)

# ColossalAI's keywords that ask for what the plugin's calls do anyway, at these values: taken
# (code ported from its Booster passes them), any other value refused
_COLOSSALAI_DEFAULTS = {"shard": False, "gather_dtensor": True, "prefix": None,
                        "use_safetensors": False, "size_per_shard": 1024}
# ColossalAI's names for what the plugin's calls take otherwise: its keyword -> (the plugin's
# parameter, the hint), hinted where the call takes that parameter
_COLOSSALAI = {"shard": (("max_shard_size", "max_shard_size"), ("sharded", "sharded")),
               "size_per_shard": (("max_shard_size", "max_shard_size (ColossalAI's "
                                   "size_per_shard=N MB is max_shard_size=f'{N}MiB')"),)}


def current_call() -> str:
    """The checkpoint function this thread is in (for messages), or ``"checkpoint"``."""
    return getattr(_CALL, "name", None) or "checkpoint"


_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10,
          "MIB": 2 ** 20, "GIB": 2 ** 30}


def shard_bytes(size, fn: str = "save_model") -> int:
    """``max_shard_size`` in bytes: a number (a float is truncated to whole bytes) or a string
    like ``"500MB"`` / ``"2GiB"``, of at least one byte. Raises ValueError naming ``fn``
    otherwise (a bool, 0, ``"0.1B"``)."""
    if isinstance(size, numbers.Real) and not isinstance(size, bool):
        # (a number as it is: its text, "1e+30", missed the pattern below)
        n = int(size) if math.isfinite(size) else 0
    else:
        m = None if isinstance(size, bool) else re.fullmatch(
            r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
        n = 0 if m is None else int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if n < 1:
        raise ValueError(f"{fn}: max_shard_size must be a positive number of bytes or "
                         f"a string like '500MB' / '2GiB', got {size!r}")
    return n


def _check_path(fn: str, checkpoint) -> str:
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"{fn}: checkpoint must be a path (str or os.PathLike), got "
                        f"{reprlib.repr(checkpoint)} ({type(checkpoint).__name__})")
    path = os.fspath(checkpoint)
    if not isinstance(path, str) or not path:
        raise TypeError(f"{fn}: checkpoint must be a non-empty str path, got {checkpoint!r}")
    return path


# What each kind of object a checkpoint call takes must have (its parameter's name -> the
# attributes that tell it, what to call it): checked before any file is touched (before, an
# optimizer call given the model wrote the model's weights over the optimizer checkpoint)
_OBJECTS = {"model": (("state_dict", "load_state_dict", "parameters", "modules"),
                      "a torch.nn.Module (the boosted model)"),
            "optimizer": (("state_dict", "load_state_dict", "param_groups"),
                          "a torch.optim.Optimizer (the boosted optimizer)"),
            "lr_scheduler": (("state_dict", "load_state_dict"),
                             "an lr scheduler (an object with state_dict and load_state_dict)")}


def _check_object(fn: str, name: str, obj) -> None:
    needs, what = _OBJECTS[name]
    missing = [a for a in needs if not hasattr(obj, a)]
    reason = f"without {', '.join(missing)}" if missing else None
    if name == "lr_scheduler" and not missing:
        # (a model or an optimizer has a state dict too; torch's schedulers hold the optimizer)
        if hasattr(obj, "parameters"):
            reason = "a model's parameters: a scheduler has none"
        elif hasattr(obj, "param_groups") and not hasattr(obj, "optimizer"):
            reason = "without optimizer"
    if reason:
        raise TypeError(f"{fn}: {name} must be {what}, got {type(obj).__name__} ({reason})")


def _bind(fn: str, method, self, args, kwargs) -> inspect.BoundArguments:
    """``method``'s arguments bound, ColossalAI's no-op keywords at their defaults dropped and
    the object and path checked (``str``). TypeError for an argument it does not take (with
    the plugin's name for ColossalAI's), an object of another kind (a model for an optimizer,
    None), a flag that is no bool (NumPy's count; ``sharded`` may be None); ValueError for a
    shard size (via :func:`shard_bytes`)."""
    signature = inspect.signature(method)
    kwargs = {k: v for k, v in kwargs.items()
              if not (k in _COLOSSALAI_DEFAULTS and k not in signature.parameters
                      and _same(v, _COLOSSALAI_DEFAULTS[k]))}
    unknown = sorted(set(kwargs) - set(signature.parameters))
    if unknown:
        takes = list(signature.parameters)[3:]  # (after self, the object and the path)
        hints = [f"{k}: see {hint}" for k in unknown for param, hint in _COLOSSALAI.get(k, ())
                 if param in signature.parameters]
        raise TypeError(f"{fn}: unexpected keyword argument(s) {unknown}; it takes "
                        f"{takes or 'no other arguments'}" + (f" ({'; '.join(hints)})"
                                                              if hints else ""))
    try:
        bound = signature.bind(self, *args, **kwargs)
    except TypeError as exc:
        takes = ", ".join(list(signature.parameters)[1:])
        raise TypeError(f"{fn}: {exc}; it takes ({takes})") from None
    bound.apply_defaults()  # (an option passed at its default is the option left out)
    obj_name = list(signature.parameters)[1]
    _check_object(fn, obj_name, bound.arguments[obj_name])
    bound.arguments["checkpoint"] = _check_path(fn, bound.arguments["checkpoint"])
    for name in ("strict", "sharded"):
        value = bound.arguments.get(name)
        if name not in bound.arguments or (name == "sharded" and value is None):
            continue
        if not is_bool(value):
            raise TypeError(f"{fn}: {name} must be a bool{' or None' if name == 'sharded' else ''}"
                            f", got {value!r} ({type(value).__name__})")
        bound.arguments[name] = bool(value)
    if bound.arguments.get("max_shard_size") is not None:
        shard_bytes(bound.arguments["max_shard_size"], fn)
    return bound


def _same(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def _options(bound: inspect.BoundArguments) -> str:
    """The options of a call besides its object and path (``sharded``, ``strict``,
    ``max_shard_size``), as text: ranks passing others would run other collectives."""
    return ", ".join(f"{k}={v!r}" for k, v in list(bound.arguments.items())[3:])


def _agree(fn: str, path: Optional[str], options: str,
           problem: Optional[BaseException]) -> None:
    """Every rank calls ``fn`` with the same path and arguments it accepts: the ranks agree
    on the default group's control channel (a rank in another call, or another function,
    meets it there instead of a collective of the save); ``problem`` raises on every rank.
    Skipped where there is nothing to agree with (one process, checks off) or the ring is
    broken (a failed step: the checkpoint that repairs it must still load)."""
    if not dist.is_initialized():
        if problem is not None:
            raise problem
        return
    ring = get_ring(None)
    if not ring.checks_on or ring.broken is not None:
        if problem is not None:
            raise problem
        return
    where = os.path.abspath(path) if problem is None else ""
    try:
        ring.agree(problem is None, str(problem), error=problem, about="checkpoint call",
                   called=fn, hint="Every rank makes the same checkpoint call.",
                   fields=(("checkpoint function", stable_code(fn)),
                           ("checkpoint path", stable_code(where)),
                           ("checkpoint options", stable_code(options))))
    except RingMismatchError:
        # (every rank judged the same rows: all of them are here, so they can show the paths)
        calls = [None] * dist.get_world_size()
        dist.all_gather_object(calls, (fn, where, options))
        detail = "; ".join(f"rank {r}: {f}({p!r}{', ' + o if o else ''})"
                           for r, (f, p, o) in enumerate(calls))
        raise RingMismatchError(
            f"{fn}: the ranks made different checkpoint calls ({detail}); every rank calls the "
            f"same function with the same path, on a file system every rank reads (a save "
            f"with other paths loses the shards or the state of the others, a load mixes "
            f"them). Nothing was written or read") from None


def checkpoint_call(method):
    """Decorates a checkpoint I/O method ``(self, obj, checkpoint, ...)``: its arguments are
    checked and agreed on by every rank (:func:`_agree`) before it runs; the call nested in it
    (a subclass calling its base class) runs as it is."""
    fn = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if getattr(_CALL, "name", None):
            return method(self, *args, **kwargs)
        problem, bound = None, None
        try:
            bound = _bind(fn, method, self, args, kwargs)
        except (TypeError, ValueError) as exc:
            problem = named_for(fn, exc)
        _agree(fn, None if bound is None else bound.arguments["checkpoint"],
               "" if bound is None else _options(bound), problem)
        _CALL.name = fn
        try:
            return method(*bound.args, **bound.kwargs)
        finally:
            _CALL.name = None

    return call
