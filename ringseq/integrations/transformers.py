"""Ring attention as a HuggingFace transformers attention implementation named ``"ringseq"``.

    from ringseq.integrations.transformers import apply
    model = apply(AutoModelForCausalLM.from_config(cfg), group=None, layout="zigzag")
    batch = ringseq.shard_batch({"input_ids": ids, "labels": ids}, layout="zigzag")
    targets = batch.pop("shift_labels")
    loss = ringseq.sharded_cross_entropy(model(**batch, use_cache=False).logits, targets)

How it plugs in (verified with transformers 4.57.1 and 5.24.0):

- Importing this module registers :func:`ringseq_attention_forward` under ``"ringseq"`` with
  ``transformers.AttentionInterface`` (models that call
  ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` dispatch to it)
  and a mask function under the same name with ``transformers.AttentionMaskInterface``.
  The mask function is needed: for a name without one, ``masking_utils`` drops the padding
  mask altogether (the attention function would get ``None`` and could not refuse padding).
  Ours hands the 2D (b, s_local) boolean padding mask through untouched, and the attention
  function refuses it unless it is all ones. A local (s_local x s_local) 4D mask, which is
  what transformers' own mask functions build, means nothing for a sharded sequence: the
  causal structure comes from the layout instead.
- :func:`apply` calls ``model.set_attn_implementation("ringseq")`` (or sets
  ``config._attn_implementation`` on versions without it) and stores a
  :class:`RingSettings` (group, layout, backend) on every attention module. The attention
  function reads the settings from the module it is called with, so two models with
  different groups or layouts work side by side; nothing is kept at module level besides the
  two registrations.

Sliding windows (per layer), logit soft-capping (Gemma 2) and packed documents work in every
sequence-parallel mode. What it cannot do exactly raises ``ValueError`` (on every rank, through
the ring's control channel, where the condition is only visible on some ranks): dropout > 0
(attention dropout while training), a padding mask with zeros or any 4D mask,
``output_attentions=True`` (the probabilities are never materialized), a KV cache holding
earlier tokens, position ids that are not the global positions of the local tokens
(forgetting ``position_ids`` makes every rank's RoPE start at 0), attention sinks, chunked
attention layers, bidirectional blocks of image tokens (transformers' blockwise overlay,
which :func:`ringseq_mask` hands to the input check) and, over several ranks, ``labels`` given
to a causal LM (its loss would shift each shard's labels within the shard). Position ids are
checked from the model's own call where the attention function gets none (GPT-BigCode).
:func:`apply` refuses models whose tokens also meet outside softmax attention (hybrids' Mamba,
short-convolution and linear-attention layers), ALiBi position biases, heads that pool the
sequence (sequence classification) and embeddings computed over the whole row (ESM-2's
``token_dropout``, MobileBERT's ``trigram_input``). Sub-models whose attention modules ringseq
does not switch (a multimodal model's vision or audio tower) keep their implementation.
"""
from __future__ import annotations

import inspect
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import torch

try:
    from transformers import AttentionInterface
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ringseq.integrations.transformers needs HuggingFace transformers with "
        "AttentionInterface (>= 4.57): `pip install 'ringseq[hf]'` or "
        "`pip install 'transformers>=4.57'`") from exc

try:
    from transformers.masking_utils import AttentionMaskInterface
except ImportError:  # pragma: no cover - transformers < 4.53 builds masks inside each model
    AttentionMaskInterface = None

from .._args import as_int, check_cu_seqlens, is_bool
from .._dist import group_info, named_for
from ..engine.integrity import FWD
from ..engine.ring import get_ring, refuse_on_error
from ..kernels import get_backend
from ..layouts import Layout, document_positions, get_layout, positions_local
from ..nn import ring_attention
from ..parallel.groups import (SequenceParallelGroups, check_model_heads, check_sp_mode,
                               make_sp_groups, resolve_sp_sizes)
from ..kernels.checks import SDPA_FORM
from ..parallel.usp import _usp

__all__ = ["ATTN_IMPLEMENTATION", "RingSettings", "apply", "ringseq_attention_forward",
           "ringseq_mask"]

ATTN_IMPLEMENTATION = "ringseq"


@dataclass
class RingSettings:
    """What :func:`apply` records on a model's attention modules (one object per model)."""

    group: Any = None
    layout: Layout = field(default_factory=lambda: get_layout("zigzag"))  # bound per batch
    backend: Optional[str] = None
    # Ulysses / hybrid / double ring (``apply(..., sp_mode=...)``): ``group`` is then the whole
    # sequence-parallel group, ``layout`` its data layout and ``ring_layout`` the ring's.
    sp: Optional[SequenceParallelGroups] = None
    ring_layout: Optional[Layout] = None
    # The last inputs found valid -- mask and position-id tensors (weakly, with their in-place
    # versions), document boundaries, local length: every layer of one forward gets the same,
    # so they are checked (and agreed on across ranks) once per forward.
    _checked: tuple = field(default=(None, None, None, None, None), repr=False, compare=False)
    # The stacks of attention layers (apply's ``_ringseq_stack``: an encoder's, a decoder's
    # self- and cross-attention) checked in the model call ``_checked`` names: each stack
    # gets its own inputs (a decoder its own position ids and mask), so each is checked.
    _stacks_checked: tuple = field(default=(), repr=False, compare=False)
    # Model calls begun (the base model's forward pre-hook counts them on every rank alike):
    # the first layer of each call checks its inputs on every rank, so whether the collective
    # runs never depends on a rank's own tensor identities (a batch reused on one rank only).
    _calls: int = field(default=0, repr=False, compare=False)
    # Model calls running (between the base model's pre- and post-hook; a depth: a teacher
    # copy called inside the student's forward shares these settings): a layer or attention
    # function called on its own checks its inputs at every call.
    _in_call: int = field(default=0, repr=False, compare=False)
    # The position ids the model itself was called with, for models whose attention function
    # gets none (GPT-BigCode adds learned position embeddings before its layers): set by a
    # hook around the base model's forward (:func:`_capture_positions`), None outside it.
    _model_positions: Any = field(default=None, repr=False, compare=False)
    # Whether the running model call was given packed documents' boundaries (cu_seq_lens_q):
    # a layer that does not hand them to the attention function (Falcon, StableLM, Nemotron
    # call it without **kwargs) is then named as such, not told to pass what was passed.
    _model_documents: bool = field(default=False, repr=False, compare=False)
    # The running model call's logits_to_keep (generate() passes 1), None when it keeps all:
    # over several ranks each would keep its own shard's last tokens, which is refused.
    _logits_kept: Any = field(default=None, repr=False, compare=False)
    # Whether the running model call, a causal LM's, was given ``labels``: over several ranks
    # its own loss would shift each shard's labels within the shard (refused).
    _labels_given: bool = field(default=False, repr=False, compare=False)

    def __deepcopy__(self, memo):
        # A process group cannot be copied, and a copied model runs on the same ring.
        return self

    def __getstate__(self):
        # (pickling an applied model, torch.save(model): the checked inputs' weak references
        # cannot be pickled and mean nothing in another process; the next call checks again)
        if self.sp is not None or isinstance(self.group, torch.distributed.ProcessGroup):
            raise TypeError("ringseq: a model applied with group= (a process group, or "
                            "SequenceParallelGroups) cannot be pickled, since process groups "
                            "cannot: save its state_dict(), or pickle the model before apply "
                            "(a model applied with group=None pickles)")
        state = dict(self.__dict__)
        state.update(_checked=(None,) * 5, _stacks_checked=())
        return state


def _settings(module) -> RingSettings:
    s = getattr(module, "ringseq_settings", None)
    if s is None:
        raise ValueError(
            f"{type(module).__name__} runs with attn_implementation='ringseq' but has no ring "
            f"settings; switch models with ringseq.integrations.transformers.apply(model, "
            f"group=..., layout=...) instead of setting the implementation by hand")
    return s


def _input_mark(t):
    """What a verdict on tensor ``t`` holds for: its identity and in-place version (a buffer
    refilled in place is checked again); None for None. Tensors without a version counter
    (made under inference mode) get no mark and are checked at every call."""
    if t is None:
        return None
    try:
        return weakref.ref(t), t._version
    except RuntimeError:  # inference tensors track no version
        return weakref.ref(t), None


