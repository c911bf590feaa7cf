"""The CPU kernel through torch.ops.ringseq.{fwd,bwd,bwd_accum}, against a float64 reference.

Tolerances follow docs/design.md (tests/utils.py: assert_close_per_design): the error against the
float64 reference may be 2x (outputs) or 3x (gradients) that of plain attention computed in the
input dtype, plus a small floor. The case list is a covering subset of the issue's cross
product (every length, head count, GQA ratio, head dim, dtype, batch size and layout appears),
not the full product, to keep the file fast on two cores.
"""
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

import ringseq  # noqa: F401
import ringseq._C  # noqa: F401  (registers torch.ops.ringseq)
from utils import (assert_close_per_design, cpu_isa_forced, isa_levels, reference_grads,
                   scaled_floor)

f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
ops = torch.ops.ringseq


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def case_floor(dtype, ref):
    """The design floor plus a few ulps at the scale of the case's values (see scaled_floor)."""
    return scaled_floor(dtype, *ref)


def make(shape, dtype, layout, gen):
    """A (b, s, h, d) tensor in the given layout: "contig", "slice" (a window of a longer
    sequence) or "transposed" (a transposed view of a (b, h, s, d) tensor)."""
    b, s, h, d = shape
    if layout == "contig":
        return torch.randn(b, s, h, d, generator=gen).to(dtype)
    if layout == "slice":
        return torch.randn(b, s + 7, h, d, generator=gen).to(dtype)[:, 3:3 + s]
    if layout == "transposed":
        return torch.randn(b, h, s, d, generator=gen).to(dtype).transpose(1, 2)
    raise ValueError(layout)


