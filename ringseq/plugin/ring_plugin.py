"""RingSequenceParallelPlugin: ring attention over ``sp`` ranks, data parallel over ``dp``."""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (DataLoader, IterableDataset, RandomSampler,
                              SequentialSampler)

from .._args import as_int, check_ignore_index, given, int_if_integer, is_bool
from .._dist import named_for
from .._hash import ints_field, stable_code
from ..engine.integrity import TEXT
from ..engine.ring import get_ring, reset_ring
from ..layouts import PerBatchDocuments, get_layout, layout_field
from ..parallel.dims import ParallelDims, renamed_dims_error, sharding_refusal
from ..parallel.groups import SP_MODES
from .base import Plugin
from .dataloader import ShardedDataLoader, pack_documents
from .loader_state import INT64_LIMIT as _INT64, ResumableDistributedSampler
from .ddp_sum import DdpSum, sum_allreduce_hook
from .mesh import _world_size, build_mesh, build_sp_mesh, check_sharded_order
from .policy import is_transformers_model, switch_attention
from .precision import PRECISIONS, Precision, check_precision_name
from .sharded_checkpoint import DistributedCheckpointIO
from .wrappers import (BOTH_CHECKPOINTINGS, FailureReporter, ModelWrapper, OptimizerWrapper,
                       ReducedGrads, SequenceParallelLoss, StepTag, hf_checkpointing)

__all__ = ["RingSequenceParallelPlugin"]


# Buffers are identical on every rank (deterministic RoPE tables), so re-broadcasting them
# before every forward is wasted communication; newer torch renamed the switch.
_NO_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in
                   inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
                   else "broadcast_buffers")

# The DataLoader settings a loader passed to boost keeps when the plugin rebuilds it over the
# data-parallel groups (besides batch size, order, drop_last, pin_memory and workers).
_LOADER_SETTINGS = ("collate_fn", "worker_init_fn", "timeout", "multiprocessing_context",
                    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device",
                    "in_order")


_DEVICE_TYPES = ("cpu", "cuda")


def _length(x) -> str:
    try:
        return str(len(x))
    except TypeError:
        return "unknown"
# The dim names a mesh passed to the plugin may have (build_mesh / build_sp_mesh), each
# optionally followed by "tp": a mismatch between ranks names them.
_MESH_NAMES = ("none passed", "dp,sp", "dp,sp_r,sp_u", "dp,sp_u,sp_r", "other names")


def _mesh_fields(mesh) -> tuple:
    """A passed DeviceMesh as control fields: its shape then its ranks (a mismatch lists
    them), its dim names and its device type (the same fields on every rank)."""
    kinds = ("none passed",) + _DEVICE_TYPES + ("other",)
    if mesh is None:
        return (ints_field("mesh shape and ranks", None), ("mesh dim names", 0, _MESH_NAMES),
                ("mesh tp dim", 0, "bool"), ("mesh device type", 0, kinds))
    table = mesh.mesh
    dims = tuple(mesh.mesh_dim_names or ())
    tp = dims[-1:] == ("tp",)
    names = ",".join(dims[:-1] if tp else dims)
    return (ints_field("mesh shape and ranks", [*table.shape, *table.flatten().tolist()]),
            ("mesh dim names", _MESH_NAMES.index(names) if names in _MESH_NAMES[1:-1]
             else len(_MESH_NAMES) - 1, _MESH_NAMES),
            ("mesh tp dim", int(tp), "bool"),
            ("mesh device type", kinds.index(mesh.device_type) if mesh.device_type in kinds
             else len(kinds) - 1, kinds))


def _style_text(style) -> str:
    """A plan entry as text alike on every rank that gave it alike: a plan name itself, a
    ParallelStyle by its type and its options (layouts, use_local_output: styles of one type
    with other options shard other ways). An option whose repr holds an address (a callable,
    say) counts by its type, since addresses differ between processes."""
    if isinstance(style, str):
        return style
    options = sorted((name, text if " at 0x" not in (text := repr(value))
                      else type(value).__qualname__)
                     for name, value in vars(style).items() if not name.startswith("_"))
    return f"{type(style).__qualname__}{options}"


def _plan_code(tp_plan) -> int:
    """A hash of a tp_plan's patterns and their entries (``_style_text``)."""
    if tp_plan is None:
        return 0
    if not isinstance(tp_plan, dict):
        return 1  # (refused at boost, on every rank alike)
    entries = sorted((str(k), _style_text(v)) for k, v in tp_plan.items())
    return 2 + stable_code(repr(entries))


def _option_fields(dims: ParallelDims, layout, precision: str, ignore_index: int,
                   ulysses_inner, activation_checkpointing, tp_plan, device,
                   inner_ring_given: bool, mesh) -> tuple:
    """The plugin options every rank must share, as control fields ``(name, int[, kind])``."""
    return (("sp_size", dims.sp_size), ("tp_size", dims.tp_size),
            # (meshes that differ build different groups: rings of other ranks, a hang)
            *_mesh_fields(mesh),
            ("zero_stage", dims.zero_stage), ("sp_mode", SP_MODES.index(dims.sp_mode), SP_MODES),
            ("ulysses_size", dims.ulysses_size or 0),
            ("inner_ring_size", dims.inner_ring_size or 0),
            # (as given too: None builds a plain ring's mesh, the ring size a double ring's
            # groups of one ring; ranks must build alike)
            ("inner_ring_size given", int(inner_ring_given), "bool"),
            ("ulysses_inner", -1 if ulysses_inner is None else int(bool(ulysses_inner))),
            layout_field("layout", layout, layout.code),
            ("precision", tuple(PRECISIONS).index(precision), tuple(PRECISIONS)),
            ("ignore_index", int(ignore_index)),
            ("activation_checkpointing", int(bool(activation_checkpointing)), "bool"),
            # (its entries: plans of one length that differ built other shards, a hang)
            ("tp_plan", _plan_code(tp_plan)),
            ("device", _DEVICE_TYPES.index(torch.device(device).type) if device is not None
             else len(_DEVICE_TYPES), (*_DEVICE_TYPES, "default")))


def _model_fields(model: nn.Module) -> tuple:
    """What every rank's model must share before it is boosted, as control fields: parameter
    count and elements per dtype, the elements that train, and a hash of every parameter's
    and buffer's name, shape and dtype."""
    params = list(model.parameters())
    per_dtype = {dtype: 0 for dtype in (torch.float32, torch.bfloat16, torch.float16,
                                        torch.float64)}
    other = 0
    for p in params:
        if p.dtype in per_dtype:
            per_dtype[p.dtype] += p.numel()
        else:
            other += p.numel()
    # names, shapes and dtypes of every tensor, in order: what rank 0's broadcast pairs
    def layout(named) -> int:
        return stable_code("|".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in named))
    # (by name, shown where the ranks differ: the elements alone did not say which)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    shown = ", ".join(frozen[:8]) + (f" ... ({len(frozen)} in all)" if len(frozen) > 8 else "")
    return (("parameters", len(params)),
            *((f"{str(dtype).replace('torch.', '')} parameter elements", n)
              for dtype, n in per_dtype.items()),
            ("parameter elements of other dtypes", other),
            ("trainable parameter elements", sum(p.numel() for p in params if p.requires_grad)),
            ("frozen parameters", stable_code("|".join(frozen)), TEXT, shown or "none"),
            ("parameter names, shapes and dtypes (hash)", layout(model.named_parameters())),
            ("buffer names, shapes and dtypes (hash)", layout(_persistent_buffers(model))))


def _stepped_params(model: nn.Module, optimizer, names) -> tuple:
    """(the parameters of ``model`` the boosted ``optimizer`` steps, the others): every
    parameter is stepped without an optimizer. ``names``: ``parameter_names`` taken before
    ``model`` was sharded (``optimizer`` still holds the parameters from then)."""
    params = list(model.named_parameters())
    if optimizer is None:
        return [p for _, p in params], []
    optim = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
    held = {names[id(p)] for group in optim.param_groups for p in group["params"]}
    stepped = [p for n, p in params if n in held]
    return (stepped, [p for n, p in params if n not in held]) if stepped else (
        [p for _, p in params], [])


