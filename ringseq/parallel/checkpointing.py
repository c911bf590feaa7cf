"""Activation checkpointing per decoder layer that never repeats the ring's communication.

Each decoder layer's forward runs under non-reentrant ``torch.utils.checkpoint`` with a
selective policy (``create_selective_checkpoint_contexts``): the outputs of the attention
operator (``ringseq::attention``, which every mode runs in: the attention output, (b, s_local,
h, d), its lse, (b, h, s_local) float32, and what the mode saves for its backward) are kept,
everything else of the layer is recomputed in the backward.
When the recompute reaches the attention it gets the kept outputs back instead of running the
operator, so no K/V block travels the ring again: the exchanges of a training step are the
forward lap and the backward lap, with or without checkpointing. The kept bytes per layer are,
for the ring and the double ring, b * s_local * h * d in the input dtype plus
4 * b * h * s_local, instead of every activation of the layer; Ulysses and the hybrid mode
also keep what their backward needs, the head shards of q, k, v (K/V repeated where the
degree exceeds the K/V heads) and of the output: about four times that at h_kv = h / 2
(docs/memory.md counts each term).

This covers every mode, all of them inside that one operator: the ring, Ulysses (its
all-to-alls are not repeated either), the hybrid mode and the double ring. Tensor-parallel
all-gathers / reduce-scatters inside a layer are repeated by the recompute, as Megatron's
recompute does.
"""
from __future__ import annotations

import functools
import types
from typing import List

from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

__all__ = ["apply_activation_checkpointing", "kept_ops"]


def kept_ops() -> tuple:
    """The operators whose outputs are kept rather than recomputed (registered by importing
    ringseq, which this module's package import has done)."""
    import torch
    return (torch.ops.ringseq.attention.default,)


def _policy(kept, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(kept):
    return create_selective_checkpoint_contexts(functools.partial(_policy, kept))


def _checkpointed_forward(context_fn, layer, *args, **kwargs):
    """``layer``'s forward as it was (:func:`apply_activation_checkpointing`), checkpointed."""
    return checkpoint(layer._ringseq_forward_unchecked, *args, use_reentrant=False,
                      context_fn=context_fn, **kwargs)


def apply_activation_checkpointing(layers: List[nn.Module]) -> int:
    """Makes every module of ``layers`` run its forward under checkpointing (in place: the
    module's ``forward`` is wrapped on the instance, so its parameters, names and hooks --
    FSDP's included, which stay outside the checkpointed region -- are unchanged). Returns the
    number of layers. Raises ValueError for an empty list."""
    if not layers:
        raise ValueError("activation_checkpointing=True found no decoder layers to checkpoint "
                         "(transformers models: the classes in _no_split_modules; other "
                         "models: the children of an nn.ModuleList)")
    context_fn = functools.partial(_contexts, kept_ops())
    for layer in layers:
        if "_ringseq_forward_unchecked" in vars(layer):
            continue  # (checkpointed already: a copy of a boosted model, boosted again)
        # Both forwards are methods bound to the layer, which copy.deepcopy binds to the copy.
        # (A closure over the layer's forward made a copied model -- an EMA, a teacher -- run
        # the original's layers, with the original's weights.)
        layer._ringseq_forward_unchecked = layer.forward
        layer.forward = types.MethodType(functools.partial(_checkpointed_forward, context_fn),
                                         layer)
    return len(layers)
