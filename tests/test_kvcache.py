"""KV-cache decoding: flash_attn_with_kvcache (flash-attn 2's semantics) and its
context-parallel form ring_flash_attn_with_kvcache, against float64 attention.

The single-device cases are flash-attn's own kvcache test grid (tests/test_flash_attn.py,
test_flash_attn_kvcache: seqlen_q 1 and > 1, new keys appended or not, cache_batch_idx,
cache_leftpad, MHA/GQA/MQA, causal, sliding windows, rotary at fraction 0/0.5/1 interleaved or
not, num_splits) re-typed with a deterministic sample of its combinations, plus softcap.
Tolerance: docs/design.md's rule (2x the error of plain same-dtype attention vs float64, plus a
small floor). The reference below is written from flash-attn's documented definition, not from
ringseq's code.
"""
from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch

import ringseq
from ringseq import commstats, flash_attn_with_kvcache, ring_flash_attn_with_kvcache
from ringseq.engine.integrity import HEADER_BYTES
from dist_utils import RankError, run_ranks
from utils import assert_close_per_design, scaled_floor

bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


# ------------------------------------------------------------------------- the reference
def visible(s_q, k_len, causal, window, device=None):
    """(s_q, k_len) bool: flash-attn's bottom-right aligned mask over a row's valid keys."""
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    off = k_len - s_q
    vis = torch.ones(s_q, k_len, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        vis &= j <= i + off
    if left >= 0:
        vis &= j >= i + off - left
    if right >= 0:
        vis &= j <= i + off + right
    return vis


def attention_rows(q, keys, values, masks, scale, softcap, dtype):
    """Per batch row: attention of q[b] (s_q, h, d) to keys[b] (n_b, h_kv, d) under masks[b],
    computed in `dtype`; out (b, s_q, h, d), lse (b, h, s_q); rows with no key: 0 and +inf."""
    outs, lses = [], []
    h = q.shape[2]
    for b in range(q.shape[0]):
        kk = keys[b].to(dtype).repeat_interleave(h // keys[b].shape[1], dim=1)
        vv = values[b].to(dtype).repeat_interleave(h // keys[b].shape[1], dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b].to(dtype), kk) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~masks[b], float("-inf"))
        lse = torch.logsumexp(s.float() if dtype in (bf16, f16) else s, dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        lses.append(lse.masked_fill(torch.isneginf(lse), float("inf")))
    return torch.stack(outs), torch.stack(lses)


def rotary(x, cos, sin, pos, interleaved, dtype):
    """x (b, s, h, d) rotated at rows pos (b, s) of cos/sin (n, r/2), computed in `dtype`:
    pairs (2i, 2i+1) when interleaved, else (i, i + r/2)."""
    r = 2 * cos.shape[1]
    c, s = cos.to(dtype)[pos][:, :, None], sin.to(dtype)[pos][:, :, None]
    xr = x.to(dtype)
    if interleaved:
        a, b = xr[..., 0:r:2], xr[..., 1:r:2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xr[..., :r // 2], xr[..., r // 2:r]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot, xr[..., r:]), dim=-1)


# ------------------------------------------------------------------------- flash-attn's grid
SEQLENS = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048),
           (16, 2000), (1, 4096)]
AXES = dict(
    seqlens=SEQLENS, d=[64, 59, 128], batch_idx=[False, True], leftpad=[False, True],
    rotary=[0.0, 0.5, 1.0], interleaved=[False, True], new_eq_q=[True, False],
    causal=[False, True], local=[False, True], new_kv=[True, False],
    mha=["mha", "mqa", "gqa"], splits=[1, 0, 3], dtype=[f16, bf16])


def grid_sample(n, seed=0):
    """n combinations of flash-attn's axes in which every value of every axis appears: each
    axis deals its values from seeded shuffles, reshuffled after each round, independently of
    the other axes. Rotary needs new keys (as in flash-attn): a case without them has none."""
    rng = random.Random(seed)
    columns = {}
    for k, vals in AXES.items():
        col = []
        while len(col) < n:
            col += rng.sample(vals, len(vals))
        columns[k] = col[:n]
    out = []
    for i in range(n):
        case = {k: columns[k][i] for k in AXES}
        if not case["new_kv"]:
            case["rotary"] = 0.0
        out.append(case)
    return out


def run_flash_case(case, device="cpu", seed=0):
    s_q, s_k = case["seqlens"]
    d, dtype = case["d"], case["dtype"]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    b, h = 2, 6
    h_kv = {"mha": 6, "mqa": 1, "gqa": 3}[case["mha"]]
    b_c = 2 * b if case["batch_idx"] else b
    rotary_dim = math.floor(int(case["rotary"] * d) / 16) * 16
    window = (-1, -1) if not case["local"] else tuple(
        int(x) for x in torch.randint(0, s_k, (2,), generator=gen))
    s_new = s_q if case["new_eq_q"] else int(torch.randint(1, s_q + 1, (1,), generator=gen))
    new = case["new_kv"]
    q = randn(b, s_q, h, d)
    k_new, v_new = (randn(b, s_new, h_kv, d), randn(b, s_new, h_kv, d)) if new else (None, None)
    k_cache, v_cache = randn(b_c, s_k, h_kv, d), randn(b_c, s_k, h_kv, d)
    hi = (s_k - (s_q if (case["causal"] or case["local"]) and rotary_dim > 1 else s_new) + 1) \
        if new else s_k + 1
    cache_seqlens = torch.randint(0 if new else 1, max(hi, 1), (b,), generator=gen, dtype=torch.int32)
    leftpad = None
    if case["leftpad"]:
        leftpad = torch.tensor([int(torch.randint(0, n, (1,), generator=gen)) if n > 0 else 0
                                for n in cache_seqlens.tolist()], dtype=torch.int32)
    bidx = torch.randperm(b_c, generator=gen)[:b].to(torch.int32) if case["batch_idx"] else None
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(s_k, rotary_dim // 2, generator=gen, dtype=f64) * 2 * math.pi
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    rows = bidx.long() if bidx is not None else torch.arange(b)
    before = (k_cache.clone(), v_cache.clone())

    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=None if cos is None else cos.to(device),
        rotary_sin=None if sin is None else sin.to(device), cache_seqlens=cache_seqlens.to(device),
        cache_batch_idx=None if bidx is None else bidx.to(device),
        cache_leftpad=None if leftpad is None else leftpad.to(device), causal=case["causal"],
        window_size=window, rotary_interleaved=case["interleaved"], num_splits=case["splits"],
        return_softmax_lse=True)
    # contiguous, as flash-attn returns it (before: the plain torch path gave a permuted view,
    # which out.view(b, s_q, h * d) refused)
    assert out.is_contiguous(), out.stride()

    # The reference: rotate, append, attend over each row's valid keys, in float64 and dtype.
    results = {}
    lengths = cache_seqlens.long() + (s_new if new else 0)
    starts = leftpad.long() if leftpad is not None else torch.zeros(b, dtype=torch.long)
    for dt in (f64, dtype):
        qq, kn = q.cpu(), None if k_new is None else k_new.cpu()
        if rotary_dim:
            q_pos = cache_seqlens.long()[:, None] + (torch.arange(s_q) if case["causal"] or case["local"]
                                                     else torch.zeros(s_q, dtype=torch.long))
            qq = rotary(qq, cos, sin, q_pos, case["interleaved"], dt)
            kn = rotary(kn, cos, sin, cache_seqlens.long()[:, None] + torch.arange(s_new),
                        case["interleaved"], dt).to(dtype)  # stored in the cache's dtype
        kc, vc = before[0][rows].clone().cpu(), before[1][rows].clone().cpu()
        if new:
            for bb in range(b):
                n0 = int(cache_seqlens[bb])
                kc[bb, n0:n0 + s_new], vc[bb, n0:n0 + s_new] = kn[bb], v_new[bb].cpu()
        keys = [kc[bb, starts[bb]:lengths[bb]] for bb in range(b)]
        vals = [vc[bb, starts[bb]:lengths[bb]] for bb in range(b)]
        masks = [visible(s_q, int(lengths[bb] - starts[bb]), case["causal"], window) for bb in range(b)]
        results[dt] = attention_rows(qq, keys, vals, masks, d ** -0.5, 0.0, dt)
        if dt == f64 and new:
            # The caches were written in place, at the rows and positions of the reference
            # (rotated keys may round differently by an ulp: float32 vs float64 rotation).
            tol = torch.finfo(dtype).eps if rotary_dim else 0.0
            torch.testing.assert_close(k_cache.cpu()[rows], kc, rtol=tol, atol=tol)
            assert torch.equal(v_cache.cpu()[rows], vc)
    ref, plain = results[f64], results[dtype]
    floor = scaled_floor(dtype, ref[0])
    assert_close_per_design(out.cpu(), ref[0], plain[0], "out", factor=2, floor=floor)
    assert_close_per_design(lse.cpu(), ref[1], plain[1].to(lse.dtype), "lse", factor=2, floor=floor)


@pytest.mark.parametrize("case", grid_sample(27), ids=lambda c: "-".join(
    f"{k}{v}" if not isinstance(v, tuple) else f"{v[0]}x{v[1]}" for k, v in c.items()))
def test_flash_attn_kvcache_grid(case):
    run_flash_case(case)


@pytest.mark.parametrize("case", grid_sample(4, seed=1))
def test_flash_attn_kvcache_every_isa_level(isa, case):
    run_flash_case(case, seed=3)
    assert ringseq.cpu_isa() == isa


# Multi-query cases under each mask (the grid's other axes as dealt): the masks broadcast one
# row of key positions over the queries, which a single query does not exercise.
TORCH_PATH_CASES = [dict(case, seqlens=sl, causal=causal, local=local) for case, sl, causal, local in zip(
    grid_sample(4, seed=7), [(3, 799), (64, 256), (16, 2000), (64, 800)],
    [True, False, True, False], [False, True, True, False])]


@pytest.mark.parametrize("case", TORCH_PATH_CASES)
def test_plain_torch_path_meets_the_same_rule(case, monkeypatch):
    # The path flash_attn_with_kvcache takes where ringseq's kernel does not run (CUDA float32
    # or other head dims, a build without the extension, new keys with a strided last dim in
    # the ring function): the same reference, the same tolerance rule as the kernel's cases.
    monkeypatch.setattr(ringseq.kvcache, "_kernel_runs", lambda *args: False)
    run_flash_case(case, seed=5)


@pytest.mark.parametrize("path", ["kernel", "plain torch"])
def test_slots_the_call_does_not_read_may_hold_nan(path, monkeypatch):
    """A cache made with torch.empty holds anything past each row's keys and before its left
    pad: the output is that of a cache holding zeros there (before, on the plain-torch path:
    every output row NaN, since 0 * NaN is NaN in p @ v)."""
    if path == "plain torch":
        monkeypatch.setattr(ringseq.kvcache, "_kernel_runs", lambda *args: False)
    q, kc, vc = _decode_inputs(b=2, cap=40)
    k, v = (torch.randn(2, 1, 2, 64, generator=torch.Generator().manual_seed(1))
            for _ in range(2))
    seqlens, leftpad = torch.tensor([10, 25], dtype=torch.int32), torch.tensor([0, 4])
    outs = []
    for fill in (0.0, float("nan"), float("inf")):
        kf, vf = kc.clone(), vc.clone()
        for row, (lo, hi) in enumerate(zip(leftpad.tolist(), seqlens.tolist())):
            for t in (kf, vf):  # (the appended key lands at slot hi)
                t[row, :lo], t[row, hi:] = fill, fill
        outs.append(flash_attn_with_kvcache(q, kf, vf, k, v, cache_seqlens=seqlens,
                                            cache_leftpad=leftpad, causal=True))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


def test_signature_is_flash_attns():
    # flash-attn 2's flash_attn_interface.flash_attn_with_kvcache, parameter for parameter
    import ast
    import inspect
    ref = ("q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
           "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
           "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
           "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False")
    args = ast.parse(f"def f({ref}): pass").body[0].args
    defaults = [inspect.Parameter.empty] * (len(args.args) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults]
    got = [(p.name, p.default, p.kind) for p in inspect.signature(flash_attn_with_kvcache).parameters.values()]
    assert got == [(a.arg, d, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a, d in zip(args.args, defaults)]
    assert "flash_attn_with_kvcache" in ringseq.__all__ and "ring_flash_attn_with_kvcache" in ringseq.__all__


# ------------------------------------------------------------------------- decoding specifics
def _decode_inputs(b=3, h=8, h_kv=2, d=64, cap=700, dtype=f32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, h, d, generator=gen).to(dtype)
    kc = torch.randn(b, cap, h_kv, d, generator=gen).to(dtype)
    vc = torch.randn(b, cap, h_kv, d, generator=gen).to(dtype)
    return q, kc, vc


@pytest.mark.parametrize("dtype", [f32, bf16, f64])
@pytest.mark.parametrize("window", [(-1, -1), (40, 0), (0, 0)])
def test_single_token_decoding_with_gqa_softcap_and_windows(dtype, window):
    # One query per row with GQA (the kernel reads each kv head once for its group of query
    # heads), rows of different lengths, a soft-cap and windows given as ints and as tensors.
    q, kc, vc = _decode_inputs(dtype=dtype)
    lengths = torch.tensor([1, 700, 333], dtype=torch.int32)
    for win in (window, torch.tensor(window)):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True,
                                           window_size=win, softcap=5.0, return_softmax_lse=True)
        masks = [visible(1, n, True, window) for n in lengths.tolist()]
        keys = [kc[b, :n] for b, n in enumerate(lengths.tolist())]
        vals = [vc[b, :n] for b, n in enumerate(lengths.tolist())]
        ref = attention_rows(q, keys, vals, masks, 64 ** -0.5, 5.0, f64)
        plain = attention_rows(q, keys, vals, masks, 64 ** -0.5, 5.0, dtype)
        floor = scaled_floor(dtype, ref[0])
        assert_close_per_design(out, ref[0], plain[0], "out", floor=floor)
        assert_close_per_design(lse, ref[1], plain[1].to(lse.dtype), "lse", floor=floor)


def test_num_splits_change_rounding_only():
    # Any number of key splits computes the same attention: 1 (none), 0 (chosen from the
    # shape: this call has 2 x 2 items, so it splits), 5 and more splits than key tiles.
    q, kc, vc = _decode_inputs(b=2, cap=4000, d=128)
    lengths = torch.tensor([3999, 2500], dtype=torch.int32)
    outs = [flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, num_splits=n,
                                    return_softmax_lse=True) for n in (1, 0, 5, 200)]
    keys = [kc[b, :n] for b, n in enumerate(lengths.tolist())]
    vals = [vc[b, :n] for b, n in enumerate(lengths.tolist())]
    masks = [visible(1, n, False, (-1, -1)) for n in lengths.tolist()]
    ref = attention_rows(q, keys, vals, masks, 128 ** -0.5, 0.0, f64)
    plain = attention_rows(q, keys, vals, masks, 128 ** -0.5, 0.0, f32)
    for out, lse in outs:
        assert_close_per_design(out, ref[0], plain[0], "out", floor=scaled_floor(f32, ref[0]))
        assert_close_per_design(lse, ref[1], plain[1], "lse", floor=scaled_floor(f32, ref[1]))


@pytest.mark.parametrize("dtype", [bf16, f16])
@pytest.mark.parametrize("s_q, h_kv, num_splits", [(1, 2, 0), (1, 8, 1), (5, 2, 3)])
def test_out_acc_is_the_output_before_its_rounding(isa, dtype, s_q, h_kv, num_splits):
    # The kernel's out_acc (for partial results merged afterwards, as the ring's decode does)
    # writes the float32 output that the default call rounds to the inputs' dtype: at every
    # CPU level, with and without key splits and with GQA rows (a single query per head group).
    q, kc, vc = _decode_inputs(b=2, h_kv=h_kv, cap=900, dtype=dtype)
    q = torch.randn(2, s_q, 8, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    lengths = torch.tensor([900, 317], dtype=torch.int32)
    args = (q, kc, vc, lengths, None, None, 0.125, True, -1, -1, 0.0, num_splits)
    out, lse = torch.ops.ringseq.fwd_kvcache(*args)
    out_acc, lse_acc = torch.ops.ringseq.fwd_kvcache(*args, True)
    assert out.dtype == dtype and out_acc.dtype == f32 and out_acc.shape == out.shape
    assert torch.equal(out_acc.to(dtype), out) and torch.equal(lse_acc, lse)
    assert not torch.equal(out_acc, out.float())  # (it was not rounded)


def test_results_do_not_depend_on_thread_count():
    q, kc, vc = _decode_inputs(b=1, cap=3000)
    lengths = torch.tensor([2999], dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths,
                                                   return_softmax_lse=True))
    finally:
        torch.set_num_threads(threads)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_appending_in_steps_equals_one_call_over_the_filled_cache():
    # Decoding token by token (appending each step's k, v) leaves the cache and the last
    # output as one call over the filled cache; only the appended positions change.
    q, kc, vc = _decode_inputs(b=2, cap=64)
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([10, 20], dtype=torch.int32)
    kc0, vc0 = kc.clone(), vc.clone()
    ks, vs = [], []
    for step in range(5):
        ks.append(torch.randn(2, 1, 2, 64, generator=gen))  # (b, 1, h_kv, d)
        vs.append(torch.randn(2, 1, 2, 64, generator=gen))
        out = flash_attn_with_kvcache(q, kc, vc, ks[-1], vs[-1], cache_seqlens=lengths + step,
                                      causal=True)
    direct = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths + 5, causal=True)
    torch.testing.assert_close(out, direct, rtol=0, atol=0)
    for b, n in enumerate(lengths.tolist()):
        for cache, before in ((kc, kc0), (vc, vc0)):
            assert torch.equal(cache[b, :n], before[b, :n])
            assert torch.equal(cache[b, n + 5:], before[b, n + 5:])
        assert torch.equal(kc[b, n:n + 5], torch.cat(ks, 1)[b])
        assert torch.equal(vc[b, n:n + 5], torch.cat(vs, 1)[b])


def test_rows_that_see_no_key_give_zero_and_lse_plus_inf():
    q, kc, vc = _decode_inputs(b=2)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([0, 5], dtype=torch.int32),
                                       return_softmax_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()
    assert torch.isfinite(lse[1]).all()


def test_inference_only_runs_without_autograd():
    q, kc, vc = _decode_inputs(b=1)
    q.requires_grad_()
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3)
    assert not out.requires_grad


def test_errors_name_the_argument():
    q, kc, vc = _decode_inputs(b=2, cap=16)
    n = torch.tensor([3, 4], dtype=torch.int32)
    k = torch.randn(2, 1, 2, 64)
    cases = [
        (NotImplementedError, "block_table", dict(cache_seqlens=n, block_table=torch.zeros(2, 1, dtype=torch.int32))),
        (NotImplementedError, "alibi_slopes", dict(cache_seqlens=n, alibi_slopes=torch.ones(8))),
        (ValueError, "both k and v", dict(k=k, cache_seqlens=n)),
        (ValueError, "cache_seqlens is required", dict(k=k, v=k)),
        (ValueError, "must fit the cache", dict(k=k, v=k, cache_seqlens=torch.tensor([15, 16], dtype=torch.int32))),
        (TypeError, "cache_seqlens must be", dict(cache_seqlens=torch.tensor([1.0, 2.0]))),
        (ValueError, "cache_batch_idx entries", dict(cache_seqlens=n, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))),
        (ValueError, "cache_leftpad entries", dict(cache_seqlens=n, cache_leftpad=torch.tensor([0, 5], dtype=torch.int32))),
        (ValueError, "rotary_cos / rotary_sin rotate the new keys",
         dict(cache_seqlens=n, rotary_cos=torch.ones(16, 8), rotary_sin=torch.ones(16, 8))),
        (ValueError, "multiple of 16", dict(k=k, v=k, cache_seqlens=n, rotary_cos=torch.ones(16, 4),
                                            rotary_sin=torch.ones(16, 4))),
        (ValueError, "num_splits", dict(cache_seqlens=n, num_splits=-1)),
        (TypeError, "causal", dict(cache_seqlens=n, causal=1)),
    ]
    for exc, text, kwargs in cases:
        with pytest.raises(exc, match=text) as info:
            flash_attn_with_kvcache(q, kc, vc, **kwargs)
        assert "flash_attn_with_kvcache" in str(info.value)