def _persistent_buffers(model: nn.Module) -> list:
    """(name, buffer) of the model's buffers that its state dict holds. Non-persistent ones
    (RoPE tables, caches some models grow on a long forward) are recomputed from the config:
    neither compared between ranks nor broadcast."""
    skip = {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            for name in getattr(module, "_non_persistent_buffers_set", ())}
    return [(name, b) for name, b in model.named_buffers() if name not in skip]


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Rank 0's parameters and persistent buffers on every rank, in place, as DDP starts.
    Where the plugin does not use DDP (FSDP, tensor parallelism, a frozen model), ranks that
    built different initial weights (no common seed) would otherwise train a mix of each
    rank's shards, or tp ranks keep different replicated norms, and no rank would hold the
    model it saves.
    Collective over the default group, one broadcast per tensor; the ranks agreed on the
    tensors' names, shapes and dtypes first (``_model_fields``), so the broadcasts pair."""
    with torch.no_grad():
        for t in list(model.parameters()) + [b for _, b in _persistent_buffers(model)]:
            t = t.detach()
            if t.is_contiguous():
                dist.broadcast(t, src=0)
            else:  # (NCCL broadcasts contiguous memory only)
                whole = t.contiguous()
                dist.broadcast(whole, src=0)
                t.copy_(whole)


