"""Spans, bands and soft-capping (docs/kernels.md, "Spans, bands and softcap") on the CPU.

Every result is compared with float64 plain attention under the docs' tolerance rule
(tests/utils.py: assert_close_per_design), with the visibility written from the definition
(tests/utils.py: span_mask), not from ringseq.kernels.spans.
"""
from __future__ import annotations

import re

import pytest
import torch

from ringseq.kernels import Span, UNBOUNDED, document_spans, extension_available, get_backend, window_band
from ringseq.engine.op import span_attention as attention

from utils import assert_close_per_design, reference_grads, scaled_floor

needs_ext = pytest.mark.skipif(not extension_available(), reason="ringseq._C is not built")
U = UNBOUNDED


def qkv(b, s_q, s_k, h, h_kv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=g).to(dtype)
                 for s, n in ((s_q, h), (s_k, h_kv), (s_k, h_kv)))


def run(be, q, k, v, dout, scale, causal, spans, softcap):
    out, lse = be.fwd(q, k, v, scale, causal, spans=spans, softcap=softcap)
    dq, dk, dv = be.bwd(dout, q, k, v, out, lse, scale, causal, spans=spans, softcap=softcap)
    return out, lse, dq, dk, dv


def check(q, k, v, *, spans=None, softcap=0.0, causal=False, scale=0.3, backend="ringseq", grads=True):
    """The backend's out, lse (and dq, dk, dv) against float64 plain attention, 2x/3x plain
    same-dtype attention's error plus a floor."""
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    kw = dict(spans=spans, softcap=softcap)
    ref = reference_grads(q, k, v, dout, scale, causal, **kw)
    plain = reference_grads(q, k, v, dout, scale, causal, dtype=q.dtype, **kw)
    be = get_backend(backend)
    if grads:
        got = run(be, q, k, v, dout, scale, causal, spans, softcap)
    else:
        got = be.fwd(q, k, v, scale, causal, spans=spans, softcap=softcap)
    floor = scaled_floor(q.dtype, *ref)
    for name, g, r, p, f in zip(("out", "lse", "dq", "dk", "dv"), got, ref, plain, (2, 2, 3, 3, 3)):
        assert_close_per_design(g, r, p, f"{backend} {name}", f, floor)
    return got


def window_spans(s_q, s_k, left, right, causal):
    return [Span(0, s_q, 0, s_k, *window_band(s_q, s_k, (left, right), causal))]


# ---------------------------------------------------------------- windows and bands
@needs_ext
@pytest.mark.parametrize("s_q,s_k,mode", [(97, 97, "causal"), (70, 97, "causal"), (97, 40, "causal"),
                                           (97, 97, "two-sided"), (70, 97, "left-only")])
@pytest.mark.parametrize("left", [0, 1, 17, "s-1", "s", -1])
def test_sliding_window_bottom_right(s_q, s_k, left, mode):
    s = max(s_q, s_k)
    left = {"s-1": s - 1, "s": s}.get(left, left)
    right = {"causal": 0, "two-sided": 5, "left-only": -1}[mode]
    q, k, v = qkv(1, s_q, s_k, 2, 1, 16)
    check(q, k, v, spans=window_spans(s_q, s_k, left, right, mode == "causal"))


