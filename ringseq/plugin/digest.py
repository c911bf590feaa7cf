"""Digests that tell ranks whether they hold the same data: a batch the ranks of one
data-parallel group must share, a replicated checkpoint every rank reads.

A digest is 31 bits (``ringseq._hash``) over each tensor's shape, the sum of its elements' bits
and their position-weighted sum (int64, wrapping), over at most ``_SAMPLE`` elements per
tensor (larger tensors by an evenly strided sample): another batch, or another step's
weights, changes it. Not a cryptographic hash, and a change confined to elements outside the
sample of a large tensor goes unseen: it tells a different batch or file from the expected one,
for about 10 ms per large tensor (a 131072 x 4096 ``inputs_embeds`` in full took 6.6 s).
"""
from __future__ import annotations

from typing import List

import torch

from .._hash import stable_hash_ints

__all__ = ["batch_digest", "differing_digests", "state_digest"]

_SAMPLE = 1 << 20  # elements read per tensor at most
# the same-width integer type whose bits a float element is read as
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _wrap64(v: int) -> int:
    """A Python int as the int64 it wraps to."""
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)


def _tensor_words(t: torch.Tensor) -> List[int]:
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    if flat.is_floating_point():
        flat = flat.view(_BITS[flat.element_size()])
    elif flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    stride = -(-flat.numel() // _SAMPLE)  # ceil: at most _SAMPLE elements
    part = flat[::max(1, stride)].to(torch.int64)  # (<= _SAMPLE,)
    weights = torch.arange(1, part.numel() + 1, dtype=torch.int64, device=part.device)
    total, weighted = int(part.sum()), int((part * weights).sum())
    return [len(t.shape), *t.shape, _wrap64(total), _wrap64(weighted)]


def differing_digests(rows) -> dict:
    """``rows``: one ``(group, digest)`` per rank, in rank order (a control agreement's ANY
    fields). Returns ``{group: "rank r: 0x..., ..."}`` for each group whose ranks hold different
    digests (empty when every group agrees)."""
    groups: dict = {}
    for rank, (group, digest) in enumerate(rows):
        groups.setdefault(group, {})[rank] = digest
    return {group: ", ".join(f"rank {r}: {d:#010x}" for r, d in ranks.items())
            for group, ranks in sorted(groups.items()) if len(set(ranks.values())) > 1}


#: the batch's keys that decide what a rank trains on: tokens, targets, positions and the
#: document boundaries and masks that stop them (shard_batch's inputs)
BATCH_KEYS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "position_ids",
              "cu_seq_lens_q", "cu_seq_lens_k", "attention_mask", "token_type_ids")


def batch_digest(batch) -> int:
    """The digest of a batch's tensors under :data:`BATCH_KEYS` (others are left out)."""
    words: List[int] = []
    for key in BATCH_KEYS:
        t = batch.get(key) if hasattr(batch, "get") else None
        if isinstance(t, (list, tuple)):  # (shard_batch takes boundaries as lists too)
            try:
                t = torch.as_tensor(t)
            except (TypeError, ValueError, RuntimeError):
                t = None  # (not numbers: shard_batch refuses it on every rank)
        if torch.is_tensor(t):
            words += [len(key), *key.encode(), *_tensor_words(t)]
    return stable_hash_ints(words)


def state_digest(state) -> int:
    """The digest of a (nested) state: dicts (by sorted key), lists and tuples, tensors and
    Python scalars and strings (other objects by their type name)."""
    words: List[int] = []

    def walk(obj) -> None:
        if torch.is_tensor(obj):
            words.extend([1, *_tensor_words(obj)])
        elif isinstance(obj, dict):
            words.extend([2, len(obj)])
            for key in sorted(obj, key=repr):
                walk(key)
                walk(obj[key])
        elif isinstance(obj, (list, tuple)):
            words.extend([3, len(obj)])
            for item in obj:
                walk(item)
        elif isinstance(obj, int):  # (bool included)
            words.extend([4, _wrap64(int(obj))])
        elif isinstance(obj, float):
            words.extend([5, *torch.tensor([obj], dtype=torch.float64).view(torch.int64).tolist()])
        else:
            text = obj if isinstance(obj, str) else type(obj).__name__
            words.extend([6, len(text), *text.encode()])

    walk(state)
    return stable_hash_ints(words)
