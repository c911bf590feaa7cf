"""Sharding a language-model batch along the sequence for ring attention.

``shard_batch`` turns a full batch (the same on every rank of the group) into this rank's
part, so that a model whose attention is ring attention (``ringseq.integrations.transformers``)
sees the right tokens, the right global positions and targets that need no further shift.
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch

from ._args import check_cu_seqlens, check_ignore_index, given
from ._dist import group_info, named_for
from .layouts import (PerBatchDocuments, document_positions, get_layout, positions_local,
                      shard_local)

__all__ = ["shard_batch"]

_SEQ_KEYS = ("input_ids", "inputs_embeds", "token_type_ids")


def _packed_documents(batch: Mapping, b: int, s: int,
                      per_batch_layout: bool) -> Optional[Tuple[int, ...]]:
    """The global document boundaries of a packed batch, or None for a plain one: from
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (what transformers' DataCollatorWithFlattening
    returns with ``return_flash_attn_kwargs=True``) or from position ids that restart at 0.
    For a per-batch documents layout a one-row batch without either is one document (the
    collator gives a batch of one sample position ids that never restart)."""
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    pos = batch.get("position_ids")
    rows = None if pos is None or pos.shape[-1] != s else pos.reshape(-1, s)  # (b or 1, s)
    if cu_q is not None or cu_k is not None:
        docs = check_cu_seqlens("shard_batch", "cu_seq_lens_q" if cu_q is not None
                                else "cu_seq_lens_k", cu_q if cu_q is not None else cu_k)
        if cu_q is not None and cu_k is not None and \
                check_cu_seqlens("shard_batch", "cu_seq_lens_k", cu_k) != docs:
            raise ValueError("shard_batch: cu_seq_lens_k differs from cu_seq_lens_q; ring "
                             "attention packs queries and keys the same way")
    elif rows is not None and pos.dim() <= 2 and bool((rows[:, 1:] == 0).any()):
        # (M-RoPE's (3, b, s) rows are no packed batch: named by their shape below; before,
        # an image's zeros in its height and width rows were refused as a wrongly packed one)
        restarts = (rows[0, 1:] == 0).nonzero().flatten() + 1  # (documents - 1,)
        docs = (0, *restarts.tolist(), s)
    elif per_batch_layout and b == 1 and (pos is None or rows is not None):
        docs = (0, s)
    else:
        return None
    if b != 1:
        raise ValueError(f"shard_batch: a packed batch must be one row (1, total) with its "
                         f"documents back to back, as DataCollatorWithFlattening makes it; got "
                         f"batch size {b}")
    check_cu_seqlens("shard_batch", "cu_seq_lens_q", docs, s, "the batch's length")
    if pos is not None:
        want = document_positions(docs, torch.arange(s, device=pos.device))
        rows_of = pos.reshape(-1, s)  # (1, s), or (3, s) for M-RoPE's three rows
        wrong = (rows_of != want).nonzero()  # (mismatches, 2): row, token
        if len(wrong):
            row, i = wrong[0].tolist()
            # (a row with neither restarts nor cu_seq_lens is one document: a chunk of a
            # longer sequence, positions 5, 6, ..., was refused as a wrongly packed batch)
            what = ("a one-row batch without cu_seq_lens_q whose position_ids never restart "
                    "is one document, positions 0 .. s-1; a chunk of a longer sequence takes "
                    "another layout, e.g. zigzag" if docs == (0, s) and cu_q is None and
                    cu_k is None and int(rows_of[row, 0]) != 0 else
                    f"the document there starts at token {max(d for d in docs if d <= i)}")
            at = f"token {i} of position row {row}" if len(rows_of) > 1 else f"token {i}"
            raise ValueError(f"shard_batch: the position_ids of a packed batch must restart at "
                             f"0 in every document and count up by one (0, 1, 2, ... per "
                             f"document); got {int(rows_of[row, i])} at {at}, expected "
                             f"{int(want[i])} ({what})")
    return docs


def _check_integer(name: str, t: torch.Tensor, what: str) -> None:
    """ValueError for a floating-point, complex or bool ``batch[name]`` (ids and labels)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"shard_batch: batch[{name!r}] must hold integer {what} (int64), "
                         f"got dtype {t.dtype}")