def _marked(mark, t) -> bool:
    if mark is None:
        return t is None
    ref, version = mark
    # (a checked tensor that is gone leaves a dead reference: None is not that tensor)
    return version is not None and t is not None and ref() is t and t._version == version


@torch.compiler.disable  # host reads and a collective: run between graphs, on real tensors
def _check_inputs_once(name: str, settings: RingSettings, layout, docs, attention_mask,
                       position_ids, q_local: int, device, stack: str = "") -> None:
    """Refuses padding masks and wrong position ids; agrees across ranks before raising (the
    message starts with ``name``, the attention module's class). ``stack``: the layer's
    stack (see ``RingSettings._stacks_checked``)."""
    world_size, rank = group_info(settings.group)
    kept = settings._logits_kept if world_size > 1 else None
    # the mask as given to the model (ringseq_mask hands the layers its last kv_length columns)
    attention_mask = getattr(attention_mask, "ringseq_whole_mask", attention_mask)
    mask_mark, pos_mark, checked_docs, checked_len, checked_call = settings._checked
    if world_size > 1:
        # Whether the agreement below runs is the same on every rank, so it depends on no rank's
        # own inputs (a mask on one rank only, a tensor reused on one rank only): once per model
        # call and stack of layers (the base model's hook counts the calls on every rank alike,
        # the stacks are the model's structure, and every layer of a stack gets the call's
        # inputs; before: once per call, and an encoder-decoder model's decoder went
        # unchecked, its position ids and padding mask included), and at every call of a
        # layer used on its own.
        if settings._in_call > 0 and checked_call == settings._calls and \
                stack in settings._stacks_checked:
            return
    elif (attention_mask is None and position_ids is None) or (
            checked_call == settings._calls and _marked(mask_mark, attention_mask)
            and _marked(pos_mark, position_ids) and checked_docs == docs
            and checked_len == q_local):
        return
    problems = []
    if kept is not None:
        shown = f"{kept!r}" if not torch.is_tensor(kept) else "a tensor of indices"
        problems.append(f"logits_to_keep={shown} (model.generate() passes 1) over {world_size} "
                        f"ranks: each rank would keep the logits of its own shard's last tokens, "
                        f"not the sequence's. generate() runs on one process: a run of one, or "
                        f"model.set_attn_implementation('sdpa') on the rank that generates (and "
                        f"'ringseq' after it; called on one rank with ringseq attention, it "
                        f"waits for its peers); over a ring compute every position's logits and "
                        f"gather them with ringseq.unshard")
    if world_size > 1 and settings._labels_given:
        # (before: each rank's loss shifted its own shard's labels, pairing tokens of chunks
        # that are not neighbours under zigzag, and averaged per rank: another loss on every
        # rank, without a word)
        problems.append(f"labels passed to the model over {world_size} ranks: its own loss "
                        f"(or an encoder-decoder's decoder inputs made from them) would shift "
                        f"each rank's shard of the labels within the shard and average per "
                        f"rank; leave labels out of the model call and pass the "
                        f"shift_labels of ringseq.shard_batch to ringseq.sharded_cross_entropy "
                        f"(the plugin's criterion does)")
    refusal = getattr(attention_mask, "ringseq_refusal", None)  # set by ringseq_mask
    if refusal is not None:
        problems.append(refusal)
    elif attention_mask is not None:
        if attention_mask.dim() != 2:
            problems.append(f"a {attention_mask.dim()}D attention mask of shape "
                            f"{tuple(attention_mask.shape)} (only a 2D all-ones padding mask "
                            f"or None is supported; the causal mask comes from the layout)")
        elif not bool(attention_mask.bool().all()):
            problems.append("an attention_mask with padding (zeros); ring attention cannot skip "
                            "padded tokens: pack sequences without padding and mark positions "
                            "without a target with ignore_index in the labels")
    # Also at world size 1: packed documents whose position ids restart but that come without
    # their boundaries (cu_seq_lens_q) would otherwise attend across documents without a word.
    # (Not beside a padding refusal: padded rows' position ids, as generate() makes them, are
    # no packed documents, and the advice would be wrong.)
    if position_ids is not None and not problems:
        try:
            # (s_local,); raises for a local length this rank's layout cannot place: then a
            # problem like the others, which the agreement below reports to every rank
            expected = positions_local(q_local * world_size, layout, world_size, rank,
                                       device=position_ids.device)
            if docs is not None:
                expected = document_positions(docs, expected)
        except ValueError as exc:
            expected = None
            problems.append(f"{q_local} local tokens, which layout {layout.name!r} cannot place "
                            f"({exc})")
        pos = position_ids.reshape(-1, position_ids.shape[-1])
        if expected is None:
            pass
        elif pos.shape[-1] != q_local:
            problems.append(f"position_ids of length {pos.shape[-1]} for {q_local} local tokens")
        elif not bool((pos == expected).all()):
            sharder = ("sp.shard_batch(batch, layout) of the SequenceParallelGroups this model "
                       "was switched with (the plugin's loader does it)"
                       if settings.sp is not None else "ringseq.shard_batch")
            steps_up = pos[:, 1:] == pos[:, :-1] + 1
            restarts = (pos[:, 1:] == 0) & ~steps_up
            if (docs is None and bool(restarts.any()) and bool((steps_up | restarts).all())
                    and bool((expected[1:] >= expected[:-1]).all())):
                # (rows that count up from 0 and start again at 0 where the layout's positions
                # do not: packed documents without their boundaries, e.g.
                # DataCollatorWithFlattening(return_flash_attn_kwargs=False); named as such,
                # not as wrong positions under a layout)
                problems.append(
                    "position_ids that restart within a row, as packed documents' do, without "
                    "the documents' boundaries: pass cu_seq_lens_q and cu_seq_lens_k "
                    "(DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns them; "
                    f"so does {sharder} for packed batches)")
            else:
                what = ("positions within their documents" if docs is not None else
                        "global positions")
                # (a batch sharded with position ids given to it keeps them: say so)
                advice = (f"leave position_ids out of the batch you give {sharder}: it numbers "
                          "every document from 0" if docs is not None else
                          f"pass the batch of {sharder}; without its position_ids the model "
                          "numbers every shard from 0, and packed documents need their "
                          "boundaries, cu_seq_lens_q, which it returns")
                # (the layout this model was switched with: a ring of one places tokens as
                # 'contiguous' under every layout, which the user never named)
                problems.append(
                    f"position_ids that are not the {what} of this rank's tokens under layout "
                    f"{settings.layout.name!r} ({advice})")
    # On the ring's control channel: a peer's failure report (raised in its embedding, say)
    # meets this check instead of waiting for it.
    get_ring(settings.group).agree(
        not problems, f"{name}: ringseq attention cannot compute this exactly: "
        + "; ".join(problems),
        about="attention inputs")
    stacks = settings._stacks_checked if checked_call == settings._calls else ()
    # (once each: a layer called on its own, outside a model call, checks at every call)
    settings._stacks_checked = stacks if stack in stacks else stacks + (stack,)
    settings._checked = (_input_mark(attention_mask), _input_mark(position_ids), docs, q_local,
                         settings._calls)


