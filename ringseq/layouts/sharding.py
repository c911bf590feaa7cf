"""Moving tokens between a full sequence and the ranks' shards, for any layout.

``shard`` / ``unshard`` / ``positions`` work over a process group; the ``*_local`` forms take
an explicit ``(world_size, rank)`` and communicate nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._args import given
from .._dist import agree_on_fields, group_info, named_for
from .._hash import stable_code
from .base import check_rank, get_layout, layout_name_of_code

# Every dtype by its stable code, for the cross-rank check of unshard's arguments.
_DTYPE_OF_CODE = {stable_code(str(d)): str(d) for d in vars(torch).values()
                  if isinstance(d, torch.dtype)}

__all__ = ["positions", "positions_local", "shard", "shard_local", "unshard", "unshard_local"]


def _seq_dim(fn: str, x, dim) -> int:
    """``dim`` of tensor ``x`` as a non-negative index; TypeError / ValueError naming ``fn``
    (torch's own wrap-around would silently pick another dimension)."""
    if not torch.is_tensor(x) or x.dim() == 0:
        raise ValueError(f"{fn}: the tensor must have a sequence dimension, got "
                         f"{given(x)}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{fn}: dim must be an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{fn}: dim={dim} is out of range for a tensor of shape "
                         f"{tuple(x.shape)} (expected {-x.dim()} to {x.dim() - 1})")
    return dim % x.dim()


def positions_local(seqlen: int, layout, world_size: int, rank: int,
                    device=None, fn: str = "positions_local") -> torch.Tensor:
    """Like :func:`positions` for an explicit ``(world_size, rank)`` (no process group);
    ``fn`` names the caller in errors."""
    try:
        return get_layout(layout).positions(seqlen, world_size, rank).to(device)
    except (TypeError, ValueError) as exc:
        raise named_for(fn, exc) from exc


def shard_local(x: torch.Tensor, layout, world_size: int, rank: int, dim: int = 1,
                fn: str = "shard_local") -> torch.Tensor:
    """Like :func:`shard` for an explicit ``(world_size, rank)`` (no process group); ``fn``
    names the caller in errors."""
    dim = _seq_dim(fn, x, dim)
    try:
        lay = get_layout(layout)
        check_rank(rank, world_size)
        lay.check_seqlen(x.shape[dim], world_size)
        if world_size == 1 and lay.identity_on_one_rank(x.shape[dim]):
            return x.clone(memory_format=torch.contiguous_format)
        return lay.shard(x, world_size, rank, dim)
    except (TypeError, ValueError) as exc:
        raise named_for(fn, exc) from exc


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
    world_size, rank = group_info(group, "shard")
    return shard_local(x, layout, world_size, rank, dim, fn="shard")


def positions(seqlen: int, layout="contiguous", group=None, device=None) -> torch.Tensor:
    """Global position ids (int64, ``(seqlen // W,)``) of this rank's tokens under ``layout``.

    Shard position ids with this (or ``shard(position_ids, layout)``) so rotary embeddings see
    the true positions. Raises ValueError when ``seqlen`` cannot be split.
    """
    world_size, rank = group_info(group, "positions")
    return positions_local(seqlen, layout, world_size, rank, device, fn="positions")


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
    """Reassembles the full tensor from every rank's shard (list in rank order), no comm.
    ValueError unless the parts are tensors of one shape and dtype whose length along ``dim``
    the layout can have as a shard."""
    try:
        lay = get_layout(layout)
    except ValueError as exc:
        raise named_for("unshard_local", exc) from exc
    parts = list(parts)
    world_size = len(parts)
    if world_size == 0 or not all(torch.is_tensor(p) for p in parts):
        raise ValueError(f"unshard_local: parts must be a non-empty list of tensors (one per "
                         f"rank), got {[given(p) for p in parts]}")
    dim = _seq_dim("unshard_local", parts[0], dim)
    if any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
        raise ValueError(f"unshard_local: every part must have one shape and dtype, got "
                         f"{[(tuple(p.shape), str(p.dtype)) for p in parts]}")
    try:
        lay.check_local_seqlen(parts[0].shape[dim], world_size)
        return _scattered(lay, parts, dim)
    except (TypeError, ValueError) as exc:
        raise named_for("unshard_local", exc) from exc


def _scattered(lay, parts, dim: int) -> torch.Tensor:
    """The full tensor of every rank's shard ``parts`` (rank order) under layout ``lay``."""
    shape = list(parts[0].shape)
    shape[dim] *= len(parts)
    full = parts[0].new_empty(shape)
    for r, part in enumerate(parts):
        lay.scatter(full, part, len(parts), r, dim)
    return full


def unshard(x_local: torch.Tensor, layout="contiguous", group=None, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: all-gathers the shards of ``group`` into the full tensor.

    Every rank must pass a shard of the same shape and dtype, with the same ``layout`` and
    ``dim``. Differentiable: the gradient of the local shard is the sum over ranks of each
    rank's gradient for that shard (so when every rank computes the same loss on the result,
    scale it by 1/W). Without an initialized process group (world size 1) it returns
    ``x_local`` unchanged (reordered, for a layout of your own that holds one rank's tokens
    in another order).

    Raises ValueError when this rank's shard length cannot be the layout's (the other ranks
    raise ``ringseq.RingPeerError`` naming this one), and ``ringseq.RingMismatchError`` (a
    ValueError) on every rank when the ranks' shapes, dtypes, layouts or ``dim`` differ: one
    small all-gather before the tensors' own, which would otherwise pair mismatched shards or
    wait forever.
    """
    world_size, rank = group_info(group, "unshard")
    if world_size == 1:
        try:
            lay = get_layout(layout)
        except ValueError as exc:
            raise named_for("unshard", exc) from exc
        dim = _seq_dim("unshard", x_local, dim)
        try:
            reorder = not lay.identity_on_one_rank(x_local.shape[dim])  # a layout of the user's
        except ValueError:  # a length it cannot hold: returned as it is, as by the built-ins
            reorder = False
        return _scattered(lay, [x_local], dim) if reorder else x_local
    # Whatever this rank refuses is agreed on before the all-gather, which the other ranks
    # would otherwise wait in.
    problem, lay, code = None, None, -1
    try:
        lay = get_layout(layout)
        code = lay.code
        dim = _seq_dim("unshard", x_local, dim)
        lay.check_local_seqlen(x_local.shape[dim], world_size)
    except TypeError as exc:
        problem, dim = exc, -1
    except ValueError as exc:
        problem, dim = named_for("unshard", exc), -1
    shape = tuple(x_local.shape) if torch.is_tensor(x_local) else ()
    fields = ((("ndim", len(shape), None),)
              + tuple((f"shape[{i}]", n, None) for i, n in enumerate(shape[:16]))
              + (("dtype", stable_code(str(getattr(x_local, "dtype", None))),
                  lambda c: _DTYPE_OF_CODE.get(c, f"dtype #{c}")),
                 ("layout", code, layout_name_of_code), ("dim", dim, None)))
    agree_on_fields(problem is None, str(problem), fields, group, error=problem, what="unshard")
    return _Unshard.apply(x_local, lay, group, world_size, rank, dim)
