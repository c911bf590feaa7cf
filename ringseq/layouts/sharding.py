"""Moving tokens between a full sequence and the ranks' shards, for any layout.

``shard`` / ``positions`` work over a process group (they only read its size and rank); the
``*_local`` forms take an explicit ``(world_size, rank)``. Nothing here communicates:
``ringseq.unshard`` (:mod:`ringseq.gathering`) gathers the shards back over the ring.
"""
from __future__ import annotations

import torch

from .._args import given
from .._dist import group_info, named_for
from .base import check_rank, get_layout

__all__ = ["positions", "positions_local", "scattered", "seq_dim", "shard", "shard_local",
           "unshard_local"]


def seq_dim(fn: str, x, dim) -> int:
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
        return get_layout(layout, fn).positions(seqlen, world_size, rank).to(device)
    except (TypeError, ValueError) as exc:
        raise named_for(fn, exc) from exc


def shard_local(x: torch.Tensor, layout, world_size: int, rank: int, dim: int = 1,
                fn: str = "shard_local") -> torch.Tensor:
    """Like :func:`shard` for an explicit ``(world_size, rank)`` (no process group); ``fn``
    names the caller in errors."""
    dim = seq_dim(fn, x, dim)
    try:
        lay = get_layout(layout, fn)
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


def unshard_local(parts, layout, dim: int = 1) -> torch.Tensor:
    """Reassembles the full tensor from every rank's shard (list in rank order), no comm.
    ValueError unless the parts are tensors of one shape and dtype whose length along ``dim``
    the layout can have as a shard."""
    lay = get_layout(layout, "unshard_local")
    parts = list(parts)
    world_size = len(parts)
    if world_size == 0 or not all(torch.is_tensor(p) for p in parts):
        raise ValueError(f"unshard_local: parts must be a non-empty list of tensors (one per "
                         f"rank), got {[given(p) for p in parts]}")
    dim = seq_dim("unshard_local", parts[0], dim)
    if any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
        raise ValueError(f"unshard_local: every part must have one shape and dtype, got "
                         f"{[(tuple(p.shape), str(p.dtype)) for p in parts]}")
    try:
        lay.check_local_seqlen(parts[0].shape[dim], world_size)
        return scattered(lay, parts, dim)
    except (TypeError, ValueError) as exc:
        raise named_for("unshard_local", exc) from exc


def scattered(lay, parts, dim: int) -> torch.Tensor:
    """The full tensor of every rank's shard ``parts`` (rank order) under layout ``lay``."""
    shape = list(parts[0].shape)
    shape[dim] *= len(parts)
    full = parts[0].new_empty(shape)
    for r, part in enumerate(parts):
        lay.scatter(full, part, len(parts), r, dim)
    return full
