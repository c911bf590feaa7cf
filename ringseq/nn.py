"""Public ring-attention API: functions on local shards and the ``RingAttention`` module.

Every function takes this rank's shard of a sequence that was split with
``ringseq.shard(x, layout, group)`` (or an equivalent data loader) and returns this rank's
shard of the output. All ranks of ``group`` must call with the same shapes, dtype, layout and
options; every call checks that across ranks (see ``ringseq.set_consistency_check``) and every
rank raises ``RingMismatchError`` (a ValueError) naming what differs, instead of hanging. An
argument that one rank alone finds invalid raises that rank's error there and
``RingPeerError`` (a ValueError naming it) on the others.

``group=None`` means the default process group; without an initialized process group the
functions compute plain local attention (world size 1).
"""
from __future__ import annotations

import copy

from typing import Optional

from torch import nn

from ._args import (autocast_inputs, check_bool, check_returns, check_softmax_scale, sdpa_inputs,
                    split_kv, split_packed_varlen, split_qkv)
from ._dist import check_group_type
from .engine.integrity import FWD
from .engine.op import run_attention
from .engine.placement import RingPlacement
from .engine.ring import Ring, refuse_on_error, ring_size
from .engine.transport import Transport
from .ops import returns
from .kernels import check_backend_name
from .kernels.checks import FLASH_FORM, RING_VARLEN_FORM, SDPA_FORM, InputForm
from .spec import (attn_spec, bound_layout, check_grad_comm_dtype, check_layout, documents_name,
                   check_self_attention, named_layout)

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
           "ring_flash_attn_qkvpacked_func", "ring_flash_attn_varlen_func",
           "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func",
           "ring_sdpa", "RingAttention", "ring_attention", "unpack"]


def ring_attention(fn: str, q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False,
                   window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                   return_attn_probs=False, group=None, layout="contiguous", return_lse=False,
                   backend=None, grad_comm_dtype=None, softcap=0.0, cu_seqlens=None,
                   comm_kind: str = "ring", takes_documents: bool = True,
                   needs_documents: bool = False, form: InputForm = FLASH_FORM):
    """The one implementation of every public ring function (``fn`` names the one called):
    validate once into an AttnSpec (a refusal reaches the peers), then the ring placement
    through the custom operator. Arguments and returns as :func:`ring_flash_attn_func`;
    ``takes_documents=False`` for a function without ``cu_seqlens`` (a per-batch documents
    layout is then refused with advice it can follow); ``needs_documents=True`` for the
    varlen forms, whose ``cu_seqlens`` is the call's documents: None only with a layout
    built with its own (TypeError otherwise)."""
    with refuse_on_error(group, FWD):
        check_returns(fn, return_attn_probs, return_lse)
        q, k, v = autocast_inputs(q, k, v)
        unbound = named_layout(fn, layout, takes_documents)
        if needs_documents and cu_seqlens is None and unbound.documents is None:
            # (before: a layout without documents ran attention across the documents)
            raise TypeError(f"{fn}: cu_seqlens must be the GLOBAL document boundaries "
                            f"(0, ..., total) as a list of ints or an int tensor, got None "
                            f"(None only with a layout built with them: "
                            f"ringseq.layouts.Documents(cu_seqlens))")
        spec = attn_spec(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                         causal=causal, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, deterministic=deterministic,
                         backend=backend, grad_comm_dtype=grad_comm_dtype,
                         documents=unbound.documents if cu_seqlens is None else cu_seqlens,
                         form=form)
        check_self_attention(spec, q, k, form)
        check_layout(spec, bound_layout(fn, unbound, spec.documents), ring_size(group, fn),
                     q.shape[1], documents_name(cu_seqlens))
    out, lse = run_attention(q, k, v, spec, RingPlacement(unbound, group, comm_kind))
    return returns(out, lse, return_attn_probs, return_lse)