def test_bad_values_are_refused_before_the_cache_changes():
    """Refused with the function's ValueError / TypeError, the caches unchanged: an int8 call
    (before: the kernel's refusal after the new keys were written), index values outside
    int32 (before: wrapped by the cast, 2**32 + 3 written at slot 3), rotary tables too short
    for the queries' positions (before: IndexError), caches made under inference mode written
    outside it (before: torch's bare RuntimeError)."""
    q, kc, vc = _decode_inputs(b=1, cap=16)
    k = torch.randn(1, 1, 2, 64)
    before = kc.clone()
    as_int8 = [torch.ones_like(t, dtype=torch.int8) for t in (q, kc, vc, k)]
    with pytest.raises(ValueError, match="flash_attn_with_kvcache: q, the caches and k, v must be "
                                        "float32, float64, bfloat16 or float16, got torch.int8"):
        flash_attn_with_kvcache(*as_int8, as_int8[3] * 2, cache_seqlens=3)
    assert (as_int8[1] == 1).all()  # nothing written
    for name, kwargs in (("cache_seqlens", dict(cache_seqlens=2 ** 31)),
                         ("cache_seqlens", dict(cache_seqlens=torch.tensor([2 ** 32 + 3]))),
                         ("cache_batch_idx", dict(cache_seqlens=3,
                                                  cache_batch_idx=torch.tensor([2 ** 32])))):
        with pytest.raises(ValueError, match=rf"flash_attn_with_kvcache: {name} (values )?must "
                                             rf"fit in int32"):
            flash_attn_with_kvcache(q, kc, vc, k, k.clone(), **kwargs)
    # num_splits past int64 (before: the operator's "Expected a value of type 'int'" after the
    # new keys were written), of another kind (before: ValueError without the kind)
    for value, exc, text in (
            (2 ** 63, ValueError, r"must be an int in \[0, 2\*\*31\) \(0: chosen from the shape\), "
                                  r"got 9223372036854775808"),
            (1.0, TypeError, r"must be an int \(0: chosen from the shape\), got 1.0 \(float\)")):
        with pytest.raises(exc, match=rf"^flash_attn_with_kvcache: num_splits {text}$"):
            flash_attn_with_kvcache(q, kc, vc, k, k.clone(), cache_seqlens=3, num_splits=value)
        assert torch.equal(kc, before)
    with pytest.raises(ValueError, match=r"rotary_cos / rotary_sin need at least 19 rows"):
        flash_attn_with_kvcache(torch.randn(1, 4, 8, 64), kc, vc, k, k.clone(), cache_seqlens=15,
                                causal=True, rotary_cos=torch.ones(16, 8),
                                rotary_sin=torch.zeros(16, 8))
    assert torch.equal(kc, before)
    with torch.inference_mode():
        made_there = kc.clone()
    with pytest.raises(ValueError, match=r"k_cache was created under torch.inference_mode\(\)"):
        flash_attn_with_kvcache(q, made_there, vc, k, k.clone(), cache_seqlens=3)
    with torch.inference_mode():  # inside it, as in flash-attn
        flash_attn_with_kvcache(q, made_there, vc.clone(), k, k.clone(), cache_seqlens=3)
    assert torch.equal(made_there[:, 3], k[:, 0])


