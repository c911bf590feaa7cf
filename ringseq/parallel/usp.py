"""Unified sequence parallelism (USP): attention over a Ulysses × ring group, any of its modes.

The placement is a composition of the engine's (:mod:`ringseq.engine.placement`): the ring
(``U = 1``), the double ring (``1 < I < R``), Ulysses around the local kernel (``R = 1``), or
Ulysses around the ring / double ring (hybrid). Every mode takes every mask: windows,
soft-capping and packed documents (global ``cu_seqlens``) follow global positions as in the
plain ring.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from .._args import autocast_inputs, check_returns, sdpa_inputs
from ..engine.integrity import FWD
from ..engine.op import run_attention
from ..engine.placement import LOCAL, Placement, RingPlacement
from ..engine.ring import refuse_on_error
from ..kernels.checks import FLASH_FORM, SDPA_FORM, InputForm
from ..layouts import Layout, get_layout
from ..ops import returns
from ..spec import (attn_spec, bound_layout, check_global_documents, check_layout, documents_name,
                    check_self_attention, local_spans, named_layout, named_layout_error)
from .double_ring import DoubleRingPlacement
from .groups import SequenceParallelGroups
from .sp_layout import sp_multiple
from .ulysses import UlyssesPlacement, ulysses_heads

__all__ = ["usp_attn_func", "usp_placement", "usp_sdpa"]


def usp_placement(sp: SequenceParallelGroups, layout: Layout) -> Placement:
    """The placement of attention on ``sp`` with ring layout ``layout`` (unbound)."""
    if sp.ring_size == 1:
        ring: Placement = LOCAL
    elif sp.double_ring:
        ring = DoubleRingPlacement(layout, sp.inner_group, sp.outer_group, sp.ring_group)
    else:
        ring = RingPlacement(layout, sp.ring_group)
    if sp.ulysses_size == 1:
        return ring
    return UlyssesPlacement(sp.ulysses_group, ring, control_group=sp.group)


def usp_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale=None, causal: bool = False, *,
                  sp: SequenceParallelGroups, layout="zigzag", return_lse: bool = False,
                  backend=None, grad_comm_dtype=None, window_size=(-1, -1), softcap: float = 0.0,
                  cu_seqlens=None):
    """Exact attention over a sequence split over a Ulysses × ring group (any mode of ``sp``).

    Args:
        q: (batch, s_local, nheads, headdim); k, v: (batch, s_local, nheads_kv, headdim):
            this rank's shard under ``sp.data_layout(layout)`` (e.g. ``sp.shard(x, layout)``
            or ``sp.shard_batch``). float32, float64, bfloat16 or float16; only the last
            dimension must be contiguous; under autocast cast to its dtype first.
        dropout_p: must be 0.0.
        softmax_scale: defaults to ``headdim ** -0.5``.
        causal: causal mask over global positions.
        sp: the groups (:func:`make_sp_groups`, or the plugin's ``plugin.sp``).
        layout: the layout of the ring dimension (``"zigzag"``, ``"contiguous"``,
            ``"stripe"``, ``"documents"`` or a Layout); it must be the one the data was sharded
            with. Ignored without a ring (R = 1: the Ulysses split is contiguous).
        return_lse: also return lse.
        backend: block kernel (ring steps, or the local attention when R = 1).
        grad_comm_dtype: dtype of the travelling dK/dV accumulators of the ring (see
            :func:`ringseq.ring_flash_attn_func`).
        window_size, softcap: as in :func:`ringseq.ring_flash_attn_func` (global positions).
        cu_seqlens: GLOBAL document boundaries of a packed sequence (the same on every rank).

    Returns out (batch, s_local, nheads, headdim) in q's dtype; with ``return_lse`` also lse
    (batch, nheads, s_local) float32 (float64 for float64). Differentiable (q, k, v, lse).

    Raises:
        ValueError (before any communication): ``nheads`` not divisible by U (naming the
            degrees that work), a local length the ring layout cannot use, bad shapes or
            dtypes, ``cu_seqlens`` that are not the global boundaries; the other ranks raise
            :class:`ringseq.RingPeerError` naming this one.
        NotImplementedError: ``dropout_p > 0`` (likewise before any communication).
        RingMismatchError (a ValueError): ranks called with different arguments (every rank).
        TypeError: ``sp`` is not a SequenceParallelGroups, at once (the other ranks, waiting
            on their groups' ring, raise ``ringseq.RingTimeoutError`` after the ring timeout).
    """
    return _usp("usp_attn_func", q, k, v, dropout_p, softmax_scale, causal, sp, layout,
                return_lse, backend, grad_comm_dtype, window_size, softcap, cu_seqlens)


def _refusal_group(fn: str, sp):
    """Where a refusal of ``sp`` goes: its sequence-parallel group, or a process group passed
    instead: its ring. Anything else (None, a typo) raises ``fn``'s TypeError at once: the
    peers wait on sp.group's ring, a group of its own and never the default one, so no ring
    reaches them (they time out there; before, this rank waited for that timeout too, then
    raised it, its own error hidden as a cause)."""
    if isinstance(sp, SequenceParallelGroups):
        return sp.group
    if not isinstance(sp, dist.ProcessGroup):
        _check_sp(fn, sp)
    return sp


def _check_sp(fn: str, sp) -> None:
    if not isinstance(sp, SequenceParallelGroups):  # (its group is where a refusal goes)
        raise TypeError(f"{fn}: sp must be the SequenceParallelGroups of ringseq.make_sp_groups "
                        f"(or the plugin's plugin.sp), got {type(sp).__name__}")


@torch.compiler.assume_constant_result
def _sizes(sp) -> Tuple[int, int]:
    """(U, R) of ``sp``, read once at trace time: under torch.compile(dynamic=True) its int
    attributes would be traced as symbolic sizes, which the layout checks cannot take."""
    return sp.ulysses_size, sp.ring_size


def _usp(fn, q, k, v, dropout_p, softmax_scale, causal, sp, layout, return_lse, backend,
         grad_comm_dtype, window_size=(-1, -1), softcap=0.0, cu_seqlens=None,
         form: InputForm = FLASH_FORM, takes_documents: bool = True):
    with refuse_on_error(_refusal_group(fn, sp), FWD):
        _check_sp(fn, sp)
        check_returns(fn, False, return_lse)
        q, k, v = autocast_inputs(q, k, v)
        U, R = _sizes(sp)
        # (without a ring, R = 1, only its documents count)
        given = named_layout(fn, layout, takes_documents=takes_documents)
        spec = attn_spec(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                         causal=causal, window_size=window_size, softcap=softcap,
                         backend=backend, grad_comm_dtype=grad_comm_dtype,
                         documents=given.documents if cu_seqlens is None else cu_seqlens,
                         form=form)
        check_self_attention(spec, q, k, form)
        # (the degrees listed: those that also divide sp's ranks, which make_sp_groups takes)
        ulysses_heads(q.shape[2], k.shape[2], U, fn=fn, ranks=U * R)
        part = q.shape[1] * U  # tokens of a ring part (after the all-to-all)
        # (in the caller's terms: q.shape[1] tokens on each of the U x R ranks)
        # (a ring of one runs the documents contiguously, whatever the layout)
        check_global_documents(spec, U * R, q.shape[1], documents_name(cu_seqlens),
                               layouts=R > 1)
        bound = bound_layout(fn, given, spec.documents)
        if R > 1:
            lay = given
            if U > 1:
                _check_local_length(spec, bound, U, R, q.shape[1])
            check_layout(spec, bound, R, part, documents_name(cu_seqlens))
        else:
            lay = get_layout("contiguous")
            spec = local_spans(spec, part, part)
    out, lse = run_attention(q, k, v, spec, usp_placement(sp, lay))
    return returns(out, lse, False, return_lse)


def _check_local_length(spec, layout: Layout, U: int, R: int, s_local: int) -> None:
    """The hybrid's length rule in the caller's terms, for a layout whose rule is
    ``multiple()`` (Layout's own ``check_local_seqlen``; a layout with a check of its own
    keeps it, in check_layout): the ring lays out ring parts of U local shards, so the
    global length must be a multiple of :func:`sp_multiple` (the same lengths the ring's
    check takes; before, its message named the part's length and multiple as the local
    ones). ValueError (NotImplementedError for a user's missing ``multiple``) naming
    ``spec.fn``."""
    if type(layout).check_local_seqlen is not Layout.check_local_seqlen:
        return
    try:
        layout._checked_multiple(R)  # (a user's multiple(), checked as the ring would)
        need = sp_multiple(layout, R, U)
    except (ValueError, NotImplementedError) as exc:
        raise named_layout_error(spec, exc) from None
    if s_local <= 0 or s_local * U * R % need:
        raise ValueError(f"{spec.fn}: layout {layout.name!r} over Ulysses {U} x ring {R} "
                         f"ranks needs local shards whose length is a positive multiple of "
                         f"{need // (U * R)} (global length a multiple of {need}); got a local "
                         f"length of {s_local}")


def usp_sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
             scale=None, enable_gqa: bool = True, *, sp: SequenceParallelGroups,
             layout="zigzag", backend=None, grad_comm_dtype=None):
    """:func:`usp_attn_func` in ``F.scaled_dot_product_attention``'s layout and positional
    order: query (b, h, s_local, d), key/value (b, h_kv, s_local, d) -> (b, h, s_local, d).
    ``attn_mask`` must be None (ValueError otherwise) and ``dropout_p`` 0 (NotImplementedError
    above 0)."""
    fn = "usp_sdpa"
    with refuse_on_error(_refusal_group(fn, sp), FWD):
        _check_sp(fn, sp)
        q, k, v = sdpa_inputs(fn, query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa)
    out = _usp(fn, q, k, v, 0.0, scale, is_causal, sp, layout, False, backend, grad_comm_dtype,
               form=SDPA_FORM, takes_documents=False)
    return out.transpose(1, 2)