def test_window_side_as_wide_as_the_keys_is_unbounded():
    """flash-attn's kernels clamp a window side of at least seqlen_k (varlen: max_seqlen_k) to
    -1: with more queries than keys and no causal mask, a right side of s_k lets the first rows
    see every key (the band formula alone: row 0 would see key 0 only)."""
    import ringseq
    q, k, v = (t.double() for t in qkv(1, 8, 4, 2, 2, 16))
    full = ringseq.flash_attn_func(q, k, v)
    for window in ((-1, 4), (4, 4), (9, -1)):
        got = ringseq.flash_attn_func(q, k, v, window_size=window)
        assert (got - full).abs().max() < 1e-12, window
    # one narrower: the band formula, row 0 sees keys j <= 0 + 4 - 8 + 3 < 0, none
    narrower = ringseq.flash_attn_func(q, k, v, window_size=(-1, 3))
    assert (narrower[:, 0] == 0).all() and (narrower[:, 7] - full[:, 7]).abs().max() < 1e-12
    # varlen clamps at max_seqlen_k, not at each document's key count: a document of 4
    # queries and 2 keys keeps a right side of 2 (< max_seqlen_k 6) as the band formula says,
    # row i seeing keys j <= i - 2 + 2
    qq, kk, vv = (t.double() for t in qkv(1, 8, 8, 2, 2, 16, seed=3))
    qv, kv_, vv_ = qq[0], kk[0, :8], vv[0, :8]  # (total, h, d)
    cu_q, cu_k = torch.tensor([0, 4, 8]), torch.tensor([0, 2, 8])
    got = ringseq.flash_attn_varlen_func(qv, kv_, vv_, cu_q, cu_k, 4, 6, window_size=(-1, 2))
    scores = torch.einsum("qhd,khd->hqk", qv[:4], kv_[:2]) * 16 ** -0.5  # (h, 4, 2)
    seen = torch.arange(2)[None, :] <= torch.arange(4)[:, None]  # (4, 2): j <= i
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1),
                        vv_[:2])
    assert (got[:4] - want).abs().max() < 1e-12


def test_a_left_window_leaves_the_right_side_as_wide_as_the_keys():
    """flash-attn 2 (set_params_fprop): with the left side bounded, an unbounded right side
    (-1, or one clamped at seqlen_k) is seqlen_k wide, so with more queries than keys the
    first rows see fewer keys: row i of 8 queries over 4 keys sees keys
    i - 6 <= j <= i (before: every key from i - 6 on, as with no right side at all).
    Varlen: seqlen_k is max_seqlen_k."""
    import ringseq

    def plain(q, k, v, seen):  # float64 softmax attention over the keys ``seen`` (s_q, s_k)
        scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v)

    q, k, v = (t.double() for t in qkv(1, 8, 4, 2, 2, 16, seed=5))
    i, j = torch.arange(8)[:, None], torch.arange(4)[None, :]
    want = plain(q[0], k[0], v[0], (j >= i - 6) & (j <= i))
    for window in ((2, -1), (2, 4), (2, 9)):
        got = ringseq.flash_attn_func(q, k, v, window_size=window)[0]
        assert (got - want).abs().max() < 1e-12, window
    # varlen: a document of 6 queries over 2 keys, max_seqlen_k 3: right side 3, row i
    # seeing keys i + 2 - 6 - 1 <= j <= i + 2 - 6 + 3
    cu_q, cu_k = torch.tensor([0, 6, 8]), torch.tensor([0, 2, 5])
    qv, kv_, vv_ = q[0], torch.cat([k[0], k[0, :1]]), torch.cat([v[0], v[0, :1]])
    got = ringseq.flash_attn_varlen_func(qv, kv_, vv_, cu_q, cu_k, 6, 3, window_size=(1, -1))
    i, j = torch.arange(6)[:, None], torch.arange(2)[None, :]
    want = plain(qv[:6], kv_[:2], vv_[:2], (j >= i - 5) & (j <= i - 1))
    assert (got[1:6] - want[1:]).abs().max() < 1e-12
    assert (got[0] == 0).all()  # (row 0 sees no key: j <= -1)