@pytest.mark.parametrize("fn", [
    flash_attn_with_kvcache, functools.partial(ring_flash_attn_with_kvcache, prefill_len=0)],
    ids=["flash_attn_with_kvcache", "ring_flash_attn_with_kvcache"])
def test_caches_whose_writes_would_land_on_each_other_are_refused(fn):
    """Before: accepted. A broadcast cache (rows of one memory) took row 1's new value in row
    0's slot (output 0.77 off, and the cache read next corrupted); one tensor as both caches
    returned values for keys (1.6 off); two query rows naming one cache row wrote it twice."""
    q, kc, vc = _decode_inputs(b=2, cap=16)
    k, v = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
    shared_rows = vc[:1].expand(2, -1, -1, -1)  # (2, 16, 2, 64), batch stride 0
    before = vc.clone()
    name = getattr(fn, "func", fn).__name__
    # (each function's own names for its caches)
    kn, vn = ("k_cache", "v_cache") if fn is flash_attn_with_kvcache else ("k_cache_shard",
                                                                           "v_cache_shard")
    with pytest.raises(ValueError, match=rf"^{name}: {vn} has rows that share memory "
                                         r"\(strides \(0, "):
        fn(q, kc, shared_rows, k=k, v=v, cache_seqlens=3)
    buf = torch.randn(2, 17, 2, 64)  # (b, cap + 1, h_kv, d): two views one slot apart
    for k_cache, v_cache in ((kc, kc), (buf[:, :16], buf[:, 1:17])):
        with pytest.raises(ValueError, match=rf"^{name}: {kn} and {vn} share memory"):
            fn(q, k_cache, v_cache, k=k, v=v, cache_seqlens=3)
    assert torch.equal(vc, before)  # nothing written
    tied = kc.clone()  # one cache for K = V, appended one tensor: fine, as before
    fn(q, tied, tied, k=k, v=k, cache_seqlens=3)
    assert torch.equal(tied[:, 3], k[:, 0])
    # ... but not with rotary (the keys are rotated, the values not), nor views of one buffer
    # in other orders
    cos, sin = torch.ones(16, 16), torch.zeros(16, 16)
    with pytest.raises(ValueError, match=rf"^{name}: {kn} and {vn} share memory"):
        fn(q, tied, tied, k=k, v=k, cache_seqlens=3, rotary_cos=cos, rotary_sin=sin)
    base = torch.randn(2, 2, 16, 64)  # (b, h_kv, cap, d)
    with pytest.raises(ValueError, match=rf"^{name}: {kn} and {vn} share memory"):
        fn(q, base.permute(0, 2, 1, 3), base.view(2, 16, 2, 64), k=k, v=v, cache_seqlens=3)
    if fn is flash_attn_with_kvcache:
        before = kc.clone()
        with pytest.raises(ValueError, match=r"cache_batch_idx names a cache row twice \(\[1, "
                                             r"1\]\) while k and v are appended"):
            fn(q, kc, vc, k=k, v=v, cache_seqlens=3, cache_batch_idx=torch.tensor([1, 1]))
        assert torch.equal(kc, before)
    # reading a broadcast cache, and two halves of one interleaved (b, cap, 2, h_kv, d) buffer,
    # stay fine
    fn(q, kc, shared_rows, cache_seqlens=3)
    kv = torch.randn(2, 16, 2, 2, 64)
    fn(q, kv[:, :, 0], kv[:, :, 1], k=k, v=v, cache_seqlens=3)
    assert torch.equal(kv[:, 3, 0], k[:, 0]) and torch.equal(kv[:, 3, 1], v[:, 0])


