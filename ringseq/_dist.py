"""What every layer needs to know about torch.distributed, written once.

* :func:`group_info` / :func:`global_rank`: the (world size, rank) of a group, with one clear
  error for a process outside it and world size 1 without an initialized process group;
* :func:`agree_or_raise`: a collective verdict, so that a rank failing alone raises on every
  rank instead of leaving the others waiting in their next collective;
* :func:`check_consistent` and its mode (:func:`set_consistency_check`): ranks that call the
  ring with different arguments all raise :class:`RingMismatchError` instead of hanging.

Private: the public names are re-exported by :mod:`ringseq`.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["RingMismatchError", "agree_or_raise", "check_consistent", "consistency_check_mode",
           "dtype_code", "global_rank", "group_info", "is_initialized", "set_consistency_check"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_info(group=None) -> Tuple[int, int]:
    """(world_size, rank in ``group``); (1, 0) without an initialized process group.

    Raises ValueError when a group is passed but torch.distributed is not initialized, or
    when this process is not a member of ``group`` (torch reports rank -1 there, which would
    otherwise surface as nonsense sizes much later)."""
    if not is_initialized():
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not "
                             "initialized")
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the "
                         f"process group passed as `group`; call ringseq functions only on "
                         f"the ranks of that group")
    return dist.get_world_size(group), rank


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
def agree_or_raise(ok: bool, message: str, group=None, device=None, *,
                   peer_message: Optional[str] = None,
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
            generic sentence); the failing ranks' global ranks are appended.
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
    raise ValueError((peer_message or "another rank failed (see its error); this rank was "
                      "fine") + f" [failed rank(s): {failed}]")


# ---------------------------------------------------------------------------- consistency
class RingMismatchError(ValueError):
    """Ranks of one ring called it with different arguments (raised on every rank)."""


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
    """Controls the cross-rank argument check of the ring functions.

    ``True`` / ``"first"`` (default): check on the first call per call signature (one small
    all-gather, then cached). ``"always"``: check every call (also catches a rank that diverges
    to a signature already checked elsewhere, at one all-gather and host sync per call).
    ``False`` / ``"off"``: never check; ranks that disagree may then hang or compute garbage.
    The environment variable ``RINGSEQ_CHECK_CONSISTENCY`` (``0``, ``1``, ``always``) sets the
    initial mode. Every rank must use the same mode.
    """
    global _CHECK_MODE
    if mode is True or mode == "first":
        _CHECK_MODE = "first"
    elif mode is False or mode in ("off", None):
        _CHECK_MODE = "off"
    elif mode == "always":
        _CHECK_MODE = "always"
    else:
        raise ValueError(f"consistency check mode must be True, False, 'first', 'always' or "
                         f"'off', got {mode!r}")


def consistency_check_mode() -> str:
    """The current mode: ``"first"``, ``"always"`` or ``"off"``."""
    global _CHECK_MODE
    if _CHECK_MODE is None:
        _CHECK_MODE = _mode_from_env()
    return _CHECK_MODE


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer for a dtype, the same on every rank (99: not a float dtype we know)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else 99


def _describe(kind: str, code: int) -> str:
    if kind == "dtype":
        return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else f"dtype #{code}"
    if kind == "bool":
        return str(bool(code))
    if kind == "layout":
        from .layouts import layout_name_of_code
        return layout_name_of_code(code)
    return str(code)


# A field is (name, value) or (name, value, kind); kind selects how a differing value is shown.
Field = Tuple


def check_consistent(fields: Sequence[Field], group=None, device=None,
                     checked: Optional[set] = None) -> None:
    """Raises :class:`RingMismatchError` on every rank of ``group`` when ranks disagree on
    ``fields`` (``(name, int)`` or ``(name, int, kind)`` with kind ``"dtype"``, ``"bool"``,
    ``"layout"``). One all-gather of ``len(fields)`` int64s; ``checked`` (a set kept by the
    caller, e.g. per ring) caches the signatures already agreed on in mode ``"first"``."""
    mode = consistency_check_mode()
    world, _ = group_info(group)
    if world == 1 or mode == "off":
        return
    values = tuple(int(f[1]) for f in fields)
    if mode == "first" and checked is not None and values in checked:
        return
    mine = torch.tensor(values, dtype=torch.int64, device=_collective_device(group, device))
    gathered = [torch.empty_like(mine) for _ in range(world)]  # (n_fields,) per rank
    dist.all_gather(gathered, mine, group=group)
    rows = [g.tolist() for g in gathered]
    diffs = []
    for j, f in enumerate(fields):
        column = [row[j] for row in rows]
        if len(set(column)) > 1:
            kind = f[2] if len(f) > 2 else "int"
            per_rank = ", ".join(f"rank {r}: {_describe(kind, c)}" for r, c in enumerate(column))
            diffs.append(f"{f[0]} ({per_rank})")
    if diffs:
        raise RingMismatchError(
            "ringseq: the ranks of the ring were called with different arguments: "
            + "; ".join(diffs) + ". Every rank of the group must pass shards of the same "
            "shape, dtype, layout and causal flag.")
    if checked is not None:
        checked.add(values)
