"""Moving tokens between a full sequence and the ranks' shards, for any layout.

``shard`` / ``unshard`` / ``positions`` work over a process group; the ``*_local`` forms take
an explicit ``(world_size, rank)`` and communicate nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._dist import agree_on_fields, group_info
from .._hash import stable_code
from .base import check_rank, get_layout, layout_name_of_code

# Every dtype by its stable code, for the cross-rank check of unshard's arguments.
_DTYPE_OF_CODE = {stable_code(str(d)): str(d) for d in vars(torch).values()
                  if isinstance(d, torch.dtype)}

__all__ = ["positions", "positions_local", "shard", "shard_local", "unshard", "unshard_local"]


def positions_local(seqlen: int, layout, world_size: int, rank: int,
                    device=None) -> torch.Tensor:
    """Like :func:`positions` for an explicit ``(world_size, rank)`` (no process group)."""
    return get_layout(layout).positions(seqlen, world_size, rank).to(device)


def shard_local(x: torch.Tensor, layout, world_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Like :func:`shard` for an explicit ``(world_size, rank)`` (no process group)."""
    lay = get_layout(layout)
    dim = dim % x.dim()
    lay.check_seqlen(x.shape[dim], world_size)
    check_rank(rank, world_size)
    if world_size == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return lay.shard(x, world_size, rank, dim)


def shard(x: torch.Tensor, layout="contiguous", group=None, dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor ``x`` (same on every rank) along ``dim``.

    Args:
        x: any tensor whose ``dim`` is the global sequence (e.g. (b, s, h, d) tokens,
            (b, s) position ids or labels).
        layout: ``"contiguous"``, ``"zigzag"``, ``"stripe"`` or a :class:`Layout`.
        group: process group (None: default group; world size 1 without one).
        dim: the sequence dimension.

    Returns a new contiguous tensor with ``x.shape[dim] // W`` rows along ``dim`` (autograd
    flows back into ``x``). Raises ValueError, without communicating, when the length is not a
    multiple of what the layout needs (``W``; ``2W`` for zigzag).
    """
    world_size, rank = group_info(group)
    return shard_local(x, layout, world_size, rank, dim)


def positions(seqlen: int, layout="contiguous", group=None, device=None) -> torch.Tensor:
    """Global position ids (int64, ``(seqlen // W,)``) of this rank's tokens under ``layout``.

    Shard position ids with this (or ``shard(position_ids, layout)``) so rotary embeddings see
    the true positions. Raises ValueError when ``seqlen`` cannot be split.
    """
    world_size, rank = group_info(group)
    return positions_local(seqlen, layout, world_size, rank, device)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lay, group, world_size, rank, dim):
        ctx.lay, ctx.group, ctx.world_size, ctx.rank, ctx.dim = lay, group, world_size, rank, dim
        xc = x.contiguous()
        parts = [torch.empty_like(xc) for _ in range(world_size)]
        dist.all_gather(parts, xc, group=group)
        seqlen = x.shape[dim] * world_size
        shape = list(x.shape)
        shape[dim] = seqlen
        full = x.new_empty(shape)
        for r, part in enumerate(parts):
            lay.scatter(full, part, world_size, r, dim)
        return full

    @staticmethod
    def backward(ctx, grad):
        # Each rank's output depends on every rank's input: the gradient of a shard is the
        # sum over ranks of their gradient for it (gloo has no reduce_scatter, so all_reduce).
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return shard_local(g, ctx.lay, ctx.world_size, ctx.rank, ctx.dim), None, None, None, None, None


def unshard_local(parts, layout, dim: int = 1) -> torch.Tensor:
    """Reassembles the full tensor from every rank's shard (list in rank order), no comm."""
    lay = get_layout(layout)
    world_size = len(parts)
    dim = dim % parts[0].dim()
    shape = list(parts[0].shape)
    shape[dim] *= world_size
    full = parts[0].new_empty(shape)
    for r, part in enumerate(parts):
        lay.scatter(full, part, world_size, r, dim)
    return full


def unshard(x_local: torch.Tensor, layout="contiguous", group=None, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: all-gathers the shards of ``group`` into the full tensor.

    Every rank must pass a shard of the same shape and dtype, with the same ``layout`` and
    ``dim``. Differentiable: the gradient of the local shard is the sum over ranks of each
    rank's gradient for that shard (so when every rank computes the same loss on the result,
    scale it by 1/W). Without an initialized process group (world size 1) it returns
    ``x_local`` unchanged.

    Raises ValueError when this rank's shard length cannot be the layout's (the other ranks
    raise ``ringseq.RingPeerError`` naming this one), and ``ringseq.RingMismatchError`` (a
    ValueError) on every rank when the ranks' shapes, dtypes, layouts or ``dim`` differ: one
    small all-gather before the tensors' own, which would otherwise pair mismatched shards or
    wait forever.
    """
    lay = get_layout(layout)
    world_size, rank = group_info(group)
    dim = dim % x_local.dim()
    if world_size == 1:
        return x_local
    problem = None
    try:
        lay.check_local_seqlen(x_local.shape[dim], world_size)
    except ValueError as exc:
        problem = exc
    shape = tuple(x_local.shape)
    fields = ((("ndim", len(shape), None),)
              + tuple((f"shape[{i}]", n, None) for i, n in enumerate(shape[:16]))
              + (("dtype", stable_code(str(x_local.dtype)),
                  lambda c: _DTYPE_OF_CODE.get(c, f"dtype #{c}")),
                 ("layout", lay.code, layout_name_of_code), ("dim", dim, None)))
    agree_on_fields(problem is None, str(problem), fields, group, error=problem, what="unshard")
    return _Unshard.apply(x_local, lay, group, world_size, rank, dim)
