"""DeepSpeed-Ulysses-style sequence parallelism: an all-to-all from sequence shards to head shards.

A group of ``U`` ranks holds a sequence in ``U`` contiguous shards: rank ``u`` holds tokens
``[u * s / U, (u + 1) * s / U)`` of every head. One all-to-all turns that into head shards of
the whole sequence: rank ``u`` then holds query heads ``[u * h / U, (u + 1) * h / U)`` (and the
K/V heads they read) for all ``s`` tokens, computes ordinary attention on them with any block
backend (ours by default), and a second all-to-all turns the output back into sequence shards.
Causal masks follow global positions exactly because the gathered sequence is in global order.
The backward is the same in reverse (the gradient of an all-to-all is the reverse all-to-all):
one all-to-all for dout in, one for (dq, dk, dv) out. q, k and v travel in ONE all-to-all
(one packed buffer), the output in another.

Head rule (``h`` query heads, ``h_kv`` K/V heads, degree ``U``):

* ``h % U == 0`` is required (ValueError naming ``h``, ``U`` and the degrees dividing ``h``).
* K/V heads are replicated ``rep = U / gcd(U, h_kv)`` times before the all-to-all, so every rank
  receives ``h_kv * rep / U = h_kv / gcd(U, h_kv)`` K/V heads and its ``h / U`` query heads read
  them in the kernel's uniform GQA grouping (query head ``i`` of a rank reads its K/V head
  ``i // (h / h_kv / rep)``). When ``U`` divides ``h_kv`` nothing is replicated (``rep = 1``):
  GQA/MQA is never expanded. When ``U > h_kv`` (e.g. 8:2 heads on 4 ranks, 8:1 on 2),
  ``rep = U / gcd(U, h_kv)`` is the least replication with which every rank's query heads read
  their K/V heads in that grouping: each rank receives exactly the K/V heads its query heads
  need (one, when ``h_kv`` divides ``U``). The gradients of the copies are summed back before
  they return.

Communication per rank per call, with ``b`` batch, ``s`` global length, ``d`` head dim, ``e``
bytes per element: forward ``(U - 1) / U * b * (s / U) * ((2 h + 2 h_kv * rep) * d * e + 4 h)``
bytes (q, k, v in; out and the float32 lse back), backward the same plus ``4 h`` per token when
a gradient flows into lse (dout in; dq, dk, dv back). Each direction is one all-to-all of one
packed buffer, padded to 8-byte pieces, plus the call's 64-byte integrity header to each of the
``U - 1`` peers in each all-to-all (checked where the consistency checks are off: there it is
what finds a peer in another call, step or tag).

The whole exchange is one placement of the engine (:class:`UlyssesPlacement`): two all-to-alls
around any inner placement (the local kernel; the ring or the double ring in USP), run inside
one custom operator and bracketed by the integrity protocol on the whole sequence-parallel
group (begin/end agreement, a failing rank still completes both all-to-alls with zeros, so its
peers raise instead of waiting; ``reset_ring`` on the group, ``sp.reset()`` for the groups of
``make_sp_groups``, rebuilds what a timeout broke). Windows,
soft-capping and packed documents (global ``cu_seqlens``) work as in the ring: after the
all-to-all each rank holds the whole sequence in global order, where they are plain spans.
"""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Sequence, Tuple

import torch

from .._args import autocast_inputs, check_returns
from ..engine.counting import record
from ..engine.integrity import ANY, BWD, FWD, HEADER_BYTES, operation_field
from ..engine.loops import backward_signature
from ..engine.op import run_attention
from ..engine.placement import (LOCAL, Placement, group_from_key, group_key, placement_from_key,
                                register_placement)
from ..engine.ring import get_ring, refuse_on_error, ring_size
from ..kernels import accum_dtype
from ..kernels.grad import lse_grad_for
from ..ops import returns
from ..spec import attn_spec, check_global_documents, check_self_attention, local_spans

__all__ = ["UlyssesPlacement", "kv_replication", "ulysses_attn_func", "ulysses_heads",
           "valid_ulysses_degrees"]


