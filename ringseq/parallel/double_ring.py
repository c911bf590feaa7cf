"""Double ring: the ring of ``R`` ranks split into ``O`` outer rings of inner rings of ``I``.

Ring rank ``g = o * I + j`` (``o`` in ``[0, O)``: which inner ring, e.g. the node; ``j`` in
``[0, I)``: position in it) holds the base layout's shard ``g`` of ``R``, exactly as in the
plain ring, so data, positions and ``shard``/``unshard`` do not change. Attention is the one
ring engine used twice, with no loop of its own:

* the OUTER ring (ranks with the same ``j``, one per inner ring) runs the engine with ``O``
  steps: at outer step ``p`` rank ``(o, j)`` holds the K/V of rank ``(o - p, j)`` and posts the
  outer exchange for step ``p + 1`` before computing, so the inter-node transfer has a whole
  inner lap to hide behind;
* the block kernel of outer step ``p`` (:class:`InnerLap`, carried by the step's task in the
  outer plan: data, not a counter) is a lap of the INNER ring: the ranks of inner ring ``o``
  rotate the K/V they hold at outer step ``p`` with the same engine, so rank ``(o, j)`` meets
  the K/V of every rank ``(o - p, j')``. The block tasks of that lap are the base layout's for
  (global rank ``o * I + j``, global source ``(o - p) * I + j'``), under the call's mask
  (causal, windows, documents), so every layout and mask is exact. A lap in which no rank of
  the inner ring has anything to compute (contiguous causal: later inner rings) is left out of
  the outer schedule, and the outer ring's K/V go only as far as the last lap some inner
ring runs (no hop at all when every lap but the own one is idle: documents within inner
rings, a window of width 0).

Backward: the outer engine's backward calls the inner lap's backward with the GLOBAL out/lse
(and delta, lse gradients included); the inner lap brings its dK/dV home to the rank holding
the outer block, the outer ring carries them on and home. Bytes per rank and call: forward
``O (I - 1) + (O - 1) = R - 1`` K/V blocks like the plain ring (``(I - 1) O`` of them inside the
inner rings); backward ``2R + O - 1`` blocks (the plain ring's ``2R - 1`` plus one dK/dV hop per
inner lap). Inner-lap gradients return in the input dtype before they are added into the
outer float32 accumulators: one extra rounding per outer step for bf16/fp16 inputs.

Every call is bracketed by the integrity protocol on the whole ring (so that a refusal or a
failure on any rank reaches all ``R``), besides the outer and inner rings' own.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from ..engine.integrity import BWD, FWD, operation_field
from ..engine.loops import backward_signature, ring_backward, ring_forward
from ..engine.placement import (Placement, group_from_key, group_key, layout_from_key,
                                layout_key, register_placement, ring_dout)
from ..engine.plan import PlannedTask, RingPlan, make_plan
from ..engine.ring import Ring, get_ring, meet_as_failed, refuse_on_error
from ..kernels import AttentionBackend, compute_delta
from ..kernels.grad import lse_grad_for
from ..kernels.merge import merge_into
from ..layouts import AttnMask, Layout, layout_field, masked_tasks
from ..layouts.base import layout_cached, values_key
from ..spec import AttnSpec, check_user_layout

__all__ = ["DoubleRingPlacement", "InnerLap"]


class _InnerLayout(Layout):
    """Inner lap of inner ring ``node`` at outer step ``step``: the base layout's tasks for
    the global ranks involved (a schedule only: it places no tokens)."""

    def __init__(self, base: Layout, ring_size: int, inner: int, node: int, step: int):
        self.base, self.ring_size, self.inner = base, ring_size, inner
        self.node, self.src_node = node, (node - step) % (ring_size // inner)
        self.name = (f"{base.name}@double_ring[R={ring_size},I={inner},node={node},"
                     f"step={step}]")

    def multiple(self, world_size):
        return self.base.multiple(self.ring_size) // self.ring_size * world_size

    def _positions(self, seqlen, world_size, rank):
        raise ValueError("inner-lap layouts only schedule blocks")

    def schedule(self, rank, world_size, s_local, causal):
        mask = causal if isinstance(causal, AttnMask) else AttnMask(causal=bool(causal))

        def compute():
            R, total = self.ring_size, s_local * self.ring_size
            g = self.node * self.inner + rank
            steps = []
            for i in range(self.inner):
                src = self.src_node * self.inner + (rank - i) % self.inner
                if mask.plain:
                    steps.append(tuple(self.base.tasks(g, src, R, s_local, mask.causal)))
                else:
                    steps.append(tuple(masked_tasks(self.base.runs(total, R, g),
                                                    self.base.runs(total, R, src), mask,
                                                    s_local)))
            return tuple(steps)
        return layout_cached(self, ("lap", rank, s_local, mask), compute)

    def nothing_to_do(self, s_local: int, mask: AttnMask) -> bool:
        """True when no rank of the inner ring has a task in this lap (same on all of them)."""
        return all(not any(self.schedule(j, self.inner, s_local, mask)) for j in range(self.inner))


class InnerLap(AttentionBackend):
    """The block kernel of one outer step: a lap of the inner ring (see the module doc).

    ``inner`` is None in the cached outer plan, which holds no ring (before, a cache entry
    outlived its process groups and kept their rings and exchange buffers alive, though
    get_ring holds groups weakly); each call binds the laps to its inner ring (:meth:`on`)."""

    name = "double_ring_lap"
    supports_spans = supports_softcap = True  # (the lap applies the spec's own)
    supports_delta = True  # the lap folds a caller's delta into its lse gradient

    def __init__(self, spec: AttnSpec, inner: Optional[Ring], lap: _InnerLayout):
        self.spec, self.inner, self.lap = spec, inner, lap

    def on(self, inner: Ring) -> "InnerLap":
        """This lap on the inner ring ``inner``."""
        return InnerLap(self.spec, inner, self.lap)

    def _ring(self) -> Ring:
        # (unbound, refuse_on_error / meet_as_failed would take None for the default group)
        if self.inner is None:
            raise RuntimeError("ringseq: an inner lap of the double ring ran unbound to its "
                               "inner ring (InnerLap.on)")
        return self.inner

    def accum_dtype(self, dtype):
        return self.spec.backend.accum_dtype(dtype)

    def _plan(self, q, k, kind: int) -> RingPlan:
        # (before the inner call opens, inside the outer call: a failure fails the inner call
        # on every rank of the inner ring)
        inner = self._ring()
        with refuse_on_error(inner, kind, failed=True):
            return make_plan(self.spec, self.lap, inner.world_size, inner.rank,
                             q.shape, k.shape[2], q.dtype, "ring_inner")

    def join_failed(self, kind: int) -> None:
        # This rank's outer call failed earlier: its inner peers still open this lap's call.
        meet_as_failed(self._ring(), kind)

    def _fwd(self, q, k, v, scale, causal, **_):
        return ring_forward(q, k, v, self._plan(q, k, FWD), self._ring())

    def _fwd_accum(self, q, k, v, scale, causal, out_acc, lse_acc, **_) -> None:
        o_b, l_b = ring_forward(q, k, v, self._plan(q, k, FWD), self._ring())
        merge_into(out_acc, lse_acc, o_b, l_b)

    def _bwd_accum(self, dout, q, k, v, out, lse, scale, causal, delta, dq_accum, dk_accum,
                   dv_accum, **_) -> None:
        # The inner engine derives delta from (dout, out, grad_lse); hand it the lse gradient
        # folded into the outer delta (exactly 0 when there is none; and none at all for a
        # kernel without lse gradients, which would refuse even zeros: the placement refused
        # a caller's lse gradient for it before the call)
        grad_lse = None
        if self.spec.backend.supports_delta:
            with refuse_on_error(self._ring(), BWD, failed=True):
                grad_lse = compute_delta(dout, out) - delta
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, self._plan(q, k, BWD), self._ring(),
                                   grad_lse)
        dq_accum.add_(dq)
        dk_accum.add_(dk)
        dv_accum.add_(dv)


def _outer_plan(spec: AttnSpec, layout: Layout, outer: Ring, inner: Ring,
                q_shape: Tuple[int, ...], nheads_kv: int, dtype: torch.dtype) -> RingPlan:
    """The outer ring's plan, its laps on ``inner``: the cached plan of the ring sizes and
    this rank's place (a user's layout keyed by its values too, as
    :func:`ringseq.engine.plan.make_plan`: before, one edited after a call ran its old laps),
    bound to the call's inner ring. The cache holds no Ring: keyed by the rings themselves,
    with every lap holding the inner one, it kept the rings and exchange buffers of destroyed
    groups alive (up to its 32 entries)."""
    plan = _cached_outer_plan(spec, layout, values_key(layout), outer.world_size,
                              inner.world_size, outer.rank, q_shape, nheads_kv, dtype)
    # (the binding is per call, O small objects: the planning itself stays cached)
    return dataclasses.replace(plan, schedule=tuple(
        tuple(PlannedTask(t.q, t.kv, t.causal, t.spans, t.kernel.on(inner)) for t in step)
        for step in plan.schedule))


@functools.lru_cache(maxsize=32)
def _cached_outer_plan(spec: AttnSpec, layout: Layout, layout_values, O: int, I: int,
                       node: int, q_shape: Tuple[int, ...], nheads_kv: int,
                       dtype: torch.dtype) -> RingPlan:
    # (``node``: this rank's rank in the outer ring, i.e. which inner ring it is in; the laps
    # are unbound: _outer_plan gives them each call's inner ring)
    R, s = I * O, q_shape[1]
    rows = slice(0, s)
    schedule = []
    for p in range(O):
        lap = _InnerLayout(layout, R, I, node, p)
        empty = lap.nothing_to_do(s, spec.mask)
        schedule.append(() if empty else
                        (PlannedTask(rows, rows, False, None, InnerLap(spec, None, lap)),))
    # K/V travel the outer ring only as far as some inner ring still has a lap to run (a
    # window or documents can leave the later laps idle everywhere; before, every call made
    # the full outer lap with whole blocks, even when no rank needed another's K/V)
    hops = max((p for p in range(O) if any(
        not _InnerLayout(layout, R, I, o, p).nothing_to_do(s, spec.mask) for o in range(O))),
        default=0)
    signature = (operation_field("double-ring attention"),) + spec.signature(
        q_shape, nheads_kv, dtype, extra=(layout_field("layout", layout),
                                          ("world size", R), ("inner ring", I)))
    return RingPlan(spec=spec, layout=layout, world_size=O, rank=node,
                    schedule=tuple(schedule), hops=hops, signature=signature, kv_len=s,
                    comm_kind="ring_outer")


class DoubleRingPlacement(Placement):
    """The outer ring over ``outer_group`` whose steps run laps of ``inner_group`` (see the
    module doc), bracketed on ``ring_group`` (the whole ring). ``layout`` is the base layout
    over the whole ring (bound to the call's documents inside)."""

    def __init__(self, layout: Layout, inner_group, outer_group, ring_group):
        self.layout, self.inner_group, self.outer_group = layout, inner_group, outer_group
        self.ring_group = ring_group

    def refusal_group(self):
        return self.ring_group

    def key(self) -> str:
        return (f"double|{layout_key(self.layout)}|{group_key(self.inner_group)}|"
                f"{group_key(self.outer_group)}|{group_key(self.ring_group)}")

    def check_before_call(self, spec: AttnSpec, s_local: int) -> None:
        # (the laps plan on an inner layout of ringseq's, which has nothing to check)
        check_user_layout(spec, self.layout.bind(spec.documents),
                          get_ring(self.ring_group).world_size, s_local)

    def _plan(self, q, k, spec):
        self.check_before_call(spec, q.shape[1])
        outer, inner = get_ring(self.outer_group), get_ring(self.inner_group)
        plan = _outer_plan(spec, self.layout.bind(spec.documents), outer, inner,
                           tuple(q.shape), k.shape[2], q.dtype)
        return plan, outer, get_ring(self.ring_group)

    def join_failed(self, kind: int) -> None:
        meet_as_failed(self.ring_group, kind)

    def forward(self, q, k, v, spec):
        # (a failure before the call opens is this rank's refusal: RingPlacement.forward)
        with refuse_on_error(self.ring_group, FWD):
            plan, outer, whole = self._plan(q, k, spec)
        # (the rings' control counts at this forward, which its backward names: RingPlacement)
        counts = torch.tensor([whole.control_count, outer.control_count], dtype=torch.int64)
        with whole.open_call(FWD, plan.signature, q.device, name=plan.spec.fn) as call:
            call.begin()
            out = lse = None
            with call.guard():
                out, lse = ring_forward(q, k, v, plan, outer)
            call.end()
        return out.to(q.dtype), lse, [counts]

    def backward(self, dout, dlse, q, k, v, out, lse, saved, spec):
        with refuse_on_error(self.ring_group, BWD):
            dlse = lse_grad_for(spec.backend, dlse)  # (compiled: zeros for an unused lse)
            if dlse is not None:  # (RuntimeError for a kernel without lse gradients)
                spec.backend.require_lse_grad(spec.fn)
            plan, outer, whole = self._plan(q, k, spec)
            dout = ring_dout(dout, dlse, out, spec)
        whole_count, outer_count = saved[0].tolist()
        with whole.open_call(BWD, backward_signature(plan.signature, whole_count), q.device,
                             bind=False, name=plan.spec.fn) as call:
            call.begin()
            grads = None
            with call.guard():
                grads = ring_backward(dout, q, k, v, out, lse, plan, outer, dlse,
                                      forward=outer_count)
            call.end()
        return grads

    def saved_like(self, q, k, v, spec):
        return [torch.empty(2, dtype=torch.int64)]


def _parse(rest: str) -> DoubleRingPlacement:
    lay, inner, outer, ring = rest.split("|")
    return DoubleRingPlacement(layout_from_key(lay), group_from_key(inner),
                               group_from_key(outer), group_from_key(ring))


register_placement("double", _parse)
