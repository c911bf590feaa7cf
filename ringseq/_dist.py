"""What every layer needs to know about torch.distributed, written once.

* :func:`group_info` / :func:`global_rank`: the (world size, rank) of a group, with one clear
  error for a process outside it and world size 1 without an initialized process group;
* :func:`agree_or_raise`: a collective verdict, so that a rank failing alone raises on every
  rank instead of leaving the others waiting in their next collective;
* the errors of a ring (:class:`RingMismatchError`, :class:`RingDesyncError`,
  :class:`RingBrokenError`, :class:`RingTimeoutError`) and the switches of its checks
  (:func:`set_consistency_check`, :func:`set_ring_timeout`); the checks themselves run in
  :mod:`ringseq.engine.ring` and :mod:`ringseq.engine.integrity`.

Private: the public names are re-exported by :mod:`ringseq`.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["RingBrokenError", "RingDesyncError", "RingError", "RingMismatchError",
           "RingPeerError", "RingTimeoutError", "agree_or_raise", "consistency_check_mode",
           "global_rank", "group_info", "is_initialized", "ring_timeout",
           "set_consistency_check", "set_ring_timeout"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


#: what makes a broken ring usable again, for the errors' messages
RESET_ADVICE = ("ringseq.reset_ring(group) on every rank of the ring (sp.reset() for the "
                "groups of ringseq.make_sp_groups: it resets each; after a boosted model's "
                "failed step: optimizer.zero_grad() and booster.reset() on every rank, which "
                "reset the plugin's rings and the step's data-parallel state)")


def check_group_type(group, fn: Optional[str] = None) -> None:
    """TypeError naming ``fn`` for a ``group`` that is no process group (None, a
    ProcessGroup, or the int torch.distributed.new_group returns to ranks outside it): a
    ``SequenceParallelGroups`` (its own methods split for its mode), a name, a list of ranks.
    Membership is not checked (:func:`group_info` does)."""
    # (a process group first: dynamo, tracing a caller, fails on hasattr of one)
    if not isinstance(group, dist.ProcessGroup) and hasattr(group, "shard_batch") \
            and hasattr(group, "ulysses_size"):
        # a SequenceParallelGroups: its own methods split for its mode (group_info is plain)
        decode = ("; for a decode, group=sp.group with layout=sp.data_layout(layout)"
                  if fn == "ring_flash_attn_with_kvcache" else "")
        raise TypeError(f"{_named(fn)}group= takes a torch.distributed process group, got a "
                        "SequenceParallelGroups (make_sp_groups): use its own methods "
                        "sp.shard(x, layout), sp.shard_batch(batch, layout), "
                        f"sp.positions(seqlen, layout), or usp_attn_func(..., sp=sp){decode}")
    if group is not None and not isinstance(group, (dist.ProcessGroup, int)):
        # (an int: what torch.distributed.new_group returns to ranks outside the group)
        raise TypeError(f"{_named(fn)}group must be a torch.distributed ProcessGroup or None "
                        f"(the default "
                        f"group), got {group!r} ({type(group).__name__})")


def group_info(group=None, fn: Optional[str] = None) -> Tuple[int, int]:
    """(world_size, rank in ``group``); (1, 0) without an initialized process group. ``fn``:
    the public function that was called, named first in the errors.

    Raises TypeError for a ``SequenceParallelGroups`` (its own methods split for its mode) and
    anything else that is not a process group (a name, a list of ranks:
    :func:`check_group_type`); ValueError when a group is passed but torch.distributed is not
    initialized, or when this process is not a member of ``group`` (torch reports rank -1
    there, which would otherwise surface as nonsense sizes much later)."""
    check_group_type(group, fn)
    if not is_initialized():
        if group is not None:
            raise ValueError(f"{_named(fn)}group={group!r} was passed but torch.distributed "
                             f"is not "
                             f"initialized: call torch.distributed.init_process_group first, "
                             f"or pass group=None for one process")
        return 1, 0
    if group is not None and not isinstance(group, dist.ProcessGroup):
        # dist.new_group returns GroupMember.NON_GROUP_MEMBER (an int) on the ranks it leaves out
        raise ValueError(f"{_named(fn)}this process (global rank {dist.get_rank()}) is not a "
                         f"member of the "
                         f"process group passed as `group` (got {group!r}, what "
                         f"torch.distributed.new_group returns to ranks outside the group); call "
                         f"ringseq functions only on the ranks of that group")
    try:
        rank = dist.get_rank(group)
    except (ValueError, RuntimeError) as exc:  # (torch: "Group ... is not registered")
        raise ValueError(f"{_named(fn)}the process group passed as `group` is not usable (was "
                         f"it destroyed?): {exc}") from None
    if rank < 0:
        raise ValueError(f"{_named(fn)}this process (global rank {dist.get_rank()}) is not a "
                         f"member of the "
                         f"process group passed as `group`; call ringseq functions only on "
                         f"the ranks of that group")
    return dist.get_world_size(group), rank


def _named(fn: Optional[str]) -> str:
    return f"{fn}: " if fn else ""


def global_rank(group, rank: int) -> int:
    """The global rank of ``rank`` of ``group`` (what P2P ops take)."""
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, rank)


def _collective_device(group, device=None) -> torch.device:
    """Where the small tensors of a collective live: the CUDA device under NCCL, else CPU."""
    if str(dist.get_backend(group)) == "nccl":
        if device is not None and torch.device(device).type == "cuda":
            return torch.device(device)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------- agreement
def with_message(exc: BaseException, message: str, fallback=ValueError) -> BaseException:
    """An exception of ``exc``'s type carrying ``message``, ``exc`` chained as its cause (the
    message a rank raises with after an agreement names where it failed); where that type's
    constructor takes more than a message, ``fallback(message)`` chained the same way, or
    ``exc`` itself when ``fallback`` is None."""
    try:
        wrapped = type(exc)(message)
        if not isinstance(wrapped, type(exc)):
            raise TypeError(type(exc).__name__)
    except Exception:  # noqa: BLE001 - exotic constructors
        if fallback is None:
            return exc
        wrapped = fallback(message)
    wrapped.__cause__ = exc
    return wrapped


def named_for(fn: str, exc: BaseException) -> BaseException:
    """``exc`` with ``fn``, the public function the user called, in front of its message
    (:func:`with_message`; ``exc`` itself where it already names it or its type takes more
    than a message)."""
    return exc if str(exc).startswith(fn) else with_message(exc, f"{fn}: {exc}", fallback=None)


def agree_or_raise(ok: bool, message: str, group=None, device=None, *,
                   peer_message=None,
                   error: Optional[BaseException] = None) -> None:
    """Collective: returns on every rank of ``group`` when every rank is ``ok``, else raises on
    every rank, so that a rank failing alone cannot leave the others waiting in their next
    collective.

    Args:
        ok: this rank's verdict.
        message: this rank's error message (used when not ``ok``).
        group: process group (None: the default one). Without an initialized process group
            (or a group of one) nothing is communicated.
        device: where the flag lives under NCCL (default: the current CUDA device); gloo and
            other backends use the CPU.
        peer_message: what ranks that were ``ok`` raise when another rank was not (default: a
            generic sentence), or a callable taking the failed global ranks and returning it;
            the failing ranks' global ranks are appended.
        error: this rank's original exception: re-raised unchanged on this rank (instead of a
            ValueError with ``message``) after the agreement.

    Raises ValueError (or ``error``) on every rank when any rank is not ok. Every rank of
    ``group`` must call it, with or without an error.
    """
    failed: List[int] = []
    world, rank = group_info(group)
    if world > 1:
        # One int per rank instead of a single MIN flag: same one all-reduce, and every rank
        # learns who failed.
        flags = torch.zeros(world, dtype=torch.int32, device=_collective_device(group, device))
        if not ok:
            flags[rank] = 1
        dist.all_reduce(flags, group=group)
        failed = [global_rank(group, r) for r in flags.nonzero().flatten().tolist()]
    elif not ok:
        failed = [0]
    if ok and not failed:
        return
    if not ok:
        if error is not None:
            raise error
        raise ValueError(message)
    if callable(peer_message):
        peer_message = peer_message(failed)
    raise ValueError((peer_message or "another rank failed (see its error); this rank was "
                      "fine") + f" [failed rank(s): {failed}]")


# ---------------------------------------------------------------------------- consistency
class RingMismatchError(ValueError):
    """Ranks of one ring called it with different arguments (raised on every rank, before any
    payload moved; the ring stays usable)."""


class RingError(RuntimeError):
    """Base of the errors of a ring whose ranks fell out of step or failed."""


class RingDesyncError(RingError):
    """The ranks of a ring are not in the same ring call (a rank skipped or repeated a call, or
    a received exchange header does not match): raised on every rank that sees it."""


class RingBrokenError(RingError):
    """A rank failed inside a ring call (or reported a failure), so the call's results are
    invalid; the ring stays broken on every rank until ``ringseq.reset_ring`` is called."""


class RingTimeoutError(RingError):
    """A rank waited longer than the ring timeout for its peers (or lost the connection to
    them); the ring is broken until ``ringseq.reset_ring`` rebuilds it on every rank."""


class RingPeerError(ValueError):
    """Another rank of the ring refused the call's arguments (its own check failed); raised on
    the ranks whose arguments were fine, naming the refusing ranks and their messages, before
    any payload moved. The ring stays usable. ``ranks``: the refusing ranks (in the group)."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