# ---------------------------------------------------------------------------- head rule
def valid_ulysses_degrees(nheads: int, sp_size: Optional[int] = None) -> List[int]:
    """The Ulysses degrees that can split ``nheads`` query heads (divisors of ``nheads``),
    restricted to those that also divide ``sp_size`` when given."""
    return [u for u in range(1, nheads + 1)
            if nheads % u == 0 and (sp_size is None or sp_size % u == 0)]


def kv_replication(nheads_kv: int, degree: int) -> int:
    """How many copies of each K/V head the all-to-all sends: ``degree / gcd(degree,
    nheads_kv)`` (1 when ``degree`` divides ``nheads_kv``; see the module doc)."""
    # Euclid's loop rather than math.gcd, which dynamo cannot trace on the symbolic head
    # counts of torch.compile(dynamic=True)
    a, b = degree, nheads_kv
    while b:
        a, b = b, a % b
    return degree // a


def ulysses_heads(nheads: int, nheads_kv: int, degree: int, what: str = "nheads",
                  fn: str = "ulysses", what_kv: str = "nheads_kv",
                  ranks: Optional[int] = None) -> Tuple[int, int, int]:
    """``(query heads per rank, K/V replication, K/V heads per rank)`` for a Ulysses degree.

    Raises ValueError (naming ``fn``) when ``degree`` does not divide ``nheads`` (naming both
    and the degrees that divide ``nheads``, and ``ranks``, the sequence-parallel ranks the
    degree splits, where given) or ``nheads_kv`` does not divide ``nheads``."""
    if degree < 1:
        raise ValueError(f"{fn}: the Ulysses degree must be a positive integer, got {degree}")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"{fn}: {what}={nheads} must be a multiple of {what_kv}={nheads_kv}")
    if nheads % degree:
        raise ValueError(
            f"{fn}: {what}={nheads} query heads cannot be split over a Ulysses degree of "
            f"{degree}: each rank of the all-to-all takes {what} / degree heads, so the degree "
            f"must divide {nheads}; degrees that divide it"
            + (f" and the {ranks} sequence-parallel ranks" if ranks is not None else "")
            + f": {valid_ulysses_degrees(nheads, ranks)}")
    rep = kv_replication(nheads_kv, degree)
    return nheads // degree, rep, nheads_kv * rep // degree


# ---------------------------------------------------------------------------- all-to-all
_ALIGN = 8  # bytes: every packed piece starts where any dtype may be viewed


