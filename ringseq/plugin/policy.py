"""Switching a model's attention to ring attention (the plugin's policy hook).

``switch_attention(model, group, layout, backend, policy)`` is what ``Booster.boost`` runs.
Without a ``policy`` it recognizes, in this order:

1. a HuggingFace transformers ``PreTrainedModel``: ``ringseq.integrations.transformers.apply``
   (attention modules dispatching through ``AttentionInterface``: Llama, Qwen2, Mistral, ...);
2. ``ringseq.RingAttention`` submodules: their ``group`` and ``layout`` are set to the ring's;
3. submodules with a method ``ringseq_switch(group, layout, backend)``: the convention for
   model code that calls ``F.scaled_dot_product_attention``. Keep the SDPA function in an
   attribute and let the method replace it with :func:`sdpa_on_ring`::

       class SelfAttention(nn.Module):
           sdpa = staticmethod(F.scaled_dot_product_attention)

           def ringseq_switch(self, group, layout, backend=None):
               self.sdpa = sdpa_on_ring(group, layout, backend)

           def forward(self, x):                           # x: (b, s_local, hidden)
               q, k, v = ...                               # (b, h, s_local, d)
               return self.sdpa(q, k, v, is_causal=True)   # ring attention after boost

(Calls of ``F.scaled_dot_product_attention`` written directly in ``forward`` cannot be found
from outside the code, so there is no automatic rewrite.)

A ``policy`` callable replaces all of this: ``policy(model, group, layout, backend)`` switches
what it knows and returns how many attention modules it switched.

A model with nothing to switch raises ValueError: training it on sequence shards would
silently compute attention within each shard only.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, Optional

import torch

from ..layouts import PerBatchDocuments, get_layout
from ..nn import RingAttention, ring_sdpa

__all__ = ["is_transformers_model", "sdpa_on_ring", "switch_attention"]


def sdpa_on_ring(group, layout, backend: Optional[str] = None) -> Callable:
    """A function with ``F.scaled_dot_product_attention``'s signature that runs
    :func:`ringseq.ring_sdpa` over ``group`` with ``layout``: query (b, h, s_local, d), key and
    value (b, h_kv, s_local, d) -> (b, h, s_local, d). ``attn_mask`` and ``dropout_p > 0``
    raise ValueError (see ``ring_sdpa``). When ``group`` is a
    ``ringseq.SequenceParallelGroups`` (the plugin's Ulysses / hybrid / double-ring modes)
    it runs :func:`ringseq.usp_sdpa` on those groups instead."""
    from ..parallel.groups import SequenceParallelGroups
    from ..parallel.usp import usp_sdpa
    if isinstance(group, SequenceParallelGroups):
        return functools.partial(usp_sdpa, sp=group, layout=layout, backend=backend)
    return functools.partial(ring_sdpa, group=group, layout=layout, backend=backend)


def is_transformers_model(model: torch.nn.Module) -> bool:
    # Only look at transformers if the user already imported it: `import ringseq` and plain
    # models must not pull in transformers.
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, getattr(tf, "PreTrainedModel", ()))


def switch_attention(model: torch.nn.Module, group, layout, backend: Optional[str] = None,
                     policy: Optional[Callable] = None, sp=None) -> int:
    """Puts ``model``'s attention on the ring of ``group``; returns the number of switched
    modules (> 0). With ``sp`` (a ``ringseq.SequenceParallelGroups``: Ulysses / hybrid /
    double ring) the policy, ``apply`` and ``ringseq_switch`` receive ``sp`` as the group, and
    ``RingAttention`` submodules raise ValueError (they run the plain ring only). Raises
    ValueError when nothing can be switched (see the module doc)."""
    lay = get_layout(layout)
    if isinstance(lay, PerBatchDocuments) and not is_transformers_model(model) and policy is None:
        raise ValueError("layout 'documents' (packed batches) is supported for transformers "
                         "models (their attention receives the batch's document boundaries); "
                         "for other models call ringseq.ring_flash_attn_varlen_func yourself")
    if sp is not None:
        group = sp
    if policy is not None:
        n = policy(model, group, lay, backend)
        if not n:
            raise ValueError(f"the policy {getattr(policy, '__name__', policy)!r} switched no "
                             f"attention module of {type(model).__name__} (it returned {n!r}); "
                             f"it must return the number of modules it put on the ring")
        return int(n)
    if is_transformers_model(model):
        from ..integrations.transformers import _attention_modules, apply
        apply(model, group=group, layout=lay, backend=backend)
        return len(_attention_modules(model))
    n = 0
    for m in model.modules():
        if isinstance(m, RingAttention):
            if sp is not None:
                raise ValueError(
                    f"{type(m).__name__} submodule of {type(model).__name__}: ringseq.RingAttention "
                    f"runs the plain ring only and cannot take sp_mode={sp.mode!r} "
                    f"(ulysses={sp.ulysses_size}, inner ring={sp.inner_ring_size}); use the "
                    f"ringseq_switch convention (sdpa_on_ring handles every mode) or a policy")
            m.group, m.layout = group, lay
            if backend is not None:
                m.backend = backend
            n += 1
        elif callable(getattr(m, "ringseq_switch", None)):
            m.ringseq_switch(group, lay, backend)
            n += 1
    if n == 0:
        raise ValueError(
            f"{type(model).__name__} has no attention that ringseq can switch to ring attention: "
            f"no transformers PreTrainedModel, no ringseq.RingAttention submodule and no "
            f"submodule with a ringseq_switch(group, layout, backend) method. Add one (see "
            f"ringseq.plugin.policy) or pass RingSequenceParallelPlugin(policy=...)")
    return n
