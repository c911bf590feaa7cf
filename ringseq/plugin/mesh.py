"""The (dp, sp) device mesh of sequence-parallel training and its process groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist

__all__ = ["MeshGroups", "SP_MESH_DIMS", "build_mesh", "build_sp_mesh", "valid_sp_sizes"]

# mesh dim names of the Ulysses x ring modes; the last dim holds consecutive ranks ("inner")
SP_MESH_DIMS = {True: ("dp", "sp_r", "sp_u"), False: ("dp", "sp_u", "sp_r")}


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
    #: the Ulysses x ring groups (``ringseq.SequenceParallelGroups``) of the ulysses / hybrid
    #: / double-ring modes; None for the plain ring
    sp: Any = None


def _default_device_type() -> str:
    backend = str(dist.get_backend())
    return "cuda" if (backend == "nccl" and torch.cuda.is_available()) else "cpu"


def _world_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("RingSequenceParallelPlugin needs an initialized process group: call "
                           "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
    return dist.get_world_size()


def _check_sp_size(sp_size, world: int) -> None:
    if not isinstance(sp_size, int) or sp_size < 1 or world % sp_size:
        raise ValueError(f"sp_size={sp_size!r} does not divide the world size {world}; the mesh "
                         f"is (dp, sp) with dp * sp == {world}, so sp_size must be one of "
                         f"{valid_sp_sizes(world)}")


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
    world = _world_size()
    if mesh is None:
        _check_sp_size(sp_size, world)
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


def build_sp_mesh(sp_size, sp_mode: str, ulysses_size=None, inner_ring_size=None,
                  ulysses_inner=None, mesh=None, device_type: str = None) -> MeshGroups:
    """The mesh and groups of the Ulysses / hybrid / double-ring modes over the default group.

    Args:
        sp_size: sequence-parallel ranks (ulysses_size x ring size); dp = world // sp_size.
            May be None when ``mesh`` is given.
        sp_mode, ulysses_size, inner_ring_size: see ``ringseq.hybrid.resolve_sp_sizes``.
        ulysses_inner: Ulysses groups on consecutive ranks (default True: mesh dims
            ``("dp", "sp_r", "sp_u")``) or the ring (False: ``("dp", "sp_u", "sp_r")``).
        mesh: a DeviceMesh with dims ``("dp", "sp_r", "sp_u")`` or ``("dp", "sp_u", "sp_r")``
            (the LAST of the two is the inner one), or ``("dp", "sp")`` for ``sp_mode="ring"``
            (a double ring), covering every rank; None: created with ``init_device_mesh``.
        device_type: as in :func:`build_mesh`.

    Returns MeshGroups whose ``sp_group`` is the whole sequence-parallel group (what the data
    is sharded over) and ``sp`` its SequenceParallelGroups.

    Raises RuntimeError without a process group; ValueError (every rank, before any
    communication) for sizes that do not divide the world / sp size / ring size (naming the
    ones that do), an unknown mode, or a mesh with other dim names or sizes.
    """
    from ..parallel.groups import resolve_sp_sizes, sp_groups_from_tables
    world = _world_size()
    if mesh is None:
        _check_sp_size(sp_size, world)
        U, R, I = resolve_sp_sizes(sp_mode, sp_size, ulysses_size, inner_ring_size)
        ui = True if ulysses_inner is None else bool(ulysses_inner)
        names = SP_MESH_DIMS[ui]
        shape = (world // sp_size, R, U) if ui else (world // sp_size, U, R)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type or _default_device_type(), shape,
                                mesh_dim_names=names)
    else:
        names = tuple(mesh.mesh_dim_names or ())
        allowed = [SP_MESH_DIMS[True], SP_MESH_DIMS[False]] + ([("dp", "sp")]
                                                               if sp_mode == "ring" else [])
        if names not in allowed:
            raise ValueError(f"the mesh of sp_mode={sp_mode!r} must have dims named "
                             f"{' or '.join(map(str, allowed))}, got {names or 'unnamed dims'}")
        if mesh.size() != world:
            raise ValueError(f"the mesh covers {mesh.size()} ranks but the world has {world}")
        dims = dict(zip(names, mesh.mesh.shape))
        mesh_sp = mesh.size() // dims["dp"]
        mesh_u = dims.get("sp_u", 1)
        if sp_size is not None and sp_size != mesh_sp:
            raise ValueError(f"sp_size={sp_size} but the mesh's sequence-parallel dims hold "
                             f"{mesh_sp} ranks")
        if ulysses_size is not None and ulysses_size != mesh_u:
            raise ValueError(f"ulysses_size={ulysses_size} but the mesh's 'sp_u' dim has size "
                             f"{mesh_u}")
        U, R, I = resolve_sp_sizes(sp_mode, mesh_sp, mesh_u if sp_mode == "hybrid" else
                                   ulysses_size, inner_ring_size)
        if U != mesh_u:
            raise ValueError(f"sp_mode={sp_mode!r} needs a Ulysses dim of size {U}, the mesh's "
                             f"'sp_u' dim has size {mesh_u}")
        ui = names != SP_MESH_DIMS[False]
        if ulysses_inner is not None and bool(ulysses_inner) != ui:
            raise ValueError(f"ulysses_inner={ulysses_inner} but the mesh dims {names} put the "
                             f"{'Ulysses' if ui else 'ring'} dim inside (the last dim)")
    table = mesh.mesh
    if names == ("dp", "sp"):
        table = table.unsqueeze(-1)
    elif names == SP_MESH_DIMS[False]:
        table = table.transpose(1, 2)
    sp = sp_groups_from_tables([table[d] for d in range(table.shape[0])],
                               None if I == R else I, ui)
    return MeshGroups(mesh=mesh, dp_size=table.shape[0], sp_size=sp.size,
                      dp_rank=mesh.get_local_rank("dp"), sp_rank=sp.rank,
                      dp_group=mesh["dp"].get_group(), sp_group=sp.group, sp=sp)
