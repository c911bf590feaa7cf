"""The (dp, sp, tp) device mesh of sequence-parallel training and its process groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist

__all__ = ["MeshGroups", "SP_MESH_DIMS", "build_mesh", "build_sp_mesh", "valid_sp_sizes"]

# mesh dim names of the Ulysses x ring modes; of the two sp dims the last holds consecutive
# ranks ("inner"); a "tp" dim, when present, comes last (innermost)
SP_MESH_DIMS = {True: ("dp", "sp_r", "sp_u"), False: ("dp", "sp_u", "sp_r")}


def valid_sp_sizes(world_size: int) -> List[int]:
    """The divisors of ``world_size``: the ``sp_size`` values that tile the world."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


@dataclass
class MeshGroups:
    """Process groups of a (dp, sp, tp) mesh as seen from this rank.

    ``sp_group``: the ring (ranks that hold one sample's sequence shards, same tp index);
    ``dp_group``: ranks with the same sequence shard of different samples; ``tp_group``: the
    tensor-parallel ranks sharing one sequence shard (None when tp_size is 1). The mesh covers
    the default group exactly; the loss is reduced over all of it, gradients over the dp x sp
    ranks (see :class:`RingSequenceParallelPlugin`).
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
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    #: the 1-D "tp" sub-mesh (None when the mesh has no tp dim)
    tp_mesh: Any = None
    #: the names of the mesh dims that make up sp
    sp_dims: tuple = ("sp",)
    _dp_sp_mesh: Any = None
    _replica_group: Any = False  # (False: not made yet; None: the default group)

    def dp_sp_mesh(self):
        """The 1-D mesh of the dp x sp ranks of this tp index (the ranks holding identical
        parameters: what FSDP shards over), created on first use: collective over the
        default group, so call it on every rank."""
        if self._dp_sp_mesh is None:
            self._dp_sp_mesh = self.mesh[("dp",) + tuple(self.sp_dims)]._flatten("dp_sp")
        return self._dp_sp_mesh

    def replica_group(self):
        """The ranks of this rank's model replica, sp x tp at its dp index: every rank a
        forward's collectives reach at zero stage 0 (the ring and the Ulysses all-to-alls
        over sp, the tensor-parallel ones over tp). The sp group itself without tp, None (the
        default group) without dp; else created on first use: collective over the default
        group, so call it on every rank."""
        if self._replica_group is False:
            if self.tp_size == 1:
                self._replica_group = self.sp_group
            elif self.dp_size == 1:
                self._replica_group = None
            else:
                self._replica_group = self.mesh[tuple(self.sp_dims) + ("tp",)]._flatten(
                    "sp_tp").get_group()
        return self._replica_group


def _default_device_type() -> str:
    backend = str(dist.get_backend())
    return "cuda" if (backend == "nccl" and torch.cuda.is_available()) else "cpu"


def _world_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("RingSequenceParallelPlugin needs an initialized process group: call "
                           "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
    return dist.get_world_size()


def _check_sp_size(sp_size, world: int, tp_size: int = 1) -> None:
    from ..parallel.dims import ParallelDims
    ParallelDims(world_size=world, sp_size=sp_size, tp_size=tp_size)  # raises, names the sizes


def _mesh_tp(mesh, names, tp_size) -> int:
    mesh_tp = mesh["tp"].size() if "tp" in names else 1
    if tp_size is not None and mesh_tp != tp_size:
        has = f"a 'tp' dim of size {mesh_tp}" if "tp" in names else "no 'tp' dim"
        raise ValueError(f"tp_size={tp_size} but the mesh passed to RingSequenceParallelPlugin "
                         f"has {has}")
    return mesh_tp


def _with_tp(groups: MeshGroups) -> MeshGroups:
    names = tuple(groups.mesh.mesh_dim_names)
    if "tp" in names:
        tp_mesh = groups.mesh["tp"]
        groups.tp_mesh, groups.tp_size = tp_mesh, tp_mesh.size()
        groups.tp_rank = groups.mesh.get_local_rank("tp")
        groups.tp_group = tp_mesh.get_group() if tp_mesh.size() > 1 else None
    return groups


def _check_dp_counts_up(mesh) -> None:
    """ValueError (on every rank: the mesh is the same table everywhere) unless the ranks
    along the mesh's 'dp' dim increase in every slice. torch numbers a dp process group's
    ranks in sorted order, not by mesh coordinate: with a dp dim that does not count up, the
    ranks of one replica (its sp or tp peers) took different data-parallel indices and loaded
    different samples, and FSDP's shards gathered out of order (silently wrong training and
    checkpoints)."""
    table = mesh.mesh.movedim(mesh.mesh_dim_names.index("dp"), -1)  # (..., dp)
    rows = table.reshape(-1, table.shape[-1])
    bad = [r for r in rows.tolist() if r != sorted(r)]
    if bad:
        raise ValueError(f"the mesh must list the ranks along its 'dp' dim in increasing "
                         f"order (torch numbers the data-parallel groups by sorted rank), got "
                         f"the dp slice {bad[0]} in {mesh.mesh.tolist()}; permute the other "
                         f"dims instead")


def check_sharded_order(groups: MeshGroups, fsdp: bool = True) -> None:
    """For FSDP (zero stage 2 or 3; ``fsdp``) or tensor parallelism (DTensor parameters)
    over a user's mesh: ValueError (on every rank alike)
    unless the dp x sp ranks of each tp index, flattened in the mesh's order, count up, and so
    do the tp ranks of each. FSDP shards over the flattened group, whose ranks torch numbers
    in sorted order, while DTensor and torch.distributed.checkpoint place each shard by mesh
    coordinate: with ``[[1, 0], [3, 2]]`` as ("dp", "sp") the shards were gathered and saved
    at each other's offsets, silently."""
    mesh = groups.mesh
    names = list(mesh.mesh_dim_names)
    flat = ("dp", *groups.sp_dims)
    order = [names.index(n) for n in flat] + ([names.index("tp")] if "tp" in names else [])
    table = mesh.mesh.permute(order).reshape(-1, groups.tp_size)  # (dp x sp, tp)
    rows = table.T.tolist() + table.tolist()  # dp x sp per tp index, tp per dp x sp index
    bad = [r for r in rows if r != sorted(r)]
    if bad:
        # (the remedy names what asked for the order: zero 0 helps only without tp)
        if fsdp:
            who, way = "zero_stage 2 and 3 need", "zero_stage=0"
            way += " and tp_size=1" if groups.tp_size > 1 else ""
        else:
            who, way = f"tensor parallelism (tp_size={groups.tp_size}) needs", "tp_size=1"
        raise ValueError(f"{who} a mesh whose {' x '.join(flat)} ranks (flattened in that order) "
                         f"count up for each tp index, and whose tp ranks count up (FSDP numbers "
                         f"them by sorted rank, DTensor by mesh coordinate), got {bad[0]} in "
                         f"{mesh.mesh.tolist()}; order the ranks so, or use {way}")


