"""One forward loop and one backward loop that execute any layout's block schedule.

Forward (rank ``r`` of ``W``; at step ``i`` it holds the K/V of rank ``(r - i) % W``):

    for i in 0..W-1:
        post the exchange that brings step i+1's K/V      (if i + 1 < W)
        for each block task of step i: (o_b, l_b) = kernel(q[rows], k[kv rows], v[kv rows])
                                       merge (o_b, l_b) into the float32 (out, lse) of those rows
        wait for the exchange                              (its data is used at step i+1)

Backward, with the global ``out``/``lse`` saved by the forward and ``D = rowsum(dO * out)``
computed once: dQ accumulates locally; each K/V block carries a dK/dV accumulator around the
ring. To keep the exchange of step i+1's K/V overlapped with step i's compute and still post
one batch per step, an accumulator travels one exchange behind its block: the exchange posted
before step i carries step i+1's K/V together with the accumulator completed at step i-1, and
the accumulator of the block being computed at step i arrives during step i (it is added once
both are there). After the W compute steps one last exchange brings every accumulator home, so
each makes exactly one full lap (W hops); K/V make W-1 hops.

Accumulation is float32 (float64 for float64 inputs). ``grad_comm_dtype`` may send the dK/dV
accumulators in another dtype (e.g. the input's bf16/fp16, cutting backward traffic from 3x to
2x of the forward's) at the cost of one rounding per hop: for bf16 at W=4 about twice the
dK/dV error of float32 transit (tests/test_ring.py::test_grad_comm_dtype_accuracy_cost).
"""
from __future__ import annotations

import math
import threading
from typing import List, Optional, Sequence

import torch

from .comm import RingComm
from .kernels import compute_delta, default_scale
from .layouts import BlockTask, Layout, get_layout

__all__ = ["ring_attention", "simulate_ring", "RingAttnFunc", "resolve_grad_comm_dtype"]

_ALIGN = 64  # bytes; keeps every packed view aligned for any dtype and for vector loads


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _view(buf: torch.Tensor, offset: int, shape, dtype) -> torch.Tensor:
    n = math.prod(shape) * dtype.itemsize
    return buf[offset:offset + n].view(dtype).view(shape)