def test_a_window_as_wide_as_the_cache_is_no_window_on_the_torch_path(monkeypatch):
    """flash-attn's rule, which the kernel follows: window_size entries >= seqlen_cache mean
    no window. More queries than cache slots, not causal, right window 4 over a 4-slot cache:
    the plain-torch path (CUDA float32, other head dims) gave a different output (off by 2.16)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2, 16, generator=g, dtype=f64)
    kc, vc = (torch.randn(1, 4, 2, 16, generator=g, dtype=f64) for _ in range(2))
    want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4)
    monkeypatch.setattr(ringseq.kvcache, "_kernel_runs", lambda *args: False)
    for window in ((-1, 4), (4, -1), (7, 9)):
        got = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, window_size=window)
        assert torch.allclose(got, want, atol=1e-12, rtol=0), window


@pytest.mark.parametrize("path", ["kernel", "plain torch"])
def test_a_bounded_left_side_bounds_the_right_side_at_the_cache_width(path, monkeypatch):
    """flash-attn's rule, as flash_attn_func follows it with seqlen_k: with the left side
    bounded, an unbounded right side is as wide as the cache's capacity (6 slots here, 4 of
    them filled), so the first s_q - k_len - capacity = 12 - 4 - 6 = 2 rows see no key (out 0,
    lse +inf). Before, both paths let them attend to every key (off by up to 1.7 against
    flash_attn_func with the same tensors)."""
    if path == "plain torch":
        monkeypatch.setattr(ringseq.kvcache, "_kernel_runs", lambda *args: False)
    elif not ringseq.kvcache._kernel_runs("cpu", f32, 16):
        pytest.skip("the extension is not built")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 12, 2, 16, generator=g)
    kc, vc = (torch.randn(1, 6, 2, 16, generator=g) for _ in range(2))
    for window in ((2, -1), (0, -1), (6, -1)):  # (6, -1): as wide as the cache, no window
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, window_size=window,
                                           return_softmax_lse=True)
        rule = (-1, -1) if window[0] >= 6 else (window[0], 6)
        masks = [visible(12, 4, False, rule)]
        want, want_lse = attention_rows(q, kc[:, :4], vc[:, :4], masks, 16 ** -0.5, 0.0, f64)
        plain, _ = attention_rows(q, kc[:, :4], vc[:, :4], masks, 16 ** -0.5, 0.0, f32)
        blind = 2 if window[0] < 6 else 0
        assert torch.isinf(lse[..., :blind]).all() and (lse[..., :blind] > 0).all(), window
        assert not out[:, :blind].any() and torch.isfinite(lse[..., blind:]).all(), window
        assert_close_per_design(out, want, plain, name=f"out {window}")
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), window


# ------------------------------------------------------------------------- context parallel
class _count_collectives:
    """Records (op, elements sent) of torch.distributed's all_gather / all_reduce calls and
    of the default group's ring's all-to-alls (bytes sent, the rank's own piece included)."""

    def __enter__(self):
        import torch.distributed as dist
        self.sent, self.saved = [], (dist.all_gather, dist.all_reduce)
        self.transport = ringseq.get_ring().transport

        def all_to_all(send, recv):
            self.sent.append(("all_to_all", send.numel()))
            return type(self.transport).all_to_all(self.transport, send, recv)
        self.transport.all_to_all = all_to_all

        def gather(parts, t, *a, **kw):
            self.sent.append(("all_gather", t.numel()))
            return self.saved[0](parts, t, *a, **kw)

        def reduce(t, *a, **kw):
            self.sent.append(("all_reduce", t.numel()))
            return self.saved[1](t, *a, **kw)
        dist.all_gather, dist.all_reduce = gather, reduce
        return self.sent

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.all_gather, dist.all_reduce = self.saved
        del self.transport.all_to_all


def _ring_decode_worker(cases, check_errors):
    """Each case: prefill a global cache sharded with its layout, then decode steps; returns the
    max error ratio vs the tolerance rule per case (checked on the caller side too)."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    report = []
    for case in cases:
        layout, dtype, s_q_steps, b, h, h_kv, d = (case[k] for k in ("layout", "dtype", "steps", "b", "h", "h_kv", "d"))
        gen = torch.Generator().manual_seed(case["seed"])
        P = case["prefill"]
        total_new = sum(s_q_steps)
        lengths = torch.tensor(case["lengths"], dtype=torch.int32)  # global, before decoding
        leftpad = torch.tensor(case["leftpad"], dtype=torch.int32) if case["leftpad"] else None
        cap_global = max(case["lengths"]) + total_new
        K = torch.randn(b, cap_global, h_kv, d, generator=gen).to(dtype)  # the global cache
        V = torch.randn(b, cap_global, h_kv, d, generator=gen).to(dtype)
        # Rank shards: the prefill by the layout; positions past it were decoded earlier,
        # round-robin (the documented rule), written here from K/V.
        cap_local = P // world + (cap_global - P + world - 1) // world + 1
        kc = torch.zeros(b, cap_local, h_kv, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        if P:
            kc[:, :P // world] = ringseq.layouts.shard_local(K[:, :P], layout, world, rank)
            vc[:, :P // world] = ringseq.layouts.shard_local(V[:, :P], layout, world, rank)
        for t in range(P, max(case["lengths"])):
            if (t - P) % world == rank:
                kc[:, P // world + (t - P) // world] = K[:, t]
                vc[:, P // world + (t - P) // world] = V[:, t]
        worst = 0.0
        for step, s_q in enumerate(s_q_steps):
            q = torch.randn(b, s_q, h, d, generator=gen).to(dtype)
            k_new = torch.randn(b, s_q, h_kv, d, generator=gen).to(dtype)
            v_new = torch.randn(b, s_q, h_kv, d, generator=gen).to(dtype)
            window = case["window"] if s_q == 1 else (-1, -1)
            # Every other step without the consistency check: then the call's only
            # communication is one all-gather of (out, lse), b * s_q * h * (d + 1) values, and
            # of whether the rank's part failed (one more), made of an all-to-all on the
            # ring's channel, with the call's header ahead (with the checks, also the begin's
            # control collective, which agrees on the arguments).
            ringseq.set_consistency_check(step % 2 == 0)
            controls = ringseq.get_ring()._seq
            with _count_collectives() as sent, commstats.count_bytes() as counted:
                out, lse = ring_flash_attn_with_kvcache(
                    q, kc, vc, lengths, k_new, v_new, layout=layout, causal=True,
                    window_size=window, softcap=case["softcap"], cache_leftpad=leftpad,
                    return_softmax_lse=True, prefill_len=P)
            itemsize = 8 if dtype == f64 else 4  # (float32 partials, float64 for float64)
            # a piece per peer: the call's header (zeros with the checks on), then the values,
            # padded to 8 bytes
            piece = HEADER_BYTES + -(-(b * s_q * h * (d + 1) + 1) * itemsize // 8) * 8
            assert sent == [("all_to_all", world * piece)], sent  # (nothing on the group)
            # counted as what leaves the rank (before: nothing, commstats read {})
            assert counted.bytes == {"all_gather": (world - 1) * piece}, counted.bytes
            # a ring call's begin (a control collective when the checks are on; counted either
            # way, as the headers name it) and, with the checks off, its end (no collective:
            # the headers' verdict)
            assert ringseq.get_ring()._seq - controls == (1 if step % 2 == 0 else 2)
            ringseq.set_consistency_check(True)
            for bb in range(b):  # the global cache gets the same tokens
                n = int(lengths[bb])
                K[bb, n:n + s_q], V[bb, n:n + s_q] = k_new[bb], v_new[bb]
            lengths = lengths + s_q
            start = leftpad.long() if leftpad is not None else torch.zeros(b, dtype=torch.long)
            keys = [K[bb, start[bb]:lengths[bb]] for bb in range(b)]
            vals = [V[bb, start[bb]:lengths[bb]] for bb in range(b)]
            masks = [visible(s_q, int(lengths[bb] - start[bb]), True, window) for bb in range(b)]
            ref = attention_rows(q, keys, vals, masks, d ** -0.5, case["softcap"], f64)
            plain = attention_rows(q, keys, vals, masks, d ** -0.5, case["softcap"], dtype)
            floor = scaled_floor(dtype, ref[0])
            err, base = assert_close_per_design(out, ref[0], plain[0], "out", floor=floor)
            assert_close_per_design(lse, ref[1], plain[1].to(lse.dtype), "lse", floor=floor)
            worst = max(worst, err / (2 * base + floor))
        # the documented homes: position t >= P lives on rank (t - P) % W at slot P/W + (t - P) // W
        for t in range(P, int(lengths.min())):
            if (t - P) % world == rank:
                assert torch.equal(kc[:, P // world + (t - P) // world], K[:, t]), (case, t)
        report.append(worst)
    return report, _ring_errors() if check_errors else None


RING_CASES = [
    dict(layout="contiguous", dtype=f32, steps=[1, 1, 2, 1], b=2, h=8, h_kv=2, d=32, prefill=48,
         lengths=[48, 53], leftpad=None, window=(-1, -1), softcap=0.0, seed=1),
    dict(layout="zigzag", dtype=bf16, steps=[1, 3, 1], b=2, h=4, h_kv=1, d=64, prefill=64,
         lengths=[40, 70], leftpad=[3, 0], window=(-1, -1), softcap=0.0, seed=2),
    dict(layout="stripe", dtype=f32, steps=[1, 1, 1], b=2, h=6, h_kv=3, d=16, prefill=32,
         lengths=[33, 45], leftpad=[0, 7], window=(9, 0), softcap=4.0, seed=3),
    dict(layout="contiguous", dtype=f64, steps=[2, 1], b=1, h=2, h_kv=2, d=8, prefill=0,
         lengths=[5], leftpad=None, window=(-1, -1), softcap=0.0, seed=4),
]


def _ring_decode_protections():
    """A ring decode is a ring call like attention: (a) a second thread's call on the same
    group is refused at once; (b) a peer stalled inside its part makes the others raise
    RingTimeoutError after the ring timeout; (c) with the checks off, ranks under other call
    tags raise RingDesyncError from the headers. After reset_ring a decode is exact again.
    Returns what each case raised and the last decode's error against float64."""
    import threading
    import time

    import torch.distributed as dist
    import ringseq.kvcache as kvcache
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 16, generator=g)
    K, V = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(2))  # the whole prompt

    def decode():
        kc, vc = (ringseq.shard(t, "zigzag") for t in (K, V))  # (1, 4, 2, 16)
        return ring_flash_attn_with_kvcache(q, kc, vc, 8, layout="zigzag", prefill_len=8)

    def caught(fn):
        try:
            fn()
            return "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads its text
            return f"{type(exc).__name__}: {exc}"

    out = {}
    decode()  # (binds the ring to this thread)
    seen = []
    other = threading.Thread(target=lambda: seen.append(caught(decode)), name="other")
    other.start()
    other.join()
    out["thread"] = seen[0]
    # (b) rank 1 stalls inside its part for 3 s, over a ring timeout of 1 s
    ringseq.set_ring_timeout(1)
    local = kvcache._local_decode

    def stalled(*a, **kw):
        time.sleep(3)
        return local(*a, **kw)
    if rank == 1:
        kvcache._local_decode = stalled
    start = time.monotonic()
    out["stalled"] = caught(decode), time.monotonic() - start
    kvcache._local_decode = local
    time.sleep(max(0.0, 3.5 - out["stalled"][1]) if rank == 0 else 0)  # (both past the stall)
    ringseq.set_ring_timeout(60)
    dist.barrier()
    ringseq.reset_ring()
    # (c) checks off, other call tags
    ringseq.set_consistency_check(False)
    with ringseq.call_tag(7 + rank):
        out["tags"] = caught(decode)
    ringseq.set_consistency_check(True)
    ringseq.reset_ring()
    # (d) rank 1's part fails, checks on and off: raised there, RingPeerError on rank 0, and
    # the ring stays usable (no reset below)
    def failing(*a, **kw):
        raise MemoryError("injected: out of memory")
    for checks in (True, False):
        ringseq.set_consistency_check(checks)
        kvcache._local_decode = failing if rank == 1 else local
        out[f"part_fails_checks_{checks}"] = caught(decode)
        kvcache._local_decode = local
    ringseq.set_consistency_check(True)
    # ... packing the gathered payload fails on rank 1 (zeros go out, read as a failed part);
    # the payload's buffer cannot be allocated on rank 1 (refused at the call's begin)
    import ringseq.parallel.ulysses as ulysses
    pieces = ulysses._pieces
    if rank == 1:
        ulysses._pieces = failing
    out["packing_fails"] = caught(decode)
    ulysses._pieces = pieces

    class NoZeros:  # (kvcache's torch, whose zeros() raise)
        def __getattr__(self, name):
            return failing if name == "zeros" else getattr(torch, name)
    if rank == 1:
        kvcache.torch = NoZeros()
    out["buffer_fails"] = caught(decode)
    kvcache.torch = torch
    # (e) ranks that disagree (cache_seqlens 8 and 7) raise before any cache is written
    kc, vc = (ringseq.shard(t, "zigzag").contiguous() for t in (K, V))
    kc, vc = torch.cat([kc, torch.zeros_like(kc)], 1), torch.cat([vc, torch.zeros_like(vc)], 1)
    before = kc.clone(), vc.clone()
    new = torch.randn(1, 1, 2, 16, generator=g)
    out["disagree"] = caught(lambda: ring_flash_attn_with_kvcache(
        q, kc, vc, 8 - rank, new, new.clone(), layout="zigzag", prefill_len=8))
    out["caches_untouched"] = torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    got = decode()
    want = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(),
                                      K.double().repeat_interleave(2, 2)) / 4, -1)
    want = torch.einsum("bhqk,bkhd->bqhd", want, V.double().repeat_interleave(2, 2))
    out["err"] = float((got.double() - want).abs().max())
    # a sequence-parallel group (Ulysses 2 here): refused with the way that works, which is
    # exact on the cache its shard left
    sp = ringseq.make_sp_groups(2)
    kc, vc = (sp.shard(t, "zigzag") for t in (K, V))
    out["sp"] = caught(lambda: ring_flash_attn_with_kvcache(q, kc, vc, 8, group=sp,
                                                            prefill_len=8))
    got = ring_flash_attn_with_kvcache(q, kc, vc, 8, group=sp.group,
                                       layout=sp.data_layout("zigzag"), prefill_len=8)
    out["sp_err"] = float((got.double() - want).abs().max())
    return out