def build_mesh(sp_size: int, mesh=None, device_type: str = None, tp_size: int = 1
               ) -> MeshGroups:
    """Builds (or checks) the mesh with dims ``("dp", "sp", "tp")`` over the default group.

    Args:
        sp_size: ranks per ring (sequence-parallel degree); dp = world size // (sp x tp).
        mesh: an existing ``torch.distributed.device_mesh.DeviceMesh`` with dims named
            ``("dp", "sp", "tp")`` (or ``("dp", "sp")`` without tensor parallelism) covering
            every rank of the default group, or None to create one with
            ``init_device_mesh(device_type, (dp, sp, tp), mesh_dim_names=("dp", "sp", "tp"))``.
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` under NCCL, else ``"cpu"``.
        tp_size: tensor-parallel ranks (the innermost dim: consecutive ranks).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``sp_size`` x ``tp_size`` does not divide the world size (the message
            lists the sizes that do), or a passed mesh has other dim names, other sizes, or
            does not cover the world. Every rank sees the same arguments, so every rank
            raises, before any communication (``init_device_mesh`` itself does not check the
            product on gloo in torch 2.13: a (3, 1) mesh on 4 ranks is accepted silently).
    """
    world = _world_size()
    if mesh is None:
        _check_sp_size(sp_size, world, tp_size)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type or _default_device_type(),
                                (world // (sp_size * tp_size), sp_size, tp_size),
                                mesh_dim_names=("dp", "sp", "tp"))
    else:
        names = tuple(mesh.mesh_dim_names or ())
        if names not in (("dp", "sp"), ("dp", "sp", "tp")):
            raise ValueError(f"the mesh passed to RingSequenceParallelPlugin must have dims named "
                             f"('dp', 'sp', 'tp') (or ('dp', 'sp') without tensor "
                             f"parallelism), got {names or 'unnamed dims'}")
        if mesh.size() != world:
            raise ValueError(f"the mesh covers {mesh.size()} ranks but the world has {world}; "
                             f"dp * sp * tp must equal the world size (sp one of "
                             f"{valid_sp_sizes(world)})")
        _check_dp_counts_up(mesh)
        if sp_size is not None and mesh["sp"].size() != sp_size:
            raise ValueError(f"sp_size={sp_size} but the mesh's 'sp' dim has size "
                             f"{mesh['sp'].size()}")
        _mesh_tp(mesh, names, tp_size)
    return _with_tp(MeshGroups(mesh=mesh, dp_size=mesh["dp"].size(), sp_size=mesh["sp"].size(),
                               dp_rank=mesh.get_local_rank("dp"),
                               sp_rank=mesh.get_local_rank("sp"),
                               dp_group=mesh["dp"].get_group(),
                               sp_group=mesh["sp"].get_group()))