def make_inputs(b, s_q, s_k, h, h_kv, d, dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = make((b, s_q, h, d), dtype, layout, gen)
    k = make((b, s_k, h_kv, d), dtype, layout, gen)
    v = make((b, s_k, h_kv, d), dtype, layout, gen)
    dout = make((b, s_q, h, d), dtype, layout, gen)
    if layout != "contig":  # a view into a larger or permuted buffer, not a fresh tensor
        assert q._base is not None and k._base is not None
    return q, k, v, dout


# (batch, s_q, s_k, nheads, nheads_kv, headdim, causal, dtype, layout)
CASES = [
    (1, 1, 1, 1, 1, 16, False, f32, "contig"),
    (1, 1, 1, 5, 5, 64, True, f64, "transposed"),
    (2, 1, 17, 5, 5, 64, True, bf16, "contig"),
    (1, 17, 1, 8, 1, 64, True, f32, "contig"),        # 16 rows see no key, MQA
    (3, 17, 17, 8, 2, 80, False, f16, "slice"),
    (3, 17, 17, 8, 2, 80, True, f32, "transposed"),
    (2, 17, 255, 8, 2, 128, True, f32, "transposed"),
    (1, 255, 17, 5, 1, 16, True, bf16, "contig"),     # 238 rows see no key
    (2, 255, 255, 8, 8, 256, True, f16, "contig"),
    (1, 255, 255, 1, 1, 256, False, f32, "slice"),
    (1, 255, 255, 1, 1, 64, False, f64, "transposed"),
    (2, 255, 100, 8, 2, 64, False, bf16, "slice"),
    (1, 100, 255, 8, 1, 80, True, f64, "slice"),
    (3, 33, 77, 5, 5, 128, False, bf16, "transposed"),
    (1, 300, 700, 2, 1, 64, True, f32, "contig"),     # several key and query tiles
    (1, 700, 300, 4, 2, 16, True, f16, "slice"),
    (2, 129, 129, 1, 1, 80, True, bf16, "contig"),
    (1, 3816, 3816, 1, 1, 64, True, f32, "contig"),
    (1, 3816, 3816, 1, 1, 128, False, bf16, "transposed"),
]


def case_id(c):
    b, s_q, s_k, h, h_kv, d, causal, dtype, layout = c
    return (f"b{b}-sq{s_q}-sk{s_k}-h{h}:{h_kv}-d{d}-{'causal' if causal else 'full'}-"
            f"{str(dtype).split('.')[-1]}-{layout}")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_fwd_bwd_and_bwd_accum_match_reference(case):
    _check_kernel(case, *_references(case))


def _references(case):
    """(inputs, float64 reference, plain same-dtype reference, floor) of ``case``: torch's,
    the same at every kernel ISA level."""
    b, s_q, s_k, h, h_kv, d, causal, dtype, layout = case
    q, k, v, dout = make_inputs(b, s_q, s_k, h, h_kv, d, dtype, layout)
    scale = d ** -0.5
    ref = reference_grads(q, k, v, dout, scale, causal, dtype=torch.float64)
    plain = reference_grads(q, k, v, dout, scale, causal, dtype=dtype)
    return (q, k, v, dout, scale), ref, plain, case_floor(dtype, ref)


def _check_kernel(case, inputs, ref, plain, floor):
    """The kernel's forward, backward and accumulating backward against the references, per
    docs/design.md's rule."""
    b, s_q, s_k, h, h_kv, d, causal, dtype, layout = case
    q, k, v, dout, scale = inputs
    out, lse = ops.fwd(q, k, v, scale, causal)
    assert out.dtype == dtype and lse.dtype == acc_dtype(dtype)
    assert lse.shape == (b, h, s_q)
    assert_close_per_design(out, ref[0], plain[0], "out", factor=2, floor=floor)
    assert_close_per_design(lse, ref[1], plain[1].to(lse.dtype), "lse", factor=2, floor=floor)

    dq, dk, dv = ops.bwd(dout, q, k, v, out, lse, scale, causal)
    for name, got, i in (("dq", dq, 2), ("dk", dk, 3), ("dv", dv, 4)):
        assert got.dtype == dtype
        assert_close_per_design(got, ref[i], plain[i], name, factor=3, floor=floor)

    # bwd_accum adds into pre-filled accumulators of the accumulation type.
    gen = torch.Generator().manual_seed(1)
    acc = acc_dtype(dtype)
    init = [torch.randn(t.shape, generator=gen, dtype=acc) for t in (q, k, v)]
    bufs = [t.clone() for t in init]
    ops.bwd_accum(dout, q, k, v, out, lse, scale, causal, None, *bufs)
    for name, buf, start, i in zip(("dq", "dk", "dv"), bufs, init, (2, 3, 4)):
        added = buf.double() - start.double()
        assert_close_per_design(added, ref[i], plain[i], name + "_accum", factor=3, floor=floor)


@pytest.mark.parametrize("d", [1, 3, 40, 200, 512])
def test_any_head_dim(d):
    q, k, v, dout = make_inputs(2, 37, 53, 4, 2, d, f32, "contig", seed=d)
    scale = 0.3
    ref = reference_grads(q, k, v, dout, scale, True)
    plain = reference_grads(q, k, v, dout, scale, True, dtype=f32)
    floor = case_floor(f32, ref)
    out, lse = ops.fwd(q, k, v, scale, True)
    assert_close_per_design(out, ref[0], plain[0], "out", floor=floor)
    assert_close_per_design(lse, ref[1], plain[1], "lse", floor=floor)
    grads = ops.bwd(dout, q, k, v, out, lse, scale, True)
    for name, got, i in zip(("dq", "dk", "dv"), grads, (2, 3, 4)):
        assert_close_per_design(got, ref[i], plain[i], name, factor=3, floor=floor)


@pytest.mark.parametrize("dtype", [f32, bf16, f64])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_without_keys_give_zero_out_neg_inf_lse_zero_grads(dtype, causal):
    # causal with s_q > s_k: query i sees key j iff j <= i - 12, so rows 0..11 see nothing.
    q, k, v, dout = make_inputs(2, 20, 8, 3, 1, 32, dtype, "contig", seed=3)
    out, lse = ops.fwd(q, k, v, 0.25, causal)
    dq, dk, dv = ops.bwd(dout, q, k, v, out, lse, 0.25, causal)
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    if causal:
        assert torch.all(out[:, :12] == 0)
        assert torch.all(lse[:, :, :12] == -math.inf)
        assert torch.all(torch.isfinite(lse[:, :, 12:]))
        assert torch.all(dq[:, :12] == 0)
    else:
        assert torch.all(torch.isfinite(lse))
    # A global lse of -inf for a row (it saw no key anywhere in a ring) must give zero
    # gradients for that row, not NaN, even where this block has visible keys.
    lse2 = lse.clone()
    lse2[:, :, -3:] = -math.inf
    dq2, dk2, dv2 = ops.bwd(dout, q, k, v, out, lse2, 0.25, causal)
    for t in (dq2, dk2, dv2):
        assert torch.all(torch.isfinite(t))
    assert torch.all(dq2[:, -3:] == 0)


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_explicit_delta_matches_computed(dtype):
    q, k, v, dout = make_inputs(2, 70, 90, 4, 2, 64, dtype, "slice", seed=5)
    out, lse = ops.fwd(q, k, v, 0.125, True)
    acc = acc_dtype(dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()
    # also through a non-contiguous (b, h, s_q) view: a window of a longer buffer
    wide = torch.zeros(2, 4, 70 + 9, dtype=acc)
    wide[:, :, 4:74] = delta
    delta_view = wide[:, :, 4:74]
    explicit = ops.bwd(dout, q, k, v, out, lse, 0.125, True, delta)
    for a, e in zip(explicit, ops.bwd(dout, q, k, v, out, lse, 0.125, True, delta_view)):
        assert torch.equal(a, e)
    bufs = [torch.zeros(t.shape, dtype=acc) for t in (q, k, v)]
    ops.bwd_accum(dout, q, k, v, out, lse, 0.125, True, delta, *bufs)
    for a, e in zip(explicit, bufs):
        torch.testing.assert_close(e.to(dtype), a, rtol=0, atol=0)
    # Without a delta the CPU kernel sums its own, in its dP GEMM's order (not torch's): the
    # same up to rounding.
    for a, e in zip(ops.bwd(dout, q, k, v, out, lse, 0.125, True), explicit):
        torch.testing.assert_close(a, e)
    # ops.delta is that sum (what the ring passes for all its steps): the same bits as the
    # kernel's own, (b, h, s_q) in the accumulation dtype; torch's sum up to rounding.
    own = ops.delta(dout, out)
    assert own.shape == (2, 4, 70) and own.dtype == acc and own.is_contiguous()
    torch.testing.assert_close(own, delta)
    for a, e in zip(ops.bwd(dout, q, k, v, out, lse, 0.125, True, own),
                    ops.bwd(dout, q, k, v, out, lse, 0.125, True)):
        assert torch.equal(a, e)
    with pytest.raises(ValueError, match="dout must have the shape of out"):
        ops.delta(dout[:, :-1], out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_blockwise_backward_with_global_out_lse_sums_to_full(causal, dtype):
    # Ring property: with the global out/lse (and delta), the gradients of key blocks add up.
    # s_k - s_q >= split - 1 keeps the first block fully visible under bottom-right causality,
    # so it runs without a mask and the last block runs causal, as in a ring step.
    b, s_q, s_k, h, h_kv, d, split = 2, 40, 300, 4, 2, 64, 170
    q, k, v, dout = make_inputs(b, s_q, s_k, h, h_kv, d, dtype, "contig", seed=7)
    scale = d ** -0.5
    out, lse = ops.fwd(q, k, v, scale, causal)
    full = ops.bwd(dout, q, k, v, out, lse, scale, causal)

    acc = acc_dtype(dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()
    dq = torch.zeros(q.shape, dtype=acc)
    dk = torch.zeros(k.shape, dtype=acc)
    dv = torch.zeros(v.shape, dtype=acc)
    blocks = [(slice(0, split), False), (slice(split, s_k), causal)]
    for sl, blk_causal in blocks:
        # the accumulators of a block are views into the full buffers (non-contiguous)
        ops.bwd_accum(dout, q, k[:, sl], v[:, sl], out, lse, scale, blk_causal, delta,
                      dq, dk[:, sl], dv[:, sl])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == f32 else dict(rtol=1e-2, atol=1e-2)
    for name, summed, whole in zip(("dq", "dk", "dv"), (dq, dk, dv), full):
        torch.testing.assert_close(summed.to(dtype), whole, **tol, msg=name)
    # and against the float64 reference under the design rule
    ref = reference_grads(q, k, v, dout, scale, causal)
    plain = reference_grads(q, k, v, dout, scale, causal, dtype=dtype)
    for name, got, i in zip(("dq", "dk", "dv"), (dq, dk, dv), (2, 3, 4)):
        assert_close_per_design(got.double(), ref[i], plain[i], name, factor=3,
                                floor=case_floor(dtype, ref))


def test_gqa_equals_expanded_heads():
    # Head mapping (query head hi reads kv head hi // group) matches explicitly repeated K/V,
    # and dK/dV of a kv head are the sums over its query heads.
    q, k, v, dout = make_inputs(2, 50, 60, 6, 2, 32, f64, "contig", seed=11)
    out, lse = ops.fwd(q, k, v, 0.2, True)
    ke, ve = k.repeat_interleave(3, dim=2), v.repeat_interleave(3, dim=2)
    out_e, lse_e = ops.fwd(q, ke, ve, 0.2, True)
    torch.testing.assert_close(out, out_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_e, rtol=1e-12, atol=1e-12)
    dq, dk, dv = ops.bwd(dout, q, k, v, out, lse, 0.2, True)
    dq_e, dk_e, dv_e = ops.bwd(dout, q, ke, ve, out, lse, 0.2, True)
    torch.testing.assert_close(dq, dq_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dk, dk_e.unflatten(2, (2, 3)).sum(3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dv, dv_e.unflatten(2, (2, 3)).sum(3), rtol=1e-12, atol=1e-12)


def test_results_do_not_depend_on_thread_count():
    q, k, v, dout = make_inputs(1, 300, 520, 4, 1, 64, f32, "contig", seed=13)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, lse = ops.fwd(q, k, v, 0.125, True)
            results.append((out, lse, *ops.bwd(dout, q, k, v, out, lse, 0.125, True)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, e in zip(results[0], other):
            assert torch.equal(a, e)


def test_concurrent_calls_from_python_threads():
    # The kernel keeps no global state: overlapping calls (e.g. a ring's compute next to
    # other work) give the same result as a lone call.
    q, k, v, dout = make_inputs(1, 130, 130, 2, 2, 16, f32, "contig", seed=17)
    expected = ops.fwd(q, k, v, 0.25, False)[0]
    outs = [None] * 4

    def work(i):
        outs[i] = ops.fwd(q, k, v, 0.25, False)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in outs:
        assert torch.equal(o, expected)


# ---------------------------------------------------------------- every ISA level
# The kernel is compiled once per ISA level (baseline, avx2, avx512, avx512bf16, amx) and picks
# one at first use (RINGSEQ_CPU_ISA forces it). A representative subset of the cases above runs on every level
# this machine supports (the `isa` fixture, conftest.py): each level is its own code (register
# blocking, tiles, exp). The wrappers call the tests above, which assert; each then checks that
# the level under test was the one that ran.
ISA_LEVELS = ringseq._C.cpu_isa_supported()


# dtypes, head dims (vector multiples and not), causal/full, GQA/MQA, odd lengths, rows that
# see no key, strided views (slice, transposed)
ISA_CASES = [c for c in CASES if c[1] < 1000] + [
    (1, 1000, 1000, 2, 1, 64, True, bf16, "slice"),  # several tiles of every size, bf16
    # odd head dims in bf16: avx512bf16 multiplies bf16 pairs, the last pair half zero
    (1, 67, 67, 2, 1, 7, True, bf16, "slice"),
    (2, 40, 90, 4, 2, 33, False, bf16, "transposed"),
]


@pytest.mark.parametrize("case", ISA_CASES, ids=[case_id(c) for c in ISA_CASES])
def test_every_isa_level_matches_reference(case):
    # every level in one test: the references (torch's, 10x the kernel's time) once
    refs = _references(case)
    for isa in isa_levels():
        with cpu_isa_forced(isa):
            try:
                _check_kernel(case, *refs)  # asserts per docs/design.md
            except AssertionError as exc:
                raise AssertionError(f"ISA level {isa}: {exc}") from exc
            assert ringseq._C.cpu_isa() == isa  # ... and ran at the level under test


# A worker thread packs the rows that several of its items read (the forward's K/V of a kv
# head, the backward's Q/dO of a query head) once, up to a per-thread budget, and copies the rest
# tile by tile (csrc/cpu/common.h: HeadRows). That changes where the kernel reads its inputs,
# not what it computes: every budget gives the same bits. 0 packs nothing; 192 KiB packs the
# forward's shorter causal key ranges of the first case and copies the longer ones.
HEAD_ROWS_CASES = [
    (1, 700, 700, 4, 2, 64, True, f32, "slice"),        # forward: several q tiles per kv head
    # backward: an item packs when it has several key tiles, i.e. when b·h_kv covers the
    # machine's threads (bwd_chunks): 64 (batch, kv head) pairs keep one chunk up to 32 CPUs
    (4, 200, 1000, 16, 16, 16, True, f32, "slice"),
    (2, 300, 400, 8, 4, 32, False, bf16, "slice"),      # GQA: a slot per query head of a group
    (1, 700, 300, 4, 2, 16, True, f16, "slice"),
    (1, 100, 255, 8, 1, 80, True, f64, "slice"),
    # float rows at the GEMMs' stride at every level (3 lines, whole vectors): read in place
    (1, 500, 500, 2, 2, 48, False, f32, "transposed"),
]


@pytest.mark.parametrize("case", HEAD_ROWS_CASES, ids=[case_id(c) for c in HEAD_ROWS_CASES])
def test_every_isa_level_packed_rows_budget_does_not_change_results(isa, case):
    b, s_q, s_k, h, h_kv, d, causal, dtype, layout = case
    q, k, v, dout = make_inputs(b, s_q, s_k, h, h_kv, d, dtype, layout, seed=5)
    scale = d ** -0.5
    default = ringseq._C._cpu_head_rows_bytes()
    results = []
    try:
        previous = default
        for budget in (default, 0, 192 << 10):
            assert ringseq._C._cpu_head_rows_bytes(budget) == previous
            previous = budget
            out, lse = ops.fwd(q, k, v, scale, causal)
            results.append((out, lse, *ops.bwd(dout, q, k, v, out, lse, scale, causal)))
    finally:
        ringseq._C._cpu_head_rows_bytes(default)
    assert default == 9 << 20 and ringseq._C._cpu_head_rows_bytes() == default
    for other in results[1:]:
        for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), results[0], other):
            assert torch.equal(a, e), name
    assert ringseq._C.cpu_isa() == isa


def test_packed_rows_budget_rejects_negative_values():
    with pytest.raises(ValueError, match=r"_cpu_head_rows_bytes\(value\): value must be None or a "
                                         r"byte count >= 0, got -5"):
        ringseq._C._cpu_head_rows_bytes(-5)
    assert ringseq._C._cpu_head_rows_bytes() == 9 << 20


@pytest.mark.parametrize("dtype", [f32, bf16, f16, f64])
@pytest.mark.parametrize("causal", [False, True])
def test_every_isa_level_fwd_accum_over_key_blocks(isa, dtype, causal):
    # fwd_accum merges key blocks into a running (out, lse) in place: three blocks (the last
    # one causal, as in a ring step) must give the one-call result, on strided accumulators.
    q, k, v, _ = make_inputs(2, 75, 230, 4, 2, 40, dtype, "slice", seed=21)
    scale = 40 ** -0.5
    ref = reference_grads(q, k, v, torch.zeros_like(q), scale, causal)
    plain = reference_grads(q, k, v, torch.zeros_like(q), scale, causal, dtype=dtype)
    acc = acc_dtype(dtype)
    out = torch.zeros(2, 75 + 5, 4, 40, dtype=acc)[:, 5:]  # a strided view
    lse = torch.full((2, 4, 75), float("-inf"), dtype=acc)
    # Keys [0, 60) and [60, 150) are visible to every query (j <= i + 155); the last block ends
    # at s_k, so its bottom-right aligned causal mask is the global one.
    for lo, hi, blk_causal in ((0, 60, False), (60, 150, False), (150, 230, causal)):
        ops.fwd_accum(q, k[:, lo:hi], v[:, lo:hi], scale, blk_causal, out, lse)
    floor = case_floor(dtype, ref)
    assert_close_per_design(out.to(dtype), ref[0], plain[0], "out", factor=2, floor=floor)
    assert_close_per_design(lse, ref[1], plain[1].to(lse.dtype), "lse", factor=2, floor=floor)


@pytest.mark.parametrize("d", [1, 3, 40, 200])
def test_every_isa_level_any_head_dim(isa, d):
    test_any_head_dim(d)
    assert ringseq._C.cpu_isa() == isa


@pytest.mark.parametrize("causal", [False, True])
def test_every_isa_level_rows_without_keys(isa, causal):
    for dtype in (f32, bf16):
        test_rows_without_keys_give_zero_out_neg_inf_lse_zero_grads(dtype, causal)
    assert ringseq._C.cpu_isa() == isa


# Input rows that already are float rows at the stride a GEMM reads them at are read in place;
# others are copied, among them the rows of a (b, h, s, d) tensor at d = 64 or 128, which lie an
# even number of cache lines apart (csrc/cpu/common.h: packed_ld). That changes where the
# kernel reads, not what it computes: the same values in either layout give the same bits.
# d = 48: rows of 3 lines, read in place at every level; 40: copied where it is not whole vectors.
@pytest.mark.parametrize("d", [40, 48, 64, 128])
def test_every_isa_level_input_layout_does_not_change_results(isa, d):
    q, k, v, dout = make_inputs(1, 300, 300, 4, 2, d, f32, "contig", seed=7)
    results = []
    for layout in ("(b, s, h, d)", "(b, h, s, d)"):
        if layout == "(b, h, s, d)":  # the same values, stored head-major: rows d apart
            q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
            assert q.stride(1) == d
        out, lse = ops.fwd(q, k, v, d ** -0.5, True)
        results.append((out, lse, *ops.bwd(dout, q, k, v, out, lse, d ** -0.5, True)))
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, e), name
    assert ringseq._C.cpu_isa() == isa


# A key no query of a work item can see stays out of its rows: an inf there would give
# 0·inf = NaN. The amx level's P·V runs whole 32-key steps and its per-thread Vᵀ may hold other
# items' keys past an item's band; a last partial step reads a zero-padded copy instead
# (csrc/cpu/amx.h: amx_pv). One thread, so that the item of rows 256.. (keys 0..309, packed
# first: heaviest) leaves its Vᵀ for the item of rows 0..255 (keys 0..265).
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_every_isa_level_keys_past_the_band_do_not_leak(isa, dtype):
    q, k, v, _ = make_inputs(1, 300, 310, 2, 2, 64, dtype, "contig", seed=3)
    v_inf = v.clone()
    v_inf[:, 270] = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out, _ = ops.fwd(q, k, v_inf, 64 ** -0.5, True)
        ref, _ = ops.fwd(q, k, v, 64 ** -0.5, True)
    finally:
        torch.set_num_threads(threads)
    # causal, bottom-right aligned: query i sees keys <= i + 10, so rows below 240 (clear of
    # any register block that reaches key 270) never see it
    assert torch.isfinite(out[:, :240]).all()
    assert torch.equal(out[:, :240], ref[:, :240])
    assert ringseq._C.cpu_isa() == isa


def test_every_isa_level_is_deterministic_across_threads(isa):
    test_results_do_not_depend_on_thread_count()
    assert ringseq._C.cpu_isa() == isa


def _start_python(code, **env):
    """`code` in a fresh interpreter (the level is resolved at a process's first kernel call),
    with RINGSEQ_CPU_ISA* taken from `env` only."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSEQ_CPU_ISA")}
    full_env.update(env)
    return subprocess.Popen([sys.executable, "-c", code], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc):
    """The finished process as subprocess.run returns it (killed after 120 s)."""
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run_python(code, **env):
    return _finish(_start_python(code, **env))


PROBE = ("import torch, ringseq; q = torch.randn(1, 8, 2, 16); "
         "print(ringseq.cpu_isa(), float(torch.ops.ringseq.fwd(q, q, q, 0.25, True)[0].sum()))")
# The environments the level-selection tests probe, keyed by what RINGSEQ_CPU_ISA holds
# (None: unset).
PROBE_SETTINGS = [*ISA_LEVELS, None, "sse9", "auto"]


@pytest.fixture(scope="module")
def probes():
    """PROBE's finished process per PROBE_SETTINGS entry. All start at once: each spends
    seconds importing torch on one core, and one after another they took about a minute."""
    procs = {}
    try:
        for level in PROBE_SETTINGS:
            env = {} if level is None else {"RINGSEQ_CPU_ISA": level}
            procs[level] = _start_python(PROBE, **env)
        return {level: _finish(proc) for level, proc in procs.items()}
    finally:  # one that timed out (or failed to start) leaves none of the others running
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_ringseq_cpu_isa_env_forces_the_level_at_first_use(level, probes):
    proc = probes[level]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == level


def _cpu_vendor():
    """cpuid's vendor string as /proc/cpuinfo shows it ("GenuineIntel", "AuthenticAMD"); "" where
    it shows none (not x86, no /proc): only "GenuineIntel" changes auto's choice."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def expected_auto_level(vendor, highest, built):
    """The level RINGSEQ_CPU_ISA=auto runs, as docs/kernels.md states it: the highest level the CPU
    supports, except avx512 instead of avx512bf16 on Intel (whose vdpbf16ps runs at half the
    FMAs' rate), when avx512 is built."""
    if highest == "avx512bf16" and vendor == "GenuineIntel" and "avx512" in built:
        return "avx512"
    return highest


def test_default_level_is_the_best_this_cpu_supports_except_slow_bf16_dots(probes):
    want = expected_auto_level(_cpu_vendor(), ISA_LEVELS[-1], ringseq._C.cpu_isa_built())
    proc = probes[None]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == want
    assert ringseq._C._cpu_isa_auto() == want


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD", "HygonGenuine", ""])
@pytest.mark.parametrize("highest", ["baseline", "avx2", "avx512", "avx512bf16", "amx"])
def test_auto_level_per_vendor_and_highest_level(vendor, highest):
    # The rule on any CPU, whatever this one is: only Intel's avx512bf16 steps down, one level.
    built = ringseq._C.cpu_isa_built()
    if highest not in built:
        pytest.skip(f"{highest} is not built into this extension")
    assert ringseq._C._cpu_isa_auto(vendor, highest) == expected_auto_level(vendor, highest, built)


def test_auto_level_rejects_unknown_level_names():
    with pytest.raises(RuntimeError, match="level must be one of baseline, avx2, avx512, avx512bf16, amx; got 'avx9'"):
        ringseq._C._cpu_isa_auto("GenuineIntel", "avx9")


def test_unsupported_forced_level_errors_clearly():
    # RINGSEQ_CPU_ISA_CEILING makes this CPU pretend to support nothing above the baseline, so
    # a forced avx2 is a level "this CPU lacks": cpu_isa() and every kernel call say so.
    code = ("import torch, ringseq\n"
            "for f in (ringseq.cpu_isa, lambda: torch.ops.ringseq.fwd(*[torch.randn(1, 4, 1, 8)] * 3, 0.3, False)):\n"
            "    try:\n"
            "        f(); print('no error')\n"
            "    except RuntimeError as e:\n"
            "        print('ERROR', str(e).splitlines()[0])\n")
    proc = _run_python(code, RINGSEQ_CPU_ISA="avx2", RINGSEQ_CPU_ISA_CEILING="baseline")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert line.startswith("ERROR RINGSEQ_CPU_ISA=avx2 but this CPU cannot run it"), line
        assert "levels this CPU supports: baseline" in line
    # A level the CPU really lacks (on machines without AVX-512 or AVX2) fails the same way.
    for level in ("avx2", "avx512", "avx512bf16", "amx"):
        if level not in ISA_LEVELS and level in ringseq._C.cpu_isa_built():
            proc = _run_python(code, RINGSEQ_CPU_ISA=level)
            assert f"ERROR RINGSEQ_CPU_ISA={level} but this CPU cannot run it" in proc.stdout


def test_detected_levels_follow_the_cpu_flags():
    # cpuid (dispatch.cpp) against the kernel's view in /proc/cpuinfo: avx512bf16 is offered
    # exactly where the CPU has AVX512_BF16 besides AVX-512 F/BW/DQ/VL, amx where it also has
    # AMX-TILE and AMX-BF16 (and the build has the level).
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is None or os.environ.get("RINGSEQ_CPU_ISA_CEILING"):
        pytest.skip("no /proc/cpuinfo flags (or a ceiling is set)")
    built = ringseq._C.cpu_isa_built()
    avx512 = all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl"))
    if "avx512" in built:
        assert ("avx512" in ISA_LEVELS) == avx512
    if "avx512bf16" in built:
        # (a kernel older than Linux 5.2 lists no avx512_bf16 flag even where cpuid has it)
        assert avx512 or "avx512bf16" not in ISA_LEVELS
        if avx512 and "avx512_bf16" in flags:
            assert "avx512bf16" in ISA_LEVELS
    if "amx" in built:
        # amx also needs the tile state, which Linux lists (amx_tile) only where it enables it
        # and grants on request (a process it refuses falls back to avx512bf16).
        amx = "avx512bf16" in ISA_LEVELS and all(f in flags for f in ("amx_tile", "amx_bf16"))
        assert ("amx" in ISA_LEVELS) == amx


def test_unknown_level_name_errors_clearly(probes):
    proc = probes["sse9"]
    assert proc.returncode != 0
    assert "RINGSEQ_CPU_ISA must be one of auto, baseline, avx2, avx512, avx512bf16, amx; got 'sse9'" in proc.stderr
    proc = probes["auto"]
    assert proc.returncode == 0 and proc.stdout.split()[0] == ringseq._C._cpu_isa_auto(), proc.stderr


def test_set_cpu_isa_rejects_unsupported_levels():
    with pytest.raises(RuntimeError, match="must be one of auto, baseline, avx2, avx512, avx512bf16, amx"):
        ringseq._C._set_cpu_isa("avx9000")
    assert ringseq.cpu_isa() in ISA_LEVELS
