"""The plan of one ring-attention call: every default and check, resolved once.

A public entry point (``ringseq.ring_flash_attn_func`` and friends, the simulator) builds a
:class:`RingPlan` with :func:`make_plan` and hands it, with the tensors, to the engine
(:mod:`ringseq.ring`). Nothing below the plan re-applies a default or re-checks an argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ._dist import dtype_code
from .comm import Transport
from .kernels import AttentionBackend, check_qkv, get_backend, resolve_scale
from .layouts import BlockTask, Layout, get_layout, span_keys
from .masks import AttnMask

__all__ = ["RingPlan", "make_plan", "resolve_grad_comm_dtype"]


@dataclass(frozen=True)
class RingPlan:
    """What a ring call runs, besides its tensors.

    Attributes:
        layout: how the global sequence is split (a :class:`ringseq.layouts.Layout`).
        transport: the ring (:class:`ringseq.comm.Transport`: ``RingComm`` or the simulator).
        softmax_scale: resolved float.
        causal: causal mask over the layout's global positions.
        backend: the block kernel.
        accum_dtype: dtype of out/lse/dq/dk/dv accumulation (float32; float64 for float64).
        grad_comm_dtype: dtype in which the travelling dK/dV accumulators move.
        schedule: this rank's block tasks per ring step (``layout.schedule``).
        mask: the global mask (:class:`ringseq.masks.AttnMask`: causal, window, documents).
        softcap: logit soft-capping (0: off).
        hops: how far K/V travel (the last step with a task on any rank; W - 1 unless a
            window makes later steps empty everywhere).
        signature: ``(name, value[, kind])`` fields every rank of the ring must agree on,
            compared by the begin collective of each ring call (:mod:`ringseq.integrity`).
        kv_rows: per source rank, the ``(start, end)`` intervals of its local K/V rows that
            travel (``layout.kv_rows``: windows and documents need only part of a shard
            remotely), or None: every row travels. With it, every K/V block and dK/dV
            accumulator moves compacted to ``kv_len`` rows and the tasks of steps >= 1 in
            ``schedule`` index those compacted rows.
        kv_len: rows of a travelling block (the longest ``kv_rows`` entry; the local length
            when ``kv_rows`` is None).
    """

    layout: Layout
    transport: Transport
    softmax_scale: float
    causal: bool
    backend: AttentionBackend
    accum_dtype: torch.dtype
    grad_comm_dtype: torch.dtype
    schedule: Tuple[Tuple[BlockTask, ...], ...]
    signature: Tuple[tuple, ...] = ()
    mask: AttnMask = AttnMask()
    softcap: float = 0.0
    hops: int = 0
    kv_rows: Optional[Tuple[Tuple[Tuple[int, int], ...], ...]] = None
    kv_len: int = 0

    def kernel_kwargs(self, task: BlockTask) -> dict:
        """The mask arguments of a block kernel call for ``task`` (none for plain blocks)."""
        kw = {}
        if task.spans is not None:
            kw["spans"] = task.spans
        if self.softcap:
            kw["softcap"] = self.softcap
        return kw

    def _travelling(self, src: int):
        """(local start, local end, compacted start) of every row interval rank ``src``'s
        block carries."""
        at = 0
        for a, b in self.kv_rows[src]:
            yield a, b, at
            at += b - a

    def pack_rows(self, x: torch.Tensor, out: torch.Tensor, src: Optional[int] = None) -> None:
        """Writes the rows of rank ``src``'s (default: this rank's) shard ``x`` (b, s_local, h,
        d) that travel into the first rows of ``out`` (b, kv_len, h, d), in order, and zeros
        after them (all rows, without ``kv_rows``)."""
        if self.kv_rows is None:
            out.copy_(x)
            return
        end = 0
        for a, b, at in self._travelling(self.rank if src is None else src):
            out[:, at:at + b - a].copy_(x[:, a:b])
            end = at + b - a
        # Blocks of other ranks may carry more rows; the rest of ours must hold numbers (the
        # buffers are reused), since a dense kernel multiplies masked rows by zero.
        out[:, end:].zero_()

    def carried(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """What the block of rank ``src`` carries of its (b, s_local, h, d) shard ``x``: a new
        (b, kv_len, h, d) tensor (``x`` itself without kv_rows)."""
        if self.kv_rows is None:
            return x
        out = x.new_empty((x.shape[0], self.kv_len, *x.shape[2:]))
        self.pack_rows(x, out, src)
        return out

    def add_home_rows(self, full: torch.Tensor, block: torch.Tensor) -> None:
        """``full`` (b, s_local, h, d) += this rank's travelled rows of ``block`` (b, kv_len,
        h, d), at their local places (the inverse of :meth:`pack_rows`)."""
        if self.kv_rows is None:
            full.add_(block)
            return
        for a, b, at in self._travelling(self.rank):
            full[:, a:b].add_(block[:, at:at + b - a])

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def rank(self) -> int:
        return self.transport.rank


def resolve_grad_comm_dtype(grad_comm_dtype, dtype: torch.dtype, acc: torch.dtype) -> torch.dtype:
    """None -> the accumulation dtype; "input" -> ``dtype``; a floating torch.dtype as is."""
    if grad_comm_dtype is None:
        return acc
    if grad_comm_dtype == "input":
        return dtype
    if isinstance(grad_comm_dtype, torch.dtype) and grad_comm_dtype.is_floating_point:
        return grad_comm_dtype
    raise ValueError(f"grad_comm_dtype must be None, 'input' or a floating torch.dtype, got "
                     f"{grad_comm_dtype!r}")


def make_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, transport: Transport,
              softmax_scale=None, causal: bool = False, layout="contiguous", backend=None,
              grad_comm_dtype=None, needs_grad: Optional[bool] = None,
              window_size=(-1, -1), softcap: float = 0.0,
              cu_seqlens: Optional[Tuple[int, ...]] = None) -> RingPlan:
    """Validates a ring call on this rank's shards and resolves its defaults.

    Args:
        q: (b, s_local, h, d); k, v: (b, s_local, h_kv, d) -- this rank's shards.
        transport: the ring.
        softmax_scale, causal, layout, backend, grad_comm_dtype: as in
            :func:`ringseq.ring_flash_attn_func`.
        needs_grad: whether a backward will follow (default: grad mode and any input
            requiring grad); part of the signature, so that no rank runs a backward alone.
        window_size: flash-attn's ``(left, right)`` sliding window over GLOBAL positions
            (-1: unbounded), combined with ``causal``.
        softcap: logit soft-capping ``softcap * tanh(scores / softcap)`` (0: off).
        cu_seqlens: GLOBAL document boundaries ``(0, ..., total)`` of a packed sequence: a
            token attends only to its own document.

    Raises ValueError for what this rank can see alone (shapes, dtypes, a local length the
    layout cannot use, an unknown layout or backend, a backend that cannot take a ring's
    merged out/lse), without communicating. Whether the ranks agree is checked when the call
    runs (``RingMismatchError``, see :mod:`ringseq.integrity`).
    """
    check_qkv(q, k, v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention needs q and k/v shards of the same local length "
                         f"(self-attention over one sharded sequence), got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    lay = get_layout(layout)
    W = transport.world_size
    lay.check_local_seqlen(q.shape[1], W)
    be = get_backend(backend, q.device, q.dtype, q.shape[-1])
    if W > 1 and not be.supports_global_backward:
        raise ValueError(f"backend {be.name!r} cannot compute a block's gradients from the "
                         f"merged output of a ring; use backend='ringseq' or 'reference'")
    scale = resolve_scale(softmax_scale, q.shape[-1])
    acc = be.accum_dtype(q.dtype)
    gdt = resolve_grad_comm_dtype(grad_comm_dtype, q.dtype, acc)
    b, s, h, d = q.shape
    own = getattr(lay, "cu_seqlens", None)  # a layout made for one packed batch (Documents)
    if own is not None:
        if cu_seqlens is not None and tuple(int(c) for c in cu_seqlens) != tuple(own):
            raise ValueError("cu_seqlens differ from the document boundaries the layout was "
                             "built with; pass one of them")
        cu_seqlens = own
    mask = AttnMask(causal=bool(causal), window=tuple(int(w) for w in window_size),
                    cu_seqlens=None if cu_seqlens is None else tuple(int(c) for c in cu_seqlens))
    if mask.cu_seqlens is not None and mask.cu_seqlens[-1] != s * W:
        raise ValueError(f"cu_seqlens must end at the global length {s * W} (local length {s} x "
                         f"world size {W}), got {mask.cu_seqlens[-1]}")
    softcap = float(softcap)
    if not softcap >= 0.0:
        raise ValueError(f"softcap must be >= 0 (0: off), got {softcap}")
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # What every rank must agree on; compared by the ring call's begin collective.
    signature = (
        ("batch", b), ("local seqlen", s), ("nheads", h), ("nheads_kv", k.shape[2]),
        ("headdim", d), ("dtype", dtype_code(q.dtype), "dtype"),
        ("layout", lay.code, "layout"), ("world size", W), ("causal", bool(causal), "bool"),
        ("requires_grad", bool(needs_grad), "bool"),
        ("grad_comm_dtype", dtype_code(gdt), "dtype"),
        ("softmax_scale (x1e6)", round(scale * 1e6)),
        ("window left", mask.window[0]), ("window right", mask.window[1]),
        ("softcap (x1e6)", round(softcap * 1e6)),
        ("documents (hash of cu_seqlens)", 0 if mask.cu_seqlens is None else mask.code()),
    )
    schedule = lay.schedule(transport.rank, W, s, mask)
    hops = lay.hops(W, s, mask)
    kv_rows = lay.kv_rows(W, s, mask) if hops > 0 else None  # nothing travels at hops == 0
    kv_len = s
    if kv_rows is not None:
        kv_len = max(sum(b - a for a, b in m) for m in kv_rows)
        schedule = compact_schedule(schedule, transport.rank, W, kv_rows, kv_len)
    return RingPlan(layout=lay, transport=transport, softmax_scale=scale, causal=bool(causal),
                    backend=be, accum_dtype=acc, grad_comm_dtype=gdt, schedule=schedule,
                    signature=signature, mask=mask, softcap=softcap, hops=hops,
                    kv_rows=kv_rows, kv_len=kv_len)


_COMPACT_CACHE: dict = {}


def compact_schedule(schedule, rank: int, world_size: int, kv_rows, kv_len: int):
    """``schedule`` with the tasks of every step ``i >= 1`` moved to the compacted rows of
    their source ``(rank - i) % world_size`` (``kv_rows``): a plain task's kv slice and a
    span's first kv row are mapped; every row a task reads travels, and rows that are
    contiguous locally stay contiguous compacted (``kv_rows`` merges touching intervals).
    Cached (schedules are immutable)."""
    key = (id(schedule), rank, world_size, kv_rows)
    hit = _COMPACT_CACHE.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]

    def mapper(intervals):
        starts, at = [], 0
        for a, b in intervals:
            starts.append((a, b, at))
            at += b - a

        def where(x, n):  # compacted index of local row x, for n rows that must all travel
            if n <= 0:
                return 0
            for a, b, off in starts:
                if a <= x and x + n <= b:
                    return off + x - a
            raise AssertionError(f"rows [{x}, {x + n}) do not travel")  # kv_rows covers them
        return where

    out = [schedule[0]]
    for i in range(1, len(schedule)):
        where = mapper(kv_rows[(rank - i) % world_size])
        tasks = []
        for t in schedule[i]:
            if t.spans is None:
                a = where(t.kv.start, t.kv.stop - t.kv.start)
                tasks.append(BlockTask(t.q, slice(a, a + t.kv.stop - t.kv.start), t.causal))
            else:
                # each span trimmed to the keys it sees (the rows that travel), its band
                # shifted with its first key
                spans = []
                for sp in t.spans:
                    q0, nq, k0, nk, lo, hi = sp
                    a, b = span_keys(sp)
                    if b > a:
                        spans.append((q0, nq, where(t.kv.start + k0 + a, b - a), b - a,
                                      lo - a, hi - a))
                if spans:
                    tasks.append(BlockTask(t.q, slice(0, kv_len), False, spans=tuple(spans)))
        out.append(tuple(tasks))
    result = tuple(out)
    if len(_COMPACT_CACHE) > 256:
        _COMPACT_CACHE.clear()
    _COMPACT_CACHE[key] = (schedule, result)
    return result
