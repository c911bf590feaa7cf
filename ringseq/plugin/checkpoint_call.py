"""The entry of every checkpoint call (``save_model``, ``load_optimizer``, ...): its arguments
checked, and every rank agreeing that it makes the same call with the same path before any file
is touched.

Ranks given different paths would otherwise each write or read their own: a save lost the
other ranks' shards, or a load mixed two steps' states without an error."""
from __future__ import annotations

import functools
import inspect
import os
import re
import threading
from typing import Optional

import torch.distributed as dist

from .._dist import RingMismatchError, named_for
from .._hash import stable_code
from ..engine.ring import get_ring

__all__ = ["checkpoint_call", "current_call", "shard_bytes"]

_CALL = threading.local()  # the checkpoint call this thread is inside (nested calls agree once)

# ColossalAI's names for what the plugin's calls take otherwise
_COLOSSALAI = {"shard": "max_shard_size", "size_per_shard": "max_shard_size (ColossalAI's "
               "size_per_shard=N MB is max_shard_size=f'{N}MiB')"}


def current_call() -> str:
    """The checkpoint function this thread is in (for messages), or ``"checkpoint"``."""
    return getattr(_CALL, "name", None) or "checkpoint"


_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10,
          "MIB": 2 ** 20, "GIB": 2 ** 30}


def shard_bytes(size, fn: str = "save_model") -> int:
    """``max_shard_size`` in bytes: a positive int, or a string like ``"500MB"`` / ``"2GiB"``
    of at least one byte. Raises ValueError naming ``fn`` otherwise (a bool, 0, ``"0.1B"``)."""
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
                        f"{type(checkpoint).__name__}")
    path = os.fspath(checkpoint)
    if not isinstance(path, str) or not path:
        raise TypeError(f"{fn}: checkpoint must be a non-empty str path, got {checkpoint!r}")
    return path


def _check_options(fn: str, method, obj, checkpoint, args, kwargs) -> None:
    """TypeError for an argument ``method`` does not take, or a flag that is no bool (and
    ``sharded`` not None either); ValueError for a shard size (via ``shard_bytes``)."""
    params = inspect.signature(method).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        takes = [p for p in params if p not in ("self", "model", "optimizer", "lr_scheduler",
                                                 "checkpoint")]
        hints = [f"{k}: see {_COLOSSALAI[k]}" for k in unknown if k in _COLOSSALAI]
        raise TypeError(f"{fn}: unexpected keyword argument(s) {unknown}; it takes "
                        f"{takes or 'no other arguments'}" + (f" ({'; '.join(hints)})"
                                                              if hints else ""))
    bound = inspect.signature(method).bind(None, obj, checkpoint, *args, **kwargs).arguments
    for name in ("strict", "sharded"):
        value = bound.get(name)
        if name in bound and not isinstance(value, bool) and not (name == "sharded"
                                                                  and value is None):
            raise TypeError(f"{fn}: {name} must be a bool{' or None' if name == 'sharded' else ''}"
                            f", got {value!r} ({type(value).__name__})")
    if bound.get("max_shard_size") is not None:
        shard_bytes(bound["max_shard_size"], fn)


def _agree(fn: str, path: Optional[str], problem: Optional[BaseException]) -> None:
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
                           ("checkpoint path", stable_code(where))))
    except RingMismatchError:
        # (every rank judged the same rows: all of them are here, so they can show the paths)
        calls = [None] * dist.get_world_size()
        dist.all_gather_object(calls, (fn, where))
        detail = "; ".join(f"rank {r}: {f}({p!r})" for r, (f, p) in enumerate(calls))
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
    def call(self, obj, checkpoint, *args, **kwargs):
        if getattr(_CALL, "name", None):
            return method(self, obj, checkpoint, *args, **kwargs)
        problem, path = None, None
        try:
            path = _check_path(fn, checkpoint)
            _check_options(fn, method, obj, path, args, kwargs)
        except (TypeError, ValueError) as exc:
            problem = named_for(fn, exc)
        _agree(fn, path, problem)
        _CALL.name = fn
        try:
            return method(self, obj, path, *args, **kwargs)
        finally:
            _CALL.name = None

    return call
