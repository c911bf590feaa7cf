"""Double ring: the ring of ``R`` ranks split into ``O`` outer rings of inner rings of ``I``.

Ring rank ``g = o * I + j`` (``o`` in ``[0, O)``: which inner ring, e.g. the node; ``j`` in
``[0, I)``: position in it) holds the base layout's shard ``g`` of ``R``, exactly as in the
plain ring, so data, positions and ``shard``/``unshard`` do not change. Attention is the one
ring engine used twice, with no loop of its own:

* the OUTER ring (ranks with the same ``j``, one per inner ring) runs
  :func:`ringseq.ring.ring_attention` with ``O`` steps: at outer step ``p`` rank ``(o, j)``
  holds the K/V of rank ``(o - p, j)`` and posts the outer exchange for step ``p + 1`` before
  computing, so the inter-node transfer has a whole inner lap to hide behind;
* its block kernel (:class:`InnerRingBackend`) is a lap of the INNER ring: the ranks of inner
  ring ``o`` rotate the K/V they hold at outer step ``p`` with the same engine, so rank
  ``(o, j)`` meets the K/V of every rank ``(o - p, j')``. The block tasks of that lap are the
  base layout's for (global rank ``o * I + j``, global source ``(o - p) * I + j'``), so every
  layout is exact, causal or not. A lap in which no rank of the inner ring has anything to
  compute (contiguous causal: later inner rings) is skipped without communicating.

Backward: the outer engine's backward calls the inner lap's backward with the GLOBAL out/lse
(and delta, lse gradients included); the inner lap brings its dK/dV home to the rank holding
the outer block, the outer ring carries them on and home. Bytes per rank and call: forward
``O (I - 1) + (O - 1) = R - 1`` K/V blocks like the plain ring (``(I - 1) O`` of them inside the
inner rings); backward ``2R + O - 1`` blocks (the plain ring's ``2R - 1`` plus one dK/dV hop per
inner lap). Inner-lap gradients return in the input dtype before they are added into the
outer float32 accumulators: one extra rounding per outer step for bf16/fp16 inputs.

Why not a transport alone: the engine sends the dK/dV accumulator one step behind its K/V in
the SAME exchange, so a transport whose neighbours change from step to step (inner hops, then
an outer hop) would send the accumulator of a block along another block's route. A flat
double ring needs the engine to tell the transport what each exchange carries (see the report
of issue 15); this construction needs nothing new from the engine.
"""
from __future__ import annotations

from typing import List

import torch

from .commstats import CountingTransport
from .comm import get_comm
from .kernels import AttentionBackend, compute_delta, get_backend
from .kernels.merge import merge_into
from .layouts import BlockTask, Layout, get_layout
from .plan import make_plan
from .ring import _ring_backward, _ring_forward

__all__ = ["InnerRingBackend", "double_ring_attention"]


class _OuterLayout(Layout):
    """The outer ring's schedule: one whole block per step (the inner lap masks)."""

    def __init__(self, base: Layout, ring_size: int, inner: int):
        self.base, self.ring_size, self.inner = base, ring_size, inner
        self.name = f"double_ring[{base.name},R={ring_size},I={inner}]"

    def multiple(self, world_size):
        return self.base.multiple(self.ring_size) // self.ring_size * world_size

    def _positions(self, seqlen, world_size, rank):
        raise ValueError("a double ring places tokens with its base layout over the whole ring; "
                         "shard with that layout and the ring group")

    def _tasks(self, rank, src, world_size, s_local):
        return [BlockTask(slice(0, s_local), slice(0, s_local), True)]


