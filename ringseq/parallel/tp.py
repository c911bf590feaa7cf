"""Tensor parallelism on the "tp" mesh dim with Megatron sequence parallelism (DTensor).

Layout of activations on the tp ranks that share one sequence shard (b, s_local) of the
ring (s_local = s / sp; t = tp size):

* residual stream, norms, embedding, LM head and logits: the sequence split again over tp,
  (b, s_local / t, hidden) per rank, parameters replicated over tp (``SequenceParallel``);
* attention and MLP blocks: their input all-gathered along the sequence (``GatherSequence``,
  one all-gather; its backward one reduce-scatter), q/k/v/gate/up split by output columns
  (``ColwiseParallel``: this rank's h / t heads, h_kv / t K/V heads, intermediate / t columns),
  o/down split by input rows (``RowwiseParallel``) with their partial sums reduce-scattered back
  to the (b, s_local / t, hidden) sequence shard. Ring (or Ulysses) attention runs over sp on
  the rank's local heads, so its traffic per rank drops by t.

The first rows of the sequence never leave a rank whole: the input embedding keeps only this
rank's (b, s_local / t) share of the input ids (``SliceSequence``) and the LM head produces
logits of that share only, so the loss stays ``ringseq.sharded_cross_entropy`` over all
dp x sp x tp ranks without gathering logits (the plugin's criterion cuts the targets alike).

Plans. A transformers model declares which linear layers are ``"colwise"`` / ``"rowwise"``
(``config.base_model_tp_plan``, the plan behind ``from_pretrained(tp_plan="auto")``);
:func:`resolve_tp_plan` translates those names into the layout above: the blocks holding
colwise layers gather their input, every other module with parameters is replicated over tp
and computes on this rank's share (norms, the final norm, the LM head; Qwen3's per-head
``q_norm`` / ``k_norm``, declared ``"replicated_with_grad_allreduce"``, compute on this rank's
heads), the input embedding is sliced, and the plan's own entries for the embedding
(``"embedding_rowwise"``) and LM head (``"colwise_gather_output"``, which would gather full
logits) are replaced by that; an attention module outside every block (it would attend over
a tp rank's share of the tokens) is refused. Other models pass such a dict of names (module
name patterns, ``*`` for one name component) or a dict of torch ``ParallelStyle`` objects
applied as given (every module with parameters needs a style on itself or an ancestor, and
the model itself must keep the sequence split over tp up to its logits, e.g. with
:class:`SliceSequence`, :class:`GatherSequence` and ``SequenceParallel``).

Gradients: a replicated parameter is used on a disjoint share of the work on each tp rank
(other tokens or other heads), so its gradient is the SUM over tp of the per-rank gradients:
DTensor marks it ``Partial`` and FSDP (or ``grad_sync`` at zero_stage 0) reduces it; sharded
parameters need no tp reduction. docs/parallelism.md has the whole argument.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from .modules import retie, tied_parameters

__all__ = ["GatherSequence", "SliceSequence", "TP_STYLE_NAMES", "TensorParallelPlan",
           "apply_tensor_parallel", "resolve_tp_plan", "transformers_tp_plan"]

#: the transformers plan vocabulary this module translates (anything else raises)
TP_STYLE_NAMES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
# entries transformers declares for the embedding and the LM head: replaced (module doc)
_REPLACED_STYLES = ("embedding_rowwise", "embedding_colwise", "colwise_gather_output",
                    "colwise_rep", "sequence_parallel", "replicate")


class SliceSequence(ParallelStyle):
    """ParallelStyle for the input embedding: keeps this tp rank's contiguous share of the
    first positional input along ``sequence_dim`` (the input ids (b, s_local), identical on
    every tp rank, become (b, s_local / t)), replicates the module's parameters over tp and
    returns the local output (b, s_local / t, hidden). Raises ValueError in the forward when
    the length is not a multiple of t (the plugin's loader checks it first, on every rank).
    """

    def __init__(self, sequence_dim: int = 1):
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        dim, t, r = self.sequence_dim, device_mesh.size(), device_mesh.get_local_rank()

        def keep_share(mod, args):
            if not args or not torch.is_tensor(args[0]):
                raise ValueError(f"SliceSequence on {type(mod).__name__}: expected the token "
                                 f"ids as the first positional input")
            n = args[0].shape[dim]
            if n % t:
                raise ValueError(f"SliceSequence: a sequence of {n} local tokens cannot be "
                                 f"split over tp_size={t} ranks")
            return (args[0].narrow(dim, r * (n // t), n // t),) + tuple(args[1:])

        module.register_forward_pre_hook(keep_share)  # registered first: runs first
        return SequenceParallel(sequence_dim=dim, use_local_output=True)._apply(module,
                                                                                device_mesh)

    def __repr__(self):
        return f"SliceSequence(sequence_dim={self.sequence_dim})"


class GatherSequence(ParallelStyle):
    """ParallelStyle for an attention or MLP block: its hidden-states input (the keyword
    ``hidden_states``, else the first positional input), this rank's (b, s_local / t, hidden)
    share of the sequence, becomes the whole (b, s_local, hidden) as a replicated DTensor (one
    all-gather; in the backward the partial gradients of all colwise consumers are summed and
    reduce-scattered once). The block's colwise layers take it as it is."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            return x.redistribute(placements=[Replicate()])

        def hook(mod, args, kwargs):
            if torch.is_tensor(kwargs.get("hidden_states")):
                kwargs = dict(kwargs, hidden_states=gather(kwargs["hidden_states"]))
            elif args and torch.is_tensor(args[0]):
                args = (gather(args[0]),) + tuple(args[1:])
            else:
                raise ValueError(f"GatherSequence on {type(mod).__name__}: expected the hidden "
                                 f"states as `hidden_states=` or the first positional input")
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self):
        return "GatherSequence()"


