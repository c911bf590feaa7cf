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

* ``h % U == 0`` is required (ValueError naming ``h``, ``U`` and the degrees that work).
* K/V heads are replicated ``rep = U / gcd(U, h_kv)`` times before the all-to-all, so every rank
  receives ``h_kv * rep / U = h_kv / gcd(U, h_kv)`` K/V heads and its ``h / U`` query heads read
  them in the kernel's uniform GQA grouping (query head ``i`` of a rank reads its K/V head
  ``i // (h / h_kv / rep)``). When ``U`` divides ``h_kv`` nothing is replicated (``rep = 1``):
  GQA/MQA is never expanded. When ``U > h_kv`` (e.g. 8:2 heads on 4 ranks, 8:1 on 2),
  ``rep = U / gcd(U, h_kv)`` is the least replication with which every rank's query heads read
  their K/V heads in that grouping: each rank receives exactly the K/V heads its query heads
  need (one, when ``h_kv`` divides ``U``). The gradients of the copies are summed back before
  they return.

Communication per rank per call (forward; the backward moves the same again), with ``b``
batch, ``s`` global length, ``d`` head dim, ``e`` bytes per element:
``(U - 1) / U * b * (s / U) * (2 h + 2 h_kv * rep) * d * e`` bytes (q, k, v in; out back).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import commstats
from ._args import autocast_inputs, check_dropout
from ._dist import dtype_code, group_info
from .comm import check_consistent
from .kernels import check_qkv
from .ops import flash_attn_func

__all__ = ["all_to_all", "heads_to_seq", "kv_replication", "lse_heads_to_seq",
           "seq_to_heads", "ulysses_attn_func", "ulysses_heads", "valid_ulysses_degrees"]


# ---------------------------------------------------------------------------- head rule
def valid_ulysses_degrees(nheads: int, sp_size: Optional[int] = None) -> List[int]:
    """The Ulysses degrees that can split ``nheads`` query heads (divisors of ``nheads``),
    restricted to those that also divide ``sp_size`` when given."""
    return [u for u in range(1, nheads + 1)
            if nheads % u == 0 and (sp_size is None or sp_size % u == 0)]


def kv_replication(nheads_kv: int, degree: int) -> int:
    """How many copies of each K/V head the all-to-all sends: ``degree / gcd(degree,
    nheads_kv)`` (1 when ``degree`` divides ``nheads_kv``; see the module doc)."""
    return degree // math.gcd(degree, nheads_kv)


def ulysses_heads(nheads: int, nheads_kv: int, degree: int, what: str = "nheads") -> Tuple[int, int, int]:
    """``(query heads per rank, K/V replication, K/V heads per rank)`` for a Ulysses degree.

    Raises ValueError when ``degree`` does not divide ``nheads`` (naming both and the degrees
    that work) or ``nheads_kv`` does not divide ``nheads``."""
    if degree < 1:
        raise ValueError(f"the Ulysses degree must be a positive integer, got {degree}")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"nheads={nheads} must be a multiple of nheads_kv={nheads_kv}")
    if nheads % degree:
        raise ValueError(
            f"{what}={nheads} query heads cannot be split over a Ulysses degree of {degree}: "
            f"each rank of the all-to-all takes {what} / degree heads, so the degree must "
            f"divide {nheads}; degrees that work: {valid_ulysses_degrees(nheads)}")
    rep = kv_replication(nheads_kv, degree)
    return nheads // degree, rep, nheads_kv * rep // degree


# ---------------------------------------------------------------------------- all-to-all
def _a2a(tensors: Sequence[torch.Tensor], group, degree: int, scatter_dim: int,
         gather_dim: int) -> List[torch.Tensor]:
    """One all-to-all for several same-dtype tensors: chunk ``u`` of each tensor along
    ``scatter_dim`` goes to rank ``u``; what arrives is concatenated along ``gather_dim`` in
    rank order. Returns new contiguous tensors."""
    parts = []
    for t in tensors:
        chunk = list(t.shape)
        chunk[scatter_dim] //= degree
        parts.append((t, chunk, math.prod(chunk)))
    total = sum(n for _, _, n in parts)
    send = torch.empty((degree, total), dtype=tensors[0].dtype, device=tensors[0].device)
    off = 0
    for t, chunk, n in parts:
        send[:, off:off + n].view(degree, *chunk).copy_(
            t.unflatten(scatter_dim, (degree, chunk[scatter_dim])).movedim(scatter_dim, 0))
        off += n
    recv = torch.empty_like(send)
    commstats.record("all_to_all", send.numel() * send.element_size() * (degree - 1) // degree)
    dist.all_to_all_single(recv, send, group=group)
    outs, off = [], 0
    for t, chunk, n in parts:
        piece = recv[:, off:off + n].view(degree, *chunk).movedim(0, gather_dim)
        shape = list(chunk)
        shape[gather_dim] *= degree
        outs.append(piece.reshape(shape))
        off += n
    return outs


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, degree, scatter_dim, gather_dim, *tensors):
        ctx.args = (group, degree, scatter_dim, gather_dim)
        return tuple(_a2a(tensors, group, degree, scatter_dim, gather_dim))

    @staticmethod
    def backward(ctx, *grads):
        group, degree, scatter_dim, gather_dim = ctx.args
        back = _a2a(grads, group, degree, gather_dim, scatter_dim)
        return (None, None, None, None, *back)