def _pieces(t: torch.Tensor, dim: int, degree: int):
    """The ``degree`` chunks of ``t`` along ``dim`` (views)."""
    return t.unflatten(dim, (degree, t.shape[dim] // degree)).movedim(dim, 0)


def all_to_all(transport, moves: Sequence[Tuple[torch.Tensor, int, int]],
               call=None, record_as: str = "all_to_all") -> List[torch.Tensor]:
    """One all-to-all over ``transport`` (degree ``U``) of several tensors of any dtypes in one
    packed byte buffer. ``moves`` holds ``(tensor, scatter_dim, gather_dim)``: chunk ``u`` of
    the tensor along ``scatter_dim`` goes to rank ``u``; what arrives is concatenated along
    ``gather_dim`` in rank order. Returns new tensors; the bytes that leave the rank are
    recorded as ``record_as`` (an all-gather made of one: ``"all_gather"``). With ``call`` (an
    open RingCall), a failure of this rank's packing or unpacking (an out-of-memory error) is
    recorded by the call's guard and the rank still takes part in the exchange (zeros, then
    zero outputs): the peers raise at the call's end instead of waiting in the all-to-all (a
    ring decode, without an end, reads the zeros as a failed part).
    Where the call stamps headers, each piece carries room for the call's header ahead of its
    data (HEADER_BYTES), stamped and checked with the consistency checks off: there they are
    all that finds a peer in another call, step or tag. (With the checks on, the call's begin
    compared all that, and reading the headers' verdict would wait for the device at every
    call's end.)"""
    degree = transport.world_size
    guard = call.guard if call is not None else contextlib.nullcontext
    headers = call is not None and call.stamps_headers
    verify = headers and not call.gathered
    start = HEADER_BYTES if headers else 0
    layout, offset = [], start
    for t, sd, gd in moves:
        chunk = list(t.shape)
        chunk[sd] //= degree
        nbytes = math.prod(chunk) * t.element_size()
        layout.append((t, sd, gd, chunk, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    device = moves[0][0].device
    send = packed = None
    with guard():
        send = torch.empty((degree, offset), dtype=torch.uint8, device=device)
        for t, sd, gd, chunk, off, nbytes in layout:
            if nbytes:  # (an empty byte slice cannot be viewed as a wider dtype)
                send[:, off:off + nbytes].view(t.dtype).view(degree, *chunk).copy_(
                    _pieces(t, sd, degree))
        packed = send
    if packed is None:  # this rank failed: its part of the exchange is zeros (not what an
        # unfinished packing left in the buffer: the ring decode's peers read a flag there)
        send = torch.zeros((degree, offset), dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    if offset > start:  # nothing to move (an empty batch): the same on every rank (signature)
        if verify:  # (a failed rank's zeros too: they still pair with the right call)
            words = send[:, :HEADER_BYTES].view(torch.int64)  # (degree, HEADER_WORDS)
            step = call.stamp(words[0])
            words[1:] = words[0]
        elif headers:  # (no uninitialized bytes on the wire)
            send[:, :HEADER_BYTES].zero_()
        record(record_as, send.numel() * (degree - 1) // degree)
        transport.all_to_all(send, recv)
        if verify:
            for u in range(degree):
                if u != transport.rank:
                    call.check(recv[u, :HEADER_BYTES].view(torch.int64), step,
                               f"its all-to-all peer ({transport.peer_name(u)})")
    shapes = []
    for t, sd, gd, chunk, off, nbytes in layout:
        shape = list(chunk)
        shape[gd] *= degree
        shapes.append(shape)
    outs = None
    with guard():
        outs = []
        for (t, sd, gd, chunk, off, nbytes), shape in zip(layout, shapes):
            if not nbytes:
                outs.append(t.new_empty(shape))
                continue
            piece = recv[:, off:off + nbytes].view(t.dtype).view(degree, *chunk).movedim(0, gd)
            outs.append(piece.reshape(shape))
    if outs is None or len(outs) < len(layout):  # this rank failed (the call raises at end)
        outs = [t.new_zeros(shape) for (t, *_), shape in zip(layout, shapes)]
    return outs


# ---------------------------------------------------------------------------- placement
class UlyssesPlacement(Placement):
    """Two all-to-alls over ``group`` (degree ``U``) around the ``inner`` placement, bracketed
    by the integrity protocol on ``control_group`` (the whole sequence-parallel group, so a
    refusal or failure on any rank of a 2-D group reaches every rank). Saves the control
    ring's count at the forward (which its backward names), the head-sharded q, k, v, out and
    lse (and the inner placement's own) for the backward."""

    backward_reads_inputs = False  # it reads the head shards it saved

    def __init__(self, group, inner: Placement = LOCAL, control_group=None):
        self.group, self.inner = group, inner
        self.control_group = group if control_group is None else control_group

    def refusal_group(self):
        return self.control_group

    def key(self) -> str:
        return f"ulysses|{group_key(self.group)}|{group_key(self.control_group)}|{self.inner.key()}"

    def _setup(self, q, k, spec):
        comm = get_ring(self.group).transport
        U = comm.world_size
        _, rep, _ = ulysses_heads(q.shape[2], k.shape[2], U, fn=spec.fn)
        sig = (operation_field("Ulysses attention"),) + spec.signature(
            q.shape, k.shape[2], q.dtype, extra=(("Ulysses degree", U),)
            + self.inner.signature_fields())
        return comm, U, rep, sig

    def forward(self, q, k, v, spec):
        # A failure before the call opens (an out-of-memory error in the copies, say) is this
        # rank's refusal of the call: the peers raise instead of waiting in their begin.
        with refuse_on_error(self.control_group, FWD):
            comm, U, rep, sig = self._setup(q, k, spec)
            b, s, h, d = q.shape
            self.inner.check_before_call(spec, s * U)
            if rep > 1:  # (b, s, h_kv * rep, d): each K/V head once per rank that reads it
                k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            ring = get_ring(self.control_group)
        count = ring.control_count  # (which its backward names: loops.backward_signature)
        with ring.open_call(FWD, sig, q.device, name=spec.fn) as call:
            call.begin()
            # (b, s, heads, d) sequence shards -> (b, U * s, heads / U, d) head shards
            q_h, k_h, v_h = all_to_all(comm, [(q, 2, 1), (k, 2, 1), (v, 2, 1)], call)
            out_h = lse_h = None
            inner_saved: List[torch.Tensor] = []
            if call.ok:
                with call.guard():
                    out_h, lse_h, inner_saved = self.inner.forward(q_h, k_h, v_h, spec)
            else:  # an inner ring's peers still open its call
                self.inner.join_failed(FWD)
            if out_h is None:  # this rank failed: complete the exchange with zeros
                out_h = torch.zeros_like(q_h)
                lse_h = torch.zeros((b, h // U, s * U), dtype=accum_dtype(q.dtype),
                                    device=q.device)
            # out (b, U * s, h / U, d) -> (b, s, h, d); lse (b, h / U, U * s) -> (b, h, s)
            out, lse = all_to_all(comm, [(out_h, 1, 2), (lse_h, 2, 1)], call)
            call.end()
        return out, lse, [torch.tensor(count, dtype=torch.int64),  # ()
                          q_h, k_h, v_h, out_h, lse_h, *inner_saved]

    def backward(self, dout, dlse, q, k, v, out, lse, saved, spec):
        with refuse_on_error(self.control_group, BWD):
            comm, U, rep, sig = self._setup(q, k, spec)
            dlse = lse_grad_for(spec.backend, dlse)  # (compiled: zeros for an unused lse)
            if dlse is not None:  # (RuntimeError for a kernel without lse gradients)
                spec.backend.require_lse_grad(spec.fn)
            count, q_h, k_h, v_h, out_h, lse_h, *inner_saved = saved
            h_kv = k.shape[2]
            if dout is None:
                dout = torch.zeros_like(out)
            ring = get_ring(self.control_group)
        # A gradient into lse moves with dout when any rank has one (zeros from the others:
        # exact, the lse term of the backward is then 0 for their rows); ranks may differ.
        # The backward names its forward: ranks running the backwards of two alike calls in
        # another order raise instead of pairing one's dout with the other's head shards.
        sig = backward_signature(sig + (("gradient into lse", dlse is not None, ANY),),
                                 int(count))
        with ring.open_call(BWD, sig, q.device, bind=False, name=spec.fn) as call:
            call.begin()
            with_dlse = call.any_rank("gradient into lse")
            if with_dlse and dlse is None:
                dlse = torch.zeros_like(lse)  # (b, h, s) float32
            moved = all_to_all(comm, [(dout, 2, 1)] + ([(dlse, 1, 2)] if with_dlse else []),
                               call)
            dout_h, dlse_h = moved[0], (moved[1] if with_dlse else None)
            if dlse_h is not None and not call.gathered and not spec.backend.supports_delta:
                # Checks off: the ranks exchanged the slot whether or not any had a gradient
                # (they cannot tell); a kernel without lse gradients gets none when all are 0.
                dlse_h = dlse_h if bool(dlse_h.any()) else None
            grads = None
            if call.ok:
                with call.guard():
                    grads = self.inner.backward(dout_h, dlse_h, q_h, k_h, v_h, out_h, lse_h,
                                                inner_saved, spec)
            else:
                self.inner.join_failed(BWD)
            if grads is None:  # this rank failed: complete the exchange with zeros
                grads = (torch.zeros_like(q_h), torch.zeros_like(k_h), torch.zeros_like(v_h))
            dq, dk, dv = all_to_all(comm, [(g, 1, 2) for g in grads], call)
            call.end()
        if rep > 1:  # the copies' gradients add up
            dk = dk.unflatten(2, (h_kv, rep)).sum(3)
            dv = dv.unflatten(2, (h_kv, rep)).sum(3)
        return dq, dk, dv

    def saved_like(self, q, k, v, spec):
        U = ring_size(self.group)
        b, s, h, d = q.shape
        rep = kv_replication(k.shape[2], U)
        q_h = q.new_empty((b, s * U, h // U, d))
        kv_h = k.new_empty((b, s * U, k.shape[2] * rep // U, d))
        lse_h = q.new_empty((b, h // U, s * U), dtype=accum_dtype(q.dtype))
        return [torch.empty((), dtype=torch.int64), q_h, kv_h, kv_h.clone(), q_h.clone(), lse_h,
                *self.inner.saved_like(q_h, kv_h, kv_h, spec)]


def _parse(rest: str) -> UlyssesPlacement:
    group, control, inner = rest.split("|", 2)
    return UlyssesPlacement(group_from_key(group), placement_from_key(inner),
                            group_from_key(control))


register_placement("ulysses", _parse)


# ---------------------------------------------------------------------------- the function
def ulysses_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale=None, causal: bool = False,
                      *, group=None, return_lse: bool = False, backend=None,
                      window_size=(-1, -1), softcap: float = 0.0, cu_seqlens=None):
    """Exact attention over a sequence split contiguously across ``group`` (Ulysses).

    Args:
        q: (batch, s_local, nheads, headdim); k, v: (batch, s_local, nheads_kv, headdim):
            rank ``u`` of the ``U`` ranks holds tokens ``[u * s_local, (u + 1) * s_local)``
            (``ringseq.shard(x, "contiguous", group)``). float32, float64, bfloat16 or
            float16; only the last dimension must be contiguous. Under ``torch.autocast`` they
            are first cast to the autocast dtype (float64 excepted).
        dropout_p: must be 0.0.
        softmax_scale: defaults to ``headdim ** -0.5``.
        causal: causal mask over global positions.
        group: the Ulysses process group (None: the default group; no process group: local).
        return_lse: also return lse.
        backend: the local attention kernel (None: ours where it supports the inputs; any
            name ``ringseq.flash_attn_func`` takes).
        window_size: flash-attn's ``(left, right)`` sliding window over global positions.
        softcap: logit soft-capping of the scaled scores (0.0: off).
        cu_seqlens: GLOBAL document boundaries ``(0, ..., total)`` of a packed sequence (the
            same on every rank): each token attends only to its own document.

    Returns:
        out (batch, s_local, nheads, headdim) in q's dtype; with ``return_lse`` also lse
        (batch, nheads, s_local) float32 (float64 for float64), natural log. Differentiable
        in q, k, v (and through lse).

    Raises:
        ValueError: ``nheads`` not divisible by the group size (the message lists the
            degrees that work), bad shapes/dtypes, q and k/v of different local lengths,
            ``cu_seqlens`` that are not the global boundaries -- before any communication;
            on the other ranks :class:`ringseq.RingPeerError` naming this one.
        NotImplementedError: ``dropout_p > 0`` (likewise before any communication).
        RingMismatchError (a ValueError): ranks called with different arguments (every rank).
    """
    fn = "ulysses_attn_func"
    with refuse_on_error(group, FWD):
        check_returns(fn, False, return_lse)
        q, k, v = autocast_inputs(q, k, v)
        spec = attn_spec(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                         causal=causal, window_size=window_size, softcap=softcap,
                         backend=backend, documents=cu_seqlens)
        check_self_attention(spec, q, k)
        degree = ring_size(group, fn)
        ulysses_heads(q.shape[2], k.shape[2], degree, fn=fn)
        check_global_documents(spec, degree, q.shape[1], layouts=False)
        spec = local_spans(spec, *(q.shape[1] * degree,) * 2)
    placement = LOCAL if degree == 1 else UlyssesPlacement(group, LOCAL)
    out, lse = run_attention(q, k, v, spec, placement)
    return returns(out, lse, False, return_lse)