def _ring_forward(q, k, v, scale: float, schedule: Sequence[List[BlockTask]], comm: RingComm,
                  be):
    """Returns (out in the accumulation dtype, lse) for this rank's q rows."""
    b, s, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    acc = be.accum_dtype(q.dtype)
    W = comm.world_size
    kv_bufs = None
    if W > 1:
        kv_shape = (2, b, s_kv, h_kv, d)
        nbytes = _aligned(math.prod(kv_shape) * k.element_size())
        a, c = comm.buffers("fwd", nbytes, q.device)
        kv_bufs = [_view(a, 0, kv_shape, k.dtype), _view(c, 0, kv_shape, k.dtype)]
        kv_bufs[0][0].copy_(k)
        kv_bufs[0][1].copy_(v)

    first = schedule[0][0] if schedule[0] else None
    take_first = first is not None and first.q == slice(0, s)
    out = lse = None
    if not take_first:
        out = torch.zeros((b, s, h, d), dtype=acc, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)

    for i in range(W):
        pending = comm.exchange(kv_bufs[i % 2], kv_bufs[(i + 1) % 2]) if i + 1 < W else None
        # Step 0 computes on the caller's k/v: for W == 1 no buffer is touched at all.
        kk, vv = (k, v) if i == 0 else (kv_bufs[i % 2][0], kv_bufs[i % 2][1])
        for j, t in enumerate(schedule[i]):
            if take_first and i == 0 and j == 0:
                # Fresh kernel outputs become the accumulators: no fill, no merge, and no copy
                # at all when the input dtype is the accumulation dtype.
                o_b, l_b = be.fwd(q[:, t.q], kk[:, t.kv], vv[:, t.kv], scale, t.causal)
                out = o_b.to(acc)
                lse = l_b.to(acc)
            else:
                # The backend merges in place (our CPU kernel resumes its online softmax from
                # the running pair, so no block-sized temporary is made).
                be.fwd_accum(q[:, t.q], kk[:, t.kv], vv[:, t.kv], scale, t.causal, out[:, t.q],
                             lse[:, :, t.q])
        if pending is not None:
            pending.wait()
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, scale: float, schedule: Sequence[List[BlockTask]],
                   comm: RingComm, be, grad_comm_dtype: torch.dtype, grad_lse=None):
    """Returns (dq, dk, dv) in the input dtype."""
    b, s, h, d = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    acc = be.accum_dtype(q.dtype)
    W = comm.world_size
    delta = compute_delta(dout, out, grad_lse)  # (b, h, s), computed once for every block
    dq = torch.zeros((b, s, h, d), dtype=acc, device=q.device)

    kv_shape = (2, b, s_kv, h_kv, d)
    n_acc = _aligned(math.prod(kv_shape) * grad_comm_dtype.itemsize)
    n_kv = _aligned(math.prod(kv_shape) * k.element_size()) if W > 1 else 0
    bufs = comm.buffers("bwd", n_acc + n_kv, q.device)
    # Buffer = [dK/dV accumulator | K/V]: any step's payload is one contiguous byte range.
    acc_v = [_view(buf, 0, kv_shape, grad_comm_dtype) for buf in bufs]
    kv_v = [_view(buf, n_acc, kv_shape, k.dtype) for buf in bufs] if W > 1 else None
    if W > 1:
        kv_v[0][0].copy_(k)
        kv_v[0][1].copy_(v)
    direct = grad_comm_dtype == acc
    scratch = None
    if W > 1 or not direct:
        scratch = torch.empty(kv_shape, dtype=acc, device=q.device)  # (2, b, s_kv, h_kv, d)

    for i in range(W):
        cur, nxt = i % 2, (i + 1) % 2
        pending = None
        if W > 1:
            lo = 0 if i >= 1 else n_acc  # the accumulator completed at step i-1
            hi = n_acc + n_kv if i + 1 < W else n_acc  # K/V for step i+1
            if lo < hi:
                pending = comm.exchange(bufs[cur][lo:hi], bufs[nxt][lo:hi])
        kk, vv = (k, v) if i == 0 else (kv_v[cur][0], kv_v[cur][1])
        tasks = schedule[i]
        # At step 0 nothing arrives in the accumulator part of `nxt`, so the own block's
        # gradients can go straight there; later the incoming accumulator lands there while
        # we compute, so ours go to `scratch` and are added once both exist.
        target = acc_v[nxt] if (i == 0 and direct) else scratch
        if i == 0 or tasks:
            target.zero_()
        for t in tasks:
            be.bwd_accum(dout[:, t.q], q[:, t.q], kk[:, t.kv], vv[:, t.kv], out[:, t.q],
                         lse[:, :, t.q], scale, t.causal, delta[:, :, t.q], dq[:, t.q],
                         target[0][:, t.kv], target[1][:, t.kv])
        if pending is not None:
            pending.wait()
        if target is scratch:
            if i == 0:
                acc_v[nxt].copy_(scratch)
            elif tasks:
                acc_v[nxt].add_(scratch)

    if W > 1:
        comm.exchange(bufs[W % 2][:n_acc], bufs[(W + 1) % 2][:n_acc]).wait()
        home = acc_v[(W + 1) % 2]
    else:
        home = acc_v[1]
    # Copies: the accumulators live in the comm's cached buffers.
    dk = home[0].to(k.dtype, copy=True)
    dv = home[1].to(v.dtype, copy=True)
    return dq.to(q.dtype), dk, dv


def resolve_grad_comm_dtype(grad_comm_dtype, dtype: torch.dtype, acc: torch.dtype) -> torch.dtype:
    """None -> the accumulation dtype; "input" -> ``dtype``; a floating torch.dtype as is."""
    if grad_comm_dtype is None:
        return acc
    if isinstance(grad_comm_dtype, str):
        if grad_comm_dtype == "input":
            return dtype
        raise ValueError(f"grad_comm_dtype must be None, 'input' or a floating torch.dtype, got "
                         f"{grad_comm_dtype!r}")
    if isinstance(grad_comm_dtype, torch.dtype) and grad_comm_dtype.is_floating_point:
        return grad_comm_dtype
    raise ValueError(f"grad_comm_dtype must be None, 'input' or a floating torch.dtype, got "
                     f"{grad_comm_dtype!r}")