def unpack(fn: str, group, split, packed):
    """``split(fn, packed)`` (the kv / qkv views of a packed form) as an entry point's check:
    a refusal reaches the other ranks of ``group``'s ring."""
    with refuse_on_error(group, FWD):
        return split(fn, packed)


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                         return_attn_probs=False, group=None, *, layout="contiguous",
                         return_lse=False, backend=None, grad_comm_dtype=None,
                         softcap=0.0, cu_seqlens=None):
    """Exact attention over a sequence sharded across ``group``, on this rank's shards.

    The positional order and defaults are ring-flash-attention's ``ring_flash_attn_func``
    (flash-attn's, plus ``group`` last); ringseq's options are keyword-only. With the default
    ``layout="contiguous"`` it is ring-flash-attention's plain ring;
    ``ringseq.zigzag_ring_flash_attn_func`` / ``ringseq.stripe_flash_attn_func`` bind the
    other layouts under ring-flash-attention's names.

    Args:
        q: (batch, s_local, nheads, headdim); k, v: (batch, s_local, nheads_kv, headdim) with
            ``nheads % nheads_kv == 0`` (GQA/MQA: only the kv heads travel the ring). float32,
            float64, bfloat16 or float16; only the last dimension must be contiguous. Under
            ``torch.autocast`` they are first cast to the autocast dtype (float64 excepted),
            as ``F.scaled_dot_product_attention`` is, so mixed float32/bf16 inputs work.
        dropout_p: must be 0.0 (no attention dropout: NotImplementedError otherwise).
        softmax_scale: a float, or None for ``headdim ** -0.5``.
        causal: bool; causal mask over GLOBAL positions as placed by ``layout``.
        window_size: flash-attn's ``(left, right)`` sliding window over GLOBAL positions
            (key j visible to query i iff ``i - left <= j <= i + right``; -1 = unbounded),
            combined with ``causal``. K/V travel only as far as the window reaches (e.g. one
            hop on contiguous shards for a window reaching left only, causal or
            ``(left, 0)``, shorter than a shard; K/V travel one way round the ring, so a
            window reaching right makes the full lap) and dK/dV come back the short way;
            pick ``layout="contiguous"`` for short windows (zigzag and stripe spread every
            window over all ranks, so they need the full lap).
        alibi_slopes: must be None (NotImplementedError otherwise).
        deterministic: accepted and without effect: ringseq's kernels (the default backend)
            are always deterministic (fixed accumulation order, no atomics) and the ring
            merges blocks in a fixed order; other backends are as their library is.
        return_attn_probs: return ``(out, softmax_lse, None)`` as ring-flash-attention does.
        group: process group of the ring (None: default group; no process group: local).
        layout (keyword-only): ``"contiguous"``, ``"zigzag"``, ``"stripe"`` or a
            ``ringseq.layouts.Layout``; must match how the shards were made. All layouts are
            exact for full (non-causal) attention, which is permutation invariant;
            zigzag/stripe only balance causal work.
        return_lse (keyword-only): return ``(out, lse)``.
        backend (keyword-only): block kernel: None (best available), "ringseq", "reference",
            ... (see ``ringseq.get_backend``); "sdpa" works for forward and backward without
            lse grads.
        softcap (keyword-only): logit soft-capping ``softcap * tanh(s / softcap)`` of the
            scaled scores (Gemma 2; 0.0: off).
        cu_seqlens (keyword-only): GLOBAL document boundaries ``(0, ..., total)`` (a list or
            an int tensor, the same on every rank) of a packed sequence: each token attends
            only to its own document (see also :func:`ring_flash_attn_varlen_func`).
        grad_comm_dtype (keyword-only): dtype in which the dK/dV accumulators travel in the
            backward. None: float32 (float64 for float64 inputs), exact accumulation.
            ``"input"`` (or e.g. ``torch.bfloat16``): one rounding per ring hop; for 16-bit
            inputs about 2/3 of the backward traffic as W grows (K/V and accumulators both
            2 bytes an element instead of 2 and 4; float32 inputs: ``"input"`` changes
            nothing, ``torch.bfloat16`` about 3/4). Measured for bf16 inputs at W=4
            (tests/test_ring.py): about 2x the dK/dV error of float32 transit, about the
            error of plain bf16 attention;
            bounded by float32 transit's error + W * 2**-8 * max|dK|. out, lse and dQ are
            unaffected. float16 transit can overflow (partial sums above 65504 become inf);
            prefer bfloat16.

    Returns:
        out (batch, s_local, nheads, headdim) in q's dtype (under ``torch.autocast``: the
        autocast dtype, float64 inputs excepted); with ``return_lse`` ``(out, lse)``, with
        ``return_attn_probs`` ``(out, lse, None)``, lse (batch, nheads, s_local) float32
        (float64 for float64 inputs), natural log; for rows that see no key -inf with
        ``return_lse``, +inf with ``return_attn_probs`` (flash-attn's convention). Gradients
        flow to q, k, v (in their dtype) and through lse.

    Raises:
        TypeError: an argument of the wrong kind (a bool or None for ``dropout_p`` or
            ``softmax_scale``, a ``causal`` that is not a bool, ...), naming it.
        NotImplementedError: ``dropout_p > 0``, ``alibi_slopes``.
        ValueError: a ``dropout_p`` outside [0, 1], bad shapes/dtypes/devices, a local length
            the layout cannot use (zigzag needs an even one), an unknown layout or backend,
            ``cu_seqlens`` that do not end at the global length -- before any communication.
        RingMismatchError (a ValueError): ranks called with different arguments (every rank).
    """
    return ring_attention("ring_flash_attn_func", q, k, v, dropout_p=dropout_p,
                          softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          alibi_slopes=alibi_slopes, deterministic=deterministic,
                          return_attn_probs=return_attn_probs, group=group, layout=layout,
                          return_lse=return_lse, backend=backend,
                          grad_comm_dtype=grad_comm_dtype, softcap=softcap,
                          cu_seqlens=cu_seqlens)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None, *, layout="contiguous",
                                  return_lse=False, backend=None, grad_comm_dtype=None,
                                  softcap=0.0):
    """:func:`ring_flash_attn_func` with ``kv`` packed as (batch, s_local, 2, nheads_kv, headdim)
    (ring-flash-attention's ``ring_flash_attn_kvpacked_func`` signature).

    K and V are read as strided views of ``kv`` (no copy); the gradient comes back packed."""
    fn = "ring_flash_attn_kvpacked_func"
    k, v = unpack(fn, group, split_kv, kv)
    return ring_attention(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                          causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, return_attn_probs=return_attn_probs,
                          group=group, layout=layout, return_lse=return_lse, backend=backend,
                          grad_comm_dtype=grad_comm_dtype, softcap=softcap,
                          takes_documents=False, form=FLASH_FORM.packed("kv"))


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                   window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                   return_attn_probs=False, group=None, *, layout="contiguous",
                                   return_lse=False, backend=None, grad_comm_dtype=None,
                                   softcap=0.0):
    """:func:`ring_flash_attn_func` with ``qkv`` packed as (batch, s_local, 3, nheads, headdim)
    (ring-flash-attention's ``ring_flash_attn_qkvpacked_func`` signature)."""
    fn = "ring_flash_attn_qkvpacked_func"
    q, k, v = unpack(fn, group, split_qkv, qkv)
    return ring_attention(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                          causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, return_attn_probs=return_attn_probs,
                          group=group, layout=layout, return_lse=return_lse, backend=backend,
                          grad_comm_dtype=grad_comm_dtype, softcap=softcap,
                          takes_documents=False, form=FLASH_FORM.packed("qkv"))


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen=None, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None, *, layout=None, return_lse=False, backend=None,
                                grad_comm_dtype=None, softcap=0.0):
    """Ring attention over a packed sequence of documents, on this rank's shard.

    Args:
        q: (total_local, nheads, headdim); k, v: (total_local, nheads_kv, headdim): this
            rank's tokens of the packed sequence under ``layout`` (flash-attn's packed
            convention, no batch dimension), e.g. ``ringseq.shard(x, layout, dim=0)``.
        cu_seqlens: the GLOBAL document boundaries ``(0, ..., total)`` of the whole packed
            sequence (int tensor or list), the same on every rank (checked across ranks).
            Unlike ring-flash-attention's per-rank boundaries: a port passing local boundaries
            fails loudly (they do not end at the global length).
        max_seqlen: accepted for ring-flash-attention's signature (unused; may be None).
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
            return_attn_probs, group: as in :func:`ring_flash_attn_func`; causal masks and
            windows follow global positions within each document.
        layout (keyword-only): default ``ringseq.layouts.Documents(cu_seqlens)``: every
            document is split into 2W pieces (zigzag per document), which balances causal
            work for any document lengths; only ``total % W == 0`` is needed. The other
            layouts also work (attention is restricted to documents either way).
        return_lse, backend, grad_comm_dtype, softcap (keyword-only): as in
            :func:`ring_flash_attn_func`.

    Returns out (total_local, nheads, headdim); with ``return_lse`` also lse
    (nheads, total_local) float32 (float64 for float64); with ``return_attn_probs``
    ``(out, lse, None)``. Ring steps whose blocks see no pair of one document do no work.

    Raises what :func:`ring_flash_attn_func` raises, and ValueError for ``cu_seqlens`` that do
    not start at 0, decrease, or do not end at the global length, and for 3-dim shape errors;
    TypeError for ``cu_seqlens=None`` unless ``layout`` was built with its documents
    (``ringseq.layouts.Documents(cu_seqlens)``).
    """
    return _ring_varlen("ring_flash_attn_varlen_func", q, k, v, cu_seqlens, dropout_p,
                        softmax_scale, causal, window_size, alibi_slopes, deterministic,
                        return_attn_probs, group, layout, return_lse, backend, grad_comm_dtype,
                        softcap)


def ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen=None, dropout_p=0.0,
                                         softmax_scale=None, causal=False, window_size=(-1, -1),
                                         alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, layout=None,
                                         return_lse=False, backend=None, grad_comm_dtype=None,
                                         softcap=0.0):
    """:func:`ring_flash_attn_varlen_func` with ``kv`` packed as (total_local, 2, nheads_kv,
    headdim) (ring-flash-attention's ``ring_flash_attn_varlen_kvpacked_func`` signature). K
    and V are strided views of ``kv`` (no copy); the gradient comes back packed."""
    fn = "ring_flash_attn_varlen_kvpacked_func"
    k, v = unpack(fn, group, lambda f, t: split_packed_varlen(f, "kv", t, 2, "nheads_kv"), kv)
    return _ring_varlen(fn, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size,
                        alibi_slopes, deterministic, return_attn_probs, group, layout,
                        return_lse, backend, grad_comm_dtype, softcap,
                        RING_VARLEN_FORM.packed("kv"))


def ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen=None, dropout_p=0.0,
                                          softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None,
                                          deterministic=False, return_attn_probs=False,
                                          group=None, *, layout=None, return_lse=False,
                                          backend=None, grad_comm_dtype=None, softcap=0.0):
    """:func:`ring_flash_attn_varlen_func` with ``qkv`` packed as (total_local, 3, nheads,
    headdim) (ring-flash-attention's ``ring_flash_attn_varlen_qkvpacked_func`` signature)."""
    fn = "ring_flash_attn_varlen_qkvpacked_func"
    q, k, v = unpack(fn, group, lambda f, t: split_packed_varlen(f, "qkv", t, 3, "nheads"), qkv)
    return _ring_varlen(fn, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size,
                        alibi_slopes, deterministic, return_attn_probs, group, layout,
                        return_lse, backend, grad_comm_dtype, softcap,
                        RING_VARLEN_FORM.packed("qkv"))


