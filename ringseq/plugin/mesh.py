"""The (dp, sp) device mesh of sequence-parallel training and its process groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist

__all__ = ["MeshGroups", "build_mesh", "valid_sp_sizes"]


def valid_sp_sizes(world_size: int) -> List[int]:
    """The divisors of ``world_size``: the ``sp_size`` values that tile the world."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


@dataclass
class MeshGroups:
    """Process groups of a (dp, sp) mesh as seen from this rank.

    ``sp_group``: the ring (ranks that hold one sample's sequence shards);
    ``dp_group``: ranks with the same sequence shard of different samples. The mesh covers
    the default group exactly; gradients and the loss are reduced over it (see
    :class:`RingSequenceParallelPlugin`).
    """

    mesh: Any
    dp_size: int
    sp_size: int
    dp_rank: int
    sp_rank: int
    dp_group: Any
    sp_group: Any


def _default_device_type() -> str:
    backend = str(dist.get_backend())
    return "cuda" if (backend == "nccl" and torch.cuda.is_available()) else "cpu"


def build_mesh(sp_size: int, mesh=None, device_type: str = None) -> MeshGroups:
    """Builds (or checks) the mesh with dims ``("dp", "sp")`` over the default process group.

    Args:
        sp_size: ranks per ring (sequence-parallel degree); dp = world size // sp_size.
        mesh: an existing ``torch.distributed.device_mesh.DeviceMesh`` with dims named
            ``("dp", "sp")`` covering every rank of the default group, or None to create one
            with ``init_device_mesh(device_type, (dp, sp_size), mesh_dim_names=("dp", "sp"))``.
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` under NCCL, else ``"cpu"``.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``sp_size`` does not divide the world size (the message lists the sizes
            that do), or a passed mesh has other dim names, another sp size, or does not cover
            the world. Every rank sees the same arguments, so every rank raises, before any
            communication (``init_device_mesh`` itself does not check the product on gloo in
            torch 2.13: a (3, 1) mesh on 4 ranks is accepted silently).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("RingSequenceParallelPlugin needs an initialized process group: call "
                           "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
    world = dist.get_world_size()
    if mesh is None:
        if not isinstance(sp_size, int) or sp_size < 1 or world % sp_size:
            raise ValueError(f"sp_size={sp_size!r} does not divide the world size {world}; "
                             f"the mesh is (dp, sp) with dp * sp == {world}, so sp_size must be "
                             f"one of {valid_sp_sizes(world)}")
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type or _default_device_type(), (world // sp_size, sp_size),
                                mesh_dim_names=("dp", "sp"))
    else:
        names = tuple(mesh.mesh_dim_names or ())
        if names != ("dp", "sp"):
            raise ValueError(f"the mesh passed to RingSequenceParallelPlugin must have dims named "
                             f"('dp', 'sp'), got {names or 'unnamed dims'}")
        if mesh.size() != world:
            raise ValueError(f"the mesh covers {mesh.size()} ranks but the world has {world}; "
                             f"dp * sp must equal the world size (sp one of "
                             f"{valid_sp_sizes(world)})")
        if sp_size is not None and mesh.size(1) != sp_size:
            raise ValueError(f"sp_size={sp_size} but the mesh's 'sp' dim has size {mesh.size(1)}")
    return MeshGroups(mesh=mesh, dp_size=mesh.size(0), sp_size=mesh.size(1),
                      dp_rank=mesh.get_local_rank("dp"), sp_rank=mesh.get_local_rank("sp"),
                      dp_group=mesh["dp"].get_group(), sp_group=mesh["sp"].get_group())