class RingSequenceParallelPlugin(Plugin):
    """Sequence parallelism with ring attention on ``sp`` ranks, data parallelism over the rest,
    optionally with tensor parallelism (``tp_size``) and FSDP (``zero_stage``).

    The W ranks of the default process group form a (dp, sp, tp) mesh, dp = W / (sp x tp)
    (``init_device_mesh(device, (dp, sp, tp), mesh_dim_names=("dp", "sp", "tp"))``, or
    ``mesh``). Rank (d, r, t) holds sequence shard r (``layout``) of the samples of
    data-parallel group d; the tp ranks t of one (d, r) split its heads and MLP columns and,
    between blocks, its sequence again (docs/parallelism.md).

    Args:
        sp_size: ranks per ring; must divide the world size.
        layout: ``"zigzag"`` (default), ``"contiguous"``, ``"stripe"`` or a Layout.
        precision: ``"fp32"`` (default), ``"bf16"`` (autocast) or ``"fp16"`` (autocast and a
            GradScaler); see :class:`ringseq.plugin.precision.Precision` for devices.
        mesh: a ``DeviceMesh`` covering every rank, instead of creating one (the same on
            every rank: RingMismatchError otherwise), with dims ``("dp", "sp")`` for
            ``sp_mode="ring"`` (plain or double ring) and ``("dp", "sp_r", "sp_u")`` or
            ``("dp", "sp_u", "sp_r")`` (the last is the inner one) for ``"ulysses"`` and
            ``"hybrid"``; each followed by ``"tp"`` with tensor parallelism.
        policy: ``policy(model, group, layout, backend) -> int`` switching the model's
            attention to ring attention (default: see :mod:`ringseq.plugin.policy`).
        backend: ring block kernel backend (None: the best available).
        ignore_index: label value without a target.
        device: where the model and the loader's batches are put (default:
            ``cuda:<current>`` under NCCL, else CPU).
        ddp_kwargs: extra ``DistributedDataParallel`` arguments (e.g. ``bucket_cap_mb``,
            ``find_unused_parameters``): only where DDP runs (zero_stage 0, tp_size 1; a
            single process has no DDP and ignores them); ValueError with tp_size > 1 or
            zero_stage >= 2, and for ``module`` / ``process_group`` (the plugin's).
        tp_size (keyword-only): tensor-parallel ranks (1: none): DTensor tensor parallelism
            with Megatron sequence parallelism on the "tp" dim (``ringseq.parallel.tp``), from
            the plan a transformers model declares or ``tp_plan``.
        zero_stage (keyword-only): 0 (replicated parameters: DDP, or DTensor gradients summed
            by ``ringseq.parallel.grad_sync`` with tp), 2 or 3 (FSDP2 over the dp x sp ranks,
            ``ringseq.parallel.fsdp``: 3 reshards parameters after forward, 2 keeps them until
            backward; parameters, gradients and optimizer state are 1 / (dp x sp) per rank).
            1 raises (see ``ringseq.parallel.dims.ParallelDims``).
        activation_checkpointing (keyword-only): recompute every decoder layer in the backward,
            keeping the attention operator's outputs (the output and lse; under Ulysses and
            the hybrid mode also the head shards of q, k, v and the output) so that no ring
            or all-to-all communication is repeated (``ringseq.parallel.checkpointing``).
        tp_plan (keyword-only): for models without a declared transformers plan, a dict of
            module-name patterns to ``"colwise"`` / ``"rowwise"`` /
            ``"replicated_with_grad_allreduce"`` or to torch ``ParallelStyle`` objects.

    Gradient reduction (why gradients are SUMMED over all dp x sp ranks, never averaged).
    Let a global step see the dp x b sequences of all groups, with T targets that are not
    ``ignore_index`` in total and per-token losses l_t. Single-process training minimizes
    ``L = (1/T) * sum_t l_t``. The plugin's criterion (:class:`SequenceParallelLoss`) all-reduces
    the pair (local sum of l_t, local count) over ALL ranks, so every rank evaluates exactly L,
    and the backward of that all-reduce is the identity: rank (d, r)'s autograd receives
    dL/d(its logits) and, through ring attention (whose backward brings the dK/dV of every
    block home to the rank that produced K/V), dL/d(its activations). Every use of a replicated
    parameter in the step happens on exactly one rank, so by the chain rule
    ``dL/dtheta = sum over all (d, r) of g_(d,r)``, with g_(d,r) the gradient autograd
    accumulates on rank (d, r). Hence DDP runs over the whole dp x sp group with a SUM hook:
    no division by sp (each sp rank holds a share of the sequence, not a copy of the loss) and
    none by dp either, because T already counts the targets of every dp group -- averaging
    per-group means instead would weight groups with fewer targets too much whenever their
    token counts differ. The step thus equals single-process training on the whole global
    batch, up to float summation order. With ``no_sync`` over k micro-batches the gradients of
    the k global means add up (scale the loss by 1/k for their average). Without ``no_sync``
    (zero stage 0), a second backward would sum the already summed gradients again (W times
    too large): the boosted optimizer's ``step`` then raises ValueError instead of stepping
    (its ``step`` and ``zero_grad`` reset the count).

    The same argument holds with ``zero_stage`` 2/3 (FSDP's reduce-scatter is made a plain SUM
    over the dp x sp ranks: divide factor 1, SUM reductions) and with ``tp_size`` > 1, where the
    loss also sums over the tp ranks (each computes the logits of its own share of the
    tokens): a tp-sharded parameter element is used on one tp rank per (dp, sp) rank, so its
    gradient is the sum over dp x sp of that rank's; a replicated one (norms, embedding, LM
    head) is used by each tp rank on a disjoint share of tokens (or heads), so its gradient is
    the sum over dp x sp x tp (DTensor's ``Partial`` over tp, then the dp x sp sum).

    Sequence-parallel modes (keyword-only; ColossalAI's ``sequence_parallelism_mode``):

    * ``sp_mode="ring"`` (default): ring attention over the ``sp`` ranks, as above;
      ``inner_ring_size=I`` makes it a double ring (inner rings of I consecutive ranks,
      ``ringseq.double_ring``).
    * ``sp_mode="ulysses"``: DeepSpeed-Ulysses all-to-all over the ``sp`` ranks
      (``ringseq.ulysses_attn_func``); the data is split contiguously (``layout`` does not
      apply: the all-to-all gathers the whole sequence).
    * ``sp_mode="hybrid"``: Ulysses over ``ulysses_size`` ranks x ring over
      ``sp_size / ulysses_size`` (``ringseq.usp_attn_func``), ``layout`` on the ring dim,
      ``inner_ring_size`` optional. The mesh is ``("dp", "sp_r", "sp_u")`` (Ulysses inner,
      default) or ``("dp", "sp_u", "sp_r")`` (``ulysses_inner=False``: ring inner).

    In these modes the loader shards with ``plugin.data_layout`` over the whole sequence-parallel
    group (``plugin.sp_group``; ``plugin.sp`` holds all the groups), transformers models are
    switched with ``apply(..., group=plugin.sp)``, modules on the ``ringseq_switch`` convention
    receive ``plugin.sp`` as their group (``sdpa_on_ring`` handles it) and ``RingAttention``
    submodules raise (they run the plain ring only). The gradient argument below is unchanged:
    every use of a parameter still happens on exactly one rank.

    Raises (at construction, on every rank, before any process group is made: the options are
    agreed on first, on the default group's control channel): ValueError for an
    sp_size x tp_size that does not divide the world size (listing the sizes that do), an
    unknown layout, precision or sp_mode, a ulysses_size / inner_ring_size that does not
    divide sp_size / the ring size (listing the ones that do), a zero_stage not in (0, 2, 3),
    fp16 with sharded parameters (use bf16), packed documents with tp_size > 1, a mesh of the
    wrong shape or dim names; RingMismatchError naming each rank's value when ranks pass
    different options; RuntimeError without a process group. ``configure`` raises on
    every rank, before modifying the model (refusals are agreed on in one control all-gather,
    with a signature of the model: models that differ raise RingMismatchError), for a
    transformers model whose heads tp_size x the Ulysses degree cannot split (naming the sizes
    that can), tp_size > 1 without a plan (neither a declared transformers plan nor
    ``tp_plan``), a plan that does not fit the model, and an optimizer that already took a
    step.
    """

    def __init__(self, sp_size: int, layout="zigzag", precision: str = "fp32", mesh=None,
                 policy: Optional[Callable] = None, backend: Optional[str] = None,
                 ignore_index: int = -100, device=None, ddp_kwargs: Optional[dict] = None, *,
                 sp_mode: str = "ring", ulysses_size: Optional[int] = None,
                 inner_ring_size: Optional[int] = None, ulysses_inner: Optional[bool] = None,
                 tp_size: int = 1, zero_stage: int = 0, activation_checkpointing: bool = False,
                 tp_plan: Optional[dict] = None):
        # Every option checked on this rank, then agreed on by every rank (one control
        # all-gather on the default group) before the first process group is made: options
        # that differ between ranks (or that one rank alone refuses) raise on every rank
        # instead of leaving some of them inside init_device_mesh.
        refusal = None
        # (NumPy's integers are sizes too: as ints from here on, every check and group below)
        sp_size, tp_size, zero_stage, ulysses_size, inner_ring_size = map(
            int_if_integer, (sp_size, tp_size, zero_stage, ulysses_size, inner_ring_size))
        try:
            from torch.distributed.device_mesh import DeviceMesh
            if mesh is not None and not isinstance(mesh, DeviceMesh):
                raise TypeError(f"mesh must be a torch DeviceMesh or None, got "
                                f"{type(mesh).__name__}")
            if ulysses_inner is not None and not is_bool(ulysses_inner):
                # ("no" is truthy: it would have put the Ulysses groups inside)
                raise TypeError(f"ulysses_inner must be a bool or None, got {ulysses_inner!r}")
            self.layout = get_layout(layout, "RingSequenceParallelPlugin")
            check_precision_name(precision)
            # every size checked at once, on every rank alike, before any process group exists
            # (a user's hybrid mesh carries the Ulysses degree in its "sp_u" dim)
            u = ulysses_size
            if u is None and mesh is not None and sp_mode == "hybrid" and \
                    "sp_u" in (mesh.mesh_dim_names or ()):
                u = mesh["sp_u"].size()
            self.dims = ParallelDims(world_size=_world_size(), sp_size=sp_size, tp_size=tp_size,
                                     zero_stage=zero_stage, sp_mode=sp_mode, ulysses_size=u,
                                     inner_ring_size=inner_ring_size)
            too_old = sharding_refusal(self.dims.zero_stage, self.dims.tp_size)
            if too_old:
                raise ValueError(too_old)
            if self.dims.sharded and precision == "fp16":
                raise ValueError(f"precision='fp16' needs one GradScaler decision over "
                                 f"gradients that are sharded with tp_size={tp_size} / "
                                 f"zero_stage={zero_stage}; use precision='bf16' (no loss "
                                 f"scaling needed)")
            if ddp_kwargs is not None and not isinstance(ddp_kwargs, dict):
                raise ValueError(f"ddp_kwargs must be a dict of DistributedDataParallel "
                                 f"arguments, got {type(ddp_kwargs).__name__}")
            if ddp_kwargs and self.dims.sharded:
                raise ValueError(f"ddp_kwargs {sorted(ddp_kwargs)} apply to "
                                 f"DistributedDataParallel, which the plugin uses only at "
                                 f"zero_stage=0 with tp_size=1; got zero_stage={zero_stage}, "
                                 f"tp_size={tp_size}")
            taken = sorted({"module", "process_group"} & set(ddp_kwargs or {}))
            if taken:
                raise ValueError(f"ddp_kwargs: {taken} are set by the plugin (the model, the "
                                 f"default process group over dp x sp); drop them")
            if isinstance(tp_plan, dict) and any(not isinstance(k, str) for k in tp_plan):
                raise TypeError(f"tp_plan keys must be module name patterns (str), got "
                                f"{[k for k in tp_plan if not isinstance(k, str)][:3]}")
            if tp_plan is not None and self.dims.tp_size == 1:
                # (it would be ignored: no tensor parallelism without a word)
                raise ValueError(f"tp_plan is a tensor-parallel plan, applied only with "
                                 f"tp_size > 1; got tp_size={self.dims.tp_size} (pass tp_size, "
                                 f"or drop tp_plan)")
            if tp_size > 1 and isinstance(self.layout, PerBatchDocuments):
                raise ValueError("layout='documents' (packed batches) is not supported with "
                                 "tp_size > 1 yet; use tp_size=1 or unpacked batches")
            if device is not None:
                wanted = torch.device(device)
                if wanted.type not in self.supported_devices():
                    raise ValueError(f"device {wanted} is not supported; expected one of "
                                     f"{self.supported_devices()}")
                if wanted.type == "cuda" and not torch.cuda.is_available():
                    raise ValueError(f"device={device!r}, but this torch sees no CUDA device "
                                     f"(torch.cuda.is_available() is False); use 'cpu'")
            if not isinstance(activation_checkpointing, bool):
                # ("no" is truthy: it would have turned checkpointing on)
                raise TypeError(f"activation_checkpointing must be a bool, got "
                                f"{activation_checkpointing!r}")
            if ulysses_inner is not None and sp_mode != "hybrid":
                raise ValueError(f"ulysses_inner={ulysses_inner!r} orders the Ulysses and ring "
                                 f"dims of sp_mode='hybrid' only; got sp_mode={sp_mode!r}")
            # (a NumPy int too, as the loss takes it; outside int64 refused here, where the peers
            # learn of it, not in packing the options agreement)
            ignore_index = check_ignore_index(type(self).__name__, ignore_index)
            fields = _option_fields(self.dims, self.layout, precision, ignore_index,
                                    ulysses_inner, activation_checkpointing, tp_plan, device,
                                    inner_ring_size is not None, mesh)
        except (ValueError, TypeError, RuntimeError) as exc:
            # (RuntimeError: no process group, on every rank; or a device string torch
            # rejects, perhaps on one rank only). Named for the user, who called the plugin
            # (the checks below it speak of their own arguments; ParallelDims is internal).
            if isinstance(exc, ValueError) and str(exc).startswith("ParallelDims: "):
                exc = renamed_dims_error(type(self).__name__, exc)
            refusal, fields = named_for(type(self).__name__, exc), ()
        get_ring(None).agree(refusal is None, str(refusal), error=refusal, fields=fields,
                             about="plugin options", called=type(self).__name__,
                             hint="Every rank must build the plugin with the same options "
                                  "(inner_ring_size and ulysses_size not given are those "
                                  "sp_size and sp_mode imply).")
        plain_ring = (sp_mode == "ring" and ulysses_size in (None, 1)
                      and inner_ring_size is None and ulysses_inner is None)
        try:  # (a passed mesh is checked there: the same object on every rank)
            if plain_ring:
                self.groups = build_mesh(sp_size, mesh, tp_size=tp_size)
            else:
                self.groups = build_sp_mesh(sp_size, sp_mode, ulysses_size, inner_ring_size,
                                            ulysses_inner, mesh, tp_size=tp_size)
            if self.dims.sharded and mesh is not None:
                check_sharded_order(self.groups, fsdp=self.dims.zero_stage >= 2)
        except ValueError as exc:
            raise named_for(type(self).__name__, exc) from exc.__cause__
        if self.dims.sharded:
            self.groups.dp_sp_mesh()  # its process group, now, on every rank alike
        self.sp_mode = sp_mode
        self.activation_checkpointing = bool(activation_checkpointing)
        self.tp_plan = tp_plan
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if self.groups.mesh.device_type == "cuda" else torch.device("cpu"))
        self.device = torch.device(device)
        self.precision = Precision(precision, self.device.type)
        self.policy = policy
        self.backend = backend
        self.ignore_index = ignore_index
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self._reporter = None
        self._grad_uses = []  # per boosted model: what booster.backward agrees on first
        self._boosted = 0  # models boosted (numbers them in the agreement's messages)
        # The user modules this plugin boosted: boosting one again would switch its attention
        # again, wrap it in a second DDP and register it twice for the gradient agreement and
        # the failure reports (zero stage 0 leaves no other trace on the module).
        self._boosted_modules = weakref.WeakSet()

    # -- mesh ------------------------------------------------------------------------------
    @property
    def mesh(self):
        return self.groups.mesh

    @property
    def dp_size(self) -> int:
        return self.groups.dp_size

    @property
    def sp_size(self) -> int:
        return self.groups.sp_size

    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    @property
    def sp_rank(self) -> int:
        return self.groups.sp_rank

    @property
    def sp_group(self):
        return self.groups.sp_group

    @property
    def dp_group(self):
        return self.groups.dp_group

    @property
    def sp(self):
        """The ``ringseq.SequenceParallelGroups`` of the ulysses / hybrid / double-ring modes
        (None for the plain ring)."""
        return self.groups.sp

    @property
    def tp_size(self) -> int:
        return self.groups.tp_size

    @property
    def tp_rank(self) -> int:
        return self.groups.tp_rank

    @property
    def tp_group(self):
        return self.groups.tp_group

    @property
    def zero_stage(self) -> int:
        return self.dims.zero_stage

    @property
    def ulysses_size(self) -> int:
        return 1 if self.sp is None else self.sp.ulysses_size

    @property
    def ring_size(self) -> int:
        return self.sp_size if self.sp is None else self.sp.ring_size

    @property
    def data_layout(self):
        """How the loader places tokens over ``sp_group``: ``layout`` for the ring, the
        Ulysses x ring split (``SequenceParallelLayout``) otherwise."""
        return self.layout if self.sp is None else self.sp.data_layout(self.layout)

    # -- Plugin surface --------------------------------------------------------------------
    def supported_devices(self) -> List[str]:
        return list(_DEVICE_TYPES)

    def supported_precisions(self) -> List[str]:
        return sorted(PRECISIONS)

    def control_device(self) -> bool:
        return True

    def control_precision(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return True

    def prepare_dataloader(self, dataset, batch_size: int, shuffle: bool = False,
                           seed: int = 1024, drop_last: bool = False, pin_memory: bool = False,
                           num_workers: int = 0, pack: bool = False,
                           **kwargs) -> ShardedDataLoader:
        """A loader of this rank's sequence shards on the plugin's device (see
        :class:`ShardedDataLoader`).

        Args:
            dataset: a map-style dataset of mappings with ``input_ids`` (s,) int64 and
                optionally ``labels`` (s,) (same s within a batch; s a multiple of what the
                layout needs: sp, 2*sp for zigzag).
            batch_size: samples per data-parallel group per step (global batch: x dp); None
                for a dataset whose items are whole batches (DataLoader's own meaning).
            shuffle, seed, drop_last: as ``DistributedSampler`` over the dp groups (without
                drop_last the sampler repeats samples to even out the groups); drop_last also
                drops each dp group's last batch when it has fewer than ``batch_size``
                samples (``DataLoader(drop_last=True)``), as ColossalAI's loaders do.
            pin_memory, num_workers, kwargs: passed to ``DataLoader`` (e.g. ``collate_fn``).
            pack: pack each batch's samples (any lengths) back to back into one row of
                documents (:func:`ringseq.plugin.dataloader.pack_documents`, like
                transformers' ``DataCollatorWithFlattening``); every document attends only to
                itself and no target crosses a document. A batch whose total is not a multiple
                of what the mesh splits and the loader's layout shards
                (``plugin.dims.seq_multiple(layout)``: the least common multiple of the
                layout's multiple over sp, ``2 * sp`` for a zigzag ring, and ``sp * tp``; 2 for
                zigzag at sp 1) gets one padding document
                (ignored by the loss, seen by no real token) to round it up. Use
                ``layout="documents"`` for balanced causal work.

        Raises ValueError for an iterable-style dataset (it cannot be split by index over dp),
        for ``sampler=`` / ``batch_sampler=`` / ``distributed_sampler_cls=`` (the plugin's
        DistributedSampler would replace them; a subset is a ``torch.utils.data.Subset``),
        for ``pack=True`` with a ``collate_fn`` (packing is the collate function), for a
        ``batch_size`` < 1 and for a ``seed`` outside [-2**63, 2**63) (the sampler seeds a
        ``torch.Generator`` with seed + epoch, which must stay below 2**64), for ``in_order``
        other than True with ``num_workers`` > 0 (batches in the order the workers finish them
        differ between the ranks and from the order a resumed loader skips); TypeError for a
        dataset without a length or indexing (``__getitem__``, or ``__getitems__`` with a
        ``batch_size``), for a ``batch_size`` or ``seed`` that is not an int, and for
        ``shuffle``, ``drop_last``, ``pin_memory`` or ``pack`` that is not a bool. A loader
        that gives no batch per epoch raises when iterated (see :class:`ShardedDataLoader`).
        """
        fn = "prepare_dataloader"
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last),
                            ("pin_memory", pin_memory), ("pack", pack)):
            if not is_bool(value):  # (a string "no" would be true; NumPy's bools are bools)
                raise TypeError(f"{fn}: {name} must be a bool (True or False), got "
                                f"{given(value)}")
        shuffle, drop_last, pin_memory, pack = map(bool, (shuffle, drop_last, pin_memory, pack))
        # (batch_size None: the dataset yields whole batches, DataLoader's automatic batching
        # off)
        size, seed_int = None if batch_size is None else as_int(batch_size), as_int(seed)
        if (size is None and batch_size is not None) or seed_int is None:
            name, value = ("seed", seed) if seed_int is None else ("batch_size", batch_size)
            raise TypeError(f"{fn}: {name} must be an int, got {given(value)}")
        if size is not None and size < 1:
            raise ValueError(f"{fn}: batch_size must be an int >= 1 or None, got {size}")
        if size is None and (drop_last or pack):
            # (no batch to drop or to pack: the dataset's items are the batches)
            raise ValueError(f"{fn}: batch_size=None (the dataset's items are whole batches) "
                             f"takes neither drop_last=True nor pack=True, got drop_last="
                             f"{drop_last}, pack={pack}")
        if not -_INT64 <= seed_int < _INT64:  # (the sampler seeds torch.Generator with it)
            raise ValueError(f"{fn}: seed must be an int within [-2**63, 2**63), got {seed_int}")
        batch_size, seed = size, seed_int
        if isinstance(dataset, IterableDataset):
            raise ValueError(f"{fn}: dataset must be a map-style dataset (len and indexing) to "
                             f"split its samples over the data-parallel groups, got an "
                             f"IterableDataset ({type(dataset).__name__}): split it over the "
                             f"data-parallel groups yourself and shard each batch with "
                             f"ringseq.shard_batch")
        # (torch's fetcher reads a batch through __getitems__ where a dataset has it)
        indexed = hasattr(dataset, "__getitem__") or (batch_size is not None
                                                      and hasattr(dataset, "__getitems__"))
        if not (hasattr(dataset, "__len__") and indexed):
            raise TypeError(f"{fn}: dataset must be a map-style dataset (len and indexing), got "
                            f"{given(dataset)}")
        # (distributed_sampler_cls: ColossalAI's prepare_dataloader takes one; None is its
        # default)
        for key in ("sampler", "batch_sampler", "distributed_sampler_cls"):
            value = kwargs.get(key)
            if value is not None:
                raise ValueError(
                    f"prepare_dataloader: {key}= cannot be used: the plugin splits the samples "
                    f"over the data-parallel groups with its own DistributedSampler (shuffle, "
                    f"seed, drop_last); got "
                    f"{(value if isinstance(value, type) else type(value)).__name__}. For a "
                    f"subset (a train split) pass torch.utils.data.Subset(dataset, indices)")
            kwargs.pop(key, None)
        in_order = kwargs.get("in_order", True)
        if num_workers and not (is_bool(in_order) and in_order):
            # (worker processes then hand out batches in the order they finish them: before,
            # the ranks of a sequence-parallel group could pair shards of different batches,
            # and a resumed loader skipped other batches than those trained on)
            raise ValueError(
                f"{fn}: in_order must be True (DataLoader's default) with worker processes, got "
                f"{given(in_order)} with num_workers={num_workers}: batches handed out as the "
                f"workers finish them come in another order on each rank and cannot be "
                f"resumed")
        if pack:
            if kwargs.get("collate_fn") is not None:  # (None: DataLoader's default)
                raise ValueError("prepare_dataloader(pack=True) packs the batch itself; drop the "
                                 "collate_fn (or pack in your own collate_fn with pack=False)")
            # (what the mesh splits and the loader's layout shards: zigzag over a ring of one
            # needs an even length too)
            multiple = self.dims.seq_multiple(self.layout)
            kwargs["collate_fn"] = functools.partial(pack_documents, multiple=multiple,
                                                     ignore_index=self.ignore_index)
        # (a DistributedSampler that can start an epoch after its first batches: a loader
        # restored by ShardedDataLoader.load_state_dict resumes its epoch)
        sampler = ResumableDistributedSampler(dataset, num_replicas=self.dp_size,
                                              rank=self.dp_rank, shuffle=shuffle, seed=seed,
                                              drop_last=drop_last)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            drop_last=drop_last, pin_memory=pin_memory,
                            num_workers=num_workers, **kwargs)
        return ShardedDataLoader(loader, self.sp_group, self.data_layout, self.dp_rank,
                                 ignore_index=self.ignore_index, check_group=None,
                                 device=self.device, shared=self.dp_size < _world_size(),
                                 seq_multiple=(self.dims.seq_multiple(self.layout)
                                               if self.tp_size > 1 else 1))

    def _criterion(self, criterion):
        tp = dict(tp_size=self.tp_size, tp_rank=self.tp_rank)
        if criterion is None:
            return SequenceParallelLoss(group=None, ignore_index=self.ignore_index, **tp)
        if isinstance(criterion, SequenceParallelLoss):
            # (a loss of another ignore_index failed only at the first step, on the ranks
            # holding sequence ends; another tp share counted tokens twice or not at all)
            mine = dict(ignore_index=self.ignore_index, **tp)
            theirs = {k: getattr(criterion, k) for k in mine}
            if theirs != mine:
                raise ValueError(f"boost: criterion {criterion!r} has {theirs}, the plugin "
                                 f"{mine}; pass criterion=None (the plugin builds its "
                                 f"SequenceParallelLoss) or make them equal")
            # (a loss averaged over the sequence-parallel group alone gave each dp group its
            # own loss, and gradients dp times too large: the plugin sums them over all ranks)
            size = None if criterion.group is None else dist.get_world_size(criterion.group)
            if size is not None and size != _world_size():
                over = (f"a group of {size} ranks" if size > 0 else
                        "a group this rank is not in")  # (-1 there)
                raise ValueError(f"boost: criterion {criterion!r} averages over {over}; the "
                                 f"plugin's gradients are those of the token mean over all "
                                 f"{_world_size()} ranks (dp x sp x tp): pass criterion=None "
                                 f"or SequenceParallelLoss(group=None)")
        if getattr(criterion, "sequence_parallel_aware", False):
            return criterion
        # (a subclass with its own forward computes something else: refused below)
        if (isinstance(criterion, nn.CrossEntropyLoss)
                and type(criterion).forward is nn.CrossEntropyLoss.forward):
            if (criterion.reduction != "mean" or criterion.weight is not None
                    or criterion.label_smoothing):
                raise ValueError(f"boost: criterion: only a plain nn.CrossEntropyLoss "
                                 f"(reduction='mean', no class weights, no label smoothing) can "
                                 f"be turned into the global token-mean loss of the ring plugin; "
                                 f"got reduction={criterion.reduction!r}, weight "
                                 f"{'set' if criterion.weight is not None else 'None'}, "
                                 f"label_smoothing={criterion.label_smoothing}")
            if criterion.ignore_index != self.ignore_index:
                # The loader fills shift_labels with the plugin's ignore_index past each
                # sequence's end; a loss ignoring another value would index the vocabulary
                # with it (an IndexError on the ranks holding sequence ends, a hang on the
                # others).
                raise ValueError(
                    f"nn.CrossEntropyLoss(ignore_index={criterion.ignore_index}) does not match "
                    f"the plugin's ignore_index={self.ignore_index}; pass "
                    f"RingSequenceParallelPlugin(..., ignore_index={criterion.ignore_index}) "
                    f"or use the same value in both")
            return SequenceParallelLoss(group=None, ignore_index=criterion.ignore_index, **tp)
        raise ValueError(
            f"criterion {criterion!r} cannot be used as is: on sequence shards a local loss "
            f"gives wrong gradients. Pass None or nn.CrossEntropyLoss() (both become "
            f"ringseq.plugin.SequenceParallelLoss, the global token mean over all ranks), or a "
            f"callable with `sequence_parallel_aware = True` that returns that global mean")

    def _dataloader(self, dataloader):
        if dataloader is None or isinstance(dataloader, ShardedDataLoader):
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise ValueError(f"boost: dataloader must be a torch DataLoader or the result of "
                             f"plugin.prepare_dataloader, got {type(dataloader).__name__}")
        if isinstance(dataloader.dataset, IterableDataset):
            raise ValueError(f"boost: dataloader: the plugin rebuilds the loader with its own "
                             f"DistributedSampler over the data-parallel groups, which needs a "
                             f"map-style dataset (len and indexing); got an IterableDataset "
                             f"({type(dataloader.dataset).__name__}): split it over the "
                             f"data-parallel groups yourself and shard each batch with "
                             f"ringseq.shard_batch")
        # The loader is rebuilt over the dp groups with a DistributedSampler: only a plain
        # sequential or shuffling order over the whole dataset carries over; any other
        # sampler (a subset, weights, a batch sampler) would be lost without a word.
        sampler = dataloader.sampler
        # (RandomSampler keeps an explicit num_samples privately; len(dataset) is the default)
        # (a sampler over another dataset, e.g. range(4) of a dataset of 10: a subset; a
        # range over the whole dataset draws the same indices as the dataset itself)
        source = getattr(sampler, "data_source", None)
        whole = source is dataloader.dataset or (isinstance(source, range)
                                                 and source == range(len(dataloader.dataset)))
        plain = whole and (
            isinstance(sampler, SequentialSampler) or (
                isinstance(sampler, RandomSampler) and not sampler.replacement
                and getattr(sampler, "_num_samples", None) in (None, len(dataloader.dataset))))
        custom_batches = dataloader.batch_size is None and dataloader.batch_sampler is not None
        if custom_batches or not plain:
            what = (f"batch_sampler {type(dataloader.batch_sampler).__name__}"
                    if custom_batches else f"sampler {type(sampler).__name__}")
            if not custom_batches and not whole and source is not None:
                what += (f" (it draws from {type(source).__name__} of {_length(source)} "
                         f"items, not from the loader's dataset of "
                         f"{len(dataloader.dataset)})")
            raise ValueError(
                f"boost: dataloader: the plugin rebuilds the loader with its own "
                f"DistributedSampler over the data-parallel groups, which would drop this "
                f"loader's {what}; pass a DataLoader with batch_size and shuffle=True/False "
                f"only (a subset: torch.utils.data.Subset), or build it with "
                f"plugin.prepare_dataloader")
        # Every other DataLoader setting carries over (those this torch has); the shuffled
        # order is the DistributedSampler's with seed 1024 on every rank (the dp groups must
        # shuffle alike, and a generator seeded per rank for the workers' augmentations is a
        # valid setup), and the loader's generator seeds its workers only. Another order:
        # prepare_dataloader(seed=...).
        kept = {name: getattr(dataloader, name) for name in _LOADER_SETTINGS
                if hasattr(dataloader, name)}
        try:
            return self.prepare_dataloader(
                dataloader.dataset, dataloader.batch_size,
                shuffle=isinstance(sampler, RandomSampler), drop_last=bool(dataloader.drop_last),
                pin_memory=bool(dataloader.pin_memory), num_workers=dataloader.num_workers,
                **kept)
        except (TypeError, ValueError) as exc:  # (named for the call the user made)
            text = str(exc).removeprefix("prepare_dataloader: ")
            raise type(exc)(f"boost: dataloader's {text}") from exc

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None,
                  lr_scheduler=None):
        """Switches attention to the ring, moves the model to the device, applies tensor
        parallelism, activation checkpointing and data parallelism (DDP, or FSDP2 for
        zero_stage 2/3) and precision; returns ``(ModelWrapper, OptimizerWrapper or None,
        SequenceParallelLoss, ShardedDataLoader or None, lr_scheduler)``.

        ``optimizer`` is built over the user's model as usual; when sharding replaces the
        parameters (tp_size > 1 or zero_stage >= 2) the same optimizer object is pointed at
        the sharded parameters, group by group (an lr scheduler built on it keeps working).
        A plain ``DataLoader`` is rebuilt over the same dataset with the dp sampler and the
        sequence sharding. Raises ValueError (every rank, before modifying the model: the
        ranks agree on every refusal with one control all-gather) for a model whose attention
        cannot be switched, heads the tp / Ulysses sizes cannot split, a missing or unfitting
        tensor-parallel plan, a model this plugin boosted already (or whose parameters are
        sharded already), an optimizer holding a tensor that is not a parameter of the model,
        an optimizer with state where sharding replaces the parameters, 0-dim parameters under
        zero_stage 2/3, or an unsupported criterion (see :meth:`_criterion`); RingPeerError on
        the ranks that did not refuse; RingMismatchError (every rank) for models whose
        parameters differ between ranks in count, elements per dtype, trainable elements or
        which are frozen (named), or whose parameters and buffers differ in name, shape or
        dtype. Every mesh starts from rank 0's weights: DDP broadcasts them; where DDP is not
        used (FSDP, tensor parallelism, a frozen model) the parameters and buffers are
        broadcast from rank 0 before sharding (collective).
        """
        from ..parallel.modules import decoder_layers
        from ..parallel.optim import check_rebindable, parameter_names, rebind_optimizer
        from torch.distributed.tensor import DTensor
        # Everything that can refuse comes before the model is modified, and is agreed on by
        # every rank with the model's signature (one control all-gather): a refusal on some
        # ranks only, or models that differ between ranks (a dtype, a frozen layer), raise on
        # every rank here rather than inside DDP's or FSDP's first collective.
        refusal = None
        try:
            if (isinstance(model, ModelWrapper) or model in self._boosted_modules
                    or any(isinstance(p, DTensor) for p in model.parameters())):
                # (the module a sharded boost returned the wrapper of holds DTensors: fully_shard
                # and tensor parallelism cannot be applied to it again)
                raise ValueError(f"boost: this {type(model).__name__} was already boosted (by this "
                                 f"plugin, or its parameters are already sharded DTensors); "
                                 f"boost a fresh model, or keep using the model the first boost "
                                 f"returned")
            if isinstance(getattr(model, "_orig_mod", None), nn.Module):
                # (torch.compile's wrapper: its attention was traced before the switch)
                raise ValueError(f"boost: model is a torch.compile'd "
                                 f"{type(model._orig_mod).__name__} ({type(model).__name__}); "
                                 f"boost the model itself, then compile the model boost "
                                 f"returns")
            criterion = self._criterion(criterion)
            if isinstance(criterion, SequenceParallelLoss):
                criterion.reporter = self.reporter
            dataloader = self._dataloader(dataloader)
            dims = self.dims
            if is_transformers_model(model):
                from ..integrations.transformers import config_heads
                dims = dims.with_model(*config_heads(model.config), fn="boost")
            plan = None
            if dims.tp_size > 1:
                from ..parallel.tp import resolve_tp_plan
                plan = resolve_tp_plan(model, dims.tp_size, self.tp_plan)
            names = parameter_names(model)
            if optimizer is not None:
                check_rebindable(optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper)
                                 else optimizer, names, moved=dims.sharded)
            layers = decoder_layers(model)
            if dims.zero_stage >= 2:
                from ..parallel.fsdp import check_fsdp_units
                check_fsdp_units(model, layers, dims.zero_stage)
            if self.activation_checkpointing and not layers:
                raise ValueError(f"activation_checkpointing=True: {type(model).__name__} has no "
                                 f"decoder layers to checkpoint (transformers: the classes in "
                                 f"_no_split_modules; other models: the children of an "
                                 f"nn.ModuleList)")
            if self.activation_checkpointing and hf_checkpointing(model):
                raise ValueError(f"boost: {BOTH_CHECKPOINTINGS.format(type(model).__name__)}")
        except (ValueError, TypeError) as exc:
            # (the tensor-parallel plan's refusals are raised below the call they belong to)
            refusal = named_for("boost", exc)
        get_ring(None).agree(refusal is None, str(refusal), error=refusal,
                             fields=_model_fields(model) if refusal is None else (),
                             about="boosted model", called="boost",
                             hint="Every rank must boost the same model: the same parameters "
                                  "and buffers (names, shapes, dtypes), frozen alike.")
        # (apply() refuses head counts the Ulysses degree cannot split before switching;
        # its refusals, on every rank alike, leave the model as it was)
        switch_attention(model, self.sp_group, self.layout, self.backend, self.policy,
                         sp=self.sp)
        self._boosted_modules.add(model)
        if is_transformers_model(model) and getattr(model.config, "use_cache", False):
            # A KV cache of a sharded sequence is meaningless and ring attention refuses one.
            model.config.use_cache = False
        model = model.to(self.device)
        # DDP refuses a model without trainable parameters (a distillation teacher): it runs
        # without DDP, and the wrapper refuses forwards that could train it
        frozen = (dims.zero_stage == 0 and dims.tp_size == 1 and dims.world_size > 1
                  and not any(p.requires_grad for p in model.parameters()))
        if dist.get_world_size() > 1 and (dims.zero_stage >= 2 or dims.tp_size > 1 or frozen):
            _broadcast_from_rank0(model)  # what DDP does where DDP runs
        if plan is not None:
            from ..parallel.tp import apply_tensor_parallel
            apply_tensor_parallel(model, plan, self.groups.tp_mesh)
        if self.activation_checkpointing:
            from ..parallel.checkpointing import apply_activation_checkpointing
            apply_activation_checkpointing(layers)
        # Counted by the SUM reductions of zero stage 0 (DDP, ReplicatedGradSync), checked by
        # the optimizer's step (OptimizerWrapper); FSDP reduce-scatters each backward's own
        # gradients into the shards, which accumulation does not double.
        summed = dims.zero_stage == 0 and dims.world_size > dims.tp_size  # over dp x sp
        reduced = ReducedGrads()
        if summed:
            # (the probe among the parameters the boosted optimizer steps: another optimizer
            # clearing its own every backward would restart the count of this one's)
            stepped, outside = _stepped_params(model, optimizer, names)
            reduced.watch(stepped)
            reduced.watch_outside(outside)
        reduction = None  # completes the other ranks' collectives after a failure
        if dims.zero_stage >= 2:
            from ..parallel.fsdp import HeldGrads, apply_fsdp
            mesh = self.groups.dp_sp_mesh()
            apply_fsdp(model, mesh, dims.zero_stage, layers,
                       param_dtype=(self.precision.dtype if self.precision.name == "bf16"
                                    else None))
            reduced.held = HeldGrads(model)  # (FSDP's no_sync micro-batches: see ReducedGrads)
            tp = (self._tp_replay(model, plan, None, params_cast=self.precision.name == "bf16")
                  if dims.tp_size > 1 else None)
            if tp is not None or (dims.tp_size == 1 and mesh.size() > 1):
                from .fsdp_replay import FsdpReplay  # (FSDP2's internals: only where used)
                reduction = FsdpReplay([model] + list(layers), mesh.get_group(), tp=tp)
        elif dims.tp_size > 1:
            from ..parallel.grad_sync import ReplicatedGradSync
            # (tp alone sums nothing over ranks: accumulating without no_sync is exact there)
            grad_sync = ReplicatedGradSync(model, self.groups.dp_sp_mesh().get_group(),
                                           reduced if summed else None)
            reduction = self._tp_replay(model, plan, grad_sync)
        elif dist.get_world_size() > 1 and not frozen:
            kwargs = {_NO_BUFFER_SYNC: False}  # buffers (RoPE tables) are identical
            kwargs.update(self.ddp_kwargs)
            if self.device.type == "cuda":
                kwargs.setdefault("device_ids", [self.device.index])
            ddp = nn.parallel.DistributedDataParallel(model, process_group=None, **kwargs)
            reduction = DdpSum(ddp, reduced)
            ddp.register_comm_hook(reduction, sum_allreduce_hook)
            model = ddp
        if reduction is not None:
            reduction.model_ref = weakref.ref(model)
            self.reporter.reductions.append(reduction)
        # what the agreement before each booster.backward compares (grad_agreement)
        from .grad_agreement import GradUse
        use = None
        if dims.zero_stage >= 2 and self.groups.dp_sp_mesh().size() * dims.tp_size > 1:
            use = GradUse.for_fsdp(model, reduction)
        elif dims.zero_stage == 0 and dims.tp_size > 1:
            use = GradUse.for_grad_sync(grad_sync, model, reduction)
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            use = GradUse.for_ddp(model, reduction)
        if use is not None:
            use.index = self._boosted
            use.reduced, use.parameters = (reduced if summed else None), model.parameters
            self._grad_uses.append(use)
        self._boosted += 1
        user_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) \
            else model
        if optimizer is not None and dims.sharded:
            rebind_optimizer(optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper)
                             else optimizer, names, user_model)
        step = StepTag()  # the loader's batch number tags the ring calls of each step
        if dataloader is not None:
            dataloader.tag = step
        model = ModelWrapper(model, self.precision, self.reporter, step, reduced)
        model._reduction = reduction
        # (before any forward: FSDP2 then registers its compute-dtype copies as the parameters)
        model.param_dtypes = frozenset(p.dtype for p in user_model.parameters()
                                       if p.is_floating_point())
        # The ranks a forward's collectives reach agree at the end of a forward under no_grad:
        # at zero stage 2/3 every rank (FSDP's all-gathers); at zero stage 0 those of its
        # model replica (the ring, tp), so that evaluating on one data-parallel group alone
        # stays possible. (Made on every rank alike: boost runs on every rank.)
        group = None if dims.zero_stage >= 2 else self.groups.replica_group()
        model.agrees_after_no_grad_forward = (dist.is_initialized()
                                              and dist.get_world_size(group) > 1)
        self.reporter.no_grad_group = group
        # ... and agree on their inputs (the call tag, the loader's batch number, and the tp
        # peers' inputs) before the forward's first collective where that may be one that
        # carries neither (ModelWrapper._agree_on_inputs): tp's, FSDP's all-gathers, DDP's
        # (with gradients only: under no_grad DDP runs none). Where the first one is a ring
        # call, the call itself compares tags and shapes, and nothing is added.
        several = dist.is_initialized() and dist.get_world_size() > 1
        model.agrees_before_forward = several and (
            dims.tp_size > 1 or dims.zero_stage >= 2
            or isinstance(model.module, nn.parallel.DistributedDataParallel))
        model.agrees_before_no_grad_forward = (model.agrees_after_no_grad_forward
                                               and (dims.tp_size > 1 or dims.zero_stage >= 2))
        if frozen or isinstance(model.module, nn.parallel.DistributedDataParallel):
            # DDP sums only the parameters that required gradients when it was built (and a
            # frozen model has no sum at all): unfreezing one later must be refused
            model.frozen_at_boost = tuple((n, p) for n, p in user_model.named_parameters()
                                          if not p.requires_grad)
            if not frozen and not model.module.find_unused_parameters:
                # ... and waits for a gradient of every parameter it sums: freezing one
                # later leaves its bucket unsent (refused before the forward's collectives)
                model.trained_at_boost = tuple((n, p) for n, p in user_model.named_parameters()
                                               if p.requires_grad)
        # (a plan of the user's own ParallelStyles need not split at the embedding)
        model.needs_input_ids = plan is not None and plan.source != "tp_plan styles"
        model.needs_position_ids = model.needs_input_ids and is_transformers_model(user_model)
        model.tp_split = dims.tp_size if model.needs_input_ids else 1
        if model.needs_input_ids:
            # (the plan slices the same shard on every tp rank: their inputs must be equal; a
            # plan of the user's own styles may take other inputs per tp rank: not compared)
            model.tp_peers = min(dist.get_process_group_ranks(self.groups.tp_group))
        model.checkpointed = self.activation_checkpointing
        if dataloader is not None:
            dataloader.needs_input_ids = model.needs_input_ids
        if dims.zero_stage == 0 and dims.tp_size > 1:
            model.grad_sync = grad_sync  # lives as long as the model; no_sync finds it there
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer, self.precision.scaler, model=user_model,
                                         step=step, reduced=reduced)
        elif optimizer is not None:
            optimizer.model, optimizer._step, optimizer.reduced = user_model, step, reduced
        return model, optimizer, criterion, dataloader, lr_scheduler

    def _tp_replay(self, model: nn.Module, plan, grad_sync, params_cast: bool = False):
        """The tp collectives' completion after a failure (``tp_replay.TpReplay``) of
        ``model`` after tensor parallelism; None for a plan of the user's own styles (their
        collectives are not known here). ``grad_sync``: the model's ``ReplicatedGradSync``
        (zero stage 0), else None; ``params_cast``: FSDP casts the parameters to the
        precision's dtype (its ``param_dtype``)."""
        if plan.source == "tp_plan styles":
            return None
        from .tp_replay import TpReplay
        own = self.activation_checkpointing
        return TpReplay(model, plan, self.groups.tp_mesh, grad_sync,
                        self.precision.dtype if self.precision.name != "fp32" else None,
                        lambda: own or hf_checkpointing(model), params_cast=params_cast)

    def no_sync(self, model: nn.Module, optimizer=None):
        if not isinstance(model, ModelWrapper):
            # the user's own module (or None) has no reduction to skip: a silent no-op here
            # would let every micro-batch sum its gradients
            raise ValueError(f"no_sync: model must be the model booster.boost returned (a "
                             f"ModelWrapper), got {type(model).__name__}")
        inner = model.module
        if isinstance(inner, nn.parallel.DistributedDataParallel):
            reduction = getattr(model, "_reduction", None)
            if getattr(inner, "static_graph", False) and reduction is not None \
                    and not reduction.completed:
                # (torch's DDP asserts inside the first static-graph backward under no_sync,
                # and a failure there made the completion pair with other collectives)
                raise ValueError("no_sync: DDP with static_graph=True needs one reduced "
                                 "backward before the first one inside no_sync (it records "
                                 "the graph there); run the first micro-batch outside no_sync, "
                                 "or pass static_graph=False")
            return inner.no_sync()
        if self.dims.zero_stage >= 2:
            from ..parallel.fsdp import fsdp_no_sync
            return fsdp_no_sync(inner)
        grad_sync = getattr(model, "grad_sync", None)
        if grad_sync is not None:
            return grad_sync.no_sync()
        return contextlib.nullcontext()

    def before_backward(self, loss, completing=None) -> None:
        """The agreement before every ``booster.backward`` (``grad_agreement``): raises
        RingMismatchError on every rank when the ranks disagree on ``booster.no_sync`` or froze
        different parameters, and gives zero gradients to the parameters other ranks use and
        this one does not. ``completing``: the reduction a rank whose forward failed completes instead of a
        backward (``loss`` None)."""
        if self._grad_uses and dist.is_initialized() and dist.get_world_size() > 1:
            from .grad_agreement import agree_before_backward
            agree_before_backward(get_ring(None), self._grad_uses, loss, completing)
        if loss is not None:
            # (after the agreement: every rank is inside no_sync alike) a micro-batch under
            # no_sync after the reduced one is never summed: its step is refused, for each
            # model the loss reaches (a reentrant checkpoint hides its parameters: counted)
            leaves = hidden = None
            for use in self._grad_uses:
                if use.reduced is None or use.sync_on():
                    continue
                if leaves is None:
                    from .grad_agreement import graph_leaves
                    leaves, hidden = graph_leaves(loss)
                if hidden or any(id(p) in leaves for p in use.parameters()):
                    use.reduced.unreduced_backward()

    @property
    def reporter(self) -> FailureReporter:
        """Reports this rank's failures in the model to the other ranks (see ModelWrapper)."""
        if self._reporter is None:
            self._reporter = FailureReporter(get_ring(self.sp_group), loss_group=None,
                                             device=self.device)
            # a rank completing a backward it did not run meets the others' agreement first
            self._reporter.before_completion = lambda reduction: self.before_backward(
                None, reduction)
        return self._reporter

    def reset(self) -> None:
        """Makes this plugin's rings usable again after a failed step (they stay broken on every
        rank until then, see ringseq.engine.integrity): the sequence-parallel ring, the groups
        of its Ulysses / hybrid / double-ring modes and the default group's (where the loader
        and the loss agree); rebuilds what a timeout broke. Call it on every rank, with the
        ranks back at the same batch. Raises RuntimeError when this rank could not complete
        the data-parallel collectives of its failed step (the other ranks wait in them), or
        when FSDP2 cannot forget a failed step with this torch (< 2.13: every rank alike);
        then nothing is reset."""
        unusable = self._reporter.unusable if self._reporter is not None else None
        for reduction in self.reporter.reductions:
            refusal = reduction.reset_refusal()
            if refusal:
                raise RuntimeError(f"booster.reset: {refusal}")
        if unusable:
            raise RuntimeError(
                f"booster.reset: {unusable}; this rank's next collectives would pair with "
                f"them, so the process group cannot be used again: restart the processes "
                f"(from the last checkpoint)")
        reset_ring(self.sp_group)
        reset_ring(None)  # the loader's and the loss's agreements
        if self.sp is not None:
            self.sp.reset()
        for reduction in self.reporter.reductions:
            reduction.reset()  # DDP's reducer, FSDP's iteration state after a failed step
        self.reporter.backward_pending = False  # (the failed step's backward never comes)

    def get_checkpoint_io(self) -> DistributedCheckpointIO:
        return DistributedCheckpointIO()

    def estimate_memory(self, model: nn.Module, seqlen: int, micro_batch: int = 1,
                        optimizer: str = "adamw", activation_checkpointing: bool = None,
                        gradient_accumulation_steps: int = 1):
        """Per-rank memory of one training step of ``model`` (a transformers model, boosted or
        not) at global sequence length ``seqlen`` on this plugin's mesh and precision:
        :func:`ringseq.memory.estimate_memory` (see there for ``optimizer``, the result and
        what is raised; ``gradient_accumulation_steps``: micro-batches per optimizer step,
        all but the last under ``booster.no_sync``). ``activation_checkpointing``: whether
        the decoder layers are checkpointed (None: the plugin's own
        ``activation_checkpointing``), a double ring (``inner_ring_size``) with its inner
        rings' buffers. Local: no communication. Raises ValueError for a model without a
        ``config``, for parameters that are not float32 and for attention that runs another
        backend than ringseq's kernel: the estimate models neither (before, it was
        given without a word: 40-49 % above a bfloat16 model's measured peak, 6-13 % below
        the sdpa backend's)."""
        from ..memory import estimate_memory
        inner = model.unwrap() if isinstance(model, ModelWrapper) else model
        config = getattr(inner, "config", None)
        if config is None:
            raise ValueError(f"estimate_memory needs a model with a transformers-style config "
                             f"(hidden_size, num_hidden_layers, ...), got "
                             f"{type(inner).__name__}; call ringseq.memory.estimate_memory "
                             f"with a dict of those sizes instead")
        from ..kernels import get_backend
        from ..memory import ModelShape
        # (the backend the attention calls resolve: backend=None runs sdpa on CUDA for head
        # dims ringseq's kernel lacks)
        head_dim = ModelShape.from_config(config).head_dim
        runs = get_backend(self.backend, self.device, self.precision.dtype, head_dim,
                           fn="estimate_memory").name
        if runs != "ringseq":
            raise ValueError(f"estimate_memory: the estimate models ringseq's kernel; this "
                             f"plugin's attention runs backend {runs!r} (backend="
                             f"{getattr(self.backend, 'name', self.backend)!r}, "
                             f"{self.precision.dtype}, head dim {head_dim} on {self.device}), "
                             f"whose attention blocks allocate other temporaries (sdpa: 6-13 % "
                             f"more at 2048-8192 tokens in our measurement; reference: the s x "
                             f"s scores)")
        dtypes = (model.param_dtypes if isinstance(model, ModelWrapper) else
                  {p.dtype for p in inner.parameters() if p.is_floating_point()})
        other = sorted(str(d) for d in dtypes if d != torch.float32)
        if other:
            raise ValueError(f"estimate_memory: the estimate models float32 parameters (the "
                             f"plugin's precision={self.precision.name!r} sets the compute "
                             f"dtype); this {type(inner).__name__} holds {', '.join(other)} "
                             f"parameters, whose parameters, gradients, optimizer states and "
                             f"weight copies it does not model (a float32 copy's estimate "
                             f"measured 40-49 % above a bfloat16 model's peak)")
        return estimate_memory(
            config, seqlen=seqlen, micro_batch=micro_batch, world_size=self.mesh.size(),
            sp_size=self.sp_size, tp_size=self.tp_size, zero_stage=self.zero_stage,
            precision=self.precision.name, optimizer=optimizer,
            activation_checkpointing=(self.activation_checkpointing
                                      if activation_checkpointing is None
                                      else activation_checkpointing),
            sp_mode=self.sp_mode,
            ulysses_size=self.ulysses_size if self.sp_mode == "hybrid" else None,
            layout=self.layout, gradient_accumulation_steps=gradient_accumulation_steps,
            inner_ring_size=self.dims.inner_ring_size)

    def __repr__(self):
        modes = ("" if self.sp is None else
                 f", sp_mode={self.sp.mode!r}, ulysses={self.sp.ulysses_size}, "
                 f"ring={self.sp.ring_size}, inner_ring={self.sp.inner_ring_size}")
        extra = (f", tp={self.tp_size}" if self.tp_size > 1 else "") + \
            (f", zero_stage={self.zero_stage}" if self.zero_stage else "") + \
            (", activation_checkpointing=True" if self.activation_checkpointing else "")
        return (f"RingSequenceParallelPlugin(dp={self.dp_size}, sp={self.sp_size}{modes}{extra}, "
                f"layout={getattr(self.layout, 'name', self.layout)!r}, "
                f"precision={self.precision.name!r}, "
                f"device={self.device})")