def agree_on_fields(ok: bool, message: str, fields, group=None, *,
                    error: Optional[BaseException] = None, what: str = "call") -> None:
    """Collective for a function outside ring attention that all ranks of ``group`` call
    together (one all-gather of a few ints): returns when every rank is ``ok`` and passed the
    same ``fields``, ``(name, int, describe)`` with ``describe(int) -> str`` or None (the
    same names in the same order on every rank; at most 30). Else raises on every rank: the
    ranks that were not ok ``error`` (or a ValueError with ``message``), the others
    :class:`RingPeerError` naming them and their messages unknown here; when all were ok but
    a field differs, :class:`RingMismatchError` naming each field and every rank's value."""
    world, rank = group_info(group)
    if world == 1:
        if not ok:
            raise error if error is not None else ValueError(message)
        return
    if len(fields) > 30:
        raise ValueError(f"agree_on_fields: at most 30 fields, got {len(fields)}")
    values = [0 if ok else 1] + [int(f[1]) for f in fields]
    vec = torch.tensor(values + [0] * (31 - len(values)), dtype=torch.int64,
                       device=_collective_device(group, None))
    parts = [torch.empty_like(vec) for _ in range(world)]
    dist.all_gather(parts, vec, group=group)
    rows = [p.tolist() for p in parts]
    failed = [global_rank(group, r) for r, row in enumerate(rows) if row[0]]
    if not ok:
        raise error if error is not None else ValueError(message)
    if failed:
        raise RingPeerError(f"ringseq: {what} not run: rank(s) {failed} of the group refused "
                            f"its arguments (see their errors)", ranks=failed)
    diffs = []
    for j, (name, _, describe) in enumerate(fields):
        column = [row[1 + j] for row in rows]
        if len(set(column)) > 1:
            show = describe or str
            diffs.append(f"{name} (" + ", ".join(f"rank {r}: {show(c)}" for r, c in
                                                   enumerate(column)) + ")")
    if diffs:
        raise RingMismatchError(f"ringseq: {what}: the ranks were called with different "
                                f"arguments: " + "; ".join(diffs))


