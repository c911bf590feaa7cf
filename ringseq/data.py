"""Sharding a language-model batch along the sequence for ring attention.

``shard_batch`` turns a full batch (the same on every rank of the group) into this rank's
part, so that a model whose attention is ring attention (``ringseq.integrations.transformers``)
sees the right tokens, the right global positions and targets that need no further shift.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ._dist import group_info
from .layouts import get_layout, positions_local, shard_local

__all__ = ["shard_batch"]

_SEQ_KEYS = ("input_ids", "inputs_embeds", "token_type_ids")


def shard_batch(batch: Mapping, group=None, layout="zigzag", ignore_index: int = -100) -> dict:
    """This rank's part of a causal-LM batch, split along the sequence with ``layout``.

    Args:
        batch: a mapping holding the full sequences (identical on every rank of ``group``):
            ``input_ids`` (b, s) int64 and/or ``inputs_embeds`` (b, s, hidden) (at least one),
            optionally ``attention_mask`` (b, s), ``position_ids`` (b, s) or (1, s),
            ``labels`` (b, s) int64 with ``ignore_index`` for tokens without a target,
            ``token_type_ids`` (b, s). Other keys are passed through unchanged.
        group: process group of the ring (None: default group; world size 1 without one).
        layout: ``"contiguous"``, ``"zigzag"``, ``"stripe"`` or a ``ringseq.layouts.Layout``;
            must be the layout the model's ring attention uses.
        ignore_index: the label value that marks tokens without a target.

    Returns a new dict with, for this rank's ``s // W`` tokens:
        ``input_ids`` / ``inputs_embeds`` / ``token_type_ids``: sharded along dim 1;
        ``position_ids`` (b, s // W) int64: the global positions of the local tokens (sharded
        from the given ones, else made from ``ringseq.positions``) -- rotary embeddings need
        them, the model's default ``arange(s // W)`` would be wrong;
        ``attention_mask`` (b, s // W): only when given (all ones);
        ``shift_labels`` (b, s // W) int64 (only when ``labels`` was given): the target of each
        local token, i.e. ``labels`` shifted left by one over the FULL sequence before
        sharding, ``ignore_index`` after the last token. There is no ``labels`` key, so the
        model does not shift again (that would lose the target of the last token of every
        shard). Pass ``shift_labels`` to ``ringseq.sharded_cross_entropy(logits, ...)``.

    Raises:
        ValueError: an ``attention_mask`` with any zero (padding cannot be expressed by a
            causal ring; pack sequences without padding instead), no ``input_ids`` /
            ``inputs_embeds``, tensors whose sequence lengths differ, or a length the layout
            cannot split (``W``; ``2W`` for zigzag). Raised on every rank alike, before any
            communication, since every rank holds the same full batch.
    """
    lay = get_layout(layout)
    world_size, rank = group_info(group)
    if "input_ids" in batch and batch["input_ids"] is not None:
        b, s = batch["input_ids"].shape[:2]
    elif "inputs_embeds" in batch and batch["inputs_embeds"] is not None:
        b, s = batch["inputs_embeds"].shape[:2]
    else:
        raise ValueError("shard_batch needs `input_ids` (b, s) or `inputs_embeds` (b, s, hidden) "
                         f"in the batch, got keys {sorted(batch)}")
    lay.check_seqlen(s, world_size)

    def check_len(name, t):
        if t.dim() < 2 or t.shape[1] != s:
            raise ValueError(f"batch[{name!r}] must have the sequence length {s} in dim 1 "
                             f"(like input_ids), got shape {tuple(t.shape)}")

    out = {}
    for key, value in batch.items():
        if value is None or key in ("attention_mask", "position_ids", "labels", "shift_labels"):
            continue
        if key in _SEQ_KEYS:
            check_len(key, value)
            out[key] = shard_local(value, lay, world_size, rank, dim=1)
        else:
            out[key] = value

    mask = batch.get("attention_mask")
    if mask is not None:
        check_len("attention_mask", mask)
        if not bool(mask.bool().all()):
            n = int((~mask.bool()).sum())
            raise ValueError(f"attention_mask has {n} zero (padding) entries; ring attention "
                             "computes a causal mask over the whole sharded sequence and cannot "
                             "skip padding. Pack sequences without padding (and drop the mask), "
                             "or mark padding positions in `labels` with ignore_index.")
        out["attention_mask"] = shard_local(mask, lay, world_size, rank, dim=1)

    pos = batch.get("position_ids")
    if pos is not None:
        check_len("position_ids", pos)
        out["position_ids"] = shard_local(pos, lay, world_size, rank, dim=1)
    else:
        device = (batch.get("input_ids") if batch.get("input_ids") is not None
                  else batch["inputs_embeds"]).device
        local = positions_local(s, lay, world_size, rank, device=device)  # (s // W,)
        out["position_ids"] = local.unsqueeze(0).expand(b, -1).contiguous()

    if batch.get("shift_labels") is not None and batch.get("labels") is None:
        # already targets (shifted by the caller): only shard them
        check_len("shift_labels", batch["shift_labels"])
        out["shift_labels"] = shard_local(batch["shift_labels"], lay, world_size, rank, dim=1)
    labels = batch.get("labels")
    if labels is not None:
        check_len("labels", labels)
        # Shift over the full sequence first: the target of a shard's last token is the first
        # token of another rank's shard, which a per-shard shift would drop.
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        out["shift_labels"] = shard_local(shifted, lay, world_size, rank, dim=1)
    return out