def _ring_varlen(fn, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size,
                 alibi_slopes, deterministic, return_attn_probs, group, layout, return_lse,
                 backend, grad_comm_dtype, softcap, form=RING_VARLEN_FORM):
    """The varlen ring functions' one body: 3-dim (total_local, nheads, headdim) inputs as a
    batch of one (``form``: as the function called names them)."""
    with refuse_on_error(group, FWD):
        q, k, v = form.to_flash(fn, q, k, v)  # (1, total_local, h, d) views
    res = ring_attention(fn, q, k, v, dropout_p=dropout_p,
                         softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                         alibi_slopes=alibi_slopes, deterministic=deterministic,
                         return_attn_probs=return_attn_probs, group=group,
                         layout="documents" if layout is None else layout,
                         return_lse=return_lse, backend=backend,
                         grad_comm_dtype=grad_comm_dtype, softcap=softcap, cu_seqlens=cu_seqlens,
                         needs_documents=True, form=form)
    if isinstance(res, tuple):
        return (res[0][0], res[1][0]) + tuple(res[2:])  # out (s, h, d), lse (h, s)
    return res[0]


def ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=True, *, group=None, layout="contiguous", backend=None,
              grad_comm_dtype=None):
    """Ring attention with ``F.scaled_dot_product_attention``'s layout and positional order,
    for SDPA model code (a call written for SDPA means the same here).

    Args:
        query: (batch, nheads, s_local, headdim); key, value: (batch, nheads_kv, s_local,
            headdim), ``nheads % nheads_kv == 0``.
        attn_mask, dropout_p: as in SDPA's signature; only None / 0.0 are supported
            (ValueError for a mask, NotImplementedError for ``dropout_p > 0``).
        is_causal, scale: as in SDPA (causal over global positions of ``layout``).
        enable_gqa: as in SDPA: fewer K/V heads than query heads (grouped-query attention)
            need ``enable_gqa=True`` (ValueError otherwise; one K/V head is taken either way).
        group, layout, backend, grad_comm_dtype (keyword-only): as in
            :func:`ring_flash_attn_func`.

    Returns (batch, nheads, s_local, headdim) in query's dtype (under ``torch.autocast``: the
    autocast dtype, float64 inputs excepted; a transposed view).
    """
    fn = "ring_sdpa"
    with refuse_on_error(group, FWD):
        q, k, v = sdpa_inputs(fn, query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa)
    out = ring_attention(fn, q, k, v, softmax_scale=scale, causal=is_causal, group=group,
                         layout=layout, backend=backend, grad_comm_dtype=grad_comm_dtype,
                         takes_documents=False, form=SDPA_FORM)
    return out.transpose(1, 2)