_MODES = {"first": "first", "1": "first", "true": "first", "on": "first", "yes": "first",
          "always": "always",
          "off": "off", "0": "off", "false": "off", "no": "off"}


def _mode_from_env() -> str:
    raw = os.environ.get("RINGSEQ_CHECK_CONSISTENCY", "1").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"RINGSEQ_CHECK_CONSISTENCY={raw!r} is not a consistency check mode; "
                         f"expected one of {sorted(_MODES)}")
    return _MODES[raw]


_CHECK_MODE: Optional[str] = None


def set_consistency_check(mode=True) -> None:
    """Controls the cross-rank checks of the ring (the control collectives of
    :mod:`ringseq.engine.integrity`).

    ``True`` / ``"first"`` / ``"always"`` (default; the three are the same since every call is
    checked): every ring call begins and ends with a small all-gather on the ring's gloo
    control group (host memory only, no device synchronization). Ranks that call with
    different arguments raise :class:`RingMismatchError`; ranks at different calls (one
    skipped its backward) raise :class:`RingDesyncError`; a rank failing inside a call makes
    every rank raise :class:`RingBrokenError` -- before any payload of a mismatching call
    moves, so nothing hangs and nothing is computed from mismatched data.
    ``False`` / ``"off"``: no control collectives. Exchange headers still catch desynchronized
    steps (ranks a different number of ring calls apart, or under other call tags) on the rank
    next to the one out of step (Ulysses: on its all-to-all peers) (RingDesyncError), but
    ranks that disagree on sizes may hang
    or abort in the transport, a failing rank can leave its peers waiting until the ring
    timeout, and a rank that fails inside a call (it still completes the
    call's exchanges) can leave its peers with results that silently miss its part, e.g. dK/dV
    without its contribution: only the failing rank raises. Turn the checks off only where
    every call is known to succeed on every rank. (Ulysses' backward then exchanges a
    gradient-into-lse slot on every rank, since no rank knows whether another has one, and
    with a kernel that takes none, torch's or flash-attn's, reads on the host whether it is
    all zeros: one device synchronization per backward.)
    The environment variable ``RINGSEQ_CHECK_CONSISTENCY`` (``1``/``true``/``on``/``yes``/
    ``first``/``always``, ``0``/``false``/``off``/``no``; anything else raises ValueError at
    the next ring call, before it opens, and the ranks where the variable is well formed raise
    :class:`RingPeerError`) sets the initial mode; ``mode`` takes the same words.
    Every rank must use the same mode.
    """
    global _CHECK_MODE
    if mode is True or mode is False:
        _CHECK_MODE = "first" if mode else "off"
    elif isinstance(mode, str) and mode.strip().lower() in _MODES:
        _CHECK_MODE = _MODES[mode.strip().lower()]  # the environment variable's words too
    else:
        raise ValueError(f"set_consistency_check: consistency check mode must be True, False "
                         f"or one of the strings {sorted(_MODES)}, got {mode!r} "
                         f"({type(mode).__name__})")