@dataclass(frozen=True)
class TensorParallelPlan:
    """A resolved plan: ``styles`` maps concrete module names to ParallelStyles, in the order
    they are applied; ``tied`` the tied parameter groups to restore afterwards."""

    styles: Dict[str, object]
    tied: tuple
    source: str  # "transformers config" / "tp_plan names" / "tp_plan styles"


def _compile(pattern: str):
    parts = [re.escape(p) if p != "*" else r"[^.]+" for p in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def _expand(model: nn.Module, plan: dict) -> Dict[str, object]:
    """Concrete module name -> plan value, in module order; patterns that match nothing are
    skipped (a transformers plan covers variants a model may not have)."""
    compiled = [(_compile(k), v) for k, v in plan.items()]
    out = {}
    for name, _ in model.named_modules():
        for rx, value in compiled:
            if name and rx.match(name):
                out[name] = value
                break
    return out


def transformers_tp_plan(model: nn.Module) -> Optional[Dict[str, str]]:
    """The plan a transformers model declares (``config.base_model_tp_plan``), with names
    relative to ``model`` (prefixed by ``base_model_prefix`` for heads like ForCausalLM), or
    None when it declares none."""
    cfg = getattr(model, "config", None)
    base = getattr(cfg, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    if isinstance(inner, nn.Module) and inner is not model:
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def _input_embedding(model: nn.Module) -> Optional[nn.Module]:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except NotImplementedError:
            emb = None
        if emb is not None:
            return emb
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _check_divisible(name: str, module: nn.Module, style: str, tp: int) -> None:
    what = "out_features" if style == "colwise" else "in_features"
    size = getattr(module, what, None)
    if size is None:
        raise ValueError(f"tensor parallelism: {name} ({type(module).__name__}) is planned "
                         f"{style!r}, which splits an nn.Linear; it has no {what}")
    if size % tp:
        raise ValueError(f"tensor parallelism: {name}.{what}={size} cannot be split over "
                         f"tp_size={tp} ranks ({style!r} in the plan); choose a tp_size that "
                         f"divides {size}")


# plan names of a block's projections: those gathering their output mark the projections
# whose output columns do not split by heads (transformers declares them so)
_BLOCK_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")


def _gathered_inside(model: nn.Module, named: Dict[str, str]) -> Dict[str, str]:
    """The linear layers ``named`` (module name -> plan name) plans ``"colwise_gather_output"``
    inside a block (another projection of the plan next to them; not the LM head), with the
    style: their output columns are no heads' own -- [q | k | v] or [gate | up] side by side
    (Phi-3's qkv_proj, GLM-4's gate_up_proj), or a norm over all heads after them (OLMo 2) --
    so a split by columns is wrong and only a gather of the whole output right, which ringseq
    does not run inside a block."""
    modules = dict(model.named_modules())
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    in_block = Counter(n.rpartition(".")[0] for n, s in named.items() if s in _BLOCK_STYLES)
    return {n: s for n, s in named.items()
            if s == "colwise_gather_output" and isinstance(modules.get(n), nn.Linear)
            and modules[n] is not head and in_block[n.rpartition(".")[0]] > 1}


def _refuse_gathered(model: nn.Module, named: Dict[str, str], source: str) -> None:
    """ValueError for a projection that the plan, or the model's own declared plan, gathers
    inside a block (:func:`_gathered_inside`). Before: 'colwise' on GLM-4's fused gate_up_proj
    was accepted, and each tp rank paired gate columns with gate columns (loss 4.899 against
    5.224, no error); Phi-3's declared plan was refused naming its o_proj's style."""
    declared = transformers_tp_plan(model)
    declared = _gathered_inside(model, _expand(model, declared)) if declared else {}
    gathered = _gathered_inside(model, named)  # (once: it walks the model's modules)
    for name, style in named.items():
        if name in gathered:
            why = f"the plan ({source}) gathers its output ('colwise_gather_output')"
        elif style in ("colwise", "colwise_rep") and name in declared:
            why = (f"it is planned {style!r}, but {type(model).__name__} declares it "
                   f"'colwise_gather_output' (config.base_model_tp_plan)")
        else:
            continue
        raise ValueError(
            f"tensor parallelism: {name}: {why}: its output columns do not split by heads (a "
            f"fused [q | k | v] or [gate | up] side by side, or a norm over all heads after "
            f"it), so a split by columns pairs the wrong columns, and ringseq gathers nothing "
            f"inside a block. Leave its block out of the plan (an MLP then runs replicated on "
            f"each tp rank's tokens; an attention cannot be split over tp: train with sp_size "
            f"and zero_stage=3, FSDP2, instead of tp_size)")


def _is_experts(name: str, module: nn.Module) -> bool:
    """A mixture-of-experts layer's experts or sparse block: a module named ``experts``, a
    class named so (MixtralExperts, Qwen2MoeSparseMoeBlock, ...), or parameters of more than
    two dims (experts' weights stacked)."""
    cls = type(module).__name__
    return (name.rsplit(".", 1)[-1] == "experts" or "Experts" in cls or "SparseMoe" in cls
            or any(p.dim() > 2 for p in module.parameters(recurse=False)))


def _refuse_experts(model: nn.Module) -> None:
    """ValueError for a model with mixture-of-experts layers (by its modules: a config with
    expert counts whose layers are all dense, Qwen2-MoE's mlp_only_layers, trains as before)."""
    name = next((n for n, m in model.named_modules() if n and _is_experts(n, m)), None)
    if name is not None:
        raise ValueError(
            f"tensor parallelism: {type(model).__name__} has mixture-of-experts layers "
            f"({name}, {type(model.get_submodule(name)).__name__}): their router and experts "
            f"take the tokens flattened, which the plan neither splits nor can run replicated "
            f"on a tp rank's share of the sequence (before: DTensor errors at the first "
            f"forward). Train it with sp_size and zero_stage=3 (FSDP2) instead of tp_size")


def _names_to_styles(model: nn.Module, named: Dict[str, str], tp: int, source: str,
                     tied: list) -> TensorParallelPlan:
    _refuse_experts(model)
    emb = _input_embedding(model)
    modules = dict(model.named_modules())
    styles: Dict[str, object] = {}
    linear, blocks, replicated_inside = {}, {}, set()
    _refuse_gathered(model, named, source)
    for name, style in named.items():
        module = modules[name]
        if style in ("colwise", "rowwise"):
            _check_divisible(name, module, style, tp)
            linear[name] = style
            parent = name.rpartition(".")[0]
            blocks.setdefault(parent, set()).add(style)
        elif style == "replicated_with_grad_allreduce":
            replicated_inside.add(name)
        elif style in _REPLACED_STYLES:
            continue  # the embedding / LM head / norms: replicated on this rank's share below
        else:
            raise ValueError(f"tensor parallelism: the plan entry {name!r}: {style!r} is not "
                             f"supported; supported: {list(TP_STYLE_NAMES)} (and "
                             f"{list(_REPLACED_STYLES[:3])} on the embedding / LM head, which "
                             f"ringseq replaces; see ringseq.parallel.tp)")
    if not linear:
        raise ValueError(f"tensor parallelism: the plan ({source}) names no 'colwise' or "
                         f"'rowwise' module of {type(model).__name__}")
    for parent, kinds in blocks.items():
        if kinds != {"colwise", "rowwise"}:
            raise ValueError(f"tensor parallelism: block {parent!r} has only "
                             f"{sorted(kinds)} layers in the plan; a block needs colwise "
                             f"inputs and a rowwise output to return the sequence-sharded "
                             f"hidden states")
    if emb is None:
        raise ValueError(f"tensor parallelism: {type(model).__name__} has no input embedding "
                         f"(get_input_embeddings() or an nn.Embedding) to split the sequence "
                         f"over the tp ranks")
    emb_name = next(n for n, m in modules.items() if m is emb)
    _check_attention_in_blocks(modules, blocks, source)
    for name, module in modules.items():  # module order: parents before children
        if name in blocks:
            if any(True for _ in module.parameters(recurse=False)):
                raise ValueError(f"tensor parallelism: the block {name!r} "
                                 f"({type(module).__name__}) holds parameters of its own, "
                                 f"which the plan cannot place; only its submodules may")
            styles[name] = GatherSequence()
            continue
        if name in linear:
            styles[name] = (ColwiseParallel() if linear[name] == "colwise"
                            else RowwiseParallel(output_layouts=Shard(1)))
            continue
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        inside = next((b for b in blocks if name.startswith(b + ".")), None)
        if inside is not None and name not in replicated_inside:
            raise ValueError(
                f"tensor parallelism: {name} ({type(module).__name__}) inside the "
                f"tensor-parallel block {inside!r} has parameters the plan neither splits nor "
                f"declares 'replicated_with_grad_allreduce' (a module computing on this "
                f"rank's heads only); add it to the plan")
        if name == emb_name:
            styles[name] = SliceSequence()
        else:
            # norms, final norm, LM head (this rank's tokens) or per-head norms (its heads):
            # row-wise computation on a disjoint share, so dim 1 may stand for either
            styles[name] = SequenceParallel(sequence_dim=1, use_local_output=True)
    _check_tied_styles(tied, styles)
    return TensorParallelPlan(styles=styles, tied=tuple(tuple(g) for g in tied), source=source)


def _mixes_tokens(module: nn.Module) -> bool:
    """Whether ``module`` is an attention (a function of all the sequence's tokens) that the
    plugin switches to the ring: a module on the ``ringseq_switch`` convention, a
    ``RingAttention`` or a transformers attention module (the AttentionInterface style)."""
    from ..nn import RingAttention
    return (hasattr(module, "ringseq_switch") or isinstance(module, RingAttention)
            or ("Attention" in type(module).__name__ and hasattr(module, "scaling")))


def _check_attention_in_blocks(modules: Dict[str, nn.Module], blocks, source: str) -> None:
    # Outside the planned blocks a module computes on this tp rank's share of the sequence
    # (s_local / t tokens): an attention there attends over that share only, silently wrong.
    def in_block(n):
        return any(n == b or n.startswith(b + ".") for b in blocks)
    for name, module in modules.items():
        if not _mixes_tokens(module) or in_block(name):
            continue
        # A decoder layer whose ringseq_switch switches the attention it holds passes where
        # every linear layer under it lies in a planned block (its attention's projections
        # among them); a linear layer left out would compute on the tp rank's tokens only.
        below = [n for n in modules if name and n.startswith(name + ".")]
        if any(in_block(n) for n in below) and all(
                in_block(n) for n in below if isinstance(modules[n], nn.Linear)):
            continue
        raise ValueError(
            f"tensor parallelism: the attention {name!r} ({type(module).__name__}) lies in "
            f"no tensor-parallel block of the plan ({source}); outside one it would attend "
            f"over this tp rank's share of the tokens only. Add its query / key / value "
            f"projections ('colwise') and its output projection ('rowwise') to the plan")


def _uncovered(model: nn.Module, named: Dict[str, object]) -> list:
    """Names of the modules holding parameters of their own that no plan entry covers (none
    on the module itself or an ancestor)."""
    return [n for n, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False))
            and not any(k == "" or n == k or n.startswith(k + ".") for k in named)]


