"""Where a model's decoder layers and shared (tied) parameters are, and which of its outputs
a backward starts from.

FSDP wraps every decoder layer in its own unit (one all-gather / reduce-scatter per layer),
activation checkpointing recomputes per decoder layer, and tensor parallelism must keep tied
parameters (an embedding shared with the LM head) one parameter after replacing them with
DTensors.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Tuple

import torch
from torch import nn

__all__ = ["decoder_layers", "grad_tensors", "retie", "tied_parameters"]


def grad_tensors(obj) -> List[torch.Tensor]:
    """The tensors in a module's output (a tensor, or dicts -- transformers' ModelOutput --,
    lists and tuples of them) that require a gradient: where a backward through the module
    begins."""
    if torch.is_tensor(obj):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in grad_tensors(item)]
    return []


def _is_transformers_model(model: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, getattr(tf, "PreTrainedModel", ()))


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The repeated blocks of ``model``, in order.

    transformers models: the instances of the classes named in ``model._no_split_modules``
    (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ...: the unit transformers itself keeps
    whole for device placement and FSDP wrapping). Other models: the children of the first
    ``nn.ModuleList`` (in module order) whose children hold parameters. An empty list when
    there is neither.
    """
    names = set(getattr(model, "_no_split_modules", None) or ()) \
        if _is_transformers_model(model) else set()
    if names:
        layers = [m for m in model.modules() if type(m).__name__ in names]
        if layers:
            return layers
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(
                any(True for _ in child.parameters()) for child in m):
            return list(m)
    return []


def tied_parameters(model: nn.Module) -> List[List[Tuple[str, str]]]:
    """Groups of ``(module name, parameter name)`` that share one Parameter object (e.g.
    ``[("model.embed_tokens", "weight"), ("lm_head", "weight")]``); groups of one left out."""
    seen: Dict[int, List[Tuple[str, str]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            entry = (mod_name, p_name)
            group = seen.setdefault(id(p), [])
            if entry not in group:
                group.append(entry)
    return [g for g in seen.values() if len(g) > 1]


def retie(model: nn.Module, groups: List[List[Tuple[str, str]]]) -> None:
    """Makes every entry of each group use the parameter its first entry holds now (after
    something replaced parameters module by module)."""
    for group in groups:
        first_mod, first_name = group[0]
        param = getattr(model.get_submodule(first_mod), first_name)
        for mod_name, p_name in group[1:]:
            setattr(model.get_submodule(mod_name), p_name, param)