def test_decodes_without_a_process_group_run_from_several_threads():
    """One rank opens no ring call: a pool of threads decoding at once (a server) is not
    refused (as it would be on a ring of several ranks, where their gathers would pair)."""
    import threading
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 16, generator=g)
    kc, vc = torch.randn(1, 8, 2, 16, generator=g), torch.randn(1, 8, 2, 16, generator=g)
    want = ring_flash_attn_with_kvcache(q, kc, vc, 8, prefill_len=8)
    results = []

    def decode_many():
        for _ in range(20):
            try:
                results.append(torch.equal(
                    ring_flash_attn_with_kvcache(q, kc, vc, 8, prefill_len=8), want))
            except RuntimeError as exc:
                results.append(str(exc))
    threads = [threading.Thread(target=decode_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 80, [r for r in results if r is not True][:3]


def test_a_ring_decode_under_fullgraph_names_the_way_out():
    """(before: dynamo's errors from inside ringseq's checks, one per argument: a
    data-dependent guard whose hint was torch._check, or a data pointer comparison)"""
    kc, vc = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16)
    for prefill in (8, 0):
        compiled = torch.compile(lambda q: ring_flash_attn_with_kvcache(
            q, kc, vc, 8, prefill_len=prefill), fullgraph=True, backend="eager")
        with pytest.raises(Exception, match="ring_flash_attn_with_kvcache runs between graphs "
                                            ".*compile the code around it without "
                                            "fullgraph=True"):
            compiled(torch.randn(1, 1, 4, 16))


def test_a_ring_decode_is_protected_as_ring_calls_are():
    """(before: a plain all-gather on the group: a second thread's calls ran and, started in
    another order on the two ranks, paired with the other thread's (outputs 9 off); a stalled
    peer was waited for until the process group's timeout; with the checks off, ranks under
    other tags paired silently)"""
    res = run_ranks(_ring_decode_protections, 2, timeout=120)
    for rank, r in enumerate(res):
        assert r["thread"].startswith("RuntimeError: ring_flash_attn_with_kvcache: this ring "
                                      "(process group of 2 ranks) is bound to thread"), r
        if rank == 0:
            kind, took = r["stalled"][0].split(":")[0], r["stalled"][1]
            assert kind == "RingTimeoutError" and took < 2.9, r["stalled"]
            assert "waited more than 1 s" in r["stalled"][0], r["stalled"]
        else:  # (back after its peer left: the peer's part had arrived, so its own result
            # is whole; or the channel is gone; its next call meets rank 0's broken ring)
            assert r["stalled"][0].startswith(("no error", "RingTimeoutError",
                                               "RingBrokenError")), r
        assert r["tags"].startswith("RingDesyncError"), r["tags"]
        for case in ("part_fails_checks_True", "part_fails_checks_False", "packing_fails"):
            assert r[case].startswith("MemoryError: injected" if rank == 1 else
                                      "RingPeerError: ringseq: ring_flash_attn_with_kvcache: "
                                      "rank(s) [1] of the group failed"), (case, r[case])
        assert r["disagree"].startswith("RingMismatchError") and r["caches_untouched"], r
        assert r["buffer_fails"].startswith(
            "MemoryError: injected" if rank == 1 else "RingPeerError: ringseq: forward not run: "
            "rank(s) [1] of the ring refused the call's arguments (rank 1: MemoryError"), r
        assert "tag 7" in r["tags"] and "tag 8" in r["tags"], r["tags"]
        assert r["err"] < 1e-5 and r["sp_err"] < 1e-5, r
        assert r["sp"].startswith("TypeError: ring_flash_attn_with_kvcache: group= takes a "
                                  "torch.distributed process group, got a "
                                  "SequenceParallelGroups"), r["sp"]
        assert r["sp"].endswith("usp_attn_func(..., sp=sp); for a decode, group=sp.group with "
                                "layout=sp.data_layout(layout)"), r["sp"]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_decoding_is_exact_and_moves_no_kv(world):
    # Exactness and the collectives are asserted on every rank (a failing rank raises
    # RankError here); at W=2 the same ranks then check the errors (one spawn for both).
    cases = [c for c in RING_CASES if c["prefill"] % (2 * world) == 0]
    results = run_ranks(_ring_decode_worker, world, cases, world == 2, timeout=180)
    assert all(len(report) == len(cases) for report, _ in results)
    if world == 2:
        for rank, (_, caught) in enumerate(results):
            # a shard too small on rank 1 only: raised there, and on rank 0 as a RingPeerError
            # naming rank 1 and its message
            assert len(caught) == 11, caught
            # (the prompt's share, prefill_len 8 over 2 ranks, does not fit rank 1's shard)
            assert ("k_cache_shard / v_cache_shard on rank 1 have capacity (dim 1) 3, fewer "
                    "than the 4 slots of this rank's share of prefill_len = 8" in caught[0])
            assert rank == 1 or "rank(s) [1]" in caught[0]
            assert "prefill_len" in caught[1]  # bad on every rank: raised on every rank
            assert "window_size (2, 0) with seqlen_q = 2" in caught[2]
            assert "NotImplementedError" in caught[2]
            assert "num_splits must be an int in [0, 2**31)" in caught[3]
            assert "different arguments" in caught[4]  # (their values shown, not hashes)
            assert "cache_seqlens (rank 0: [8] (1 value), rank 1: [6] (1 value)" in caught[4]
            assert "ring_flash_attn_with_kvcache" in caught[4]
            assert "different arguments" in caught[5]
            assert "softcap (rank 0: 0.0, rank 1: 5.0)" in caught[5]
            assert "k_cache_shard was created under torch.inference_mode()" in caught[6]
            assert rank == 1 or ("RingPeerError" in caught[6] and "rank(s) [1]" in caught[6])
            assert caught[7].startswith("RingMismatchError") and "different operations (rank 0: " \
                "ring attention, rank 1: ring kv-cache decoding)" in caught[7], caught[7]
            assert caught[8].startswith("RingBrokenError") and "reset_ring" in caught[8], caught[8]
            assert caught[9].startswith("RingBrokenError") and "reset_ring" in caught[9], caught[9]
            # the prompt fits, but not the token appended after 8 cached ones
            # (token 8, the first after the prompt, lives on rank 0)
            assert ("k_cache_shard / v_cache_shard on rank 0 have capacity (dim 1) 4, but 5 "
                    "slots are needed on it for 9 tokens" in caught[10])
            assert rank == 0 or "rank(s) [0]" in caught[10]


def _ring_decode_with_cancelling_parts(dtype, case):
    """A ring decode of W=2 (one query per row, two new tokens appended) whose parts are large
    and cancel: ``"ranks"``: V offset by +30 on rank 0's half of the prompt, -30 on rank 1's;
    ``"new tokens"``: +30 on the prompt, -30 on the new tokens, whose keys (along their query
    heads' mean) make them weigh as much as the prompt. Returns (out, q, K, V), K and V the
    global cache after the call."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    # (n: the prompt's tokens; GQA for "ranks", a key per query head for "new tokens")
    b, n, h, h_kv, d = 2, 128, 4 if case == "ranks" else 2, 2, 64
    q = torch.randn(b, 1, h, d, generator=gen) * 0.1
    K = torch.randn(b, n + 2, h_kv, d, generator=gen) * 0.1
    V = torch.randn(b, n + 2, h_kv, d, generator=gen) * 0.5
    if case == "ranks":
        V[:, :n // 2] += 30.0
        V[:, n // 2:n] -= 30.0
    else:
        mean = q[:, 0].view(b, h_kv, h // h_kv, d).mean(2)  # (b, h_kv, d)
        # scores of about log(n / 2) against the ~0 of the prompt's keys: weight ~ the prompt's
        key = mean / mean.norm(dim=-1, keepdim=True) ** 2 * math.log(n / 2) * d ** 0.5
        K[:, n:] = key[:, None]  # (b, 2, h_kv, d)
        V[:, :n] += 30.0
        V[:, n:] -= 30.0
    q, K, V = q.to(dtype), K.to(dtype), V.to(dtype)
    kc = torch.zeros(b, n // world + 2, h_kv, d, dtype=dtype)  # (b, cap_local, h_kv, d)
    vc = torch.zeros_like(kc)
    kc[:, :n // world] = ringseq.layouts.shard_local(K[:, :n], "contiguous", world, rank)
    vc[:, :n // world] = ringseq.layouts.shard_local(V[:, :n], "contiguous", world, rank)
    out = ring_flash_attn_with_kvcache(q, kc, vc, n, K[:, n:], V[:, n:], layout="contiguous",
                                       causal=True, prefill_len=n)
    return out, q, K, V


@pytest.mark.parametrize("dtype", [bf16, f16])
@pytest.mark.parametrize("case", ["ranks", "new tokens"])
def test_ring_decoding_rounds_once_after_the_merge(dtype, case):
    # Each part of a decode (a rank's shard, the new tokens) stays float32 until the parts are
    # merged; the result is as close to float64 as the single-device call's, which rounds
    # once. Before, each part was rounded to bf16 / fp16 first: where the parts cancel, 15x
    # ("ranks") and 33x ("new tokens") the single-device call's error.
    results = run_ranks(_ring_decode_with_cancelling_parts, 2, dtype, case, timeout=120)
    out, q, K, V = results[0]
    assert torch.equal(out, results[1][0])
    masks = [visible(1, K.shape[1], True, (-1, -1))] * 2
    ref = attention_rows(q, list(K), list(V), masks, 64 ** -0.5, 0.0, f64)[0]
    plain = attention_rows(q, list(K), list(V), masks, 64 ** -0.5, 0.0, dtype)[0]
    single = flash_attn_with_kvcache(q, K, V, cache_seqlens=K.shape[1], causal=True)
    assert ref.abs().max() < 3.0  # (the parts, about +-30 each, cancel)
    floor = scaled_floor(dtype, ref)
    assert_close_per_design(out, ref, plain, "out", floor=floor)
    assert_close_per_design(out, ref, single, "out against the single-device call", floor=floor)


def _ring_errors():
    """Calls that must fail, each followed by one that must not; returns what each rank
    raised."""
    import torch.distributed as dist
    rank = dist.get_rank()
    caught = []

    def call(q, cap, k=None, seqlens=8, **kwargs):
        kc = torch.zeros(1, cap, 2, 16)
        try:
            ring_flash_attn_with_kvcache(q, kc, kc.clone(), seqlens, k,
                                         None if k is None else k.clone(), **kwargs)
        except (ValueError, NotImplementedError) as exc:
            caught.append(f"{type(exc).__name__}: {exc}")

    new_kv = torch.randn(1, 1, 2, 16)
    call(torch.randn(1, 1, 4, 16), 8 if rank == 0 else 3, new_kv, prefill_len=8)  # rank 1 only
    call(torch.randn(1, 1, 4, 16), 8, prefill_len=5)  # not a multiple of the layout's
    call(torch.randn(1, 2, 4, 16), 8, torch.randn(1, 2, 2, 16), prefill_len=8, window_size=(2, 0))
    call(torch.randn(1, 1, 4, 16), 8, new_kv, prefill_len=8, num_splits=-1)
    # valid on each rank, but not the same call: every rank raises, naming what differs
    call(torch.randn(1, 1, 4, 16), 8, new_kv, prefill_len=8, seqlens=8 if rank == 0 else 6)
    call(torch.randn(1, 1, 4, 16), 8, new_kv, prefill_len=8, softcap=0.0 if rank == 0 else 5.0)
    # rank 1's caches made under inference mode and written outside it: refused before the
    # agreement, so rank 0 does not wait in the all-gather
    with torch.inference_mode():
        made_there = torch.zeros(1, 8, 2, 16)
    kc = made_there if rank == 1 else torch.zeros(1, 8, 2, 16)
    try:
        ring_flash_attn_with_kvcache(torch.randn(1, 1, 4, 16), kc, kc.clone(), 8, new_kv,
                                     new_kv.clone(), prefill_len=8)
    except ValueError as exc:
        caught.append(f"{type(exc).__name__}: {exc}")
    # rank 0 in ring attention, rank 1 decoding: both name the two operations, and the ring
    # stays usable (before: a desync, which broke the ring until reset_ring)
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    try:
        if rank == 0:
            ringseq.ring_flash_attn_func(q, k, v, causal=True)
        else:
            ring_flash_attn_with_kvcache(torch.randn(1, 1, 2, 16), torch.zeros(1, 8, 2, 16),
                                         torch.zeros(1, 8, 2, 16), 8, prefill_len=8)
    except ValueError as exc:
        caught.append(f"{type(exc).__name__}: {exc}")
    ringseq.ring_flash_attn_func(q, k, v, causal=True)
    # on a broken ring (here: broken on rank 0), the decode raises RingBrokenError on every
    # rank, as any ring call does, until reset_ring (before: it ran)
    # ... and with the checks off, broken on every rank (no collective says it)
    for checks, broken_here in ((True, rank == 0), (False, True)):
        ringseq.set_consistency_check(checks)
        if broken_here:
            ringseq.get_ring().mark_broken(RuntimeError("an earlier failure"))
        try:
            ring_flash_attn_with_kvcache(torch.randn(1, 1, 4, 16), torch.zeros(1, 8, 2, 16),
                                         torch.zeros(1, 8, 2, 16), 8, prefill_len=8)
        except ringseq.RingBrokenError as exc:
            caught.append(f"{type(exc).__name__}: {exc}")
        finally:
            ringseq.set_consistency_check(True)
        ringseq.reset_ring()
    ring_flash_attn_with_kvcache(torch.randn(1, 1, 4, 16), torch.zeros(1, 8, 2, 16),
                                 torch.zeros(1, 8, 2, 16), 8, prefill_len=8)
    call(torch.randn(1, 1, 4, 16), 4 if rank == 0 else 8, new_kv, prefill_len=8)  # rank 0 only
    return caught


def test_ring_decoding_single_rank_matches_the_single_device_call_at_its_edges():
    """Without a process group the ring form is one rank: it equals flash_attn_with_kvcache
    where it used to differ -- left padding reaching into the appended tokens (a left-padded
    prompt appended to an empty cache), a q whose head dimension is strided -- and refuses
    left padding past the keys as the single-device call does."""
    g = torch.Generator().manual_seed(3)
    dt = torch.float64
    q, k, v = (torch.randn(2, 4, 2, 16, generator=g, dtype=dt) for _ in range(3))
    lengths = torch.tensor([0, 3], dtype=torch.int32)
    leftpad = torch.tensor([2, 1], dtype=torch.int32)  # row 0: inside the new tokens
    caches = [torch.randn(2, 12, 2, 16, generator=g, dtype=dt) for _ in range(2)]
    want = flash_attn_with_kvcache(q, *[c.clone() for c in caches], k, v, cache_seqlens=lengths,
                                   cache_leftpad=leftpad, causal=True)
    got = ring_flash_attn_with_kvcache(q, *[c.clone() for c in caches], lengths, k, v,
                                       cache_leftpad=leftpad, causal=True, prefill_len=0)
    # row 0's queries before its first key see nothing (both give 0 there); the rest must agree
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    strided = torch.randn(2, 1, 2, 32, generator=g, dtype=dt)[..., ::2]  # (2, 1, 2, 16)
    want = flash_attn_with_kvcache(strided, *[c.clone() for c in caches], cache_seqlens=lengths + 4)
    got = ring_flash_attn_with_kvcache(strided, *[c.clone() for c in caches], lengths + 4,
                                       prefill_len=0)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="cache_leftpad entries must lie in"):
        ring_flash_attn_with_kvcache(q, *[c.clone() for c in caches], lengths, k, v,
                                     cache_leftpad=torch.tensor([5, 0], dtype=torch.int32),
                                     causal=True, prefill_len=0)
    # without cache_seqlens the lengths shown are said to be the whole cache (before: shown
    # as if given)
    with pytest.raises(ValueError, match=r"for cache_seqlens = \[\d+, \d+\] \(not given: the "
                                         r"whole cache\) and seqlen_new = 0"):
        flash_attn_with_kvcache(q, *[c.clone() for c in caches],
                                cache_leftpad=torch.tensor([99, 0], dtype=torch.int32))


def test_batch_zero_returns_empty_results():
    """A batch of no rows decodes nothing, as flash_attn_func does for batch 0 (before:
    "max() arg is an empty sequence" from the range checks), appending or not, with and
    without cache_seqlens, on one device and as a ring of one."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(0, 1, 4, 8, generator=g)                     # (b=0, s_q, h, d)
    kc, vc = torch.zeros(0, 16, 2, 8), torch.zeros(0, 16, 2, 8)   # (b=0, cap, h_kv, d)
    k, v = torch.randn(0, 1, 2, 8), torch.randn(0, 1, 2, 8)
    for kw in (dict(cache_seqlens=4), dict(), dict(k=k, v=v, cache_seqlens=4)):
        out = flash_attn_with_kvcache(q, kc, vc, causal=True, **kw)
        assert out.shape == (0, 1, 4, 8), kw
    out = ring_flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, prefill_len=0)
    assert out.shape == (0, 1, 4, 8)