def build_sp_mesh(sp_size, sp_mode: str, ulysses_size=None, inner_ring_size=None,
                  ulysses_inner=None, mesh=None, device_type: str = None,
                  tp_size: int = 1) -> MeshGroups:
    """The mesh and groups of the Ulysses / hybrid / double-ring modes over the default group.

    Args:
        sp_size: sequence-parallel ranks (ulysses_size x ring size); dp = world // (sp x tp).
            May be None when ``mesh`` is given.
        sp_mode, ulysses_size, inner_ring_size: see ``ringseq.parallel.groups.resolve_sp_sizes``.
        ulysses_inner: Ulysses groups on consecutive ranks (default True: mesh dims
            ``("dp", "sp_r", "sp_u")``) or the ring (False: ``("dp", "sp_u", "sp_r")``); a
            ``"tp"`` dim is innermost of all.
        mesh: a DeviceMesh with dims ``("dp", "sp_r", "sp_u")`` or ``("dp", "sp_u", "sp_r")``
            (the LAST of the two is the inner one), or ``("dp", "sp")`` for ``sp_mode="ring"``
            (a double ring), each optionally followed by ``"tp"``, covering every rank; None:
            created with ``init_device_mesh``.
        device_type: as in :func:`build_mesh`.
        tp_size: tensor-parallel ranks (the ``"tp"`` dim).

    Returns MeshGroups whose ``sp_group`` is the whole sequence-parallel group (what the data
    is sharded over) and ``sp`` its SequenceParallelGroups.

    Raises RuntimeError without a process group; ValueError (every rank, before any
    communication) for sizes that do not divide the world / sp size / ring size (naming the
    ones that do), an unknown mode, or a mesh with other dim names or sizes.
    """
    from ..parallel.groups import ranks_increase, resolve_sp_sizes, sp_groups_from_tables
    world = _world_size()
    if mesh is None:
        _check_sp_size(sp_size, world, tp_size)
        U, R, I = resolve_sp_sizes(sp_mode, sp_size, ulysses_size, inner_ring_size, fn="")
        ui = True if ulysses_inner is None else bool(ulysses_inner)
        names = SP_MESH_DIMS[ui] + ("tp",)
        dp = world // (sp_size * tp_size)
        shape = (dp, R, U, tp_size) if ui else (dp, U, R, tp_size)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type or _default_device_type(), shape,
                                mesh_dim_names=names)
    else:
        names = tuple(mesh.mesh_dim_names or ())
        allowed = [SP_MESH_DIMS[True], SP_MESH_DIMS[False]] + ([("dp", "sp")]
                                                               if sp_mode == "ring" else [])
        if names not in allowed + [a + ("tp",) for a in allowed]:
            raise ValueError(f"the mesh of sp_mode={sp_mode!r} must have dims named "
                             f"{' or '.join(map(str, allowed))} (each optionally followed by "
                             f"'tp'), got {names or 'unnamed dims'}")
        if mesh.size() != world:
            raise ValueError(f"the mesh covers {mesh.size()} ranks but the world has {world}")
        _check_dp_counts_up(mesh)
        dims = dict(zip(names, mesh.mesh.shape))
        mesh_tp = _mesh_tp(mesh, names, tp_size)
        mesh_sp = mesh.size() // (dims["dp"] * mesh_tp)
        mesh_u = dims.get("sp_u", 1)
        if sp_size is not None and sp_size != mesh_sp:
            raise ValueError(f"sp_size={sp_size} but the mesh's sequence-parallel dims hold "
                             f"{mesh_sp} ranks")
        if ulysses_size is not None and ulysses_size != mesh_u:
            raise ValueError(f"ulysses_size={ulysses_size} but the mesh's 'sp_u' dim has size "
                             f"{mesh_u}")
        U, R, I = resolve_sp_sizes(sp_mode, mesh_sp, mesh_u if sp_mode == "hybrid" else
                                   ulysses_size, inner_ring_size, fn="")
        if U != mesh_u:
            raise ValueError(f"sp_mode={sp_mode!r} needs a Ulysses dim of size {U}, the mesh's "
                             f"'sp_u' dim has size {mesh_u}")
        ui = names[:3] != SP_MESH_DIMS[False]
        if ulysses_inner is not None and bool(ulysses_inner) != ui:
            raise ValueError(f"ulysses_inner={ulysses_inner} but the mesh dims {names} put the "
                             f"{'Ulysses' if ui else 'ring'} dim inside")
    table = mesh.mesh
    if "tp" not in names:
        table = table.unsqueeze(-1)              # (dp, ., ., tp)
    if names[:2] == ("dp", "sp"):
        table = table.unsqueeze(2)               # (dp, R, 1, tp)
    elif names[:3] == SP_MESH_DIMS[False]:
        table = table.transpose(1, 2)            # (dp, R, U, tp)
    # one sequence-parallel group per (dp, tp) index, created in the same order on every rank
    tables = [table[d, :, :, t] for d in range(table.shape[0]) for t in range(table.shape[3])]
    for i, t in enumerate(tables):
        if not ranks_increase(t):  # (sp_groups_from_tables' own rule, named by the mesh)
            # (before: refused by sp_groups_from_tables, naming its argument, not the mesh)
            # (the ring dim alone at U = 1: a double ring's 'sp_u' has size 1)
            dims = tuple(n for n in names if n.startswith("sp") and (U > 1 or n != "sp_u"))
            raise ValueError(f"the mesh's sequence-parallel dims {dims} "
                             f"must hold increasing global ranks in sp_mode={sp_mode!r}"
                             f"{f' with inner_ring_size={I}' if I < R else ''} (process "
                             f"groups order their ranks by global rank, which the "
                             f"{'Ulysses and ' if U > 1 else ''}ring ranks must follow), got "
                             f"{t.squeeze(-1).tolist() if U == 1 else t.tolist()}"
                             f"{' as (ring, Ulysses) rows' if U > 1 else ''} at dp index "
                             f"{i // table.shape[3]}; only a plain ring (sp_mode='ring' "
                             f"without inner_ring_size) takes a permuted sp dim (at zero "
                             f"stage 0 without tensor parallelism)")
    sp = sp_groups_from_tables(tables, None if I == R else I, ui)
    sp_dims = tuple(n for n in names if n.startswith("sp"))
    return _with_tp(MeshGroups(mesh=mesh, dp_size=table.shape[0], sp_size=sp.size,
                               dp_rank=mesh.get_local_rank("dp"), sp_rank=sp.rank,
                               dp_group=mesh["dp"].get_group(), sp_group=sp.group, sp=sp,
                               sp_dims=sp_dims))