def consistency_check_mode() -> str:
    """The current mode: ``"first"``, ``"always"`` or ``"off"``."""
    global _CHECK_MODE
    if _CHECK_MODE is None:
        _CHECK_MODE = _mode_from_env()
    return _CHECK_MODE


_TIMEOUT_S: Optional[float] = None


def real_object(obj):
    """``obj`` itself, or the object a ``FakeScriptObject`` of torch.compile's tracing wraps
    (a process group passed through a traced call arrives so, a new wrapper per trace): the
    rings and registries keyed by a wrapper gave each trace a ring of its own, whose channels
    met the earlier ring's under the same names and timed out."""
    if type(obj).__name__ == "FakeScriptObject":
        return object.__getattribute__(obj, "real_obj")
    return obj


# (host bookkeeping on a process group object, which dynamo cannot trace: a compiled boosted
# model with tensor parallelism failed on every rank in its forward)
@torch.compiler.disable
def collective_count(group) -> Optional[int]:
    """torch's count of the collectives made on process group ``group`` (its sequence
    number), or None where the group does not count. A group of per-device backends
    (``"cpu:gloo"``, or no name) counts on its CPU backend: its own count raises
    ("ProcessGroup undefined does not yet support sequence numbers")."""
    count = getattr(group, "_get_sequence_number_for_group", None)
    if count is None:
        return None
    try:
        return count()
    except RuntimeError:
        try:  # (a CUDA backend beside it would run the collectives uncounted there: None)
            group._get_backend(torch.device("cuda"))
            return None
        except Exception:  # noqa: BLE001 - no CUDA backend: the CPU one runs them
            pass
        try:
            return group._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
        except Exception:  # noqa: BLE001 - no CPU backend that counts: not counted
            return None