class RingAttention(nn.Module):
    """Ring attention as a module holding its group, layout, causal flag and backend.

    ``forward(q, k, v, return_lse=False)`` takes flash-attn's (batch, s_local, nheads,
    headdim) shards and returns what :func:`ring_flash_attn_func` returns.
    """

    def __init__(self, group=None, layout="contiguous", causal: bool = False,
                 backend: Optional[str] = None, softmax_scale: Optional[float] = None,
                 grad_comm_dtype=None):
        super().__init__()
        # (checked here, where the module is built, not at its first forward)
        check_bool("RingAttention", "causal", causal)
        check_softmax_scale("RingAttention", softmax_scale)
        check_backend_name("RingAttention", backend)
        check_grad_comm_dtype("RingAttention", grad_comm_dtype)
        # (its type only: a model built on every rank may run this module on its group's
        # ranks alone, and build it inside a compiled function)
        if not isinstance(group, (Ring, Transport)):
            check_group_type(group, "RingAttention")
        self.group = group
        self.layout = named_layout("RingAttention", layout, takes_documents=False)
        self.causal = bool(causal)
        self.backend = backend
        self.softmax_scale = softmax_scale
        self.grad_comm_dtype = grad_comm_dtype

    def forward(self, q, k, v, return_lse: bool = False):
        return ring_attention("RingAttention", q, k, v, softmax_scale=self.softmax_scale,
                              causal=self.causal, group=self.group, layout=self.layout,
                              return_lse=return_lse, backend=self.backend,
                              grad_comm_dtype=self.grad_comm_dtype)

    def __deepcopy__(self, memo):
        # A process group cannot be copied, and a copied model (EMA, teacher) runs on the same
        # ring: the copy shares the group and copies everything else.
        memo[id(self.group)] = self.group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __copy__(self):
        # (copy.copy goes through __getstate__ otherwise, which refuses a group: a shallow
        # copy shares it, as it shares everything)
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self):
        # (pickling, torch.save of the whole model): a process group belongs to its process
        # and cannot be pickled; torch's own error would name neither this module nor `group`
        if self.group is not None:
            raise TypeError("RingAttention: cannot pickle a module bound to a process group "
                            "(group=...): save the model's state_dict() (this module has no "
                            "tensors) and build the module again in the loading process")
        return super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__

    def extra_repr(self) -> str:
        # (what changes the output or the traffic, so that two modules that differ print so)
        extra = "".join(f", {name}={getattr(self, name)!r}"
                        for name in ("softmax_scale", "grad_comm_dtype")
                        if getattr(self, name) is not None)
        return (f"layout={self.layout.name!r}, causal={self.causal}, backend={self.backend!r}"
                + extra)