def all_to_all(tensors: Sequence[torch.Tensor], group, scatter_dim: int,
               gather_dim: int) -> Tuple[torch.Tensor, ...]:
    """Differentiable all-to-all over ``group`` of same-dtype tensors in one collective.

    Chunk ``u`` of each tensor along ``scatter_dim`` (whose size must be a multiple of the
    group size ``U``) goes to rank ``u``; the result concatenates, along ``gather_dim``, the
    chunks received from ranks ``0 .. U-1``. Its gradient is the reverse all-to-all. Works on
    gloo and NCCL (``all_to_all_single``); bytes sent are recorded (:mod:`ringseq.commstats`).
    """
    degree, _ = group_info(group)
    if degree == 1:
        return tuple(tensors)
    for t in tensors:
        if t.shape[scatter_dim] % degree:
            raise ValueError(f"all_to_all: dim {scatter_dim} of shape {tuple(t.shape)} is not a "
                             f"multiple of the group size {degree}")
    return _AllToAll.apply(group, degree, scatter_dim, gather_dim, *tensors)


def seq_to_heads(q, k, v, group, rep: int = 1):
    """(b, s_local, h, d) sequence shards -> (b, U * s_local, h / U, d) head shards for q, and
    the same for k, v after replicating each K/V head ``rep`` times (see the module doc)."""
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)  # autograd sums the copies' gradients
        v = v.repeat_interleave(rep, dim=2)
    return all_to_all([q, k, v], group, scatter_dim=2, gather_dim=1)


def heads_to_seq(out, group):
    """(b, U * s_local, h / U, d) head shards -> (b, s_local, h, d) sequence shards."""
    return all_to_all([out], group, scatter_dim=1, gather_dim=2)[0]


def lse_heads_to_seq(lse, group):
    """(b, h / U, U * s_local) -> (b, h, s_local)."""
    return all_to_all([lse], group, scatter_dim=2, gather_dim=1)[0]


# ---------------------------------------------------------------------------- the function
def ulysses_wrap(q, k, v, *, group, degree: int, attend: Callable, return_lse: bool):
    """Runs ``attend(q_h, k_h, v_h) -> (out_h, lse_h)`` on the head shards of the whole
    (Ulysses-group) sequence; returns ``(out, lse or None)`` on this rank's sequence shard."""
    _, rep, _ = ulysses_heads(q.shape[2], k.shape[2], degree)
    q_h, k_h, v_h = seq_to_heads(q, k, v, group, rep)
    out_h, lse_h = attend(q_h, k_h, v_h)
    out = heads_to_seq(out_h, group)
    lse = lse_heads_to_seq(lse_h, group) if return_lse else None
    return out, lse


def ulysses_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale=None, causal: bool = False,
                      *, group=None, return_lse: bool = False, backend=None):
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

    Returns:
        out (batch, s_local, nheads, headdim) in q's dtype; with ``return_lse`` also lse
        (batch, nheads, s_local) float32 (float64 for float64), natural log. Differentiable
        in q, k, v (and through lse).

    Raises:
        ValueError: ``nheads`` not divisible by the group size (the message lists the
            degrees that work), bad shapes/dtypes, ``dropout_p > 0``, q and k/v of different
            local lengths -- before any communication.
        RingMismatchError (a ValueError): ranks called with different shapes/dtypes/causal
            (every rank; one small all-gather on the first call per signature).
    """
    check_dropout("ulysses_attn_func", dropout_p)
    q, k, v = autocast_inputs(q, k, v)
    with torch.autocast(q.device.type, enabled=False):
        check_qkv(q, k, v)
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"Ulysses attention needs q and k/v shards of the same local "
                             f"length, got q {tuple(q.shape)} and k {tuple(k.shape)}")
        degree, _ = group_info(group)
        ulysses_heads(q.shape[2], k.shape[2], degree)
        if degree == 1:
            res = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                  return_lse=True, backend=backend)
            return res if return_lse else res[0]
        b, s, h, d = q.shape
        check_consistent([("batch", b), ("local seqlen", s), ("nheads", h),
                          ("nheads_kv", k.shape[2]), ("headdim", d),
                          ("dtype", dtype_code(q.dtype), "dtype"),
                          ("causal", bool(causal), "bool"), ("Ulysses degree", degree)],
                         group=group, device=q.device)

        def attend(q_h, k_h, v_h):
            return flash_attn_func(q_h, k_h, v_h, softmax_scale=softmax_scale, causal=causal,
                                   return_lse=True, backend=backend)

        out, lse = ulysses_wrap(q, k, v, group=group, degree=degree, attend=attend,
                                return_lse=return_lse)
    return (out, lse) if return_lse else out