def ringseq_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              is_causal: Optional[bool] = None,
                              sliding_window: Optional[int] = None, softcap=None, **kwargs):
    """transformers attention function: ring attention over the module's group and layout.

    Args (transformers' calling convention):
        module: the attention module; must carry ``ringseq_settings`` (set by :func:`apply`).
        query: (b, h, s_local, d); key: (b, h_kv, s_local, d), ``h % h_kv == 0`` (GQA: K/V
            heads travel the ring unexpanded, no ``repeat_kv``); value: (b, h_kv, s_local,
            d_v), ``d_v <= d`` (latent attention's smaller value heads: V is padded with
            zero columns to d and the output cut back to d_v). Any float dtype the ring
            supports; the output has query's dtype.
        attention_mask: None or a 2D (b, s_local) mask that is all ones.
        dropout: must be 0 (transformers passes the module's dropout while training).
        scaling: softmax scale; default ``module.scaling``, else ``d ** -0.5``.
        is_causal: default ``module.is_causal`` (True when absent).
        sliding_window: None, or the layer's window: a token sees itself and the
            ``sliding_window - 1`` tokens before it (transformers' convention, flash-attn's
            ``window_size=(sliding_window - 1, sliding_window - 1)``); each layer passes its
            own. Where the layer's mask is transformers' bidirectional window overlay
            (|q - k| <= w: T5Gemma, EmbeddingGemma 2), the mask's ``(w, w)`` (the layer passes
            w or w + 1).
        softcap: None, or the logit soft-cap (Gemma 2's ``attn_logit_softcapping``).
        kwargs: ``position_ids`` (checked against the layout), ``cu_seq_lens_q`` /
            ``cu_seq_lens_k`` (GLOBAL document boundaries of a packed batch, as
            ``ringseq.shard_batch`` returns them), ``output_attentions`` (must be falsy),
            ``s_aux`` (attention sinks: must be None); the rest is ignored.

    Returns ``(out, None)`` with out (b, s_local, h, d_v) -- transformers reshapes it to
    (b, s_local, h * d_v) -- and no attention weights.

    Raises ValueError for what ring attention cannot compute exactly (see the module doc),
    before any payload moves: on the other ranks RingPeerError naming this one (through the
    ring's control channel).
    """
    if not torch.compiler.is_compiling():  # (a traced count would guard on its value)
        _DISPATCHES.count += 1
    settings = _settings(module)
    name = type(module).__name__
    causal = is_causal if is_causal is not None else getattr(
        attention_mask, "ringseq_causal", getattr(module, "is_causal", True))
    # A refusal here reaches the other ranks (their input check or ring call raises
    # RingPeerError naming this rank) instead of leaving them waiting.
    dv = value.shape[-1] if torch.is_tensor(value) else None
    if torch.is_tensor(query) and torch.is_tensor(key) and dv is not None and \
            key.shape[-1] == query.shape[-1] > dv:
        # Latent attention (DeepSeek-V2/V3, MiniCPM3): values of a smaller head dim. Zero
        # columns added to V give zero output columns, cut off below: exact (before: refused
        # at every forward with the kernels' head-dim message).
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - dv))
    with refuse_on_error(settings.group, FWD):
        # (b, h, s, d) -> (b, s, h, d) as views: the ring reads strided inputs without a copy
        # (the errors name transformers' query / key / value in its (b, h, s, d))
        q, k, v = SDPA_FORM.to_flash(name, query, key, value)
        _check_layer_kind(name, module, kwargs)
        _check_cross_attention(name, query, key, causal)
        sliding_window, inclusive = _window_of_mask(name, attention_mask, sliding_window)
        if getattr(attention_mask, "ringseq_no_mask", False):  # (ringseq_mask's marker)
            attention_mask = None
        layout, docs, window = _checked_call(name, settings, query, key, value, dropout,
                                             sliding_window, kwargs, inclusive)
    s_local = query.shape[2]
    if torch._C._current_graph_task_id() == -1:
        # (not in a checkpointed layer's recompute: its forward checked these very inputs,
        # and another forward since, of other inputs, would make it check and agree again,
        # a collective the recompute of a selective checkpoint may not add)
        positions = kwargs.get("position_ids")
        called = settings._model_positions
        if positions is None:
            positions = _model_positions(settings, s_local, query.device)
        elif torch.is_tensor(called) and called.dim() == positions.dim() + 1 and \
                called.shape[1:] == positions.shape and bool((called[0] == positions).all()):
            # the model's own, every row: M-RoPE models (Qwen2-VL, Qwen2.5-VL) take 4-row
            # position ids, pass the attention the text row (the first) and rotate q and k by
            # the other three (before: only the text row was checked, and rope rows numbered
            # from 0 on every rank gave logits 1.2e-3 off without a word). Only then: an
            # encoder-decoder's decoder gets positions of its own, not the model call's.
            positions = called
        _check_inputs_once(name, settings, layout, docs, attention_mask, positions, s_local,
                           query.device, getattr(module, "_ringseq_stack", ""))
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    if settings.sp is not None:
        out = _usp(name, q, k, v, 0.0, scaling, bool(causal), settings.sp, settings.ring_layout,
                   False, settings.backend, None, window, 0.0 if softcap is None else softcap,
                   docs, form=SDPA_FORM)
    else:
        # With a batch's documents: the layout the model was switched with, which the ring
        # binds to them, not this batch's own (a compiled model guarded on that object's
        # identity: a recompile per batch of new boundaries, then, past dynamo's limit of 8,
        # the attention's frame ran eagerly)
        out = ring_attention(name, q, k, v, softmax_scale=scaling, causal=bool(causal),
                             window_size=window, group=settings.group,
                             layout=settings.layout if docs is not None else layout,
                             backend=settings.backend,
                             softcap=0.0 if softcap is None else softcap, cu_seqlens=docs,
                             form=SDPA_FORM)
    return (out if out.shape[-1] == dv else out[..., :dv]), None


def _window_of_mask(name: str, attention_mask, sliding_window):
    """``(window, inclusive)``: the layer's sliding window, the ``sliding_window`` it passes,
    else the one its mask was built with (``ringseq_mask`` marks it). Some models (PhiMoE,
    Qwen2-MoE) build a sliding-window mask and call the attention without the argument: the
    window was dropped, and the layer ran full causal attention. ``inclusive``: the mask's
    window is transformers' bidirectional overlay, which sees ``window`` keys on each side
    (|q - k| <= window; the causal overlay sees ``window`` keys, itself included). ValueError
    where the two windows differ."""
    built = getattr(attention_mask, "ringseq_window", None)
    inclusive = bool(getattr(attention_mask, "ringseq_window_inclusive", False))
    if built is None:
        return sliding_window, False
    # (an inclusive mask's layer passes w (T5Gemma) or w + 1, flash-attn's count for the same
    # band (EmbeddingGemma 2, Ultrabert): both are the mask's window)
    if sliding_window is not None and int(sliding_window) != built and not (
            inclusive and int(sliding_window) == built + 1):
        raise ValueError(f"{name}: the layer passes sliding_window={sliding_window}, but its "
                         f"attention mask was built with a sliding window of {built} tokens"
                         f"{' on each side' if inclusive else ''}; ringseq attention cannot "
                         f"tell which one the model means")
    return built, inclusive


def _check_cross_attention(name, query, key, causal) -> None:
    """ValueError for cross-attention (a non-causal module whose keys are another sequence's:
    an encoder-decoder model's decoder attending to the encoder) between sequences of
    different lengths: the ring shards queries and keys alike."""
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len == k_len or (causal and "CrossAttention" not in name):
        return  # (a causal layer with more keys than queries holds a KV cache: refused below)
    raise ValueError(f"{name}: cross-attention of {q_len} decoder tokens to {k_len} encoder "
                     f"tokens on this rank: ringseq attention shards queries and keys "
                     f"alike, so it runs cross-attention only between a decoder and an encoder "
                     f"input of the same length, sharded with the same layout (pad or truncate "
                     f"them to one length)")


def _check_layer_kind(name, module, kwargs) -> None:
    """ValueError for attention variants whose extra structure reaches the attention function
    only in ways ring attention would silently drop: learned attention sinks (``s_aux``,
    gpt-oss) and chunked attention layers (Llama 4's ``attention_chunk_size``, whose chunks
    transformers builds into a 4D mask that ringseq's mask function does not make)."""
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{name}: attention sinks (s_aux, e.g. gpt-oss) are not supported by "
                         f"ringseq attention: the ring's softmax has no sink term, and "
                         f"ignoring it would change every output")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{name}: an additive position bias (position_bias, e.g. T5's relative "
                         f"attention bias) is not supported by ringseq attention: ignoring it "
                         f"would change every output")
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if (layer_types is not None and idx is not None and 0 <= idx < len(layer_types)
            and layer_types[idx] == "chunked_attention"):
        raise ValueError(f"{name}: layer {idx} is a chunked attention layer "
                         f"(attention_chunk_size={getattr(config, 'attention_chunk_size', None)}"
                         f"): chunked attention is not supported by ringseq attention (it "
                         f"would run as full causal attention)")