class _InnerLayout(Layout):
    """Inner lap of inner ring ``node`` at outer step ``step``: the base layout's tasks for
    the global ranks involved."""

    def __init__(self, base: Layout, ring_size: int, inner: int, node: int, step: int):
        self.base, self.ring_size, self.inner = base, ring_size, inner
        self.node, self.src_node = node, (node - step) % (ring_size // inner)
        self.name = (f"{base.name}@double_ring[R={ring_size},I={inner},node={node},"
                     f"step={step}]")

    def multiple(self, world_size):
        return self.base.multiple(self.ring_size) // self.ring_size * world_size

    def _positions(self, seqlen, world_size, rank):
        raise ValueError("inner-lap layouts only schedule blocks")

    def _tasks(self, rank, src, world_size, s_local):
        return self.base.tasks(self.node * self.inner + rank, self.src_node * self.inner + src,
                               self.ring_size, s_local, True)

    def nothing_to_do(self, s_local: int, causal: bool) -> bool:
        """True when no rank of the inner ring has a task in this lap (same on all of them)."""
        cache = self.__dict__.setdefault("_idle", {})
        key = (s_local, bool(causal))
        if key not in cache:
            cache[key] = all(not self.tasks(j, js, self.inner, s_local, causal)
                             for j in range(self.inner) for js in range(self.inner))
        return cache[key]


class InnerRingBackend(AttentionBackend):
    """The outer ring's block kernel: one lap of the inner ring (see the module doc).

    One instance serves one attention call: the outer engine calls ``fwd``/``fwd_accum`` once
    per outer step in step order, then ``bwd_accum`` once per outer step in step order; the
    instance counts the steps (and checks in the forward that step 0 got the caller's own
    K/V)."""

    name = "double_ring"
    supports_global_backward = True

    def __init__(self, base: AttentionBackend, inner_transport, laps: List[_InnerLayout],
                 causal: bool, grad_comm_dtype, k_ptr: int, s_local: int):
        self.base, self.inner = base, inner_transport
        self.laps, self.causal, self.grad_comm_dtype = laps, bool(causal), grad_comm_dtype
        self.outer_steps = len(laps)
        self.empty = [lap.nothing_to_do(s_local, causal) for lap in laps]
        self.k_ptr = k_ptr
        self._fwd_step = 0
        self._bwd_step = 0
        self.supports_delta = base.supports_delta

    def accum_dtype(self, dtype):
        return self.base.accum_dtype(dtype)

    def unsupported_reason(self, device, dtype, headdim):
        return self.base.unsupported_reason(device, dtype, headdim)

    def require_lse_grad(self) -> None:
        self.base.require_lse_grad()

    def _next(self, which: str, k: torch.Tensor) -> int:
        step = getattr(self, which)
        # (forward only: saved-tensor hooks may move k before the backward)
        if which == "_fwd_step" and (step == 0) != (k.data_ptr() == self.k_ptr):
            raise RuntimeError("double ring: the outer ring engine no longer calls its block "
                               "kernel once per step in step order (step 0 on the caller's own "
                               "K/V); ringseq.double_ring must be updated with the engine")
        setattr(self, which, (step + 1) % self.outer_steps)
        return step

    def _plan(self, q, k, v, scale, step):
        return make_plan(q, k, v, transport=self.inner, softmax_scale=scale, causal=self.causal,
                         layout=self.laps[step], backend=self.base,
                         grad_comm_dtype=self.grad_comm_dtype)

    def fwd(self, q, k, v, softmax_scale, causal):
        step = self._next("_fwd_step", k)
        if self.empty[step]:
            b, s, h, d = q.shape
            acc = self.accum_dtype(q.dtype)
            return (torch.zeros((b, s, h, d), dtype=acc, device=q.device),
                    torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device))
        return _ring_forward(q, k, v, self._plan(q, k, v, softmax_scale, step))

    def fwd_accum(self, q, k, v, softmax_scale, causal, out_acc, lse_acc) -> None:
        step = self._next("_fwd_step", k)
        if self.empty[step]:
            return
        o_b, l_b = _ring_forward(q, k, v, self._plan(q, k, v, softmax_scale, step))
        merge_into(out_acc, lse_acc, o_b, l_b)

    def bwd(self, *args, **kwargs):  # pragma: no cover - the engine only accumulates
        raise NotImplementedError("the double ring's block kernel only accumulates (bwd_accum)")

    def bwd_accum(self, dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum,
                  dk_accum, dv_accum) -> None:
        step = self._next("_bwd_step", k)
        if self.empty[step]:
            return
        # The inner engine derives delta from (dout, out, grad_lse); hand it the lse gradient
        # folded into the outer delta (exactly 0 when there is none).
        grad_lse = compute_delta(dout, out) - delta
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, self._plan(q, k, v, softmax_scale,
                                                                        step), grad_lse)
        dq_accum.add_(dq)
        dk_accum.add_(dk)
        dv_accum.add_(dv)


_CACHE: dict = {}


def _layouts(base: Layout, ring_size: int, inner: int, node: int):
    """The outer layout and the inner laps of ``node`` (cached: layouts cache schedules)."""
    key = (id(base), base.name, ring_size, inner, node)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not base:
        hit = (base, _OuterLayout(base, ring_size, inner),
               [_InnerLayout(base, ring_size, inner, node, p) for p in range(ring_size // inner)])
        _CACHE[key] = hit
    return hit[1], hit[2]


def double_ring_attention(q, k, v, *, inner_group, outer_group, layout="contiguous",
                          softmax_scale=None, causal: bool = False, backend=None,
                          grad_comm_dtype=None):
    """Double-ring attention on this rank's shards; returns ``(out, lse)``.

    Args:
        q: (b, s_local, h, d); k, v: (b, s_local, h_kv, d): ring rank ``g = o * I + j``'s shard
            under ``layout`` over the whole ring of ``R = O * I`` ranks, where ``o`` is this
            rank's rank in ``outer_group`` (size ``O``) and ``j`` its rank in ``inner_group``
            (size ``I``). Shapes/dtypes as in :func:`ringseq.ring_flash_attn_func`.
        inner_group, outer_group: the process groups (see
            :func:`ringseq.hybrid.make_sp_groups`, which builds them).
        layout, softmax_scale, causal, backend, grad_comm_dtype: as in
            :func:`ringseq.ring_flash_attn_func`, for the ring of ``R``.

    Returns out (b, s_local, h, d) in q's dtype and lse (b, h, s_local) float32 (float64 for
    float64), differentiable. Bytes go to :mod:`ringseq.commstats` as ``"ring_inner"`` and
    ``"ring_outer"``. Raises what :func:`ringseq.plan.make_plan` raises (before any
    communication for what one rank can see).
    """
    base = get_layout(layout)
    inner = CountingTransport(get_comm(inner_group), "ring_inner")
    outer = CountingTransport(get_comm(outer_group), "ring_outer")
    I, O = inner.world_size, outer.world_size
    R = I * O
    base.check_local_seqlen(q.shape[1], R)
    be = get_backend(backend, q.device, q.dtype, q.shape[-1])
    outer_layout, laps = _layouts(base, R, I, outer.rank)
    kernel = InnerRingBackend(be, inner, laps, causal, grad_comm_dtype, k.data_ptr(),
                              q.shape[1])
    from .nn import ring_flash_attn_func  # the public ring op (nn imports this module's users)
    return ring_flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                group=outer, layout=outer_layout, return_lse=True,
                                backend=kernel, grad_comm_dtype=grad_comm_dtype)