# Inside a masked tile the CPU GEMMs skip the register blocks and the key (row) steps the band
# does not reach (csrc/cpu/gemm.h: Band). Band edges at many offsets across several tiles at
# every level (forward tiles of 240 query rows x 72 keys at AVX2, 128 x 256 at AVX-512 and
# 96 x 192 at the baseline for d = 64; backward 96 x 96 or 64 x 128), register blocks of 6 or
# 8 rows, 16- or 32-column panels, 72-key partial sums; a soft-cap on one of them (computed on
# the visible vectors only). At amx (bf16): 256 x 256 tiles whose 32 x 32 score blocks, 32-key
# P·V steps and exp vectors outside the band are skipped (csrc/cpu/amx.h: AmxExtras).
@needs_ext
@pytest.mark.parametrize("left,right", [(0, 0), (5, 0), (71, 0), (130, 3), (301, 0), (40, 200), (-1, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_level_band_edges_inside_tiles(isa, left, right, dtype):
    q, k, v = qkv(1, 700, 650, 2, 1, 64, dtype)
    check(q, k, v, spans=window_spans(700, 650, left, right, right == 0),
          softcap=30.0 if left == 130 else 0.0)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
def test_window_dtypes_gqa_mqa(dtype, heads):
    q, k, v = qkv(2, 83, 83, *heads, 24, dtype=dtype)
    check(q, k, v, spans=window_spans(83, 83, 17, 0, True))


@needs_ext
def test_shifted_band_leaves_rows_empty():
    """A band far from the diagonal: rows whose band misses every key get out 0, lse -inf."""
    q, k, v = qkv(1, 150, 100, 2, 2, 16)
    out, lse, dq, _, _ = check(q, k, v, spans=[Span(0, 150, 0, 100, 30, 45)])
    empty = torch.arange(150) + 30 > 99
    assert torch.isneginf(lse[:, :, empty]).all() and (out[:, empty] == 0).all() and (dq[:, empty] == 0).all()


# ---------------------------------------------------------------- packed documents
DOCS = [1, 2, 17, 255, 301]


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_packed_documents(dtype):
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    q, k, v = qkv(1, cu[-1], cu[-1], 8, 2, 16, dtype=dtype)
    check(q, k, v, spans=document_spans(cu, cu, causal=True))


@pytest.mark.parametrize("cu_q, cu_k, error, words", [
    # (before: a span of length -2, refused later by the kernel as "spans[1]")
    ((0, 5, 3), (0, 5, 3), ValueError, "cu_seqlens_q must start at 0 and never decrease, got "
                                       "(0, 5, 3)"),
    ((0, 4), (2, 4), ValueError, "cu_seqlens_k must start at 0 and never decrease, got (2, 4)"),
    ((0, 2.7, 6.2), (0, 2, 6), TypeError, "cu_seqlens_q must hold ints, got 2.7"),  # (was 2)
    ((0, 4), (0, 2, 4), ValueError, "cu_seqlens_q and cu_seqlens_k must have the same length"),
    ((), (), ValueError, "cu_seqlens_q needs at least one boundary (0), got none"),
    (5, (0, 5), TypeError, "cu_seqlens_q must be a sequence of ints or a 1-D integer tensor, "
                           "got int"),
])
def test_document_spans_refuses_boundaries_that_are_no_documents(cu_q, cu_k, error, words):
    with pytest.raises(error, match=r"^document_spans: " + re.escape(words)):
        document_spans(cu_q, cu_k)
    # integer tensors and their elements are boundaries too
    assert document_spans(torch.tensor([0, 3, 5]), [0, 3, 5]) == document_spans([0, 3, 5],
                                                                                 [0, 3, 5])


@pytest.mark.parametrize("fn", ["document_spans", "window_band"])
@pytest.mark.parametrize("kwargs, error, words", [
    # before: (-2, 0) was an unbounded left side, full attention where every entry point refuses
    ({"window_size": (-2, 0)}, ValueError,
     "window_size entries must be >= 0, or -1 for unbounded, got (-2, 0)"),
    # before: a float band, refused later by the kernel as "spans[0]"
    ({"window_size": (2.5, 0)}, TypeError, "window_size must be a pair (left, right) of ints"),
    ({"window_size": 3}, TypeError, "window_size must be a pair (left, right) of ints"),
    # before: any truthy value built a causal band
    ({"causal": "no"}, TypeError, "causal must be a bool (True or False), got 'no' (str)"),
    ({"causal": 1}, TypeError, "causal must be a bool (True or False), got 1 (int)"),
])
def test_span_helpers_check_window_and_causal_as_the_entry_points_do(fn, kwargs, error, words):
    call = {"document_spans": lambda **kw: document_spans([0, 4], [0, 4], **kw),
            "window_band": lambda **kw: window_band(4, 4, **kw)}[fn]
    with pytest.raises(error, match="^" + re.escape(f"{fn}: {words}")):
        call(**kwargs)
    # a window as wide as every tensor's sequence is no window, as at the entry points
    assert call(window_size=(UNBOUNDED, 0), causal=True) == call(window_size=(-1, 0), causal=True)


@needs_ext
def test_documents_with_windows_and_different_q_k_lengths():
    """flash-attn varlen semantics: each document is its own bottom-right problem."""
    cu_q, cu_k = [0, 3, 40, 41, 100], [0, 10, 40, 60, 129]
    q, k, v = qkv(1, 100, 129, 4, 1, 16)
    check(q, k, v, spans=document_spans(cu_q, cu_k, causal=True, window_size=(7, 0)))
    check(q, k, v, spans=document_spans(cu_q, cu_k, causal=False, window_size=(5, 3)))


@needs_ext
def test_rows_outside_every_span():
    """Ring-step pieces: uncovered q rows get out 0 and lse -inf, uncovered q/kv rows zero
    gradients."""
    q, k, v = qkv(2, 180, 200, 4, 2, 16)
    spans = [Span(0, 40, 10, 50, -U, 10), Span(60, 90, 70, 120, -30, 5)]
    out, lse, dq, dk, dv = check(q, k, v, spans=spans)
    q_out = torch.ones(180, dtype=torch.bool)
    q_out[0:40] = q_out[60:150] = False
    k_out = torch.ones(200, dtype=torch.bool)
    k_out[10:60] = k_out[70:190] = False
    assert (out[:, q_out] == 0).all() and torch.isneginf(lse[:, :, q_out]).all()
    assert (dq[:, q_out] == 0).all() and (dk[:, k_out] == 0).all() and (dv[:, k_out] == 0).all()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spans_without_keys_at_every_isa_level(isa, dtype):
    """Spans that list query rows but no key (k_len 0) and no other span: out 0, lse -inf,
    zero gradients, and bwd_accum adds nothing to its accumulators, as for rows outside every
    span (the backward once summed dq from partials no key tile had written)."""
    q, k, v = qkv(1, 64, 8, 2, 2, 16, dtype=dtype)
    spans = [Span(0, 40, 0, 0, -U, U), Span(40, 24, 3, 0, -U, U)]
    be = get_backend("ringseq")
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, lse, dq, dk, dv = run(be, q, k, v, dout, 0.3, False, spans, 0.0)
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()
    g = torch.Generator().manual_seed(2)
    accs = [torch.randn(t.shape, generator=g) for t in (q, k, v)]  # float32 accumulators
    init = [a.clone() for a in accs]
    be.bwd_accum(dout, q, k, v, out, lse, 0.3, False, None, *accs, spans=spans)
    for got, want in zip(accs, init):
        assert torch.equal(got, want)


# ---------------------------------------------------------------- soft-capping
@needs_ext
@pytest.mark.parametrize("softcap", [50.0, 5.0])
@pytest.mark.parametrize("case", ["dense-causal", "window", "docs"])
def test_softcap(softcap, case):
    # scale 1 with d = 16: scores of std ~4, so a cap of 5 changes the result a lot
    q, k, v = qkv(1, 97, 97, 4, 2, 16)
    if case == "dense-causal":
        check(q, k, v, causal=True, softcap=softcap, scale=1.0)
    elif case == "window":
        check(q, k, v, spans=window_spans(97, 97, 17, 0, True), softcap=softcap, scale=1.0)
    else:
        check(q, k, v, spans=document_spans([0, 1, 40, 97], [0, 1, 40, 97], True), softcap=softcap,
              scale=1.0)


@needs_ext
def test_softcap_changes_the_result():
    q, k, v = qkv(1, 50, 50, 2, 2, 16)
    be = get_backend("ringseq")
    o0, _ = be.fwd(q, k, v, 1.0, True)
    o5, _ = be.fwd(q, k, v, 1.0, True, softcap=5.0)
    assert (o0 - o5).abs().max() > 0.1


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_softcap_dtypes(dtype):
    q, k, v = qkv(1, 70, 90, 4, 2, 32, dtype=dtype)
    check(q, k, v, spans=window_spans(70, 90, 30, 0, True), softcap=5.0, scale=0.5)


# ---------------------------------------------------------------- accumulate (ring steps)
def piece_spans(docs, kv_lo, kv_hi):
    """Spans of causal documents (start, end) restricted to the kv rows [kv_lo, kv_hi) of a
    block: q rows in the whole tensor, kv rows local to the block, bands shifted by the
    pieces' global offsets (j_global <= i_global)."""
    out = []
    for a, b in docs:
        ka, kb = max(a, kv_lo), min(b, kv_hi)
        if ka >= kb:
            continue
        # local j - i = (j_g - ka) - (i_g - a); visible iff j_g - i_g <= 0
        out.append(Span(a, b - a, ka - kv_lo, kb - ka, -U, a - ka))
    return out


@needs_ext
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_accumulate_over_kv_blocks_equals_one_call(softcap):
    """fwd_accum / bwd_accum over two kv blocks, each with its document pieces, equal one call
    over all keys; q rows outside every document stay untouched in the accumulators."""
    docs = [(0, 30), (30, 90), (90, 120)]
    q, k, v = qkv(2, 130, 120, 4, 2, 16)  # q rows [120, 130) belong to no document
    be = get_backend("ringseq")
    whole = [Span(a, b - a, a, b - a, -U, 0) for a, b in docs]
    ref = reference_grads(q, k, v, torch.zeros_like(q), 0.3, spans=whole, softcap=softcap)
    out_w, lse_w = be.fwd(q, k, v, 0.3, False, spans=whole, softcap=softcap)
    g = torch.Generator().manual_seed(5)
    out_acc = torch.randn(q.shape, generator=g)
    lse_acc = torch.full((2, 4, 130), float("-inf"))
    lse_acc[:, :, 120:] = torch.randn(2, 4, 10, generator=g)  # must survive untouched
    out_acc0, lse_acc0 = out_acc.clone(), lse_acc.clone()
    blocks = [(0, 60), (60, 120)]
    for lo, hi in blocks:
        be.fwd_accum(q, k[:, lo:hi], v[:, lo:hi], 0.3, False, out_acc, lse_acc,
                     spans=piece_spans(docs, lo, hi), softcap=softcap)
    assert torch.equal(out_acc[:, 120:], out_acc0[:, 120:]) and torch.equal(lse_acc[:, :, 120:], lse_acc0[:, :, 120:])
    torch.testing.assert_close(out_acc[:, :120], ref[0][:, :120].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_acc[:, :, :120], ref[1][:, :, :120].float(), rtol=1e-5, atol=1e-5)

    dout = torch.randn(q.shape, generator=g)
    dq_w, dk_w, dv_w = be.bwd(dout, q, k, v, out_w, lse_w, 0.3, False, spans=whole, softcap=softcap)
    accs = [torch.randn(t.shape, generator=g) for t in (q, k, v)]
    init = [a.clone() for a in accs]
    for lo, hi in blocks:
        be.bwd_accum(dout, q, k[:, lo:hi], v[:, lo:hi], out_w, lse_w, 0.3, False, None, accs[0],
                     accs[1][:, lo:hi], accs[2][:, lo:hi], spans=piece_spans(docs, lo, hi), softcap=softcap)
    assert torch.equal(accs[0][:, 120:], init[0][:, 120:])
    for got, i0, want in zip(accs, init, (dq_w, dk_w, dv_w)):
        torch.testing.assert_close(got - i0, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- work skipped
@needs_ext
def test_invisible_tiles_are_skipped():
    """The CPU kernels' tile statistic: a window visits O(s * w) tiles, documents the sum of
    their own tiles (the same count as each document computed alone)."""
    be = get_backend("ringseq")
    stat = torch.ops.ringseq._tiles_visited

    def visited(q, k, v, causal=False, spans=None):
        stat(True)
        out, lse = be.fwd(q, k, v, 0.3, causal, spans=spans)
        be.bwd(torch.ones_like(q), q, k, v, out, lse, 0.3, causal, spans=spans)
        return stat(True)

    s = 4096  # long enough that O(s²) / O(s * w) tiles is far above 4 at every level's tile sizes
    q, k, v = qkv(1, s, s, 1, 1, 16)
    full = visited(q, k, v, causal=True)
    win = visited(q, k, v, spans=window_spans(s, s, 64, 0, True))
    assert full[0] > 0 and full[1] > 0
    assert win[0] * 4 < full[0] and win[1] * 4 < full[1], (win, full)

    docs = [1, 2, 17, 255, 600]
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    q, k, v = qkv(1, cu[-1], cu[-1], 2, 1, 16)
    packed = visited(q, k, v, spans=document_spans(cu, cu, causal=True))
    alone = [visited(q[:, a:b], k[:, a:b], v[:, a:b], causal=True) for a, b in zip(cu, cu[1:])]
    assert packed == [sum(x[0] for x in alone), sum(x[1] for x in alone)]
    whole = visited(q, k, v, causal=True)
    assert packed[0] < whole[0] and packed[1] < whole[1]


# ---------------------------------------------------------------- errors name the argument
def _bad_spans():
    yield "causal and spans", dict(causal=True, spans=[Span(0, 4, 0, 4)]), "spans and causal=True"
    yield "q range", dict(spans=[Span(0, 11, 0, 4)]), r"spans\[0\]: q rows"
    yield "kv range", dict(spans=[Span(0, 4, 9, 4)]), r"spans\[0\]: kv rows"
    yield "negative", dict(spans=[Span(-1, 4, 0, 4)]), r"spans\[0\]: q rows"
    yield "band", dict(spans=[Span(0, 4, 0, 4, 3, 2)]), "band_lo must be <= band_hi"
    yield "q overlap", dict(spans=[Span(0, 5, 0, 4), Span(4, 3, 6, 4)]), "disjoint q row ranges"
    yield "kv overlap", dict(spans=[Span(0, 5, 0, 4), Span(6, 3, 3, 4)]), "disjoint kv row ranges"
    yield "shape", dict(spans=torch.zeros(2, 5, dtype=torch.int64)), r"spans must be .*\(n, 6\)"
    yield "dtype", dict(spans=torch.zeros(1, 6, dtype=torch.int32)), "int64"
    yield "softcap", dict(softcap=-1.0), "softcap must be a finite float >= 0"
    yield "softcap nan", dict(softcap=float("nan")), "softcap must be a finite float >= 0"


BAD = list(_bad_spans())


@pytest.mark.parametrize("backend", ["ringseq", "reference"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_spans_are_named(backend, case):
    if backend == "ringseq" and not extension_available():
        pytest.skip("ringseq._C is not built")
    _, kw, message = case
    kw = dict(kw)
    q, k, v = qkv(1, 10, 12, 2, 1, 8)
    be = get_backend(backend)
    causal = kw.pop("causal", False)
    with pytest.raises(ValueError, match=message) as err:
        be.fwd(q, k, v, 0.3, causal, **kw)
    assert str(err.value).startswith(f"{backend}.fwd: "), err.value  # (the function called)


@needs_ext
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_op_rejects_bad_spans(case):
    _, kw, message = case
    q, k, v = qkv(1, 10, 12, 2, 1, 8)
    spans = kw.get("spans")
    if spans is not None and not isinstance(spans, torch.Tensor):
        spans = torch.tensor([list(s) for s in spans], dtype=torch.int64)
    with pytest.raises(ValueError, match=message.replace("must be .*", "must be a 2-dim tensor ")):
        torch.ops.ringseq.fwd(q, k, v, 0.3, kw.get("causal", False), 0, spans, kw.get("softcap", 0.0))


# ---------------------------------------------------------------- other backends
def test_reference_backend_spans_and_softcap():
    q, k, v = qkv(1, 60, 75, 4, 2, 16)
    check(q, k, v, spans=window_spans(60, 75, 9, 2, False), softcap=5.0, backend="reference")
    check(q, k, v, spans=[Span(0, 30, 5, 40, -3, 8), Span(40, 20, 50, 25)], backend="reference")


@pytest.mark.parametrize("case", ["window", "docs", "pieces"])
def test_sdpa_backend_spans(case):
    q, k, v = qkv(1, 64, 64, 4, 2, 16)
    spans = {"window": window_spans(64, 64, 9, 0, True),
             "docs": document_spans([0, 1, 20, 64], [0, 1, 20, 64], True),
             "pieces": [Span(0, 20, 4, 30, -U, 3), Span(30, 30, 40, 20, -5, 5)]}[case]
    # sdpa computes delta itself, from this call's out: its backward is exact here
    check(q, k, v, spans=spans, backend="sdpa")


def test_sdpa_backend_refuses_softcap():
    q, k, v = qkv(1, 16, 16, 2, 2, 8)
    with pytest.raises(NotImplementedError, match="soft-capping.*tanh"):
        get_backend("sdpa").fwd(q, k, v, 0.3, True, softcap=5.0)


# ---------------------------------------------------------------- torch.library integration
@needs_ext
def test_opcheck_with_spans_and_softcap():
    softcap = 5.0
    q, k, v = qkv(1, 19, 23, 4, 2, 8)
    spans = torch.tensor([[0, 9, 0, 11, -U, 2], [10, 9, 12, 11, -4, 4]], dtype=torch.int64)
    args = (0.3, False, 0, spans, softcap)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    torch.library.opcheck(torch.ops.ringseq.fwd.default, (q, k, v, *args))
    out, lse = torch.ops.ringseq.fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    plain = [t.detach() for t in (dout, q, k, v, out, lse)]
    torch.library.opcheck(torch.ops.ringseq.bwd.default, (*plain, 0.3, False, None, 0, spans, softcap))
    acc = [torch.randn(t.shape) for t in (q, k, v)]
    torch.library.opcheck(torch.ops.ringseq.bwd_accum.default,
                          (*plain, 0.3, False, None, *acc, 0, spans, softcap))
    out_acc, lse_acc = torch.randn(1, 19, 4, 8), torch.randn(1, 4, 19)
    torch.library.opcheck(torch.ops.ringseq.fwd_accum.default,
                          (plain[1], plain[2], plain[3], 0.3, False, out_acc, lse_acc, 0, spans, softcap))


@needs_ext
def test_autograd_attention_with_spans_and_softcap():
    """The one custom op (ringseq::attention) carries spans and softcap into the backward."""
    q, k, v = qkv(1, 50, 50, 4, 2, 16)
    spans = document_spans([0, 20, 50], [0, 20, 50], causal=True, window_size=(8, 0))
    dout = torch.randn(q.shape)
    ref = reference_grads(q, k, v, dout, 0.5, spans=spans, softcap=5.0)
    plain = reference_grads(q, k, v, dout, 0.5, dtype=torch.float32, spans=spans, softcap=5.0)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(qg, kg, vg, 0.5, False, get_backend("ringseq"), spans=spans, softcap=5.0)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    floor = scaled_floor(torch.float32, *ref)
    for name, got, r, p in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:]), (plain[0], *plain[2:])):
        assert_close_per_design(got, r, p, name, 3, floor)