def _check_tied_styles(tied, styles) -> None:
    for group in tied:
        if any(isinstance(styles.get(m), (ColwiseParallel, RowwiseParallel)) for m, _ in group):
            raise ValueError(f"tensor parallelism: tied parameters {group} would be split by "
                             f"the plan; tied parameters must stay replicated over tp")


def resolve_tp_plan(model: nn.Module, tp_size: int, tp_plan=None) -> TensorParallelPlan:
    """Resolves and checks the tensor-parallel plan of ``model`` without modifying it.

    Args:
        model: the user's model (a transformers model uses its declared plan when
            ``tp_plan`` is None).
        tp_size: the tp degree (> 1).
        tp_plan: None, a dict of module-name patterns to transformers plan names
            (``"colwise"``, ``"rowwise"``, ``"replicated_with_grad_allreduce"``: translated as
            the module doc says), or a dict of module-name patterns to torch
            ``ParallelStyle`` objects (applied as given).

    Raises ValueError naming what is missing or wrong: no plan (neither ``tp_plan`` nor a
    declared ``config.base_model_tp_plan``), entries that match no module, unsupported names,
    linear sizes tp_size does not divide, blocks without both colwise and rowwise layers,
    parameters inside a block the plan does not cover, an attention module outside every
    planned block (names), modules with parameters no style covers (styles), tied parameters
    the plan would split.
    """
    tied = tied_parameters(model)
    if tp_plan is None:
        plan = transformers_tp_plan(model)
        if plan is None:
            raise ValueError(
                f"tp_size={tp_size} needs a tensor-parallel plan: {type(model).__name__} "
                f"declares none (no transformers config.base_model_tp_plan); pass "
                f"RingSequenceParallelPlugin(..., tp_plan={{module name pattern: 'colwise' | "
                f"'rowwise' | a torch ParallelStyle}})")
        named = _expand(model, plan)
        if not named:
            raise ValueError(f"tensor parallelism: the declared plan of "
                             f"{type(model).__name__} matches none of its modules: {plan}")
        return _names_to_styles(model, named, tp_size, "transformers config", tied)
    if not isinstance(tp_plan, dict) or not tp_plan:
        raise ValueError(f"tp_plan must be a non-empty dict of module name patterns to plan "
                         f"names or torch ParallelStyles, got {tp_plan!r}")
    as_styles = all(isinstance(v, ParallelStyle) for v in tp_plan.values())
    if not as_styles and not all(isinstance(v, str) for v in tp_plan.values()):
        raise ValueError("tp_plan values must be all plan names (strings) or all torch "
                         "ParallelStyle objects")
    for pattern in tp_plan:
        if not _expand(model, {pattern: 0}):
            raise ValueError(f"tp_plan entry {pattern!r} matches no module of "
                             f"{type(model).__name__}")
    named = _expand(model, tp_plan)
    if as_styles:
        _check_tied_styles(tied, named)
        missing = _uncovered(model, named)
        if missing:
            # (found here, before anything is modified: after parallelize_module the model
            # would be left half sharded)
            raise ValueError(f"tensor parallelism: the tp_plan of ParallelStyles leaves "
                             f"modules with parameters without a style (themselves or an "
                             f"ancestor): {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                             f"their parameters would stay plain tensors whose gradients "
                             f"nothing reduces over tp. Give them a style (e.g. "
                             f"SequenceParallel for norms and the LM head)")
        return TensorParallelPlan(styles=named, tied=tuple(tuple(g) for g in tied),
                                  source="tp_plan styles")
    return _names_to_styles(model, named, tp_size, "tp_plan names", tied)


def apply_tensor_parallel(model: nn.Module, plan: TensorParallelPlan, tp_mesh) -> nn.Module:
    """Applies ``plan`` on the 1-D ``tp_mesh`` (in place; collective over the tp group) and
    restores tied parameters and frozen ones (torch's replicating styles make every parameter
    they replace require a gradient). Returns ``model``. Raises RuntimeError when a parameter
    was left a plain tensor (its gradient would not be reduced over tp)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, dict(plan.styles))
    retie(model, [list(g) for g in plan.tied])
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"tensor parallelism left parameters outside the plan as plain "
                           f"tensors: {plain[:8]}{' ...' if len(plain) > 8 else ''}; give their "
                           f"modules a style in tp_plan")
    return model
