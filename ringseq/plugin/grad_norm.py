"""The total norm of gradients spread over the ranks, for ``OptimizerWrapper.clip_grad_by_norm``.

Computed in two parts so that a rank failing on its own part cannot leave the others waiting:
each rank first computes its share of the norm locally (no communication), the ranks agree
that every one of them got there, and only then one all-reduce of a single float64 adds the
shares up.

A gradient is replicated (DDP: every rank holds it whole) or a DTensor whose mesh splits it
into ``n`` distinct shards (the product of the sizes of the mesh dims it is sharded on); ranks
holding the same shard hold the same values (FSDP over the other dims of the plugin's mesh,
the tp-replica sync of the plugin). Summed over all ``W`` ranks of the default group, each
shard is counted ``W / n`` times, so each rank contributes ``n / W`` of its local
``sum |g|^p``; for ``p = inf`` the shares are maxima, and copies do not matter.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .._dist import _collective_device

__all__ = ["local_norm_share", "scale_", "total_norm"]


def _local_values(grad: torch.Tensor):
    """``(local tensor, number of distinct shards of the whole gradient)``."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(grad, DTensor):
        return grad, 1
    if any(p.is_partial() for p in grad.placements):
        # (partial sums cannot be normed locally; not seen in the plugin's layouts, where
        # every gradient has its parameter's placements: reduced here, on every rank alike)
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p
                                             for p in grad.placements])
    # (every placement left splits the tensor: Shard, and FSDP2's _StridedShard under tensor
    # parallelism, which is not a Shard)
    shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements)
                       if not p.is_replicate())
    return grad.to_local(), shards


def _grouped(grads, with_shards: bool) -> dict:
    """The non-empty local tensors of ``grads`` by (device, dtype[, shards]): one foreach
    kernel per group instead of a few per gradient."""
    groups = {}
    for grad in grads:
        local, shards = _local_values(grad) if with_shards else (
            grad.to_local() if hasattr(grad, "to_local") else grad, 1)
        if local.numel():
            key = (local.device, local.dtype) + ((shards,) if with_shards else ())
            groups.setdefault(key, []).append(local)
    return groups


def local_norm_share(grads, norm_type: float) -> torch.Tensor:
    """This rank's share of the total ``norm_type`` norm of ``grads`` (see the module doc): a
    float64 scalar, ``sum |g|^p`` scaled by ``n / W`` (or the local maximum for inf). No
    communication (but for partial DTensor gradients)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    inf = math.isinf(norm_type)
    share = None
    for (device, dtype, shards), tensors in _grouped(grads, with_shards=True).items():
        # (bf16 / fp16 gradients normed in float32: their own precision loses digits)
        norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=None if dtype in (
            torch.float32, torch.float64) else torch.float32)).to(torch.float64)
        part = norms.max() if inf else (norms ** norm_type).sum() * (shards / world)
        share = part if share is None else (torch.maximum(share, part.to(share.device)) if inf
                                            else share + part.to(share.device))
    return torch.zeros((), dtype=torch.float64) if share is None else share


def scale_(grads, factor: torch.Tensor) -> None:
    """Multiplies every gradient's local values by ``factor`` (a scalar tensor), in place,
    one foreach kernel per device and dtype."""
    with torch.no_grad():
        for (device, _), tensors in _grouped(grads, with_shards=False).items():
            torch._foreach_mul_(tensors, factor.to(device))


def total_norm(share: torch.Tensor, norm_type: float) -> float:
    """The total norm from every rank's ``share`` (one all-reduce on the default group, when
    there is one): the same value on every rank."""
    inf = math.isinf(norm_type)
    if dist.is_initialized() and dist.get_world_size() > 1:
        share = share.to(_collective_device(None))
        if inf:
            # (gloo's MAX keeps or drops a NaN by the order of its operands: a NaN in one
            # rank's shard was lost; its flag travels beside the share. An infinite share
            # stays infinite: nan_to_num's default made it float64's largest finite value,
            # and error_if_nonfinite passed an infinite gradient)
            both = torch.stack([torch.nan_to_num(share.double(), nan=0.0, posinf=math.inf),
                                torch.isnan(share).double()])  # (2,)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            return math.nan if both[1] > 0 else float(both[0])
        dist.all_reduce(share, op=dist.ReduceOp.SUM)
    value = float(share)
    return value if inf else value ** (1.0 / norm_type)
