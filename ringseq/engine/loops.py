"""The engine: one forward loop and one backward loop that execute any layout's block schedule.

Both take this rank's tensors, a :class:`ringseq.engine.plan.RingPlan` (the spec, the
layout's schedule, what travels) and the group's :class:`ringseq.engine.ring.Ring` (transport
and integrity state); they never re-check or re-default anything. Autograd and
torch.compile see them through one custom operator (:mod:`ringseq.engine.op`).

Forward (rank ``r`` of ``W``; at step ``i`` it holds the K/V of rank ``(r - i) % W``):

    for i in 0..W-1:
        post the exchange that brings step i+1's K/V      (if i + 1 < W)
        for each block task of step i: merge kernel(q[rows], k[kv rows], v[kv rows]) into the
                                       float32 (out, lse) of those rows
        wait for the exchange                              (its data is used at step i+1)

Backward, with the global ``out``/``lse`` saved by the forward and ``D = rowsum(dO * out)``
computed once: dQ accumulates locally; each K/V block carries a dK/dV accumulator around the
ring. To keep the exchange of step i+1's K/V overlapped with step i's compute and still post
one exchange per step, an accumulator travels one exchange behind its block
(:func:`backward_payloads`): the exchange posted before step i carries step i+1's K/V and the
accumulator completed at step i-1; the accumulator of the block computed at step i arrives
during step i and is added once both are there. One last exchange after step W-1 brings every
accumulator home: each makes exactly one full lap (W hops); K/V make W-1 hops.

Under a window or document mask a block may carry only some of its rows (``plan.kv_rows``,
compacted to ``plan.kv_len``; the tasks of steps >= 1 index the compacted rows). Then the own
step-0 gradients stay home in a full-size accumulator, and the block's travelling accumulator
is started by the first rank that reads it, so exchange 1 carries K/V only; at home the
returned rows are added at their local places.

Accumulation is float32 (float64 for float64 inputs). ``grad_comm_dtype`` may send the dK/dV
accumulators in another dtype (e.g. the input's bf16/fp16, cutting backward traffic from 3x to
2x of the forward's) at the cost of one rounding per hop: for bf16 at W=4 about twice the
dK/dV error of float32 transit (tests/test_ring.py::test_grad_comm_dtype_accuracy_cost).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._dist import named_for
from ..kernels.grad import lse_grad_for
from .counting import record
from .integrity import BWD, FORWARD_FIELD, FWD, HEADER_WORDS, RingCall
from .plan import RingPlan
from .ring import Ring
from .transport import InterruptedWait, deferred_interrupts

__all__ = ["PackedBuffers", "backward_payloads", "ring_backward", "ring_forward"]

_ALIGN = 64  # bytes; keeps every segment aligned for any dtype and for vector loads


class PackedBuffers:
    """A ring's cached double buffer cut into typed segments laid out back to back.

    ``segments`` is a list of ``(name, shape, dtype)``; slot ``j`` (0 or 1) of the double
    buffer holds one view per segment (``bufs[j][name]``). A ``"hdr"`` segment of
    ``HEADER_WORDS`` int64 (the exchange header of :mod:`ringseq.engine.integrity`) goes with every
    exchange, so it must sit next to every payload segment; adjacent segments form one
    contiguous byte range, so a step that moves several of them is still one exchange.
    """

    def __init__(self, ring: Ring, key: str, device,
                 segments: Sequence[Tuple[str, tuple, torch.dtype]], call: RingCall,
                 comm_kind: str = "ring"):
        self.transport, self.call, self.comm_kind = ring.transport, call, comm_kind
        self._span: Dict[str, Tuple[int, int]] = {}
        offset = 0
        for name, shape, dtype in segments:
            n = math.prod(shape) * dtype.itemsize
            self._span[name] = (offset, offset + n)
            offset += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        self.raw = ring.buffers(key, offset, device)
        self.slots: List[Dict[str, torch.Tensor]] = [
            {name: raw[lo:hi].view(dtype).view(shape)
             for (name, shape, dtype), (lo, hi) in zip(segments, self._span.values())}
            for raw in self.raw]

    def __getitem__(self, slot: int) -> Dict[str, torch.Tensor]:
        return self.slots[slot]

    def exchange(self, src: int, names: Sequence[str], reverse: bool = False):
        """Sends segments ``names`` (with the header) of slot ``src`` to the next rank (the
        previous one if ``reverse``), receiving into the other slot; returns the pending
        exchange, whose ``wait()`` also checks the received header (None when nothing moves)."""
        if not names:
            return None
        names = ("hdr", *names)
        lo = min(self._span[n][0] for n in names)
        hi = max(self._span[n][1] for n in names)
        step = self.call.stamp(self.slots[src]["hdr"])
        kw = {"reverse": True} if reverse else {}
        if self.transport.world_size > 1:
            record(self.comm_kind, hi - lo)
        pending = self.transport.exchange(self.raw[src][lo:hi], self.raw[1 - src][lo:hi], **kw)
        return _Checked(pending, self.call, self.slots[1 - src]["hdr"], step)


class _Checked:
    """A pending exchange whose received header is checked once it has arrived."""

    __slots__ = ("pending", "call", "header", "step")

    def __init__(self, pending, call, header, step):
        self.pending, self.call, self.header, self.step = pending, call, header, step

    def wait(self) -> None:
        if self.pending is not None:
            try:
                with deferred_interrupts():
                    self.pending.wait()
            except InterruptedWait as exc:  # a Ctrl-C, and the wait failed: out, ring broken
                self.call.ring.mark_broken(exc)
                raise
            except KeyboardInterrupt as exc:
                # A Ctrl-C during the wait, taken once the transfers completed: recorded as
                # this rank's failure, as a guarded compute's, so the peers meet this rank at
                # its next exchanges and the call's end (where they raise RingBrokenError at
                # once, not at the ring timeout); end() re-raises it.
                self.call.fail(exc)
        self.call.check(self.header, self.step)


_HDR = ("hdr", (HEADER_WORDS,), torch.int64)


def backward_payloads(world_size: int, hops: int = None) -> List[Tuple[Tuple[str, ...], bool]]:
    """What each exchange of the backward carries, and whether it runs backwards.

    K/V travel ``hops`` steps (W - 1 for a full lap); compute steps are 0..hops. Entry ``i``
    for i <= hops is posted before compute step i: ``"acc"`` (the dK/dV accumulator completed
    at step i-1 moves on with its block) when i >= 1, ``"kv"`` (the K/V of step i+1) when
    i < hops. After the last step every accumulator is complete, ``hops`` ranks ahead of its
    home: the remaining entries bring it there the short way round -- W - hops more hops
    forward (one, for a full lap) or ``hops`` hops backwards, whichever is fewer. With
    ``hops == 0`` nothing moves at all."""
    h = world_size - 1 if hops is None else hops
    if world_size == 1 or h == 0:
        return []
    steps = [((("acc",) if i >= 1 else ()) + (("kv",) if i < h else ()), False)
             for i in range(h + 1)]
    forward_home = world_size - h
    home = [(("acc",), False)] * forward_home if forward_home <= h else [(("acc",), True)] * h
    return steps + home


def ring_forward(q, k, v, plan: RingPlan, ring: Ring):
    """(out in the accumulation dtype, lse) for this rank's q rows.

    Every exchange of the call happens even after this rank failed (see
    :mod:`ringseq.engine.integrity`); the failure is raised at the end, on every rank."""
    b, s, h, d = q.shape
    be, scale = plan.backend, plan.softmax_scale
    acc = be.accum_dtype(q.dtype)
    hops = plan.hops
    with ring.open_call(FWD, plan.signature, q.device, name=plan.spec.fn) as call:
        bufs = out = lse = None
        first = plan.schedule[0][0] if plan.schedule[0] else None
        # (only in the accumulation dtype: a bf16/fp16 first block would be rounded to the
        # input dtype before the merges and the output rounded twice, up to 2.8x plain fp16
        # attention's error on packed documents)
        take_first = first is not None and first.q == slice(0, s) and q.dtype == acc
        with call.guard():
            if hops > 0:
                kv_shape = (2, k.shape[0], plan.kv_len, k.shape[2], d)  # rows that travel
                bufs = PackedBuffers(ring, "fwd", q.device,
                                     [_HDR, ("kv", kv_shape, k.dtype)], call, plan.comm_kind)
                plan.pack_rows(k, bufs[0]["kv"][0])
                plan.pack_rows(v, bufs[0]["kv"][1])
            if not take_first:
                out = torch.zeros((b, s, h, d), dtype=acc, device=q.device)
                lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
        call.begin()

        for i in range(hops + 1):
            pending = bufs.exchange(i % 2, ("kv",)) if i < hops else None
            if call.ok:
                with call.guard():
                    # Step 0 computes on the caller's k/v: for W == 1 no buffer is touched.
                    kk, vv = (k, v) if i == 0 else bufs[i % 2]["kv"]
                    for j, t in enumerate(plan.schedule[i]):
                        kw = plan.kernel_kwargs(t)
                        kernel = t.kernel or be
                        if take_first and i == 0 and j == 0:
                            # Fresh kernel outputs become the accumulators: no fill, no merge,
                            # and no copy at all when the input dtype is the accumulation one.
                            o_b, l_b = kernel.run_fwd(q[:, t.q], kk[:, t.kv], vv[:, t.kv],
                                                      scale, t.causal, **kw)
                            out, lse = o_b.to(acc), l_b.to(acc)
                        else:
                            # The backend merges in place (our CPU kernel resumes its online
                            # softmax from the running pair: no block-sized temporary).
                            kernel.run_fwd_accum(q[:, t.q], kk[:, t.kv], vv[:, t.kv], scale,
                                                 t.causal, out[:, t.q], lse[:, :, t.q], **kw)
            else:  # failed earlier: block kernels that are calls of their own still meet
                for t in plan.schedule[i]:
                    (t.kernel or be).join_failed(FWD)
            if pending is not None:
                pending.wait()
        call.end()
    return out, lse


def backward_signature(signature: Sequence[tuple], forward: Optional[int]) -> tuple:
    """A backward call's signature: its forward's, and (where given) the ring's control count
    at that forward (``Ring.control_count``, the same on every rank of a healthy ring), so that
    ranks running the backwards of alike calls in another order raise instead of pairing
    them."""
    return tuple(signature) + (((FORWARD_FIELD, forward),) if forward is not None else ())


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan, ring: Ring, grad_lse=None,
                  forward: Optional[int] = None):
    """(dq, dk, dv) in the input dtype (failures as in :func:`ring_forward`). ``forward``: the
    ring's control count at its forward (:func:`backward_signature`)."""
    b, s, h, d = q.shape
    be, scale, gdt = plan.backend, plan.softmax_scale, plan.grad_comm_dtype
    acc = be.accum_dtype(q.dtype)
    W, hops = plan.world_size, plan.hops
    kv_shape = (2, k.shape[0], plan.kv_len, k.shape[2], d)  # a travelling block's rows
    payloads = backward_payloads(W, hops)
    # At step 0 nothing arrives in the accumulator of the other slot, so the own block's
    # gradients can go straight there when no dtype conversion is needed; later the incoming
    # accumulator lands there while we compute, so ours go to `scratch` and are added after.
    # With compacted blocks (plan.kv_rows) the own step-0 gradients cover every local row and
    # stay home in `own`.
    compact = plan.kv_rows is not None  # (only with hops > 0)
    direct = gdt == acc and not compact
    if compact and len(payloads) > 1:
        # The own block's accumulator would leave empty: the first rank to compute with the
        # block starts it instead, so exchange 1 carries no accumulator.
        names, rev = payloads[1]
        payloads[1] = (tuple(n for n in names if n != "acc"), rev)
    grad_lse = lse_grad_for(be, grad_lse)
    if grad_lse is not None and not be.supports_delta:
        # Refused before the call opens, meeting the peers' begin (they raise RingPeerError;
        # with the checks off nothing meets them, as for any refusal): the ring stays usable,
        # as for a refused forward.
        try:
            be.require_lse_grad()
        except RuntimeError as exc:
            ring.refuse(BWD, named_for(plan.spec.fn, exc))
    with ring.open_call(BWD, backward_signature(plan.signature, forward), q.device, bind=False,
                        name=plan.spec.fn) as call:
        bufs = delta = dq = scratch = own = None
        with call.guard():
            delta = be.delta(dout, out, grad_lse)  # (b, h, s), once for every block
            dq = torch.zeros((b, s, h, d), dtype=acc, device=q.device)
            # [dK/dV accumulator | header | K/V]: any payload plus the header is one range.
            bufs = PackedBuffers(ring, "bwd", q.device,
                                 [("acc", kv_shape, gdt), _HDR]
                                 + ([("kv", kv_shape, k.dtype)] if hops > 0 else []), call,
                                 plan.comm_kind)
            if hops > 0:
                plan.pack_rows(k, bufs[0]["kv"][0])
                plan.pack_rows(v, bufs[0]["kv"][1])
            if hops > 0 or not direct:
                scratch = torch.empty(kv_shape, dtype=acc, device=q.device)  # (2, b, kv_len, h_kv, d)
            if compact:
                own = torch.empty((2, b, s, k.shape[2], d), dtype=acc, device=q.device)
        call.begin()

        for i in range(hops + 1):
            cur, nxt = i % 2, (i + 1) % 2
            pending = bufs.exchange(cur, *payloads[i]) if i < len(payloads) else None
            tasks = plan.schedule[i]
            if i == 0 and compact:
                target = own
            else:
                target = bufs[nxt]["acc"] if (i == 0 and direct) else scratch
            if call.ok:
                with call.guard():
                    kk, vv = (k, v) if i == 0 else bufs[cur]["kv"]
                    if i == 0 or tasks:
                        target.zero_()
                    for t in tasks:
                        (t.kernel or be).run_bwd_accum(
                            dout[:, t.q], q[:, t.q], kk[:, t.kv], vv[:, t.kv], out[:, t.q],
                            lse[:, :, t.q], scale, t.causal, delta[:, :, t.q], dq[:, t.q],
                            target[0][:, t.kv], target[1][:, t.kv], **plan.kernel_kwargs(t))
            else:  # (as in ring_forward)
                for t in tasks:
                    (t.kernel or be).join_failed(BWD)
            if pending is not None:
                pending.wait()
            if call.ok and target is scratch and hops > 0:
                with call.guard():
                    if i == 0:
                        bufs[nxt]["acc"].copy_(scratch)
                    elif i == 1 and compact:  # nothing arrived: this step starts the block's
                        if tasks:
                            bufs[nxt]["acc"].copy_(scratch)
                        else:
                            bufs[nxt]["acc"].zero_()
                    elif tasks:
                        bufs[nxt]["acc"].add_(scratch)

        # The accumulators completed at the last step sit in slot (hops + 1) % 2; the home
        # exchanges move each one back to the rank its K/V came from, one slot flip per hop.
        slot = (hops + 1) % 2
        for names, reverse in payloads[hops + 1:]:
            bufs.exchange(slot, names, reverse).wait()
            slot = 1 - slot
        call.end()
        # (at 0 hops nothing travels: the gradients stay in the accumulation dtype, not
        # rounded to grad_comm_dtype, which is for travelling accumulators)
        home = scratch if hops == 0 and not direct else bufs[slot]["acc"]
        if compact:  # after call.end(): the call succeeded on every rank
            plan.add_home_rows(own[0], home[0])
            plan.add_home_rows(own[1], home[1])
            home = own
        # Copies: the accumulators live in the transport's cached buffers.
        dk = home[0].to(k.dtype, copy=True)
        dv = home[1].to(v.dtype, copy=True)
    return dq.to(q.dtype), dk, dv