def _checked_call(name, settings, query, key, value, dropout, sliding_window, kwargs,
                  inclusive: bool = False):
    """This call's (layout bound to the batch, documents, window); ValueError for what ring
    attention cannot compute exactly (see the module doc). ``inclusive``: see
    :func:`_window_of_mask`."""
    if kwargs.get("output_attentions"):
        raise ValueError(f"{name}: output_attentions=True is not supported by ringseq attention "
                         f"(attention probabilities are never materialized); use "
                         f"attn_implementation='eager' on one device to inspect them")
    # (0 only: before, a negative or NaN dropout passed as none)
    if dropout is not None and not dropout == 0:  # (False is none too; True is refused)
        raise ValueError(f"{name}: attention dropout {dropout} is not supported by ringseq "
                         f"attention; set config.attention_dropout=0.0 (or call model.eval())")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{name}: query has {query.shape[2]} local tokens but key has "
                         f"{key.shape[2]}; ringseq attention needs the keys of exactly the "
                         f"current tokens (a KV cache is not supported: pass "
                         f"use_cache=False, and input_ids: generate(inputs_embeds=...) turns the "
                         f"cache on; generate() works so in a run of one process, or after "
                         f"model.set_attn_implementation('sdpa'))")
    docs = _documents(name, kwargs)
    if docs is None and settings._model_documents:
        raise ValueError(f"{name}: the model was called with packed documents' boundaries "
                         f"(cu_seq_lens_q), but its layer calls the attention without them "
                         f"(it passes no **kwargs on), so each document would attend to the "
                         f"others: packed batches are not supported for this model; give it "
                         f"one sequence per row")
    if docs is None and group_info(settings.group)[0] == 1:
        # A ring of one holds the whole sequence in order under every layout (shard is the
        # identity there), so no layout's length rule applies: e.g. generate's one more token
        # per step on a model switched with layout="zigzag"; "documents" without boundaries
        # is one document per row there (packed rows without them are refused by the
        # position-id check: their positions restart).
        layout = get_layout("contiguous")
    else:
        try:
            layout = settings.layout.bind(docs)  # "documents": this batch's own layout
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    window = (-1, -1)
    if sliding_window is not None:
        # (an integral float as configs may hold it; before, int() made 2.9 a window of 2)
        sw = as_int(sliding_window)
        if sw is None and isinstance(sliding_window, float) and sliding_window.is_integer():
            sw = int(sliding_window)
        if sw is None or sw < 1:
            raise ValueError(f"{name}: sliding_window must be an int >= 1, got "
                             f"{sliding_window!r}")
        # (before: (w - 1, w - 1) for T5Gemma's encoder too, whose mask sees |q - k| <= w:
        # two keys fewer per row than the model, outputs 0.09 off without a word)
        window = (sw, sw) if inclusive else (sw - 1, sw - 1)
    return layout, docs, window


def _documents(name: str, kwargs) -> Optional[tuple]:
    """The global document boundaries transformers hands over for a packed batch, or None."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return None
    # boundaries from 0, never decreasing (named as this argument, not as bad position_ids)
    docs = check_cu_seqlens(name, "cu_seq_lens_q", cu)
    cu_k = kwargs.get("cu_seq_lens_k")
    keys = None if cu_k is None else tuple(int(c) for c in (cu_k.tolist() if torch.is_tensor(cu_k)
                                                            else cu_k))
    if keys is not None and keys != docs:
        raise ValueError(f"{name}: cu_seq_lens_k {list(keys)} differs from cu_seq_lens_q "
                         f"{list(docs)} (ring attention packs queries and keys alike: pass the "
                         f"same boundaries)")
    return docs


# Marks a model call without position ids: the model numbers its tokens 0..s_local-1 itself.
_MODEL_DEFAULT_POSITIONS = "model default"


def _model_positions(settings: RingSettings, q_local: int, device):
    """The position ids the running model was called with (for attention functions that get
    none), a (q_local,) arange when it was called without any, or None outside a model call
    (a layer called on its own: nothing to check)."""
    pos = settings._model_positions
    if isinstance(pos, str):  # _MODEL_DEFAULT_POSITIONS
        # made once per model call: every layer then hands the input check the same tensor,
        # which it checks (and agrees on across ranks) once
        pos = settings._model_positions = torch.arange(q_local, device=device)  # (s_local,)
    return pos


def _capture_positions(module, args, kwargs):
    """Forward pre-hook on the base model (:func:`apply`): counts the model's calls and records
    its position ids."""
    settings = getattr(module, "ringseq_settings", None)
    if settings is None:
        return
    settings._calls += 1
    settings._in_call += 1
    settings._model_documents = settings._model_documents or _given_documents(kwargs)
    if not getattr(module, "_ringseq_takes_positions", False):
        return  # (apply refused such a model that encodes positions)
    pos = _call_arguments(module, args, kwargs).get("position_ids")
    settings._model_positions = pos if pos is not None else _MODEL_DEFAULT_POSITIONS


def _given_documents(kwargs) -> bool:
    return kwargs.get("cu_seq_lens_q") is not None


def _call_arguments(module, args, kwargs) -> dict:
    """The arguments of a call of ``module`` by name, those given by position included (and
    its ``**kwargs`` flattened in); ``kwargs`` as given when the call does not bind (the
    model's forward will say why)."""
    if not args:
        return kwargs
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError:
        return kwargs
    named = {}
    for name, value in bound.arguments.items():
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def _capture_documents(module, args, kwargs):
    """Forward pre-hook on the model ``apply`` was given, where it is not the base model: it
    may take the packed documents' boundaries and not hand them on (FalconForCausalLM)."""
    settings = getattr(module, "ringseq_settings", None)
    if settings is not None:
        kwargs = _call_arguments(module, args, kwargs)  # (labels by position: seen too)
        settings._model_documents = _given_documents(kwargs)
        kept = kwargs.get("logits_to_keep", kwargs.get("num_logits_to_keep"))
        settings._logits_kept = (None if kept is None or (isinstance(kept, int) and kept == 0)
                                 else kept)
        # (a causal LM's loss shifts the labels; other heads' per-token losses do not)
        settings._labels_given = (kwargs.get("labels") is not None
                                  and _shifts_labels(module, kwargs))


def _shifts_labels(model, kwargs) -> bool:
    """Whether labels given to ``model`` (with the call's other ``kwargs``) are shifted along
    the sequence: its own loss is transformers' causal-LM loss (its ``loss_type`` maps to it,
    or it has none, or an unknown one, which transformers falls back to, and it generates:
    GPT-2's heads, decoder-only ``*ForConditionalGeneration`` models; before, only
    "ForCausalLM" was seen, and their labels gave each rank another, wrong loss), or it is an
    encoder-decoder model that makes its decoder inputs from them (no ``decoder_input_ids``:
    they shift the labels right, within each rank's shard). A model without a generation head
    and a loss type (ELECTRA's pre-training head) computes its own, per-token loss."""
    from transformers import GenerationMixin
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return (kwargs.get("decoder_input_ids") is None
                and kwargs.get("decoder_inputs_embeds") is None)
    loss = getattr(model, "_loss_function", None)  # (set through the loss_function setter)
    if loss is None:
        loss = LOSS_MAPPING.get(getattr(model, "loss_type", None),
                                ForCausalLMLoss if isinstance(model, GenerationMixin) else None)
    return loss is ForCausalLMLoss


def _forget_documents(module, args, kwargs, output):
    settings = getattr(module, "ringseq_settings", None)
    if settings is not None:
        settings._model_documents = False
        settings._logits_kept = None
        settings._labels_given = False


def _forget_positions(module, args, kwargs, output):
    settings = getattr(module, "ringseq_settings", None)
    if settings is not None:
        settings._model_positions = None
        settings._model_documents = False
        settings._in_call = max(0, settings._in_call - 1)


def _takes_positions(base) -> bool:
    """Whether ``base.forward`` has a ``position_ids`` parameter."""
    try:
        return "position_ids" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def _unwrapped(model):
    """The transformers model inside wrappers whose forward passes ``*args, **kwargs`` on (a
    PEFT model's ``get_base_model()``, DDP's and FSDP1's ``module``)."""
    for _ in range(8):  # (wrappers of wrappers; a cycle would be a bug elsewhere)
        if callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel) or \
                type(model).__name__ == "FullyShardedDataParallel":
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner
    return model


def _base_model(model):
    """The module whose forward takes the model's ``position_ids`` (transformers' base model
    of the unwrapped model)."""
    inner = _unwrapped(model)
    return getattr(inner, "base_model", inner)


class _DISPATCHES:
    """Calls of :func:`ringseq_attention_forward` in this process so far (eager ones)."""
    count = 0