class RingAttnFunc(torch.autograd.Function):
    """Autograd around the two loops. Returns (out in the input dtype, lse (b, h, s) float32;
    float64 for float64 inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, comm, be, grad_comm_dtype):
        schedule = layout.schedule(comm.rank, comm.world_size, q.shape[1], causal)
        out_acc, lse = _ring_forward(q, k, v, scale, schedule, comm, be)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.schedule, ctx.comm, ctx.be = scale, schedule, comm, be
        ctx.grad_comm_dtype = grad_comm_dtype
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        elif dout.stride(-1) != 1:
            dout = dout.contiguous()
        if grad_lse is not None and not ctx.be.supports_delta:
            raise RuntimeError(f"backend {ctx.be.name!r} cannot backpropagate through lse; use "
                               f"backend='ringseq' or 'reference'")
        # Every rank must run the backward loop (the ring needs all of them), even one whose
        # gradients are all zero, so there is no early exit here. A backward called under the
        # caller's autocast must not lower the kernels' float32/float64 accumulation.
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.scale, ctx.schedule,
                                        ctx.comm, ctx.be, ctx.grad_comm_dtype, grad_lse)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q, k, v, scale: float, causal: bool, layout: Layout, comm: RingComm, be,
                   grad_comm_dtype: Optional[torch.dtype] = None):
    """The engine entry: validated inputs in, (out, lse) out. See ringseq.nn for the API."""
    gdt = grad_comm_dtype if grad_comm_dtype is not None else be.accum_dtype(q.dtype)
    return RingAttnFunc.apply(q, k, v, float(scale), bool(causal), layout, comm, be, gdt)


# -- simulation ---------------------------------------------------------------------------

class _SimComm(RingComm):
    """A ring of threads in one process: rank r's exchange hands its send buffer to rank r+1.

    Data moves inside ``wait()`` between two barriers, which is a legal schedule of a real
    exchange (recv is only read, send only rewritten, after wait), so the very same loops run.
    """

    def __init__(self, world_size: int, rank: int, shared):
        self.group = None
        self.world_size, self.rank = world_size, rank
        self.next_rank, self.prev_rank = (rank + 1) % world_size, (rank - 1) % world_size
        self.backend = "simulated"
        self._buffers, self._checked = {}, set()
        self._shared = shared  # {"barrier": Barrier, "sends": [None] * W}

    def exchange(self, send, recv):
        if self.world_size == 1:
            return None
        self._shared["sends"][self.rank] = send
        comm = self

        class _P:
            def wait(self_inner):
                sh = comm._shared
                sh["barrier"].wait()
                recv.copy_(sh["sends"][comm.prev_rank])
                sh["barrier"].wait()
        return _P()


def _run_simulated(world_size: int, fn):
    """Runs ``fn(rank, comm)`` on ``world_size`` threads joined in a simulated ring."""
    shared = {"barrier": threading.Barrier(world_size), "sends": [None] * world_size}
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(r):
        try:
            results[r] = fn(r, _SimComm(world_size, r, shared))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[r] = exc
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
            raise exc
    for exc in errors:
        if exc is not None:
            raise exc
    return results


@torch.no_grad()
def simulate_ring(q, k, v, layout="contiguous", world_size: int = 2, causal: bool = False,
                  backend=None, softmax_scale=None, dout=None, grad_comm_dtype=None):
    """Runs the ring schedule for ``world_size`` simulated ranks in this process (no
    torch.distributed): the same forward/backward loops, ranks as threads, exchanges as copies.

    Args:
        q, k, v: FULL sequences, (b, s, h, d) and (b, s, h_kv, d), on any device.
        layout, world_size, causal, backend, softmax_scale, grad_comm_dtype: as in
            :func:`ringseq.ring_flash_attn_func`.
        dout: optional (b, s, h, d) upstream gradient of the full output; when given the
            backward runs too.

    Returns:
        ``(out, lse)`` on the full sequence (out in q's dtype, lse (b, h, s) float32, float64 for float64 inputs), plus
        ``(dq, dk, dv)`` when ``dout`` is given, all unsharded back to global order.
    """
    from .layouts import shard_local, unshard_local
    from .ops import get_backend
    lay = get_layout(layout)
    lay.check_seqlen(q.shape[1], world_size)
    be = get_backend(backend, q.device, q.dtype, q.shape[-1])
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    acc = be.accum_dtype(q.dtype)
    gdt = resolve_grad_comm_dtype(grad_comm_dtype, q.dtype, acc)

    def rank_fn(r, comm):
        ql, kl, vl = (shard_local(t, lay, world_size, r) for t in (q, k, v))
        sched = lay.schedule(r, world_size, ql.shape[1], causal)
        out_acc, lse = _ring_forward(ql, kl, vl, scale, sched, comm, be)
        out = out_acc.to(q.dtype)
        if dout is None:
            return out, lse
        dl = shard_local(dout, lay, world_size, r)
        return (out, lse) + _ring_backward(dl, ql, kl, vl, out, lse, scale, sched, comm, be, gdt)

    per_rank = _run_simulated(world_size, rank_fn)
    n = len(per_rank[0])
    dims = [1, 2, 1, 1, 1][:n]
    return tuple(unshard_local([res[j] for res in per_rank], lay, dim=dims[j]) for j in range(n))
