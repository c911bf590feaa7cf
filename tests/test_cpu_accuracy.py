"""CPU kernel float32 accuracy: flash-attn's rule at every head dim, soft-cap included.

The rule (docs/design.md): error against float64 at most 2x (out, lse) / 3x (gradients) the
error of plain float32 attention against float64. Checked here as a pure ratio (no floor), at
every ISA level this CPU runs, on the cases that once broke it:

- ``torch.rand`` inputs (every score positive, every output a long average of positive
  values): before the forward's P·V and row sums were cut into partial sums of 32 terms
  (csrc/cpu/gemm.h, kChunk), b=1, h=1, s=256, d=32, causal gave out 2.3x and dq 3.6x.
- ``torch.randn`` inputs at large head dims and with a soft-cap (issue 28): with one float32
  chain over the head dim in S = Q·Kᵀ and dP = dO·Vᵀ (now partial sums of 64 terms, gemm.h
  kHeadChunk) d=256 gave out 2.4x and dq 3.4x, d=192 causal dq 4.3x, d=128 softcap 30 dk
  3.8x; a tanh that cancelled for small scores (csrc/cpu/masks.h, tanh_vec) gave dq 6.3x with
  softcap 30 at d=256; and a delta summed in another order than dP (the CPU kernel now sums
  its own, csrc/cpu/kernels/flash_bwd.cpp) gave dq 5.1x at d=64 with softcap 30 at the
  baseline level (the rows that see one key, where plain attention's dS is exactly 0).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import ringseq
from ringseq.kernels import extension_available

from utils import cpu_isa_forced, isa_levels, max_err, reference_grads

pytestmark = pytest.mark.skipif(not extension_available(), reason="ringseq._C is not built")

BOUND = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}


def _mean_err(a, ref):
    return float((a.detach().double() - ref).abs().mean())


def _worst_ratios(b, h, s_q, s_k, d, causal, seeds, *, rand=False, softcap=0.0, qk_scale=1.0,
                  mean=False, levels=None, h_kv=None):
    """{name: max over seeds of err(ringseq) / err(plain float32)}, both against float64: the
    max error, or with ``mean`` the mean; q and k times ``qk_scale``; loss sum(out * dout)
    with dout = ones (rand) or randn. ``levels``: {level: those ratios} for each ISA level,
    the two references computed once per seed for all of them (they are torch's, the same
    at every kernel level; they take 10x the kernel's time); None: the current level's.
    ``h_kv``: K/V heads (GQA; default ``h``)."""
    if levels is not None:
        worst = {level: dict.fromkeys(BOUND, 0.0) for level in levels}
    else:
        worst = dict.fromkeys(BOUND, 0.0)
    err = _mean_err if mean else max_err
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        make = torch.rand if rand else torch.randn
        q = qk_scale * make(b, s_q, h, d, generator=gen)
        k = qk_scale * make(b, s_k, h_kv or h, d, generator=gen)
        v = make(b, s_k, h_kv or h, d, generator=gen)
        dout = torch.ones(b, s_q, h, d) if rand else torch.randn(b, s_q, h, d, generator=gen)
        ref = reference_grads(q, k, v, dout, causal=causal, softcap=softcap)  # float64
        plain = reference_grads(q, k, v, dout, causal=causal, softcap=softcap, dtype=torch.float32)
        for level in (levels if levels is not None else [None]):
            with (cpu_isa_forced(level) if level else contextlib.nullcontext()):
                qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
                out, lse = ringseq.flash_attn_func(qs, ks, vs, causal=causal, softcap=softcap,
                                                   return_lse=True, backend="ringseq")
                out.backward(dout)
            into = worst[level] if level else worst
            for j, (name, got) in enumerate((("out", out), ("lse", lse), ("dq", qs.grad),
                                             ("dk", ks.grad), ("dv", vs.grad))):
                # (exactly 0 in plain float32 too -- a row's one key gives dk 0 -- is no excess)
                mine, theirs = err(got, ref[j]), err(plain[j], ref[j])
                ratio = mine / theirs if theirs else (0.0 if mine == 0 else float("inf"))
                into[name] = max(into[name], ratio)
    return worst


def _check(isa, worst, what):
    over = {n: round(r, 2) for n, r in worst.items() if r > BOUND[n]}
    assert not over, (f"{isa}, {what}: error / plain-fp32 error above the rule (out, lse 2x; "
                      f"grads 3x): {over}; all: { {n: round(r, 2) for n, r in worst.items()} }")


@pytest.mark.parametrize("s, d, h, causal, seeds", [
    (256, 32, 1, True, range(8)),     # the reported case
    (256, 32, 1, False, range(4)),
    (1000, 64, 2, True, range(2)),    # several key tiles: the online-softmax rescales too
    (517, 128, 1, True, range(2)),
])
def test_fp32_error_within_design_rule_on_rand_inputs(s, d, h, causal, seeds):
    # (every ISA level in one test: the references once)
    for isa, worst in _worst_ratios(1, h, s, s, d, causal, seeds, rand=True,
                                    levels=isa_levels()).items():
        _check(isa, worst, f"rand s={s} d={d} causal={causal} seeds {list(seeds)}")


# (s_q, s_k, d, causal, softcap): shapes of flash-attn's test grid where the rule once broke
# (the ratio it reached at the worst ISA level, b=2, h=2, seeds 0-1, in the comment)
@pytest.mark.parametrize("s_q, s_k, d, causal, softcap", [
    (512, 256, 256, False, 0.0),     # out 2.4
    (512, 256, 256, False, 30.0),    # out 2.4; the dv 4.3
    (1024, 1024, 256, True, 0.0),    # dq 3.4
    (1024, 1024, 256, True, 30.0),   # dq 6.3
    (1024, 1024, 192, True, 0.0),    # dq 4.3
    (1024, 1024, 128, False, 30.0),  # dk 3.8
    (1024, 1024, 64, True, 30.0),    # dq 5.1 (baseline level)
])
def test_fp32_error_within_design_rule_at_every_head_dim(s_q, s_k, d, causal, softcap):
    # (every ISA level in one test: the references once)
    for isa, worst in _worst_ratios(2, 2, s_q, s_k, d, causal, range(2), softcap=softcap,
                                    levels=isa_levels()).items():
        _check(isa, worst, f"randn s_q={s_q} s_k={s_k} d={d} causal={causal} softcap={softcap}")


@pytest.mark.parametrize("s_q, s_k, h, h_kv, d, causal", [
    (1, 8, 512, 2, 128, False),   # before: dk 3.2x, dv 4.5x; now 1.6x, 2.0x
    (4, 64, 256, 1, 128, False),  # before: dk 4.2x, dv 3.5x; now 2.2x, 2.4x
    (1, 64, 512, 1, 64, False),   # before: dk 4.5x, dv 6.0x; now 2.3x, 2.0x
    (64, 64, 64, 1, 64, True),    # many rows per head besides: 1.6x, 1.3x either way
])
def test_fp32_key_gradients_of_a_wide_gqa_group_within_design_rule(s_q, s_k, h, h_kv, d,
                                                                     causal):
    # dK and dV of a key tile sum every query row of every head of the group; with one chain
    # of all of them (a decode-shaped backward, or wide MQA) dv reached 5.3x plain float32's
    # error, which sums each head alone and the heads pairwise. Now a partial sum added into
    # the tile's at a head's end once it holds 16 rows (csrc/cpu/kernels/flash_bwd.cpp,
    # kTileRows). (Rows that
    # see one to three keys are the documented exception for dq and dk, docs/kernels.md; out,
    # lse and dq of one head's rows are the other tests'.)
    for isa, worst in _worst_ratios(1, h, s_q, s_k, d, causal, range(3), h_kv=h_kv,
                                    levels=isa_levels()).items():
        _check(isa, {n: worst[n] for n in ("dk", "dv")},
               f"GQA {h}/{h_kv} heads s_q={s_q} s_k={s_k} d={d} causal={causal}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_a_row_that_sees_one_key_has_zero_gradient_exactly(isa, softcap, dtype):
    # Causal row 0 sees key 0 alone: P = 1 and O = v_0 exactly, so dP - delta = dO·v_0 - dO·O
    # is exactly 0 when delta is summed in dP's order (the kernel's own delta), and with it
    # dS and row 0 of dq. Plain float32 attention gives exactly 0 there too. In bfloat16 the
    # avx512bf16 level sums dP from bf16 pairs, and delta the same way (odd d: a half pair).
    gen = torch.Generator().manual_seed(5)
    for d in (64, 37):
        q, k, v = (torch.randn(2, 300, 2, d, generator=gen).to(dtype).requires_grad_() for _ in range(3))
        out = ringseq.flash_attn_func(q, k, v, causal=True, softcap=softcap, backend="ringseq")
        out.backward(torch.randn(out.shape, generator=gen).to(dtype))
        assert torch.equal(q.grad[:, 0], torch.zeros_like(q.grad[:, 0])), (
            f"{isa} {dtype} d={d}: dq of the one-key rows is {q.grad[:, 0].abs().max().item():.3g}, not 0")


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_ring_keeps_the_rule_and_the_exact_zero(isa, softcap):
    # The ring computes delta once for all its steps (AttentionBackend.delta): summed in the
    # kernel's dP order, its one-key rows get dq exactly 0 too. With torch's order they did not:
    # dq reached 4.3x (5.1x with softcap 30) plain fp32's error at the baseline level, 2.1x
    # (2.5x) at avx2 and avx512, all from row 0.
    from ringseq.engine.sim import simulate_ring
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 1024, 2, 64, generator=gen) for _ in range(4))
    out, lse, dq, dk, dv = simulate_ring(q, k, v, layout="zigzag", world_size=4, causal=True,
                                         softcap=softcap, dout=dout)
    assert torch.equal(dq[:, 0], torch.zeros_like(dq[:, 0])), f"{isa}: dq row 0 is not 0"
    ref = reference_grads(q, k, v, dout, causal=True, softcap=softcap)
    plain = reference_grads(q, k, v, dout, causal=True, softcap=softcap, dtype=torch.float32)
    worst = {name: max_err(got, ref[j]) / max_err(plain[j], ref[j])
             for j, name, got in ((0, "out", out), (1, "lse", lse), (2, "dq", dq), (3, "dk", dk),
                                  (4, "dv", dv))}
    _check(isa, worst, f"ring zigzag W=4 s=1024 d=64 causal softcap={softcap}")


@pytest.mark.parametrize("d", [32, 64, 65, 128, 129])
def test_a_row_that_sees_one_key_gives_exact_gradients_at_large_scores(isa, d):
    # window_size=(0, 0): every query sees its own key alone, so P = 1 and out = v exactly;
    # dV = dO, dQ = dK = 0 in exact arithmetic and in plain float32 attention. The backward
    # recomputes S as the forward summed it (fl(scale·q)·k in the forward's order), so P =
    # exp(S - lse) is exactly 1. Before, S = q·fl(scale·k) rounded otherwise wherever the scale
    # is not a power of two (d = 32, 65, 128, 129): dV - dO reached 9.8e-6 at scores of ~30.
    gen = torch.Generator().manual_seed(d)
    q, k = (3 * torch.randn(1, 64, 2, d, generator=gen) for _ in range(2))
    v, dout = (torch.randn(1, 64, 2, d, generator=gen) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ringseq.flash_attn_func(q, k, v, window_size=(0, 0), backend="ringseq")
    out.backward(dout)
    assert torch.equal(out, v.detach()), f"{isa} d={d}: out is not v"
    assert torch.equal(v.grad, dout), f"{isa} d={d}: max |dv - dout| {(v.grad - dout).abs().max():.3g}"
    for name, g in (("dq", q.grad), ("dk", k.grad)):
        assert torch.equal(g, torch.zeros_like(g)), f"{isa} d={d}: max |{name}| {g.abs().max():.3g}"


@pytest.mark.parametrize("d, causal", [(8, False), (32, False), (128, True)])
def test_fp32_error_within_design_rule_at_large_scores(isa, d, causal):
    # Inputs x3 (scores up to ~30 at d = 128): P recomputed in the backward meets the
    # forward's S, so the gradients keep the rule there too. (d = 3 is not held to it: dv
    # 2.6-2.9x at every level, 3.04x against torch's AVX2 float32; 6.0-9.3x before.)
    worst = dict.fromkeys(BOUND, 0.0)
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        q, k = (3 * torch.randn(2, 160, 4, d, generator=gen) for _ in range(2))
        v, dout = (torch.randn(2, 160, 4, d, generator=gen) for _ in range(2))
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ringseq.flash_attn_func(qs, ks, vs, causal=causal, return_lse=True,
                                           backend="ringseq")
        out.backward(dout)
        ref = reference_grads(q, k, v, dout, causal=causal)  # float64
        plain = reference_grads(q, k, v, dout, causal=causal, dtype=torch.float32)
        for j, (name, got) in enumerate((("out", out), ("lse", lse), ("dq", qs.grad),
                                         ("dk", ks.grad), ("dv", vs.grad))):
            worst[name] = max(worst[name], max_err(got, ref[j]) / max_err(plain[j], ref[j]))
    _check(isa, worst, f"inputs x3, d={d}, causal={causal}")


@pytest.mark.parametrize("d, softcap, mult", [(32, 20.0, 5.0), (32, 50.0, 10.0), (128, 20.0, 10.0)])
def test_fp32_mean_error_within_design_rule_where_the_soft_cap_saturates(isa, d, softcap, mult):
    # q, k = mult * randn: raw scores of 25-100 against caps of 20-50, so most scores sit on
    # tanh's flat part and a few rows see scores of terms ~100 each summed over d. There the
    # max-error ratio is one element's rounding against one element's: at every level it
    # reached 2.5-5.0 (lse 4.4 at d = 128, dq and dk 5.0 at d = 32), and plain float32 swings
    # as much between summation orders: against itself with the head dim summed in another
    # order it fails the rule too (lse 3.7x, dq 23x; benchmarks/RESULTS.md, twenty-ninth
    # session). The rule is held on the mean error, which the outliers do not decide:
    # 0.95-1.44x plain float32 at every level on this CPU, as on randn inputs.
    worst = _worst_ratios(2, 2, 128, 128, d, True, (0, 1), softcap=softcap, qk_scale=mult,
                          mean=True)
    _check(isa, worst, f"mean errors, {mult} x randn, d={d}, softcap={softcap}, causal")