def _targets(name: str, labels: torch.Tensor) -> torch.Tensor:
    """``labels`` as int64 (byte-sized labels would wrap ignore_index, -100, to a real class,
    156); ValueError for floating-point or bool labels."""
    _check_integer(name, labels, "class ids")
    return labels.to(torch.int64)


def shard_batch(batch: Mapping, group=None, layout="zigzag", ignore_index: int = -100) -> dict:
    """This rank's part of a causal-LM batch, split along the sequence with ``layout``.

    Args:
        batch: a mapping holding the full sequences (identical on every rank of ``group``):
            ``input_ids`` (b, s) int64 and/or ``inputs_embeds`` (b, s, hidden) (at least one),
            optionally ``attention_mask`` (b, s), ``position_ids`` (b, s) or (1, s),
            ``labels`` (b, s) int64 with ``ignore_index`` for tokens without a target, or
            ``shift_labels`` (b, s) int64: targets already shifted (sharded as given; not
            both), ``token_type_ids`` (b, s). Other keys are passed through unchanged.
            **Packed batches** (many documents in one row, each attending only to itself): a
            (1, total) batch with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (the global document
            boundaries; one of them alone is taken for both) and/or position ids that restart
            at 0 in every document -- what transformers' ``DataCollatorWithFlattening``
            returns -- or any batch when ``layout`` was built for its documents
            (``Documents(cu_seqlens)``: every row packed alike; given position ids are kept:
            a transformers model's ringseq attention takes only positions within each
            document).
        group: process group of the ring (None: default group; world size 1 without one).
        layout: ``"zigzag"``, ``"contiguous"``, ``"stripe"``, ``"documents"`` (packed batches:
            :class:`ringseq.layouts.Documents` of the batch's boundaries, balanced for any
            document lengths) or a ``ringseq.layouts.Layout``; the model's ring attention must
            use the same one (``apply(model, layout=...)``).
        ignore_index: the label value that marks tokens without a target.

    Returns a new dict with, for this rank's ``s // W`` tokens:
        ``input_ids`` / ``inputs_embeds`` / ``token_type_ids``: sharded along dim 1;
        ``position_ids`` (b, s // W) int64: the positions of the local tokens (sharded from
        the given ones, else made from ``ringseq.positions``: global positions, or positions
        within each document for packed batches) -- rotary embeddings need them;
        ``attention_mask`` (b, s // W): only when given (all ones);
        ``shift_labels`` (b, s // W) int64 (when ``labels`` or ``shift_labels`` was given;
        from ``labels``:) the target of each
        local token, i.e. ``labels`` shifted left by one over the FULL sequence before
        sharding, ``ignore_index`` after the last token (and after the last token of every
        document of a packed batch: no target crosses a document). There is no ``labels``
        key, so the model does not shift again. Pass ``shift_labels`` to
        ``ringseq.sharded_cross_entropy(logits, ...)``;
        for packed batches also ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, the GLOBAL
        boundaries) and ``max_length_q`` / ``max_length_k``, which transformers hands to the
        attention function.

    Raises:
        ValueError: an ``attention_mask`` with any zero (padding cannot be expressed by a
            causal ring; pack sequences instead) or a value other than 0 and 1, no
            ``input_ids`` / ``inputs_embeds``, ``input_ids`` of a floating-point or bool dtype,
            both ``labels`` and ``shift_labels``,
            tensors whose sequence lengths, batch sizes or ranks differ from theirs ((b, s);
            (b, s, hidden) for ``inputs_embeds``; ``position_ids`` also (1, s)), a length the
            layout cannot split (``W``; ``2W`` for zigzag; the total for ``"documents"``),
            malformed document boundaries
            or position ids of a packed batch, labels of a floating-point or bool dtype, a
            packed batch of more than one row, or
            ``"documents"`` for a batch of several rows that is not packed (a one-row batch
            without boundaries is one document). Raised on every rank alike,
            before any communication, since every rank holds the same full batch.
        TypeError: ``batch`` is not a mapping, or ``ignore_index`` is not an int.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"shard_batch: batch must be a mapping of the full sequences (a dict "
                        f"with input_ids and/or inputs_embeds, ...), got {type(batch).__name__}")
    ignore_index = check_ignore_index("shard_batch", ignore_index)
    world_size, rank = group_info(group, "shard_batch")
    key = next((k for k in ("input_ids", "inputs_embeds") if batch.get(k) is not None), None)
    if key is None:
        raise ValueError("shard_batch needs `input_ids` (b, s) or `inputs_embeds` (b, s, hidden) "
                         f"in the batch, got keys {sorted(batch)}")
    if not torch.is_tensor(batch[key]) or batch[key].dim() != (2 if key == "input_ids" else 3):
        raise ValueError(f"shard_batch: batch[{key!r}] must be a tensor of shape "
                         f"{'(b, s)' if key == 'input_ids' else '(b, s, hidden)'} (a batch "
                         f"dimension first), got {given(batch[key])}")
    if key == "input_ids":  # (float ids failed later, in the model's embedding)
        _check_integer(key, batch[key], "token ids")
    if batch.get("labels") is not None and batch.get("shift_labels") is not None:
        # (before: the caller's shift_labels were replaced by the shifted labels without a word)
        raise ValueError("shard_batch: the batch has both 'labels' and 'shift_labels'; give "
                         "'labels' (shifted here over the full sequence) or 'shift_labels' "
                         "(targets already shifted: sharded as given), not both")
    b, s = batch[key].shape[:2]
    if s == 0:
        raise ValueError(f"shard_batch: batch[{key!r}] holds no tokens (shape "
                         f"{tuple(batch[key].shape)}); a sequence needs at least one")
    lead = key  # the tensor whose (b, s) the others must have
    lay = get_layout(layout, "shard_batch")
    inner = getattr(lay, "base", lay)  # (a hybrid mode's layout wraps the documents layout)
    # (Ulysses alone: the wrapper names the per-batch layout its contiguous split replaced)
    per_batch_name = inner.name if isinstance(inner, PerBatchDocuments) else getattr(
        lay, "per_batch_documents", None)
    per_batch = per_batch_name is not None
    # (Ulysses alone: the wrapper carries the boundaries its contiguous split does not)
    layout_docs = getattr(lay, "documents", None) or getattr(inner, "documents", None)
    if layout_docs is None:
        docs = _packed_documents(batch, b, s, per_batch)
        if per_batch and docs is None and b == 1:  # (position ids of another length)
            raise ValueError(f"shard_batch: batch['position_ids'] must have shape (1, {s}) "
                             f"(sequence length {s} from batch[{key!r}]), got "
                             f"{given(batch.get('position_ids'))}")
        if per_batch and docs is None:  # (several rows, not packed)
            raise ValueError(f"shard_batch: layout {per_batch_name!r} balances the documents of "
                             f"a packed batch: one row with cu_seq_lens_q or position ids that "
                             f"restart at 0 per document (DataCollatorWithFlattening's), got "
                             f"{b} rows without document boundaries; use a layout such as "
                             f"'zigzag', or Documents(cu_seqlens) for rows packed alike")
    else:
        # A layout built for documents (Documents(cu_seqlens)) is every row's packing: its
        # positions (unless given: kept as they are) and targets stop at the documents' ends.
        docs = check_cu_seqlens("shard_batch", "the layout's cu_seqlens", layout_docs, s,
                                "the batch's length")
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if batch.get(key) is not None and check_cu_seqlens("shard_batch", key,
                                                               batch[key]) != docs:
                raise ValueError(f"shard_batch: {key} differs from the document boundaries "
                                 f"the layout {lay!r} was built with")
    try:
        lay = lay.bind(docs)  # "documents": this batch's Documents layout
        lay.check_seqlen(s, world_size)
    except ValueError as exc:
        raise named_for("shard_batch", exc) from None

    def check_len(name, t, rows=(b,)):
        # (b, s), (b, s, hidden) for inputs_embeds, and (1, s) too for position_ids: a tensor
        # of another batch size or rank would be sharded without a word and fail (or pair
        # the wrong rows) later
        dims = 3 if name == "inputs_embeds" else 2
        if not torch.is_tensor(t) or t.dim() != dims or t.shape[1] != s or \
                t.shape[0] not in rows:
            want = " or ".join(f"({r}, {s}{', hidden' if dims == 3 else ''})" for r in rows)
            raise ValueError(f"shard_batch: batch[{name!r}] must have shape {want} (batch "
                             f"{b} and sequence length {s} from batch[{lead!r}]), got "
                             f"{given(t)}")

    out = {}
    packed_keys = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    for key, value in batch.items():
        if value is None or key in ("attention_mask", "position_ids", "labels", "shift_labels",
                                    *packed_keys):
            continue
        if key in _SEQ_KEYS:
            check_len(key, value)
            out[key] = shard_local(value, lay, world_size, rank, dim=1, fn="shard_batch")
        else:
            out[key] = value

    mask = batch.get("attention_mask")
    if mask is not None:
        check_len("attention_mask", mask)
        if not bool(((mask == 0) | (mask == 1)).all()):  # (0.5 passed as "not padding")
            raise ValueError(f"shard_batch: attention_mask must hold 0 (padding) and 1 "
                             f"(tokens), got other values, e.g. "
                             f"{mask[(mask != 0) & (mask != 1)][0].item()!r}")
        if not bool(mask.bool().all()):
            n = int((~mask.bool()).sum())
            raise ValueError(f"shard_batch: attention_mask has {n} zero (padding) entries; "
                             f"ring attention "
                             "computes a causal mask over the whole sharded sequence and cannot "
                             "skip padding. Pack sequences without padding (and drop the mask), "
                             "or mark padding positions in `labels` with ignore_index.")
        out["attention_mask"] = shard_local(mask, lay, world_size, rank, dim=1, fn="shard_batch")

    pos = batch.get("position_ids")
    if pos is not None:
        check_len("position_ids", pos, rows=(b, 1) if b != 1 else (1,))
        if not pos.dtype.is_floating_point:  # (int64 as documented; fractions stay as given)
            pos = pos.to(torch.int64)
        out["position_ids"] = shard_local(pos.expand(b, -1), lay, world_size, rank, dim=1,
                                          fn="shard_batch")
    else:
        device = (batch.get("input_ids") if batch.get("input_ids") is not None
                  else batch["inputs_embeds"]).device
        local = positions_local(s, lay, world_size, rank, device=device,
                                fn="shard_batch")  # (s // W,)
        if docs is not None:
            local = document_positions(docs, local)
        out["position_ids"] = local.unsqueeze(0).expand(b, -1).contiguous()

    if batch.get("shift_labels") is not None:
        # already targets (shifted by the caller): only shard them
        check_len("shift_labels", batch["shift_labels"])
        out["shift_labels"] = shard_local(_targets("shift_labels", batch["shift_labels"]), lay,
                                          world_size, rank, dim=1, fn="shard_batch")
    labels = batch.get("labels")
    if labels is not None:
        check_len("labels", labels)
        labels = _targets("labels", labels)
        # Shift over the full sequence first: the target of a shard's last token is the first
        # token of another rank's shard, which a per-shard shift would drop.
        shifted = torch.full_like(labels, ignore_index)  # (b, s) int64
        shifted[:, :-1] = labels[:, 1:]
        if docs is not None:  # the last token of a document has no target in the next one
            ends = torch.tensor([e - 1 for e in docs[1:] if e > 0], dtype=torch.long)
            shifted[:, ends] = ignore_index
        out["shift_labels"] = shard_local(shifted, lay, world_size, rank, dim=1, fn="shard_batch")
    if docs is not None:
        device = next(t.device for t in batch.values() if torch.is_tensor(t))
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = torch.tensor(docs, dtype=torch.int32,
                                                                   device=device)
        out["max_length_q"] = out["max_length_k"] = max(b_ - a_ for a_, b_ in zip(docs, docs[1:]))
    return out
