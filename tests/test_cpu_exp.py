"""The CPU kernels' softmax exp (csrc/cpu/vec.h: exp_vecs), through torch.ops.ringseq._softmax_exp.

What the forward and backward rely on, at every ISA level this CPU runs:
1. exp(x) within float32's relative spacing (2^-23) of float64's exp, down to the results just
   under 2^-126 (which may be subnormal: within 2^-149 more there);
2. zeros, exactly, where exp(x) is far below 2^-126 (x < -87.7, -inf included); NaN stays NaN;
   the general variant saturates at exp(88) above 88 (a soft-cap's tanh feeds it large x);
   the variant for x <= 0 or NaN (the softmax's scores minus their maximum) agrees with the
   general one there, bit for bit;
3. the same bits at every level with FMA (avx2, avx512, avx512bf16, amx): the AVX-512 levels put
   2^n in with vscalefps, AVX2 through the exponent bits, and the probabilities of a forward at
   one level are those of another.
"""
import pytest
import torch

import ringseq._C  # noqa: F401  (registers torch.ops.ringseq)
from ringseq.kernels.extension import cpu_isa_levels

exp_op = torch.ops.ringseq._softmax_exp


def inputs():
    """A dense sweep of [-100, 100], random float32 bit patterns (every binade, both signs,
    subnormals, infinities, NaNs) and the boundaries of the flush and the clamp."""
    gen = torch.Generator().manual_seed(0)
    sweep = torch.linspace(-100.0, 100.0, 1 << 20, dtype=torch.float64).float()
    bits = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), generator=gen, dtype=torch.int64)
    patterns = bits.to(torch.int32).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, float("-inf"), float("inf"), float("nan"), -87.33, -87.34, -87.68,
                          -87.69, -87.7, -87.99, -88.0, -88.01, -88.5, -88.7, -1e30, 88.0, 88.01, 88.7,
                          1e30, 1e-45, -1e-45])
    x = torch.cat([sweep, patterns, edges, torch.tensor([-1.0])])
    # not a whole number of 64-float groups: the op's last group of four vectors is partial at
    # every level (16, 8 or 4 lanes per vector)
    assert x.numel() % 64 != 0
    return x


def same_bits(a, b):
    """Equal bit patterns, NaN payloads aside."""
    both_nan = a.isnan() & b.isnan()
    return torch.equal(a.view(torch.int32)[~both_nan], b.view(torch.int32)[~both_nan])


def test_softmax_exp_is_exp_within_float32_spacing_flushes_and_saturates(isa):
    x = inputs()
    y, y_np = exp_op(x), exp_op(x, True)
    ref = torch.exp(x.double())
    assert y.shape == x.shape and y.dtype == torch.float32

    kept = x.isfinite() & (x >= -87.68) & (x <= 88.0)
    err = (y[kept].double() - ref[kept]).abs()
    bound = 2.0 ** -23 * ref[kept] + 2.0 ** -149
    worst = int(torch.argmax(err / bound))
    assert bool((err <= bound).all()), (
        f"{isa}: exp({x[kept][worst].item()!r}) = {y[kept][worst].item()!r}, float64 {ref[kept][worst].item()!r}")

    flushed = x < -87.7
    assert bool((y[flushed] == 0).all()) and bool((y_np[flushed] == 0).all()), f"{isa}: no flush below 2^-126"
    assert bool(y[x.isnan()].isnan().all()) and bool(y_np[x.isnan()].isnan().all()), f"{isa}: NaN lost"
    saturated = x > 88.0
    cap = exp_op(torch.tensor([88.0]))
    assert bool((y[saturated] == cap).all()), f"{isa}: exp above 88 is not exp(88) = {cap.item()}"
    assert cap.item() == pytest.approx(float(torch.exp(torch.tensor(88.0, dtype=torch.float64))), rel=2.0 ** -23)

    own = ~(x > 0)  # x <= 0 or NaN: the non-positive variant's domain
    assert same_bits(y_np[own], y[own]), f"{isa}: the non-positive variant differs from exp where x <= 0"


def test_softmax_exp_takes_float32_only():
    with pytest.raises(ValueError, match=r"_softmax_exp\(x\): x must be a float32 CPU tensor, got Double"):
        exp_op(torch.zeros(3, dtype=torch.float64))
    assert exp_op(torch.zeros(0)).shape == (0,)
    strided = torch.linspace(-3.0, 0.0, 64)[::2]  # not contiguous
    assert torch.equal(exp_op(strided), exp_op(strided.contiguous()))


def test_softmax_exp_gives_the_same_bits_at_every_fma_level():
    levels = [level for level in cpu_isa_levels() if level != "baseline"]
    if len(levels) < 2:
        pytest.skip(f"this CPU runs one level with FMA ({levels}): nothing to compare")
    x = inputs()
    results = {}
    try:
        for level in levels:
            ringseq._C._set_cpu_isa(level)
            assert ringseq._C.cpu_isa() == level
            results[level] = (exp_op(x), exp_op(x, True))
    finally:
        ringseq._C._set_cpu_isa(None)
    first = levels[0]
    for level in levels[1:]:
        assert same_bits(results[level][0], results[first][0]), f"exp at {level} differs from {first}"
        own = ~(x > 0)
        assert same_bits(results[level][1][own], results[first][1][own]), (
            f"the non-positive exp at {level} differs from {first} where x <= 0")


@pytest.mark.parametrize("isa", cpu_isa_levels())
def test_the_soft_caps_tanh_is_as_close_for_negative_scores_as_for_positive(isa):
    """cap * tanh(s / cap) through the forward's lse (window (0, 0): each query sees one key,
    so lse is its capped score), against float64, in units of float32's spacing there. Before:
    1.4 for s > 0 but 3.0 for s < 0 (1 - 2 / (exp(2s) + 1) near -1: the rounding of a quotient
    just below 2), 3.4 on the capped score with cap 20."""
    import numpy as np
    import ringseq
    cap = 20.0
    s = torch.linspace(-120.0, 120.0, 20000)
    exact = cap * torch.tanh(s.double() / cap)
    spacing = torch.from_numpy(np.spacing(np.abs(exact.float().numpy())).astype(np.float64))
    ones = torch.ones(1, s.numel(), 1, 1)
    ringseq._C._set_cpu_isa(isa)
    try:
        _, lse = ringseq.flash_attn_func(s.reshape(1, -1, 1, 1), ones, ones, softmax_scale=1.0,
                                         window_size=(0, 0), softcap=cap, return_lse=True,
                                         backend="ringseq")
    finally:
        ringseq._C._set_cpu_isa(None)
    ulps = (lse.reshape(-1).double() - exact).abs() / spacing
    negative, positive = ulps[s < 0].max().item(), ulps[s > 0].max().item()
    assert negative <= 2.5 and positive <= 2.5, (isa, negative, positive)