_MAX_TIMEOUT_S = 1e9


def _check_timeout(value, what: str) -> float:
    """A timeout in seconds: a real number in [1, 1e9] (NumPy's and 0-d tensors' too; bools
    refused; gloo's per-operation timeout in nanoseconds overflows above about 1e10 s)."""
    real = isinstance(value, numbers.Real) or (
        torch.is_tensor(value) and value.dim() == 0 and not value.is_complex()
        and not value.is_meta)  # (a meta tensor has no value: torch's bare .item() error)
    if not real or isinstance(value, bool) or (
            torch.is_tensor(value) and value.dtype == torch.bool):
        raise TypeError(f"{what} must be a number of seconds (>= 1, finite), got {value!r} "
                        f"({type(value).__name__})")
    try:
        seconds = float(value)
    except OverflowError:  # (an int beyond float64's range)
        seconds = math.inf
    if not (1.0 <= seconds <= _MAX_TIMEOUT_S):
        shown = repr(seconds)
        if isinstance(value, numbers.Integral):
            # (an int's digits from its bits: Python refuses to print one of over 4300)
            n = int(value)
            shown = (repr(n) if abs(n) < 10 ** 40 else
                     f"an int of about {int(n.bit_length() * 0.30103) + 1} digits")
        raise ValueError(f"{what} must be a number of seconds from 1 to {_MAX_TIMEOUT_S:.0e} "
                         f"(about 31 years), got {shown}")
    return seconds


def set_ring_timeout(seconds: Optional[float]) -> None:
    """Seconds a rank waits for its ring peers (a control collective or an exchange) before it
    raises :class:`RingTimeoutError` naming the call and the peers: a finite number >= 1 (a
    shorter limit would fire on ordinary compute imbalance). None restores the default:
    ``RINGSEQ_TIMEOUT`` from the environment, else 1800 s (torch's default process group
    timeout). Applies to every exchange at once, and to channels made afterwards (a
    ``reset_ring`` rebuilds them)."""
    global _TIMEOUT_S
    _TIMEOUT_S = None if seconds is None else _check_timeout(seconds, "set_ring_timeout: seconds")


@contextlib.contextmanager
def defaults_for_malformed_settings():
    """While a rank refuses a call over a malformed ``RINGSEQ_CHECK_CONSISTENCY`` or
    ``RINGSEQ_TIMEOUT`` of its own, the default mode ("first") and timeout (1800 s) stand in
    for the malformed ones, so that its refusal meets the peers' call; the settings are read
    from the environment again afterwards."""
    global _CHECK_MODE, _TIMEOUT_S
    saved = (_CHECK_MODE, _TIMEOUT_S)
    try:
        consistency_check_mode()
    except ValueError:
        _CHECK_MODE = "first"
    try:
        ring_timeout()
    except ValueError:
        _TIMEOUT_S = 1800.0
    try:
        yield
    finally:
        _CHECK_MODE, _TIMEOUT_S = saved


def ring_timeout() -> float:
    """The current ring timeout in seconds (see :func:`set_ring_timeout`)."""
    if _TIMEOUT_S is not None:
        return _TIMEOUT_S
    raw = os.environ.get("RINGSEQ_TIMEOUT")
    if raw is None:
        return 1800.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"RINGSEQ_TIMEOUT={raw!r} must be a number of seconds (>= 1, "
                         f"finite)") from None
    return _check_timeout(value, f"RINGSEQ_TIMEOUT={raw!r}")


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11+); on 3.10 the note is dropped, so that
    the rank's own error is still the one raised."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
