"""The sizes of a dp x sp x tp training mesh, validated once, without any process group.

``ParallelDims(world_size=8, sp_size=2, tp_size=2, zero_stage=3)`` is what the plugin resolves
its arguments into before it creates a single process group: every rank builds the same object
from the same arguments, so every rank raises the same ValueError, and none communicates
first. The object is frozen; ``dims.with_model(num_heads, num_kv_heads)`` returns a copy that
also checks a model's head counts (known only when the model is boosted).

The mesh (docs/parallelism.md): ``world = dp x sp x tp`` with tp innermost (consecutive ranks),
then sp, then dp. ``sp`` is the sequence-parallel group (``ulysses_size x ring_size`` in the
hybrid modes, ringseq.parallel.groups); ``tp`` splits attention heads and MLP columns (DTensor) and the
residual stream's sequence (Megatron sequence parallelism); FSDP (zero_stage 2, 3) shards
parameters over the flattened ``dp x sp`` ranks, which hold identical parameters.

Head rule: tensor parallelism gives every tp rank whole heads, so ``tp_size`` divides both
``num_attention_heads`` and ``num_key_value_heads`` (K/V heads are not replicated across tp
ranks: pick a tp size that divides the K/V heads, or Ulysses for the rest of the split). The
Ulysses degree then splits each tp rank's ``num_attention_heads / tp_size`` query heads
(K/V heads replicated inside the all-to-all as ``ringseq.parallel.ulysses`` describes).

Sequence rule: a sequence of length s is split over sp by the data layout (zigzag: 2 sp
chunks, ...) and each sp shard contiguously over tp, so s must be a multiple of
``dims.seq_multiple(layout)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from .._args import divisors, shown_divisors
from .._dist import named_for

__all__ = ["ParallelDims", "ZERO_STAGES"]

#: zero_stage values the plugin implements (see ParallelDims.zero_stage)
ZERO_STAGES = (0, 2, 3)
# FSDP2 and tensor parallelism through the plugin, measured: on torch 2.11 tensor parallelism
# fails in DTensor (the LM head's reshape of a sequence-sharded activation) and the failure
# completions meet FSDP2 internals of another shape; torch 2.12 trains exactly (the full
# suite); recovering FSDP2 after a failed step needs 2.13 (fsdp_replay.FsdpReplay.reset).
SHARDED_MIN_TORCH = "2.12"


def torch_version():
    """The torch in use (a TorchVersion: compares with strings such as "2.12")."""
    return torch.__version__


def sharding_refusal(zero_stage: int, tp_size: int) -> Optional[str]:
    """Why this torch cannot run FSDP2 (zero_stage 2 / 3) or tensor parallelism through the
    plugin, or None. The plugin refuses with it; the memory planner, which plans a mesh for
    any machine, does not."""
    version = torch_version()
    if (zero_stage >= 2 or tp_size > 1) and version < SHARDED_MIN_TORCH:
        return (f"zero_stage={zero_stage} / tp_size={tp_size} (FSDP2 / tensor parallelism) "
                f"need torch >= {SHARDED_MIN_TORCH}, found torch {version}; "
                f"zero_stage=0 with tp_size=1 (DDP) runs on it")
    return None


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def renamed_dims_error(fn: str, exc: ValueError) -> ValueError:
    """A ParallelDims refusal named for ``fn``, the public call that made the mesh (the user
    never calls ParallelDims)."""
    return ValueError(f"{fn}: {str(exc).removeprefix('ParallelDims: ')}")


@dataclass(frozen=True)
class ParallelDims:
    """Validated sizes of the dp x sp x tp mesh (see the module doc).

    Args:
        world_size: ranks in all (the default process group's size).
        sp_size: sequence-parallel ranks per sample (ulysses_size x ring size).
        tp_size: tensor-parallel ranks (1: none).
        zero_stage: 0 = replicated parameters (DDP, or DTensor TP with summed gradients);
            2 = FSDP2 keeping gathered parameters from forward to backward
            (``reshard_after_forward=False``); 3 = FSDP2 resharding after forward. Stage 1
            (sharded optimizer state only) is not implemented: stage 2 shards the
            optimizer state, gradients and (between steps) parameters at the same
            gradient traffic.
        sp_mode, ulysses_size, inner_ring_size: the sequence-parallel mode and its sub-sizes
            (``ringseq.parallel.groups.resolve_sp_sizes``); after validation ``ulysses_size`` and
            ``inner_ring_size`` hold the resolved values (1 and the ring size by default).
        num_heads, num_kv_heads: a model's attention heads (None: not checked yet; see
            :meth:`with_model`).

    Attributes set by validation: ``dp_size = world_size / (sp_size * tp_size)``,
    ``ring_size = sp_size / ulysses_size``.

    Raises ValueError (nothing communicates) naming the argument, the value and the values
    that would work: a size that is not a positive integer or does not divide what it must,
    an unknown sp_mode, a zero_stage not in (0, 2, 3), heads tp_size or the Ulysses degree
    cannot split.
    """

    world_size: int
    sp_size: int
    tp_size: int = 1
    zero_stage: int = 0
    sp_mode: str = "ring"
    ulysses_size: Optional[int] = None
    inner_ring_size: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    dp_size: int = field(init=False)
    ring_size: int = field(init=False)

    def __post_init__(self):
        from .groups import resolve_sp_sizes  # pure Python: no process group
        world, sp, tp = self.world_size, self.sp_size, self.tp_size
        if not _positive_int(world):
            raise ValueError(f"ParallelDims: world_size must be a positive integer, got "
                             f"{world!r}")
        for name, value in (("tp_size", tp), ("sp_size", sp)):
            if isinstance(value, bool) or not isinstance(value, int):
                # (before the divisibility: 2.0 "did not divide" a world of 2)
                raise ValueError(f"ParallelDims: {name}={value!r} must be a positive int, not "
                                 f"a {type(value).__name__}")
            if value < 1:  # (before: "-2 does not divide the world size 4", which it does)
                raise ValueError(f"ParallelDims: {name}={value!r} must be a positive int (a "
                                 f"number of ranks)")
        if not _positive_int(tp) or world % tp:
            raise ValueError(f"ParallelDims: tp_size={tp!r} does not divide the world size "
                             f"{world}; tp_size must be one of {shown_divisors(world)}")
        if not _positive_int(sp) or world % (sp * tp):
            raise ValueError(
                f"ParallelDims: sp_size={sp!r} x tp_size={tp} does not divide the world size "
                f"{world}; the mesh is dp x sp x tp, so with tp_size={tp} sp_size must be one "
                f"of {shown_divisors(world // tp)}")
        if (self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool)
                or not isinstance(self.zero_stage, int)):  # 3.0 == 3, but it is no stage
            raise ValueError(
                f"ParallelDims: zero_stage={self.zero_stage!r} is not supported; supported: "
                f"{list(ZERO_STAGES)} (0: replicated parameters; 2: FSDP2 sharding optimizer "
                f"state, gradients and parameters, keeping gathered parameters from forward "
                f"to backward; 3: FSDP2 resharding after forward too). ZeRO-1 alone is not "
                f"implemented: zero_stage=2 saves its memory and more at the same gradient "
                f"traffic")
        try:
            U, R, I = resolve_sp_sizes(self.sp_mode, sp, self.ulysses_size,
                                       self.inner_ring_size, fn="ParallelDims")
        except ValueError as exc:  # (the plugin and apply rename "ParallelDims")
            raise named_for("ParallelDims", exc) from None
        object.__setattr__(self, "ulysses_size", U)
        object.__setattr__(self, "inner_ring_size", I)
        object.__setattr__(self, "ring_size", R)
        object.__setattr__(self, "dp_size", world // (sp * tp))
        if self.num_heads is not None:
            self._check_heads()

    def _check_heads(self) -> None:
        from .ulysses import ulysses_heads
        h, tp, U = self.num_heads, self.tp_size, self.ulysses_size
        hk = self.num_kv_heads if self.num_kv_heads is not None else h
        if not (_positive_int(h) and _positive_int(hk)) or h % hk:
            raise ValueError(f"ParallelDims: num_heads={h!r} must be a positive multiple of "
                             f"num_kv_heads={hk!r}")
        if h % tp or hk % tp:
            # (sizes that also fit the mesh with this sp size: dp x sp x tp = world)
            ok = [t for t in divisors(math.gcd(h, hk))
                  if (self.world_size // self.sp_size) % t == 0]
            raise ValueError(
                f"ParallelDims: tp_size={tp} cannot split num_attention_heads={h} and "
                f"num_key_value_heads={hk}: tensor parallelism gives every rank whole query "
                f"and K/V heads, so tp_size must divide both; tp_size values that do (and "
                f"divide the world size {self.world_size} / sp_size={self.sp_size}): {ok}")
        if (h // tp) % U:
            # (the degrees dividing both sp_size and the heads: of their gcd, never a huge n)
            ok = divisors(math.gcd(self.sp_size, h // tp))
            heads = (f"num_attention_heads={h}" if tp == 1 else
                     f"the num_attention_heads={h} / tp_size={tp} = {h // tp} query heads of a "
                     f"tensor-parallel rank")
            if self.sp_mode == "ulysses":  # (the degree is sp_size itself there)
                raise ValueError(
                    f"ParallelDims: sp_mode='ulysses' splits {heads} over all sp_size={U} "
                    f"ranks, which cannot be: each rank of the all-to-all takes whole query "
                    f"heads; use sp_mode='hybrid' with a ulysses_size that divides them and "
                    f"sp_size={self.sp_size} ({[u for u in ok if u > 1] or 'none above 1'}), "
                    f"or sp_mode='ring'")
            raise ValueError(
                f"ParallelDims: ulysses_size={U} cannot split {heads}: each rank of the "
                f"all-to-all takes whole query heads; ulysses_size values that divide them "
                f"and sp_size={self.sp_size}: {ok}")
        ulysses_heads(h // tp, hk // tp, U, what="query heads per tensor-parallel rank",
                      fn="ParallelDims", what_kv="K/V heads per tensor-parallel rank")

    def with_model(self, num_heads: Optional[int], num_kv_heads: Optional[int] = None, *,
                   fn: str = "ParallelDims") -> "ParallelDims":
        """A copy that also checks a model's head counts (None: nothing to check). Raises
        ValueError when the mesh cannot split the heads, named for ``fn`` (the public call that
        checks them, e.g. ``boost``)."""
        if num_heads is None:
            return self
        try:
            return replace(self, num_heads=int(num_heads),
                           num_kv_heads=None if num_kv_heads is None else int(num_kv_heads))
        except ValueError as exc:
            if fn == "ParallelDims":
                raise
            raise renamed_dims_error(fn, exc) from None

    @property
    def dp_sp_size(self) -> int:
        """Ranks holding identical parameters: what FSDP shards over."""
        return self.dp_size * self.sp_size

    @property
    def sharded(self) -> bool:
        """Whether parameters become DTensors (FSDP or tensor parallelism)."""
        return self.zero_stage >= 2 or self.tp_size > 1

    def seq_multiple(self, layout="zigzag") -> int:
        """What the global sequence length must be a multiple of: the data layout's multiple
        over sp (``"documents"``: sp, packing pads to it), and sp x tp for the split of every
        sp shard over tp. ``layout``: a name or a ``ringseq.layouts.Layout``. In ``"ring"``
        mode the plugin's loader shards with the layout itself, also over one rank (zigzag:
        an even length at sp 1); the other modes split a ring of one contiguously."""
        from ..layouts import get_layout
        from .sp_layout import ring_layout, sp_multiple
        lay = (get_layout(layout, "seq_multiple") if self.sp_mode == "ring"
               else ring_layout(layout, self.ring_size, "seq_multiple"))
        if self.ulysses_size == 1:
            m = lay.multiple(self.sp_size)
        else:  # (the placement does not matter; before, its coordinates were built: a
            # memory estimate of a 2**24-rank mesh took seconds, and the CLI hours)
            m = sp_multiple(lay, self.ring_size, self.ulysses_size)
        st = self.sp_size * self.tp_size
        return m * st // math.gcd(m, st)

    def __repr__(self):
        extra = ("" if self.sp_mode == "ring" and self.ulysses_size == 1
                 and self.inner_ring_size == self.ring_size
                 else f", sp_mode={self.sp_mode!r}, ulysses={self.ulysses_size}, "
                      f"ring={self.ring_size}, inner_ring={self.inner_ring_size}")
        heads = ("" if self.num_heads is None
                 else f", heads={self.num_heads}/{self.num_kv_heads or self.num_heads}")
        return (f"ParallelDims(world={self.world_size}, dp={self.dp_size}, sp={self.sp_size}, "
                f"tp={self.tp_size}, zero_stage={self.zero_stage}{extra}{heads})")
