"""ring-flash-attention's varlen shards as ringseq layouts.

ring-flash-attention's varlen ring functions take shards cut per document: every document of
the packed sequence split into W chunks (``ring_flash_attn_varlen_func``) or 2W chunks with rank
r holding chunks r and 2W-1-r (``zigzag_ring_flash_attn_varlen_func``). ``DocumentsContiguous``
and ``DocumentsZigzag`` (``layout="documents_contiguous"`` / ``"documents_zigzag"``, bound per
batch) are exactly those shards, so a port keeps its data pipeline and passes the GLOBAL
boundaries (its per-rank boundaries times W).
"""
from __future__ import annotations

import pytest
import torch

import ringseq
from dist_utils import run_ranks
from masks_reference import global_mask, masked_attention
from ringseq.layouts import DocumentsContiguous, DocumentsZigzag, get_layout, shard_local

CU = (0, 8, 24, 56, 64)


def _per_document(x, cu, rank, world, pieces, which):
    """The shard as ring-flash-attention's tests cut it: torch.chunk per document."""
    parts = []
    for a, b in zip(cu, cu[1:]):
        chunks = x[:, a:b].chunk(pieces, dim=1)
        parts += [chunks[j] for j in which(rank, world)]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_equal_ring_flash_attention_cuts(world):
    x = torch.arange(64).view(1, 64)
    for r in range(world):
        assert torch.equal(shard_local(x, DocumentsContiguous(CU), world, r),
                           _per_document(x, CU, r, world, world, lambda r, w: (r,)))
        assert torch.equal(shard_local(x, DocumentsZigzag(CU), world, r),
                           _per_document(x, CU, r, world, 2 * world,
                                         lambda r, w: (r, 2 * w - 1 - r)))
    # the per-batch names bind to the batch's boundaries
    assert isinstance(get_layout("documents_zigzag").bind(CU), DocumentsZigzag)
    assert get_layout("documents_contiguous").bind(CU).cu_seqlens == CU


@pytest.mark.parametrize("layout", [DocumentsContiguous, DocumentsZigzag])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_on_these_shards_is_exact(layout, world):
    g = torch.Generator().manual_seed(world)
    q, k, v, dout = (torch.randn(1, 64, n, 8, generator=g, dtype=torch.float64)
                     for n in (4, 2, 2, 4))
    for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (5, 0))):
        out, lse, dq, dk, dv = ringseq.simulate_ring(q, k, v, layout(CU), world, causal,
                                                     backend="reference", dout=dout,
                                                     window_size=window)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ro, rl = masked_attention(*ref, global_mask(64, 64, causal, window, CU))
        ro.backward(dout)
        for got, want in ((out, ro), (lse, rl), (dq, ref[0].grad), (dk, ref[1].grad),
                          (dv, ref[2].grad)):
            assert (got - want).abs().max() < 1e-12, (layout.name, world, causal, window)


def test_documents_that_do_not_divide_are_named():
    with pytest.raises(ValueError, match=r"'documents_zigzag' cuts every document into 4 equal "
                                         r"chunks \(a ring of 2 ranks\).* and 2 of 2 documents "
                                         r"whose length is not a multiple of 4 \(document 0: "
                                         r"10, document 1: 6\)$"):
        shard_local(torch.zeros(1, 16), DocumentsZigzag((0, 10, 16)), 2, 0)
    # only those that do not divide, counted, the first five named
    lengths = (4, 5, 8, 1, 3, 7, 9, 11)
    cu = tuple(sum(lengths[:i]) for i in range(len(lengths) + 1))
    with pytest.raises(ValueError, match=r"and 6 of 8 documents whose length is not a "
                                         r"multiple of 4 \(document 1: 5, document 3: 1, "
                                         r"document 4: 3, document 5: 7, "
                                         r"document 6: 9, \.\.\.\)$"):
        shard_local(torch.zeros(1, cu[-1]), DocumentsZigzag(cu), 2, 0)


def _local_boundaries():
    q = torch.randn(16, 2, 8, dtype=torch.float64)  # this rank's 16 of 32 tokens
    local = torch.tensor([0, 4, 16], dtype=torch.int32)  # a port's per-rank boundaries
    out = {}
    for layout in (None, "documents_zigzag", "zigzag"):
        try:
            ringseq.ring_flash_attn_varlen_func(q, q, q, local, layout=layout, causal=True)
            out[str(layout)] = "no error"
        except ValueError as exc:
            out[str(layout)] = str(exc)
    return out


def test_per_rank_boundaries_say_they_must_be_global():
    for res in run_ranks(_local_boundaries, 2, timeout=120):
        for layout, msg in res.items():
            assert "must be the GLOBAL document boundaries" in msg, (layout, msg)
            assert "per-rank boundaries" in msg, (layout, msg)


def _no_boundaries():
    q = torch.randn(16, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cu = [0, 6, 32]  # (documents_contiguous cuts each document in W chunks)
    out = {}
    for layout in ("contiguous", "zigzag", None):
        try:
            ringseq.ring_flash_attn_varlen_func(q, q, q, None, layout=layout, causal=True)
            out[str(layout)] = "no error"
        except (TypeError, ValueError) as exc:
            out[str(layout)] = f"{type(exc).__name__}: {exc}"
    # a layout built with its documents carries them: None is the same call as passing them
    built = ringseq.ring_flash_attn_varlen_func(q, q, q, None, layout=DocumentsContiguous(cu),
                                                causal=True)
    given = ringseq.ring_flash_attn_varlen_func(q, q, q, cu, layout="documents_contiguous",
                                                causal=True)
    out["built"] = bool(torch.equal(built, given))
    return out


def test_varlen_without_boundaries_is_refused_unless_the_layout_has_them():
    # (before: a layout without documents attended across them, without a word)
    for res in run_ranks(_no_boundaries, 2, timeout=120):
        for layout in ("contiguous", "zigzag", "None"):
            assert res[layout].startswith("TypeError: ring_flash_attn_varlen_func: cu_seqlens "
                                          "must be the GLOBAL document boundaries"), res[layout]
        assert res["built"]