def _watch_dispatch(module) -> None:
    """Hooks a switched attention module's next call (once; the hooks go once it dispatched):
    a module whose forward computes attention itself instead of dispatching through
    AttentionInterface (a subclass calling SDPA) still has an ``*Attention`` name and a
    ``scaling``, and transformers switches its config; only its call tells (before: each rank
    attended to its own shard alone, logits 0.22 off at W=2, no error)."""
    if getattr(module, "_ringseq_dispatch_watch", None) is None:
        module._ringseq_dispatch_watch = (module.register_forward_pre_hook(_count_before),
                                          module.register_forward_hook(_check_dispatched))


def _count_before(module, args):
    if not torch.compiler.is_compiling():
        module._ringseq_dispatches_before = _DISPATCHES.count


def _check_dispatched(module, args, output):
    before = getattr(module, "_ringseq_dispatches_before", None)
    if torch.compiler.is_compiling() or before is None:
        return  # (a compiled call: checked at the next eager one)
    if getattr(module.forward, "_torchdynamo_orig_callable", None) is not None or getattr(
            getattr(module, "config", None), "_attn_implementation",
            ATTN_IMPLEMENTATION) != ATTN_IMPLEMENTATION:
        # (its own forward compiled, where the count does not run; or switched away from
        # ringseq since, sdpa to generate: checked at a later call)
        return
    if _DISPATCHES.count > before:  # (itself, or an attention module inside it)
        for handle in module._ringseq_dispatch_watch:
            handle.remove()
        module._ringseq_dispatch_watch = None
        return
    raise ValueError(f"apply: {type(module).__name__} ({getattr(module, '_ringseq_stack', '')}) "
                     f"returned from its first call since apply without calling ringseq's "
                     f"attention: its forward computes attention itself instead of "
                     f"dispatching through transformers' AttentionInterface "
                     f"(ALL_ATTENTION_FUNCTIONS[config._attn_implementation]), so each rank "
                     f"attended to its own shard only. Dispatch through the interface, or use "
                     f"ringseq.nn.RingAttention in it")


def _watch_model_positions(model, settings: RingSettings) -> None:
    """Hooks the base model's forward (once per model) so that attention functions called
    without ``position_ids`` check the ones the model was called with, and so that each model
    call checks its inputs once on every rank."""
    base = _base_model(model)
    base._ringseq_takes_positions = _takes_positions(base)  # (read at every call: cached)
    base.ringseq_settings = settings  # read by the hooks: a re-applied model's hooks see it
    if not getattr(base, "_ringseq_watches_positions", False):
        base.register_forward_pre_hook(_capture_positions, with_kwargs=True)
        base.register_forward_hook(_forget_positions, with_kwargs=True, always_call=True)
        base._ringseq_watches_positions = True
    outer = _unwrapped(model)
    if outer is not base:
        outer.ringseq_settings = settings
        if not getattr(outer, "_ringseq_watches_documents", False):
            outer.register_forward_pre_hook(_capture_documents, with_kwargs=True)
            outer.register_forward_hook(_forget_documents, with_kwargs=True, always_call=True)
            outer._ringseq_watches_documents = True


# Per-layer kinds (a config's layer_types, layers_block_type or block_types) that mix tokens
# only through the softmax attention the ring runs: attention (full or windowed; chunked
# layers are refused at the call, which knows the layer) and per-token layers (MLP, MoE).
_RING_EXACT_LAYER_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention",
                                     "attention", "mlp", "moe", "dense"})
# Token mixers other than softmax attention (state-space models, short convolutions, linear
# attention, recurrences), as runs of the words of a CamelCase class name, lower case.
_OTHER_MIXER_WORDS = (("mamba",), ("ssm",), ("short", "conv"), ("delta", "net"),
                      ("linear", "attention"), ("lightning",), ("rglru",), ("recurrent",),
                      ("rwkv",), ("lstm",), ("mlstm",), ("slstm",), ("retention",), ("hyena",))


def _camel_words(name: str) -> list:
    """The lower-case words of a CamelCase name."""
    return [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)]


def _has_run(words, run) -> bool:
    return any(tuple(words[i:i + len(run)]) == run for i in range(len(words)))


def _is_other_mixer(module) -> bool:
    """Whether ``module`` mixes tokens by other means than softmax attention: a 1-d
    convolution over the sequence, or a class whose name says so (e.g. JambaMambaMixer,
    Lfm2ShortConv, Qwen3NextGatedDeltaNet; whole words, so GptOssMLP is no "ssm")."""
    if isinstance(module, torch.nn.Conv1d):
        return True
    words = _camel_words(type(module).__name__)
    return any(_has_run(words, run) for run in _OTHER_MIXER_WORDS)


# rope_type values whose frequencies depend on the sequence length: transformers takes it as
# max(position_ids) + 1 of the ids it is given, on each rank its own shard's
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def _rope_parameter_sets(cfg):
    """The RoPE parameter dicts of a config (``rope_parameters`` / ``rope_scaling``, one dict
    or one per layer type)."""
    for attr in ("rope_parameters", "rope_scaling"):
        value = getattr(cfg, attr, None)
        if not isinstance(value, dict):
            continue
        subs = [v for v in value.values() if isinstance(v, dict)]
        yield from ((attr, v) for v in subs) if subs else ((attr, value),)


def _position_encoders(model) -> list:
    """Names of ``model``'s modules that encode positions (learned or sinusoidal position
    embeddings, rotary modules), by class or attribute name."""
    found = []
    for name, sub in model.named_modules():
        if _names_a_position_encoder(type(sub).__name__, name.rsplit(".", 1)[-1]):
            found.append(f"{name} ({type(sub).__name__})")
    return found


# Words that say a module encodes positions, in its class name (LlamaRotaryEmbedding,
# BartLearnedPositionalEmbedding, PerceiverTrainablePositionEncoding, ...RelativePositionBias,
# Sam2VideoRoPEAttention) or its attribute name (GPT-2's wpe, embed_positions,
# position_embedding, positions_embed): whole words, so PositionwiseFeedForward or a
# ...Property is none.
_POSITION_NOUNS = frozenset({"pos", "position", "positions"})
_POSITION_KINDS = frozenset({"emb", "embed", "embeds", "embedding", "embeddings", "encoding",
                             "encodings", "bias"})


def _names_a_position_encoder(cls_name: str, attr: str) -> bool:
    if re.search(r"RoPE|ROPE|(?<![a-z])Rope(?![a-z])", cls_name) or attr.lower() == "wpe":
        return True
    for words in (_camel_words(cls_name), [w for w in attr.lower().split("_") if w]):
        if "rotary" in words or "positional" in words or "rope" in words:
            return True
        if _POSITION_NOUNS & set(words) and _POSITION_KINDS & set(words):
            return True
    return False


def _check_positions_exact(model, modules) -> None:
    """ValueError (raised by :func:`apply`) for models whose position encoding cannot see the
    global positions of a rank's tokens: a base model whose forward takes no ``position_ids``
    but that encodes positions (BART-style decoders number their tokens from 0, so each rank
    would number its own shard from 0), RoPE whose frequencies depend on the sequence length
    (dynamic NTK, longrope: each rank's own shard's length), and Llama 4's query temperature
    of NoPE layers (computed from the local token count)."""
    model_name = type(model).__name__
    base = _base_model(model)
    encoders = _position_encoders(model)
    if encoders and not _takes_positions(base):
        raise ValueError(
            f"apply: {model_name} encodes positions ({', '.join(encoders[:3])}) but its base "
            f"model's forward ({type(base).__name__}.forward) takes no position_ids: each rank "
            f"would number its own shard of the sequence from 0, not with the global positions "
            f"of its tokens")
    configs = {id(c): c for c in [getattr(model, "config", None)]
               + [getattr(m, "config", None) for m in modules] if c is not None}
    for cfg in configs.values():
        for attr, params in _rope_parameter_sets(cfg):
            kind = params.get("rope_type", params.get("type"))
            if kind in _LENGTH_DEPENDENT_ROPE:
                raise ValueError(
                    f"apply: {model_name} uses rope_type={kind!r} (config.{attr}), whose "
                    f"frequencies depend on the sequence length, which transformers takes from "
                    f"the position ids it is given: each rank would rotate with its own "
                    f"shard's frequencies, not the whole sequence's")
    for m in modules:
        if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True):
            raise ValueError(
                f"apply: {model_name} scales the queries of its NoPE layers by a temperature "
                f"that transformers computes from the local token count "
                f"(attn_temperature_tuning=True in {type(m).__name__}), not from the position "
                f"ids: each rank would use its own shard's positions 0..s_local-1")