def _decode_layouts_that_differ():
    import torch.distributed as dist

    from ringseq.layouts import Documents
    from utils import error_text
    r = dist.get_rank()
    q, kc = torch.randn(1, 1, 4, 16), torch.zeros(1, 30, 2, 16)  # (b, 1, h, d), (b, cap, h_k, d)
    return [error_text(lambda: ring_flash_attn_with_kvcache(q, kc, kc.clone(), 48, layout=lay,
                                                            prefill_len=48))
            for lay in (Documents([0, 10, 48] if r == 0 else [0, 20, 48]), "documents")]


def _decode_after_a_packed_prefill():
    """One decode step over 2 ranks after a prefill of documents [0, 6) and [6, 16): row 0
    continues the last document (position 16), row 1 writes position 4, in the first."""
    import torch.distributed as dist

    from ringseq.layouts import Documents, shard_local
    from utils import error_text
    rank, world, prefill = dist.get_rank(), 2, 16
    lay = Documents([0, 6, 16])
    g = torch.Generator().manual_seed(3)
    K, V = (torch.randn(2, prefill + 1, 2, 8, generator=g, dtype=torch.float64)
            for _ in range(2))  # (b, s, h_k, d)
    q, k, v = (torch.randn(2, 1, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kc = torch.zeros(2, prefill // world + 2, 2, 8, dtype=torch.float64)  # (b, cap, h_k, d)
    vc = torch.zeros_like(kc)
    kc[:, :prefill // world] = shard_local(K[:, :prefill], lay, world, rank)
    vc[:, :prefill // world] = shard_local(V[:, :prefill], lay, world, rank)
    lengths = torch.tensor([16, 4], dtype=torch.int32)
    out = ring_flash_attn_with_kvcache(q, kc, vc, lengths, k, v, layout=lay,
                                       prefill_len=prefill)
    # the float64 reference: each row's query over its own document's keys, itself included
    want = []
    for row, (start, end) in enumerate([(6, 16), (0, 4)]):
        keys = torch.cat((K[row, start:end], k[row]))  # (keys, h_k, d)
        vals = torch.cat((V[row, start:end], v[row]))
        p = torch.einsum("hd,khd->hk", q[row, 0], keys).mul(8 ** -0.5).softmax(-1)
        want.append(torch.einsum("hk,khd->hd", p, vals))
    two = error_text(lambda: ring_flash_attn_with_kvcache(
        q.expand(2, 2, 2, 8), kc, vc, lengths, k.expand(2, 2, 2, 8), v.expand(2, 2, 2, 8),
        layout=lay, prefill_len=prefill))
    return float((out[:, 0] - torch.stack(want)).abs().max()), two


def test_a_decode_after_a_packed_prefill_attends_to_its_own_document():
    """(Before: a Documents(cu_seqlens) layout was taken for the placement alone, and the
    query attended to every document: 1.13 off in float64.)"""
    for err, two in run_ranks(_decode_after_a_packed_prefill, 2, timeout=120,
                              env={"RINGSEQ_TIMEOUT": "20"}):
        assert err < 1e-12, err
        assert two.startswith("NotImplementedError: ring_flash_attn_with_kvcache: layout "
                              "'documents' holds 2 documents, whose tokens attend to their own "
                              "document alone; that is supported for one query and at most one "
                              "new token per call, got seqlen_q = 2, seqlen_new = 2"), two


def test_a_documents_layout_with_nothing_prefilled_masks_nothing():
    """prefill_len=0: the layout placed no token, so its documents hide none (a first version
    of the document mask hid the keys before its last document's start)."""
    from ringseq.layouts import Documents
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(1, 20, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(1, 1, 2, 8, generator=g, dtype=torch.float64)
    want = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=10)
    got = ring_flash_attn_with_kvcache(q, kc, vc, 10, layout=Documents([0, 6, 16]),
                                       prefill_len=0)
    assert torch.equal(got, want)


def test_a_ring_decode_names_its_layouts_documents_and_a_per_batch_layout():
    """(Before: a mismatch of Documents(cu) layouts showed "layout #<hash>" per rank, and
    layout="documents" was told to pass cu_seqlens, which this function does not take.)"""
    from dist_utils import run_ranks
    for bound, per_batch in run_ranks(_decode_layouts_that_differ, 2, timeout=120,
                                      env={"RINGSEQ_TIMEOUT": "20"}):
        assert bound.startswith("RingMismatchError"), bound
        assert ("layout documents (cu_seqlens) (rank 0: [0, 10, 48] (3 values), rank 1: "
                "[0, 20, 48]") in bound and "#" not in bound, bound
        assert per_batch.startswith("ValueError: ring_flash_attn_with_kvcache: layout "
                                    "'documents' is per batch: it needs each batch's GLOBAL "
                                    "document boundaries, which ring_flash_attn_with_kvcache "
                                    "does not take; pass a layout bound to them"), per_batch


def _decode_with_an_edited_layout():
    """Two decode steps (the second reads the token the first wrote, at a prefill position)
    with a user's layout edited after a call, and with a fresh one of the same values."""
    import torch.distributed as dist

    import ringseq
    from custom_layout import RotatedCausal
    rank, world, prefill = dist.get_rank(), 2, 8
    g = torch.Generator().manual_seed(0)
    K, V = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q, k1, v1 = (torch.randn(1, 1, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))

    def decode(lay):
        kc = torch.zeros(1, prefill // world + 4, 2, 8, dtype=torch.float64)  # (b, cap, h, d)
        vc = torch.zeros_like(kc)
        kc[:, :prefill // world] = ringseq.layouts.shard_local(K[:, :prefill], lay, world, rank)
        vc[:, :prefill // world] = ringseq.layouts.shard_local(V[:, :prefill], lay, world, rank)
        return torch.cat([ringseq.ring_flash_attn_with_kvcache(
            q, kc, vc, torch.tensor([n], dtype=torch.int32), k1, v1, layout=lay, causal=True,
            prefill_len=prefill) for n in (4, 5)])
    edited = RotatedCausal(0)
    decode(edited)
    edited.k = 1
    return float((decode(edited) - decode(RotatedCausal(1))).abs().max())


def test_a_layout_edited_after_a_decode_places_new_tokens_by_its_new_values():
    """(before: the prefill's owners were cached by the layout object: the token went to the
    rank of the old values, and the next step was 0.657 off)"""
    assert run_ranks(_decode_with_an_edited_layout, 2, timeout=120) == [0.0, 0.0]
