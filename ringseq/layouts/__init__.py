"""How a global sequence is split over the ranks of a ring, as data (see :mod:`.base`).

``Layout`` subclasses answer which global tokens a rank holds and which block tasks each ring
step computes; ``shard`` / ``positions`` / ``unshard_local`` move tokens accordingly
(``ringseq.unshard``, which gathers over the ranks, is :mod:`ringseq.gathering`). Built in:
``contiguous``, ``zigzag``, ``stripe`` (:mod:`.builtin`), ``Documents(cu_seqlens)`` and the
per-batch ``"documents"`` (:mod:`.documents`).
"""
from ..masks import AttnMask
from .base import (LAYOUTS, BlockTask, Layout, check_rank, get_layout, layout_field,
                   layout_name_of_code, masked_tasks, merge_intervals, register_layout, span_keys)
from .builtin import Contiguous, Stripe, Zigzag
from .documents import (DOCUMENTS, Documents, DocumentsContiguous, DocumentsZigzag,
                        PerBatchDocuments, document_positions, documents_layout)
from .sharding import positions, positions_local, shard, shard_local, unshard_local

__all__ = [
    "AttnMask", "BlockTask", "Contiguous", "DOCUMENTS", "Documents", "DocumentsContiguous",
    "DocumentsZigzag", "LAYOUTS", "Layout",
    "PerBatchDocuments", "Stripe", "Zigzag", "check_rank", "document_positions",
    "documents_layout", "get_layout", "layout_field", "layout_name_of_code", "masked_tasks",
    "merge_intervals", "positions",
    "positions_local", "register_layout", "shard", "shard_local", "span_keys", "unshard_local",
]