def _text_config(config):
    """A multimodal config's language model's sub-config (the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _check_ring_exact(model, modules) -> None:
    """ValueError (raised by :func:`apply`, before any communication) for models whose tokens
    meet other than through the attention modules ringseq switches: each rank would run the
    other mixers on its own shard of the sequence only, silently giving other outputs
    (Mamba / short-convolution / linear-attention layers of hybrid models such as Jamba,
    LFM2, Qwen3-Next), and for ALiBi position biases, which the ring's softmax has no term
    for."""
    model_name = type(model).__name__
    # the language model's attention modules: the sequence the ring shards is theirs (an
    # audio or vision tower's layers, which may hold convolutions, run whole inputs per rank)
    config = getattr(model, "config", None)
    text = _text_config(config)
    modules = [m for m in modules if getattr(m, "config", None) is text] or modules
    configs = {id(c): c for c in [config] + [getattr(m, "config", None) for m in modules]
               if c is not None}
    for cfg in configs.values():
        attn_cfg = getattr(cfg, "attn_config", None)
        if (getattr(cfg, "alibi", False) is True
                or getattr(cfg, "position_embedding_type", None) == "alibi"
                or (isinstance(attn_cfg, dict) and attn_cfg.get("alibi") is True)
                or getattr(attn_cfg, "alibi", False) is True):
            raise ValueError(f"apply: {model_name} adds ALiBi position biases to its attention "
                             f"scores (config alibi=True), which ringseq attention has no term "
                             f"for: it would compute attention without them")
        for attr in ("layer_types", "layers_block_type", "block_types"):
            kinds = getattr(cfg, attr, None)
            if not isinstance(kinds, (list, tuple)):
                continue
            for idx, kind in enumerate(kinds):
                if isinstance(kind, str) and kind not in _RING_EXACT_LAYER_KINDS:
                    raise ValueError(
                        f"apply: {model_name} has a {kind!r} layer (config.{attr}[{idx}]); "
                        f"ringseq switches softmax attention only (layer kinds "
                        f"{sorted(_RING_EXACT_LAYER_KINDS)}), and on a sharded sequence any "
                        f"other token mixer would run on each rank's own tokens only")
    switched = {id(m) for m in modules}
    names = {id(m): n for n, m in model.named_modules()}
    for layers in model.modules():
        # the decoder's layer lists: those holding a switched attention module
        if not isinstance(layers, torch.nn.ModuleList) or not any(
                id(sub) in switched for sub in layers.modules()):
            continue
        for sub in layers.modules():
            if _is_other_mixer(sub):
                cls = type(sub).__name__
                raise ValueError(
                    f"apply: {model_name} mixes tokens outside softmax attention in "
                    f"{names.get(id(sub), cls)} ({cls}); ringseq switches attention modules "
                    f"only, and on a sharded sequence that mixer would run on each rank's own "
                    f"tokens only, giving other outputs")


def ringseq_mask(batch_size: int = None, q_length: int = None, kv_length: int = None,
                 q_offset: int = 0, kv_offset: int = 0, mask_function=None,
                 attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers mask function for ``"ringseq"``: the 2D (b, kv_length) padding mask as
    given (boolean), or None. The causal structure is the ring's, so no 4D mask is built;
    :func:`ringseq_attention_forward` refuses a mask with zeros. A sliding window the mask
    function carries is marked on what is returned (``ringseq_window``; where there is no
    mask, on an all-ones stand-in marked ``ringseq_no_mask``), for the layers that do not
    pass it to the attention themselves."""
    window, inclusive = _mask_window(mask_function)
    # PaliGemma's language model: its attention modules are not causal
    # (use_bidirectional_attention), but the model's mask is (create_causal_mask): the
    # mask's structure decides, as it does in transformers' own attention functions (before:
    # ring attention ran bidirectional, each token seeing the ones after it)
    causal = (True if getattr(kwargs.get("config"), "use_bidirectional_attention", False)
              and _is_causal_mask(mask_function) else None)
    if _has_blockwise_overlay(mask_function):
        # Returned as the mask, so that the attention's input check raises it on every rank
        # (agreed over the ring) rather than here, on the ranks that build this mask.
        marker = torch.ones((), dtype=torch.bool, device=kwargs.get("device")).expand(
            batch_size, 1, q_length, kv_length)  # (b, 1, q, kv), no memory
        marker.ringseq_refusal = (
            "bidirectional attention within blocks of tokens (transformers' blockwise overlay: "
            "the image tokens of Gemma 3 / Gemma 4 style multimodal models), which ring "
            "attention would run as causal attention")
        return marker
    if attention_mask is None:
        if window is None and causal is None:
            return None
        marker = torch.ones((), dtype=torch.bool, device=kwargs.get("device")).expand(
            batch_size, 1, q_length, kv_length)  # (b, 1, q, kv), no memory
        marker.ringseq_no_mask, marker.ringseq_window = True, window
        marker.ringseq_window_inclusive = inclusive
        if causal is not None:
            marker.ringseq_causal = causal
        return marker
    if attention_mask.dim() == 2 and kv_length is not None:
        whole = getattr(attention_mask, "ringseq_whole_mask", attention_mask)
        attention_mask = attention_mask[:, -kv_length:]
        # (the input check reads the whole mask: padding in the columns cut away here, e.g. a
        # full-length left-padded mask beside sharded input ids, is refused too)
        attention_mask.ringseq_whole_mask = whole
        if window is not None:
            attention_mask.ringseq_window = window
            attention_mask.ringseq_window_inclusive = inclusive
        if causal is not None:
            attention_mask.ringseq_causal = causal
    return attention_mask


def _mask_parts(mask_function):
    """The functions a transformers mask function is composed of (``or_masks`` /
    ``and_masks`` / the packed-sequence remap keep their parts in their closures), itself
    included, each once."""
    stack, seen = [mask_function], set()
    while stack:
        fn = stack.pop()
        if not callable(fn) or id(fn) in seen:
            continue
        seen.add(id(fn))
        yield fn
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            stack.extend(value if isinstance(value, (tuple, list)) else [value])


def _mask_window(mask_function) -> Tuple[Optional[int], bool]:
    """``(window, inclusive)`` of the sliding window in a transformers mask function:
    ``sliding_window_overlay``'s (tokens a query sees, itself included; ``inclusive``
    False) or ``sliding_window_bidirectional_overlay``'s (keys seen on each side,
    |q - k| <= window; True), or ``(None, False)``."""
    for fn in _mask_parts(mask_function):
        qualname = getattr(fn, "__qualname__", "")
        for overlay, inclusive in (("sliding_window_overlay.", False),
                                   ("sliding_window_bidirectional_overlay.", True)):
            if qualname.startswith(overlay):
                for cell in fn.__closure__ or ():
                    if isinstance(cell.cell_contents, int):
                        return int(cell.cell_contents), inclusive
    return None, False


# transformers' mask parts that keep a causal mask causal (a blockwise overlay with blocks is
# refused on its own); anything else -- bidirectional_mask_function, a lambda that widens it
# (Gemma 3's bidirectional models: or_mask_function=lambda *a: True) -- may not
_CAUSAL_KEEPING = ("causal_mask_function", "and_masks.", "or_masks.", "sliding_window_overlay.",
                   "chunked_overlay.", "blockwise_overlay.", "sliding_window_causal_mask_function",
                   "chunked_causal_mask_function", "padding_mask_function.",
                   "packed_sequence_mask_function.", "remap_positions_for_packed_sequence.",
                   "add_offsets_to_mask_function.")


def _is_causal_mask(mask_function) -> bool:
    """Whether a transformers mask function is ``causal_mask_function`` composed only with
    parts that keep it causal (windows, padding, packing, an overlay of no block)."""
    names = [getattr(fn, "__qualname__", "") for fn in _mask_parts(mask_function)]
    return "causal_mask_function" in names and all(n.startswith(_CAUSAL_KEEPING) for n in names)


