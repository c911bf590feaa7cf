"""The ring: neighbours, packed double buffers, one ``batch_isend_irecv`` per step.

Rank ``r`` of a group of ``W`` sends to ``(r + 1) % W`` and receives from ``(r - 1) % W``, so at
ring step ``i`` it holds the K/V shard that rank ``(r - i) % W`` started with. Everything a step
moves (K and V; in the backward also the travelling dK/dV accumulators) lives in one packed,
contiguous byte buffer, so a step is one isend and one irecv posted together.

The same code runs on gloo (CPU) and NCCL (CUDA). On NCCL, ``batch_isend_irecv`` runs on the
process group's own stream after waiting on the current stream (an event, not a synchronize),
and ``Work.wait()`` makes the current stream wait for it, so compute on the current stream
overlaps the transfer with no device-wide synchronization. With world size 1 nothing is sent.

Consistency across ranks: :meth:`RingComm.check_consistent` all-gathers a few integers that
describe a call (shapes, dtype, layout, world size, causal) and raises the same clear error on
every rank when they differ. It runs on the first call per signature, by default; turn it off
with ``ringseq.set_consistency_check(False)`` or ``RINGSEQ_CHECK_CONSISTENCY=0``, or make it run
on every call with ``"always"`` (see :func:`set_consistency_check`).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["RingComm", "get_comm", "set_consistency_check", "consistency_check_mode",
           "RingMismatchError", "agree_or_raise"]


class RingMismatchError(ValueError):
    """Ranks of one ring called it with different arguments (raised on every rank)."""


def _mode_from_env() -> str:
    raw = os.environ.get("RINGSEQ_CHECK_CONSISTENCY", "1").strip().lower()
    if raw in ("0", "false", "off", "no"):
        return "off"
    if raw == "always":
        return "always"
    return "first"


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


class _Pending:
    """The in-flight exchange of one ring step."""

    __slots__ = ("works",)

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = ()


class RingComm:
    """Ring neighbours of ``group`` (None: the default group) and the step exchange.

    Attributes: ``world_size``, ``rank`` (in the group), ``next_rank`` / ``prev_rank`` (global
    ranks, what P2P ops take). Without an initialized process group (and ``group=None``) it is
    a ring of one.
    """

    def __init__(self, group=None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the process group passed as "
                                 "`group`")
            g = group if group is not None else dist.group.WORLD
            self.next_rank = dist.get_global_rank(g, (self.rank + 1) % self.world_size)
            self.prev_rank = dist.get_global_rank(g, (self.rank - 1) % self.world_size)
            self.backend = str(dist.get_backend(group))
        else:
            if group is not None:
                raise ValueError("a process group was passed but torch.distributed is not "
                                 "initialized")
            self.world_size, self.rank = 1, 0
            self.next_rank = self.prev_rank = 0
            self.backend = None
        self._buffers: Dict[Tuple[str, torch.device], List[torch.Tensor]] = {}
        self._checked: set = set()

    # -- buffers ---------------------------------------------------------------------------
    def buffers(self, key: str, nbytes: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Two uint8 buffers of ``nbytes`` (the double buffer of a ring loop), cached per
        ``(key, device)`` and grown when needed, so repeated calls do not allocate. The
        caller must not keep views of them past its own return."""
        device = torch.device(device)
        slot = self._buffers.get((key, device))
        if slot is None or slot[0].numel() < nbytes:
            # (2, nbytes) so both halves come from one allocation.
            pair = torch.empty((2, nbytes), dtype=torch.uint8, device=device)
            slot = [pair[0], pair[1]]
            self._buffers[(key, device)] = slot
        return slot[0][:nbytes], slot[1][:nbytes]

    def release_buffers(self) -> None:
        """Drops the cached buffers (they are re-allocated on the next call)."""
        self._buffers.clear()

    # -- exchange --------------------------------------------------------------------------
    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> Optional[_Pending]:
        """Posts send-to-next and receive-from-prev of two contiguous tensors of equal size
        as one batch; returns the pending exchange (call ``wait()`` before reading ``recv`` or
        writing ``send``), or None for a ring of one."""
        if self.world_size == 1:
            return None
        ops = [dist.P2POp(dist.isend, send, self.next_rank, self.group),
               dist.P2POp(dist.irecv, recv, self.prev_rank, self.group)]
        return _Pending(dist.batch_isend_irecv(ops))

    # -- safety ----------------------------------------------------------------------------
    def check_consistent(self, fields: Sequence[Tuple[str, int]], device=None) -> None:
        """Raises :class:`RingMismatchError` on every rank when ranks disagree on ``fields``
        (pairs of name and int). One all-gather of ``len(fields)`` int64s; see
        :func:`set_consistency_check` for when it runs."""
        mode = consistency_check_mode()
        if self.world_size == 1 or mode == "off":
            return
        values = tuple(int(v) for _, v in fields)
        if mode == "first" and values in self._checked:
            return
        dev = torch.device(device) if (device is not None and self.backend == "nccl") else \
            torch.device("cpu")
        mine = torch.tensor(values, dtype=torch.int64, device=dev)  # (n_fields,)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        rows = [g.tolist() for g in gathered]
        diffs = []
        for j, (name, _) in enumerate(fields):
            column = [row[j] for row in rows]
            if len(set(column)) > 1:
                per_rank = ", ".join(f"rank {r}: {_describe(name, c)}"
                                     for r, c in enumerate(column))
                diffs.append(f"{name} ({per_rank})")
        if diffs:
            raise RingMismatchError(
                "ringseq: the ranks of the ring were called with different arguments: "
                + "; ".join(diffs) + ". Every rank of the group must pass shards of the same "
                "shape, dtype, layout and causal flag.")
        self._checked.add(values)


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 99


def _describe(name: str, code: int) -> str:
    if name == "dtype":
        return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else f"dtype #{code}"
    if name in ("causal", "requires_grad"):
        return str(bool(code))
    if name == "layout":
        from .layouts import LAYOUTS
        for lay_name in LAYOUTS:
            if layout_code(lay_name) == code:
                return repr(lay_name)
        return f"layout #{code}"
    return str(code)


def layout_code(name: str) -> int:
    """A stable small integer for a layout name (same on every rank and run)."""
    import zlib
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


_COMMS: Dict[object, RingComm] = {}


def get_comm(group=None) -> RingComm:
    """The cached :class:`RingComm` of ``group`` (None: the default group)."""
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized:
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialized")
        key = None
    else:
        key = group if group is not None else dist.group.WORLD
    comm = _COMMS.get(key)
    if comm is None:
        comm = RingComm(group)
        _COMMS[key] = comm
    return comm


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
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if str(dist.get_backend(group)) == "nccl":
            dev = torch.device(device) if device is not None else \
                torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
        # One int per rank instead of a single MIN flag: same one all-reduce, and every rank
        # learns who failed.
        flags = torch.zeros(world, dtype=torch.int32, device=dev)
        if not ok:
            flags[rank] = 1
        dist.all_reduce(flags, group=group)
        g = group if group is not None else dist.group.WORLD
        failed = [dist.get_global_rank(g, r) for r in flags.nonzero().flatten().tolist()]
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
