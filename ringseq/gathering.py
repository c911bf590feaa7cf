"""The full sequence gathered back from every rank's shard (``ringseq.unshard``).

Both directions are collectives of the whole group: the forward all-gathers the shards, the
backward all-reduces the gradient. Each is agreed on first over the ring's control channel
(its own process group), so ranks that disagree, or a rank that does not take part, raise
named errors instead of pairing these collectives with other ones of the user's. With the
consistency checks off (``ringseq.set_consistency_check(False)``) no agreement runs: then
they are plain collectives, as every ring call is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._dist import named_for
from ._hash import ints_field
from .engine.ring import get_ring, group_info_or_refuse
from .layouts import get_layout
from .layouts.sharding import scattered, seq_dim, shard_local

__all__ = ["unshard"]

# Every dtype, in one order on every rank: a dtype travels as its index here (and a mismatch
# shows it as torch.float32, ...).
_ALL_DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)},
                       key=str))

_SAME_SHARDS = ("Every rank of the group calls unshard with a shard of the same shape and "
                "dtype, the same layout and dim, and back-propagates through it.")


_SHAPE_FIELDS = 16  # the dims a signature compares (more are rare; ndim is compared too)


def _shape_fields(shape) -> tuple:
    """ndim and the first 16 sizes, -1 past the last dim: as many fields on every rank, so
    ranks with different numbers of dims compare each field with its own (before: a 3-dim
    shard's dtype field was compared with a 4-dim one's last size, and the message showed
    values nobody passed)."""
    sizes = tuple(shape[:_SHAPE_FIELDS]) + (-1,) * (_SHAPE_FIELDS - len(shape[:_SHAPE_FIELDS]))
    return (("ndim", len(shape)),) + tuple((f"shape[{i}]", n) for i, n in enumerate(sizes))


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lay, group, world_size, rank, dim, call):
        ctx.lay, ctx.group, ctx.world_size, ctx.rank, ctx.dim = lay, group, world_size, rank, dim
        ctx.call = call
        xc = x.contiguous()
        # as bytes: every dtype travels, those the backend has no type for too (gloo: uint16,
        # float8; before: its bare "Invalid scalar type" on every rank)
        # (through a flat view: a last dim of size 1 may keep any stride in a "contiguous"
        # tensor, which a dtype view refuses)
        raw = xc.reshape(-1).view(torch.uint8).view(
            *xc.shape[:-1], xc.shape[-1] * xc.element_size())  # (.., last * itemsize)
        parts = [torch.empty_like(raw) for _ in range(world_size)]  # W x raw's shape
        dist.all_gather(parts, raw, group=group)
        # (back through a flat view too: a last dim of size 0 refused the dtype view, torch's
        # "stride(1) must be divisible by 4" after the all-gather, on every rank)
        return scattered(lay, [p.reshape(-1).view(xc.dtype).view(xc.shape) for p in parts],
                         dim)  # (.., s_local * W, ..)

    @staticmethod
    def backward(ctx, grad):
        # Each rank's output depends on every rank's input: the gradient of a shard is the
        # sum over ranks of their gradient for it (gloo has no reduce_scatter, so all_reduce).
        # Agreed on first, naming the forward it belongs to: a rank that does not
        # back-propagate through unshard leaves the others a RingTimeoutError naming the
        # step, and ranks back-propagating different unshard calls (of one shape) raise,
        # instead of an all_reduce paired with another collective (before: both got wrong
        # numbers).
        get_ring(ctx.group).agree(True, "", about="unshard backward",
                                  called="unshard (backward)", hint=_SAME_SHARDS,
                                  fields=(("unshard call (its forward's agreement)", ctx.call),)
                                  + _shape_fields(tuple(grad.shape)))
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return (shard_local(g, ctx.lay, ctx.world_size, ctx.rank, ctx.dim), None, None, None,
                None, None, None)


def unshard(x_local: torch.Tensor, layout="contiguous", group=None, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`ringseq.shard`: all-gathers the shards of ``group`` into the full
    tensor.

    Every rank must pass a shard of the same shape and dtype, with the same ``layout`` and
    ``dim``. Differentiable: the gradient of the local shard is the sum over ranks of each
    rank's gradient for that shard (so when every rank computes the same loss on the result,
    scale it by 1/W); the backward is a collective too, so every rank back-propagates through
    it. Without an initialized process group (world size 1) it returns ``x_local`` unchanged
    (reordered, for a layout of your own that holds one rank's tokens in another order).

    Raises ValueError when this rank's shard length cannot be the layout's, or a layout of
    your own gives positions that are not a permutation (the other ranks raise
    ``ringseq.RingPeerError`` naming this one and its message), and
    ``ringseq.RingMismatchError`` (a ValueError) on every rank when the ranks' shapes, dtypes,
    layouts or ``dim`` differ: one control all-gather before the tensors' own, which would
    otherwise pair mismatched shards or wait forever. A rank missing from the forward or the
    backward leaves the others ``ringseq.RingTimeoutError`` after the ring timeout; ranks
    that back-propagate different unshard calls raise ``ringseq.RingMismatchError``. (All of
    this with the consistency checks on, the default; see the module doc.)
    """
    world_size, rank = group_info_or_refuse(group, "unshard", "unshard")
    if world_size == 1:
        lay = get_layout(layout, "unshard")
        dim = seq_dim("unshard", x_local, dim)
        try:
            lay.check_seqlen(x_local.shape[dim], 1)
        except ValueError:  # a length it cannot hold: returned as it is, as by the built-ins
            return x_local
        try:
            # (a layout of the user's may hold one rank's tokens in another order; positions
            # that are no permutation are refused as shard refuses them: before, returned as
            # they were)
            reorder = not lay.identity_on_one_rank(x_local.shape[dim])
        except ValueError as exc:
            raise named_for("unshard", exc) from exc
        return scattered(lay, [x_local], dim) if reorder else x_local
    # Whatever this rank refuses is agreed on before the all-gather, which the other ranks
    # would otherwise wait in.
    problem, lay, code, text = None, None, -1, "?"
    try:
        lay = get_layout(layout, "unshard")
        code = lay.signature_code  # (a documents layout's boundaries: their own field below)
        # (here: a user layout whose text raises is refused like its other errors, not raised
        # on this rank alone before the agreement, pairing the peers with its next call)
        text = lay.signature_text(code)
        dim = seq_dim("unshard", x_local, dim)
        if x_local.is_meta:  # (no data: the all-gather would return at once on this rank only)
            raise ValueError("unshard: x_local must be a tensor with data (CPU or CUDA), got "
                             "one on the meta device")
        lay.check_local_seqlen(x_local.shape[dim], world_size)
        # (a layout of the user's: its positions over the ranks are checked here, once per
        # length, rather than after the all-gather)
        lay.check_positions(x_local.shape[dim] * world_size, world_size)
    except TypeError as exc:
        problem, dim = exc, -1
    except ValueError as exc:
        problem, dim = named_for("unshard", exc), -1
    except Exception as exc:  # noqa: BLE001 - a user layout's own error meets the peers too
        problem, dim = exc, -1
    shape = tuple(x_local.shape) if torch.is_tensor(x_local) else ()
    dtype = getattr(x_local, "dtype", None)
    fields = _shape_fields(shape) + (
        ("dtype", _ALL_DTYPES.index(dtype) if dtype in _ALL_DTYPES else -1, _ALL_DTYPES),
        ("layout", code, "layout", text), ("dim", dim),
        # (shown by value, around the first difference; before: "layout #<hash>" per rank)
        ints_field("layout documents (cu_seqlens)", getattr(lay, "documents", None)))
    ring = get_ring(group, "unshard")
    call = ring.control_count  # (the number this forward's agreement runs under)
    ring.agree(problem is None, str(problem), error=problem, about="unshard", called="unshard",
               hint=_SAME_SHARDS, fields=fields)
    return _Unshard.apply(x_local, lay, group, world_size, rank, dim, call)