def _has_blockwise_overlay(mask_function) -> bool:
    """Whether a transformers mask function is composed with ``blockwise_overlay`` over at
    least one block: its block ids are -1 for tokens outside every block, so a text-only
    input (Gemma 3's all-zero ``token_type_ids``) adds nothing to the mask. Other
    compositions are the ring's own structure: causal or not (the module's ``is_causal``),
    sliding windows (:func:`_mask_window`), packed documents (checked through position
    ids)."""
    for fn in _mask_parts(mask_function):
        if getattr(fn, "__qualname__", "").startswith("blockwise_overlay."):
            if any(bool((c.cell_contents >= 0).any()) for c in fn.__closure__ or ()
                   if torch.is_tensor(getattr(c, "cell_contents", None))):
                return True
    return False


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, ringseq_attention_forward)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ringseq_mask)


_register()


# words of a multimodal config's sub-config names for its encoders of other inputs
_TOWER_WORDS = ("vision", "visual", "image", "audio", "speech", "video")


def _attention_modules(model: torch.nn.Module):
    """The attention modules ``apply`` switches: of the AttentionInterface style (they carry
    ``scaling`` and pass themselves as ``module`` to the attention function), not those of a
    multimodal model's vision or audio tower (their ``config`` is a sub-config named so:
    each rank runs whole images there, and a ring would shard their patches; before:
    Qwen2-VL's vision attention was switched, and refused every image)."""
    towers = _tower_configs(model)
    return [m for m in model.modules()
            if "Attention" in type(m).__name__ and hasattr(m, "scaling")
            and id(getattr(m, "config", None)) not in towers]


def _tower_configs(model) -> set:
    """ids of a multimodal config's sub-configs of its encoders of other inputs (vision,
    audio: named so), which ringseq leaves as they are."""
    config = getattr(model, "config", None)
    text = _text_config(config)
    return {id(sub) for name in (getattr(config, "sub_configs", None) or {})
            for sub in [getattr(config, name, None)]
            if sub is not None and sub is not text
            and any(word in name.lower() for word in _TOWER_WORDS)}


def _poolers(model) -> list:
    """Names of the modules named ``pooler`` outside the encoders of other inputs (BERT's:
    a dense layer over the first token)."""
    towers, tower_names, out = _tower_configs(model), [], []
    for name, m in model.named_modules():
        if id(getattr(m, "config", None)) in towers:
            tower_names.append(name + ".")
        elif name.rsplit(".", 1)[-1] == "pooler" and not name.startswith(tuple(tower_names)):
            out.append(name)
    return out


def config_heads(cfg) -> tuple:
    """(num_attention_heads, num_key_value_heads) of a transformers config for the upfront
    head checks; None for a count it has none of, or holds per layer (Gemma 4's per-layer
    K/V heads: reading the attribute raises transformers' RuntimeError, which apply and boost
    raised as it was). The attention calls check each layer's heads."""
    def read(name):
        try:
            value = getattr(cfg, name, None)
        except RuntimeError:  # (AmbiguousGlobalPerLayerAttributeError)
            return None
        return None if value is None else int(value)
    return read("num_attention_heads"), read("num_key_value_heads")


def _model_heads(model) -> tuple:
    h, h_kv = config_heads(getattr(model, "config", None))
    if h is None:
        return None, None
    return h, h_kv or h


def _sp_groups(model, group, sp_mode, ulysses_size, inner_ring_size, ulysses_inner):
    """The SequenceParallelGroups ``apply`` runs on, or None for the plain ring."""
    h, h_kv = _model_heads(model)
    if isinstance(group, SequenceParallelGroups):
        sp = group
        given = {"sp_mode": (sp_mode, sp.mode), "ulysses_size": (ulysses_size, sp.ulysses_size),
                 "inner_ring_size": (inner_ring_size, sp.inner_ring_size),
                 "ulysses_inner": (ulysses_inner, sp.ulysses_inner)}
        for name, (want, have) in given.items():
            if want is not None and want != have:
                raise ValueError(f"apply: {name}={want!r} but the SequenceParallelGroups passed "
                                 f"as group has {name}={have!r}")
    else:
        mode = sp_mode or "ring"
        world, _ = group_info(group, "apply")  # raises for a group this process is not in
        try:  # (the arguments' own checks, before any communication: named for apply)
            U, R, I = resolve_sp_sizes(mode, world, ulysses_size, inner_ring_size)
            if ulysses_inner is not None and not is_bool(ulysses_inner):
                raise TypeError(f"ulysses_inner must be a bool or None, got {ulysses_inner!r}")
            if h is not None and not (U == 1 and I == R):
                check_model_heads(h, h_kv, U, world, fn="apply")
        except (TypeError, ValueError) as exc:
            raise named_for("apply", exc) from None
        if U == 1 and I == R:
            return None
        return make_sp_groups(U, None if I == R else I, group=group,
                              ulysses_inner=True if ulysses_inner is None else ulysses_inner)
    if h is not None:
        try:
            check_model_heads(h, h_kv, sp.ulysses_size, sp.size, fn="apply")
        except ValueError as exc:
            raise named_for("apply", exc) from None
    return sp


