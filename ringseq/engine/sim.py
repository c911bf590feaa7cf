"""A ring of threads in one process: the engine's loops without torch.distributed.

:class:`SimTransport` implements :class:`ringseq.engine.transport.Transport` for ``W`` threads: rank r's
exchange hands its send buffer to rank r+1. :func:`simulate_ring` runs the very same plan and
loops as ``ring_flash_attn_func`` on full-sequence tensors, for tests and for checking a new
layout before any process group exists.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from .._args import as_int, given
from ..layouts import shard_local, unshard_local
from ..spec import attn_spec, bound_layout, check_layout, check_self_attention, named_layout
from .loops import ring_backward, ring_forward
from .plan import make_plan
from .ring import Ring
from .transport import Transport

__all__ = ["SimTransport", "run_simulated", "simulate_ring"]


class _Shared:
    """What the threads of one simulated ring share."""

    def __init__(self, world_size: int):
        self.barrier = threading.Barrier(world_size)
        self.sends = [None] * world_size


class _PendingCopy:
    """Data moves inside ``wait()`` between two barriers: a legal schedule of a real exchange
    (recv is only read, and send only rewritten, after wait)."""

    __slots__ = ("shared", "recv", "prev")

    def __init__(self, shared: _Shared, recv: torch.Tensor, prev: int):
        self.shared, self.recv, self.prev = shared, recv, prev

    def wait(self) -> None:
        self.shared.barrier.wait()
        self.recv.copy_(self.shared.sends[self.prev])
        self.shared.barrier.wait()


class SimTransport(Transport):
    """Rank ``rank`` of a simulated ring of ``world_size`` threads (see module doc)."""

    ranks_are_threads = True

    def __init__(self, world_size: int, rank: int, shared: _Shared):
        self.world_size, self.rank = world_size, rank
        self._shared = shared

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, reverse: bool = False):
        if self.world_size == 1:
            return None
        self._shared.sends[self.rank] = send
        src = (self.rank + 1 if reverse else self.rank - 1) % self.world_size
        return _PendingCopy(self._shared, recv, src)


def run_simulated(world_size: int, fn):
    """Runs ``fn(rank, transport)`` on ``world_size`` threads joined in a simulated ring and
    returns their results in rank order; the first real error of any rank is re-raised."""
    shared = _Shared(world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(r):
        try:
            results[r] = fn(r, SimTransport(world_size, r, shared))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[r] = exc
            shared.barrier.abort()  # peers waiting for this rank fail instead of hanging

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    for exc in real or [e for e in errors if e is not None]:
        raise exc
    return results


@torch.no_grad()
def simulate_ring(q, k, v, layout="contiguous", world_size: int = 2, causal: bool = False,
                  backend=None, softmax_scale=None, dout=None, grad_comm_dtype=None,
                  window_size=(-1, -1), softcap: float = 0.0, cu_seqlens=None,
                  exchanges: Optional[list] = None):
    """Runs the ring schedule for ``world_size`` simulated ranks in this process (no
    torch.distributed): the same plan and forward/backward loops, ranks as threads,
    exchanges as copies.

    Args:
        q, k, v: FULL sequences, (b, s, h, d) and (b, s, h_kv, d), on any device.
        layout, world_size, causal, backend, softmax_scale, grad_comm_dtype, window_size,
            softcap, cu_seqlens: as in :func:`ringseq.ring_flash_attn_func`.
        dout: optional (b, s, h, d) upstream gradient of the full output; when given the
            backward runs too.
        exchanges: an optional list; receives, per rank, ``(forward exchanges,)`` of the
            call, ``(forward exchanges, backward exchanges)`` when ``dout`` is given.

    Returns:
        ``(out, lse)`` on the full sequence (out in q's dtype, lse (b, h, s) float32, float64
        for float64 inputs), plus ``(dq, dk, dv)`` when ``dout`` is given, all unsharded back
        to global order.

    Raises what the ring functions raise for their arguments (ValueError for a length the
    layout cannot split, q and k/v of other lengths, ...); TypeError / ValueError for a
    ``world_size`` that is not an int >= 1, an ``exchanges`` that is not a list, and a
    ``dout`` of another shape, dtype or device than q.
    """
    fn = "simulate_ring"
    world = as_int(world_size)
    if world is None:
        raise TypeError(f"{fn}: world_size must be an int, got {given(world_size)}")
    if world < 1:
        raise ValueError(f"{fn}: world_size must be an int >= 1, got {world}")
    world_size = world
    if exchanges is not None and not isinstance(exchanges, list):
        raise TypeError(f"{fn}: exchanges must be None or a list (it receives each rank's "
                        f"exchange counts), got {given(exchanges)}")
    unbound = named_layout(fn, layout)
    spec = attn_spec("simulate_ring", q, k, v, softmax_scale=softmax_scale, causal=causal,
                     window_size=window_size, softcap=softcap, backend=backend,
                     grad_comm_dtype=grad_comm_dtype,
                     documents=unbound.documents if cu_seqlens is None else cu_seqlens,
                     needs_grad=dout is not None)
    check_self_attention(spec, q, k)
    if dout is not None and not isinstance(dout, torch.Tensor):
        raise TypeError(f"{fn}: dout must be None or a tensor (the full output's gradient), "
                        f"got {given(dout)}")
    if dout is not None and (dout.shape != q.shape or dout.dtype != q.dtype
                             or dout.device != q.device):
        raise ValueError(f"{fn}: dout must be the full output's gradient, q's shape, dtype and "
                         f"device ({tuple(q.shape)} {q.dtype} on {q.device}), got "
                         f"{tuple(dout.shape)} {dout.dtype} on {dout.device}")
    lay = bound_layout("simulate_ring", unbound, spec.documents)
    try:
        lay.check_seqlen(q.shape[1], world_size)
    except ValueError as exc:
        raise ValueError(f"simulate_ring: {exc}") from None
    check_layout(spec, lay, world_size, q.shape[1] // world_size)

    def rank_fn(r, transport):
        ring = Ring(transport)
        ql, kl, vl = (shard_local(t, lay, world_size, r, fn="simulate_ring") for t in (q, k, v))
        plan = make_plan(spec, lay, world_size, r, ql.shape, kl.shape[2], ql.dtype)
        out_acc, lse = ring_forward(ql, kl, vl, plan, ring)
        counts = [ring.last_exchanges]
        out = out_acc.to(q.dtype)
        if dout is None:
            res = (out, lse)
        else:
            dl = shard_local(dout, lay, world_size, r, fn="simulate_ring")
            res = (out, lse) + ring_backward(dl, ql, kl, vl, out, lse, plan, ring)
            counts.append(ring.last_exchanges)
        return res, tuple(counts)

    per_rank = run_simulated(world_size, rank_fn)
    if exchanges is not None:
        exchanges.extend(counts for _, counts in per_rank)
    per_rank = [res for res, _ in per_rank]
    seq_dims = (1, 2, 1, 1, 1)  # out, lse, dq, dk, dv
    return tuple(unshard_local([res[j] for res in per_rank], lay, dim=seq_dims[j])
                 for j in range(len(per_rank[0])))
