"""FSDP2 (``fully_shard``) over the flattened dp x sp ranks, with gradients SUMMED.

The dp x sp ranks of one tp index hold identical parameters (sequence-parallel ranks hold
shares of a sequence, not copies of the model), so FSDP shards parameters, gradients and
optimizer state over all of them, as torchtitan does over dp_shard x cp: ``sp_size=8,
zero_stage=3`` on 8 ranks keeps 1/8 of each per rank. Every decoder layer is one FSDP unit
(one all-gather before it, one reduce-scatter of its gradients after its backward), the rest
of the model (embeddings, final norm, LM head) the root unit.

Gradient. The plugin's loss is the global token mean computed identically on every rank, so
the exact gradient is the plain SUM over the dp x sp ranks of what each rank's autograd
accumulates (the argument of ``RingSequenceParallelPlugin``). FSDP2 averages by default (it
divides by the shard group's size); :func:`apply_fsdp` sets a divide factor of 1 and forces
SUM reductions, so its reduce-scatter returns the sum. (A factor of 1 alone becomes NCCL's
PreMulSum, which gloo lacks; forcing SUM reductions gives plain SUM on both.) With tensor
parallelism FSDP first reduces the tp-``Partial`` gradients of replicated parameters over tp
(redistributing them to their parameter's placement), then reduce-scatters over dp x sp.

Precision: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
under ``precision="bf16"``: bf16 parameters all-gathered for compute, gradients reduced in
float32 into the float32 shards (the master weights).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["apply_fsdp", "fsdp_no_sync", "reshard_gathered"]


def apply_fsdp(model: nn.Module, mesh, zero_stage: int, layers: Iterable[nn.Module],
               param_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Shards ``model`` in place with FSDP2 over the 1-D ``mesh`` (the flattened dp x sp
    ranks); returns it.

    Args:
        model: on its device; tensor-parallel DTensor parameters must live on a tp mesh of
            the same root mesh as ``mesh``.
        mesh: a 1-D DeviceMesh of the ranks that hold identical parameters.
        zero_stage: 2 (``reshard_after_forward=False``: gathered layer parameters stay until
            that layer's backward) or 3 (resharded after forward, gathered again in backward).
            Between steps only the shards remain in both.
        layers: the decoder layers, each its own FSDP unit (``modules.decoder_layers``).
        param_dtype: compute dtype of the gathered parameters (None: the parameters' own);
            gradients of bf16 / fp16 compute are reduced in float32, others in their dtype.
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp: zero_stage must be 2 or 3, got {zero_stage!r}")
    # low-precision compute reduces in float32; float32 / float64 parameters in their own dtype
    low = param_dtype in (torch.bfloat16, torch.float16)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                              reduce_dtype=torch.float32 if low else None)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=zero_stage == 3, mp_policy=mp)
    # the root unit: reshard_after_forward=None lets FSDP keep it gathered into the backward,
    # which starts with it (the LM head)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def reshard_gathered(model: nn.Module) -> None:
    """Frees the parameters a forward without a backward left gathered in ``model``'s FSDP
    units (at zero stage 2 every unit keeps them, ``reshard_after_forward=False``; at 3 the
    root unit): a no-op for units holding only their shards, and local (no collective).
    Needed before anything that reads or writes the shards: an optimizer step (the next
    forward would otherwise find the units gathered and compute with the parameters of
    before the step) and a checkpoint (it would read the gathered tensors as unsharded)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def check_fsdp_units(model: nn.Module, layers: Iterable[nn.Module],
                     zero_stage: int) -> None:
    """ValueError naming the unit and its parameters when one FSDP2 unit of
    :func:`apply_fsdp` (a decoder layer, or the rest of the model) holds trainable parameters
    of more than one dtype: FSDP2 reduces a unit's gradients in one buffer and would fail at
    the first forward with a bare assertion (frozen ones of another dtype it takes: a frozen
    bf16 base beside float32 adapters), or when a parameter is a 0-dim tensor (FSDP2 shards
    dim 0 and refuses scalars: found here, before any unit is sharded)."""
    scalars = [n for n, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(f"boost: zero_stage={zero_stage}: FSDP2 shards every parameter along its "
                         f"first dim and cannot shard 0-dim ones: {scalars[:4]}"
                         f"{' ...' if len(scalars) > 4 else ''}; make them 1-dim tensors of one "
                         f"element (nn.Parameter(torch.tensor([x]))), or use zero_stage=0")
    names = {id(m): n for n, m in model.named_modules()}
    in_layers = set()
    units = []
    for layer in layers:
        params = list(layer.named_parameters())
        in_layers.update(id(p) for _, p in params)
        units.append((names.get(id(layer), type(layer).__name__),
                      [(n, p) for n, p in params if p.requires_grad]))
    units.append(("the rest of the model (the root unit)",
                  [(n, p) for n, p in model.named_parameters()
                   if id(p) not in in_layers and p.requires_grad]))
    for unit, params in units:
        by_dtype: dict = {}
        for n, p in params:
            by_dtype.setdefault(str(p.dtype), []).append(n)
        if len(by_dtype) > 1:
            detail = "; ".join(f"{d}: {ns[:3]}{' ...' if len(ns) > 3 else ''}"
                               for d, ns in sorted(by_dtype.items()))
            raise ValueError(f"boost: zero_stage={zero_stage}: FSDP2 shards each decoder layer "
                             f"and the rest of the model as one unit whose trainable parameters "
                             f"must share one dtype; {unit} holds {detail} (cast the model to "
                             f"one dtype, e.g. model.float(), and use precision= for "
                             f"low-precision compute)")


class HeldGrads:
    """The unsharded gradients FSDP2 holds between backward passes inside ``no_sync`` (the
    first backward outside it reduce-scatters them), for one sharded model. The optimizer
    sees none of them: a step after ``no_sync`` micro-batches only is refused while any is
    held (:meth:`any`), and clearing the gradients drops them (:meth:`drop`); FSDP's own
    ``zero_grad`` reaches only the sharded gradients, so they went into the next step's
    sums."""

    def __init__(self, model: nn.Module):
        self.groups = [g for m in model.modules() if isinstance(m, FSDPModule)
                       for g in m._get_fsdp_state()._fsdp_param_groups]

    @staticmethod
    def holds(fsdp_param) -> bool:
        """``fsdp_param``'s unsharded parameter holds a gradient (of this backward, or one
        accumulated under no_sync)."""
        leaf = getattr(fsdp_param, "_unsharded_param", None)  # (set at the first forward)
        return (fsdp_param.unsharded_accumulated_grad is not None
                or (leaf is not None and leaf.grad is not None))

    def any(self) -> bool:
        return any(self.holds(fp) for g in self.groups for fp in g.fsdp_params)

    def drop(self) -> None:
        for group in self.groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param._unsharded_param.grad = None


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module):
    """Backward passes inside accumulate unsharded gradients without reducing them; the
    first backward after the outermost block reduces the accumulated sum (a nested block's
    end leaves the reduction off: before, it turned it on, and the next backward inside the
    outer block reduced)."""
    depth = getattr(model, "_ringseq_no_sync_depth", 0)
    model._ringseq_no_sync_depth = depth + 1
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model._ringseq_no_sync_depth = depth
        if depth == 0:
            model.set_requires_gradient_sync(True)