def apply(model: torch.nn.Module, group=None, layout="zigzag", backend: Optional[str] = None, *,
          sp_mode: Optional[str] = None, ulysses_size: Optional[int] = None,
          inner_ring_size: Optional[int] = None, ulysses_inner: Optional[bool] = None):
    """Switches a transformers model to sequence-parallel attention over ``group``; returns it.

    Args:
        model: a ``PreTrainedModel`` whose attention uses ``AttentionInterface`` (Llama,
            Mistral, Qwen2/3, Gemma, ... in current transformers): the model you call, head
            included. Given its base model (``model.model``), the ring runs in the outer
            model too, but what only the outer model takes (``labels``, ``logits_to_keep``)
            is not seen, so not refused over several ranks.
        group: process group of the sequence-parallel ranks (None: the default group), or a
            ``ringseq.SequenceParallelGroups`` (then the ``sp_*`` arguments may be omitted).
            The model's inputs must then be sharded over it: ``ringseq.shard_batch(..., group)``
            for a process group, ``sp.shard_batch(batch, layout)`` for a
            ``SequenceParallelGroups`` (the ``ringseq`` functions take process groups only).
        layout: ``"zigzag"`` (default: balanced causal work), ``"contiguous"``, ``"stripe"``,
            ``"documents"`` (packed batches: each batch split per document by
            ``ringseq.layouts.Documents``; shard them with
            ``ringseq.shard_batch(batch, layout="documents")``) or a
            ``ringseq.layouts.Layout``: the layout of the ring dimension. Packed batches
            (``cu_seq_lens_q`` from ``shard_batch``) are exact with every layout; models with
            sliding windows (per layer) and logit soft-capping are too (for short windows pick
            ``"contiguous"``: K/V then travel only as far as the window reaches).
        backend: block kernel backend (see ``ringseq.ring_flash_attn_func``).
        sp_mode: ``"ring"`` (default), ``"ulysses"`` (all-to-all over the whole group) or
            ``"hybrid"`` (Ulysses inside, ring across: ``ringseq.usp_attn_func``).
        ulysses_size: the Ulysses degree of ``"hybrid"``.
        inner_ring_size: split the ring into inner rings of this size (a double ring).
        ulysses_inner: Ulysses groups on consecutive ranks (default True) or the ring's.
            With any non-ring choice the groups are created here (collective over the
            default group: every rank calls ``apply``; see ``ringseq.make_sp_groups``).

    Returns ``model`` (modified in place): ``config._attn_implementation == "ringseq"`` and a
    shared :class:`RingSettings` as ``ringseq_settings`` on every attention module.

    Raises ValueError for an unknown layout or sp_mode, a process group this rank is not in, a
    model without AttentionInterface-style attention modules, a model whose tokens also meet
    outside softmax attention (a layer kind in ``layer_types`` / ``layers_block_type`` /
    ``block_types`` other than attention, MLP or MoE; a 1-d convolution, Mamba, short
    convolution, linear attention or recurrence module in its decoder layers), that adds
    ALiBi biases or a learned relative position bias (T5), whose embeddings number positions
    from ``padding_idx + 1`` (RoBERTa), whose attention transformers cannot switch (it does
    not dispatch through AttentionInterface: XGLM), sizes that do not divide the
    group, or ``num_attention_heads`` not divisible by the Ulysses degree (naming the degrees
    that work) -- all before any communication. An attention module that returns from its
    first call (with the model still switched to ringseq) without having called ringseq's
    attention, computing attention itself (a subclass calling SDPA), raises ValueError then.
    """
    try:  # (checked here, not at the first forward; the errors name apply)
        lay = get_layout(layout, "apply")
        if backend is not None:
            get_backend(backend, fn="apply")
        if sp_mode is not None:
            check_sp_mode(sp_mode, "apply")
    except (TypeError, ValueError) as exc:
        raise named_for("apply", exc) from None
    if not isinstance(group, SequenceParallelGroups):
        group_info(group, "apply")  # raises for a group this process is not in
    modules = _attention_modules(model)
    if not modules:
        # (named by what they lack: before, ModernBERT's, which dispatch through the interface
        # but take their scale per call, were told they did not dispatch)
        unscaled = sorted({type(m).__name__ for m in model.modules()
                           if "Attention" in type(m).__name__ and not hasattr(m, "scaling")})
        found = (f"; its {', '.join(unscaled)} modules hold no `scaling` attribute" if unscaled else
                 "; it has none")
        raise ValueError(f"apply: {type(model).__name__} has no attention modules that ringseq "
                         f"can switch: it switches modules named *Attention* that hold their "
                         f"softmax scale as a `scaling` attribute and dispatch through "
                         f"transformers' AttentionInterface{found}")
    _check_ring_exact(model, modules)
    # each stack of attention layers (an encoder's, a decoder's self- and cross-attention:
    # their names with the layer indices left out) checks its own inputs at every model call,
    # each type of layer on its own: a model's masks may be keyed by layer type
    # ({"full_attention": ..., "sliding_attention": ...}; before, over several ranks, a 4D mask
    # given to the second type alone was never looked at, and ring attention dropped it)
    names = {id(m): n for n, m in model.named_modules()}
    for m in modules:
        kind = [str(getattr(m, a)) for a in ("layer_type", "attention_type", "is_sliding")
                if getattr(m, a, None) is not None]
        m._ringseq_stack = re.sub(r"\.\d+(?=\.|$)", ".*", names.get(id(m), "")) + (
            f" [{', '.join(kind)}]" if kind else "")
    _check_whole_sequence_terms(model)
    _check_positions_exact(model, modules)
    _check_position_terms(model, modules)
    sp = _sp_groups(model, group, sp_mode, ulysses_size, inner_ring_size, ulysses_inner)
    # (after the refusals a model without its pooler would meet too, before the switch)
    _check_pooler(model)
    if sp is None:
        settings = RingSettings(group=group, layout=lay, backend=backend)
    else:
        settings = RingSettings(group=sp.group, layout=sp.data_layout(lay), backend=backend,
                                sp=sp, ring_layout=lay)
    if hasattr(model, "set_attn_implementation"):
        # Sub-models none of whose attention ringseq switches (the vision tower of a multimodal
        # model: each rank runs whole images, not a shard of the sequence) keep their own.
        # (a dict leaves the sub-configs it does not name as they were: name them all)
        kept = _unswitched_sub_configs(model, modules)
        names = getattr(model.config, "sub_configs", None) or {}
        model.set_attn_implementation(
            {"": ATTN_IMPLEMENTATION, **{n: ATTN_IMPLEMENTATION for n in names}, **kept}
            if kept else ATTN_IMPLEMENTATION)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    if getattr(model.config, "_attn_implementation", ATTN_IMPLEMENTATION) != ATTN_IMPLEMENTATION:
        # (a model whose attention does not dispatch through AttentionInterface: XGLM, T5;
        # transformers only logs that it cannot switch. Before: accepted, each rank attending
        # to its own shard alone, XGLM's logits 2e-2 off with no error.)
        raise ValueError(f"apply: transformers cannot switch {type(model).__name__} to ringseq "
                         f"attention (its attention does not dispatch through "
                         f"AttentionInterface: the implementation stays "
                         f"{model.config._attn_implementation!r}), so each rank would attend to "
                         f"its own shard only")
    for m in modules:
        m.ringseq_settings = settings
        _watch_dispatch(m)
    _watch_model_positions(model, settings)
    return model


# heads that pool one position of the sequence ([CLS], the last token) or all of it
_POOLING_HEADS = ("ForSequenceClassification", "ForMultipleChoice", "ForNextSentencePrediction")


def _check_whole_sequence_terms(model) -> None:
    """ValueError (raised by :func:`apply`) for what reads the whole sequence outside
    attention, which each rank would compute from its own shard: a head that pools one
    position (``*ForSequenceClassification``, ``*ForMultipleChoice``, BERT's next-sentence
    head: before, every rank but one gave other logits), ESM-2's ``token_dropout`` (each row
    rescaled by its fraction of <mask> tokens) and MobileBERT's ``trigram_input`` (each
    embedding joined with its neighbours': wrong at every shard border)."""
    name = type(model).__name__
    if name.endswith(_POOLING_HEADS) or ("PreTraining" in name and _poolers(model)):
        raise ValueError(f"apply: {name}'s head pools the sequence (its first token, its last "
                         f"one, or all of it): each rank would pool its own shard's; switch the "
                         f"base model ({type(_base_model(model)).__name__}) and pool the "
                         f"gathered hidden states (ringseq.unshard)")
    config = getattr(model, "config", None)
    text = _text_config(config)
    for attr, what in (("token_dropout", "rescales each row's embeddings by the fraction of "
                                         "<mask> tokens in it"),
                       ("trigram_input", "joins each token's embedding with its neighbours'")):
        if getattr(text, attr, False) is True:
            raise ValueError(f"apply: {name} {what} (config.{attr}=True): each rank would "
                             f"compute it from its own shard of the sequence, giving other "
                             f"outputs")


def _check_pooler(model) -> None:
    """ValueError (raised by :func:`apply`) for a base model's own pooler (BERT's: a dense
    layer over the first token; before: accepted, and pooler_output was each rank's own
    shard's first token, 0.43 off on rank 1 at W=2)."""
    poolers = _poolers(model)
    if poolers:
        raise ValueError(f"apply: {type(model).__name__} pools the sequence in its module "
                         f"{poolers[0]!r} (the first token): each rank would pool its own "
                         f"shard's. Leave it out (`{poolers[0]} = None`, or "
                         f"add_pooling_layer=False where the model takes it) and pool the "
                         f"gathered hidden states (ringseq.unshard)")


def _check_position_terms(model, modules) -> None:
    """ValueError (raised by :func:`apply`) for position information ring attention would
    drop or misnumber: a learned relative position bias added to the scores (T5's
    ``relative_attention_bias``) and embeddings that number positions from ``padding_idx + 1``
    (RoBERTa's: ringseq hands out and checks global positions from 0; before: logits 0.61
    off with no error)."""
    name = type(model).__name__
    biased = [type(m).__name__ for m in modules
              if hasattr(m, "has_relative_attention_bias")
              or hasattr(m, "relative_attention_bias")]
    if biased:
        raise ValueError(f"apply: {name} adds a learned relative position bias to its attention "
                         f"scores ({biased[0]}.relative_attention_bias), which ringseq attention "
                         f"has no term for")
    relative = [type(m).__name__ for m in model.modules()
                if hasattr(m, "padding_idx") and hasattr(m, "position_embeddings")
                and "Embedding" in type(m).__name__]
    if relative:
        raise ValueError(f"apply: {name} numbers its positions from padding_idx + 1 "
                         f"({relative[0]}), not from 0 as the global position ids ringseq hands "
                         f"out and checks (ringseq.shard_batch, the plugin's loader): every "
                         f"position embedding would be off by padding_idx + 1")


def _unswitched_sub_configs(model, switched) -> dict:
    """{sub-config name: its current attention implementation} for each sub-config of
    ``model.config`` that attention modules use (``module.config``) none of which is in
    ``switched``: e.g. ``vision_config`` of Gemma 3's SigLIP tower, whose attention has no
    ``scaling`` attribute and no ring to run on."""
    config = getattr(model, "config", None)
    subs = {name: getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {}}
    used = {id(getattr(m, "config", None)) for m in switched}
    foreign = {id(getattr(m, "config", None)) for m in model.modules()
               if "Attention" in type(m).__name__ and m not in switched}
    return {name: sub._attn_implementation for name, sub in subs.items()
            if sub is not None and id(sub) in foreign and id(sub) not in used}
