"""Digests that tell ranks whether they hold the same data: a batch the ranks of one
data-parallel group must share, a replicated checkpoint every rank reads.

A digest is 31 bits (``ringseq._hash``) over each tensor's shape, the sum of its elements' bits
and their position-weighted sum (int64, wrapping), over at most ``_SAMPLE`` elements per
tensor (larger tensors by an evenly strided sample): another batch, or another step's
weights, changes it. Tensors of other kinds are read by what defines them: a sparse tensor by
its indices and values, a quantized one by its integers and their scale and zero point, a
meta one by its dtype and shape, a nested one by its components. Not a cryptographic hash,
and a change confined to elements outside the sample of a large tensor goes unseen: it tells
a different batch or file from the expected one, for about 10 ms per large tensor (a
131072 x 4096 ``inputs_embeds`` in full took 6.6 s).
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
    """The words of one tensor: a strided tensor's shape and element sums (:func:`_dense_words`);
    any other kind a state can hold by what defines it, behind a negative tag (a strided
    tensor's first word, its number of dims, is never negative), so that no tensor a file can
    hold raises here (before: sparse, meta and quantized tensors did, on the rank that read
    one alone, after the ranks' vote, and its peers waited the ring timeout)."""
    t = t.detach()
    if t.is_nested:  # (its components, one by one: reshape cannot flatten it)
        parts = t.unbind()
        return [-1, len(parts), *(w for part in parts for w in _tensor_words(part))]
    if t.is_meta:  # no data: what it is, shape and dtype
        return [-2, *_text_words(str(t.dtype)), len(t.shape), *t.shape]
    if t.is_quantized:  # the stored integers and how they map to values
        scheme = t.qscheme()
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            mapping = _dense_words(torch.tensor([t.q_scale()], dtype=torch.float64)) + \
                [int(t.q_zero_point())]
        else:
            mapping = [*_dense_words(t.q_per_channel_scales()),
                       *_dense_words(t.q_per_channel_zero_points()), t.q_per_channel_axis()]
        return [-3, *_text_words(str(scheme)), *_dense_words(t.int_repr()), *mapping]
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is not None:  # indices and values as stored (not coalesced: no copy)
        return [-4, *_text_words(str(t.layout)), len(t.shape), *t.shape,
                *(w for part in parts(t) for w in _dense_words(part))]
    return _dense_words(t)


#: a sparse tensor's parts by layout (COO's as stored, coalesced or not)
_SPARSE_PARTS = {
    torch.sparse_coo: lambda t: (t._indices(), t._values()),
    torch.sparse_csr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_bsr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_csc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
    torch.sparse_bsc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
}


def _text_words(text: str) -> List[int]:
    return [len(text), *text.encode()]


def _dense_words(t: torch.Tensor) -> List[int]:
    """A strided tensor's words: its shape, the sum of its elements' bits and their
    position-weighted sum (over at most ``_SAMPLE`` of them)."""
    flat = t
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    if flat.is_floating_point() or str(flat.dtype).startswith("torch.bits"):
        # (bits dtypes have no arithmetic either: their bits as integers)
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
