"""GPU tests of the CUDA kernels (torch.ops.ringseq.fwd / bwd / bwd_accum).

Marker `cuda`; everything skips without an NVIDIA GPU. Run on a GPU machine after building the
extension with CUDA (`RINGSEQ_CUDA=1 pip install --no-build-isolation --no-deps -e .`), e.g.
through `benchmarks/gpu_check.sh`.

Checks follow docs/design.md: float64 reference attention; the error of the kernel is at most 2x
(3x for gradients) the error of plain same-dtype torch attention, plus a small floor. Every
check draws fresh random inputs (never zeros), outputs are poisoned with NaN before each call
(a NaN-filled block of the output's size is freed into the caching allocator right before, so
the kernel's output most likely lands on it and any element it fails to write stays NaN), and
every tile configuration runs.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from utils import assert_close_per_design, default_floor, reference_grads

HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]

DTYPES = [torch.bfloat16, torch.float16]
HEADDIMS = [64, 128]
# 0: fast default, 1: conservative (64 x 64), 2: 128 x 64 (dynamic shared memory at d=128);
# csrc/kernel_math.h fwd_block_m / fwd_block_n. The backward runs config 0's kernels for 2.
TILE_CONFIGS = [0, 1, 2]


def tile_configs(d):
    """The configurations with distinct kernels at head dim d: at d=64 config 2 is config 0's
    tile (test_config_2_at_d64_runs_config_0 checks that once)."""
    return [0, 1] if d == 64 else TILE_CONFIGS

B, H, H_KV = 2, 8, 2
SHAPES = [  # (s_q, s_k)
    (1, 1), (1, 128), (128, 128), (128, 1000), (1000, 128), (1000, 1000), (1000, 4096),
    (4096, 4096),
]


@pytest.fixture(scope="module", autouse=True)
def cuda_extension():
    """The extension must have its CUDA kernels on a GPU machine: a CPU-only build would make
    every test below skip or fall back silently, so this fails instead."""
    import ringseq  # noqa: F401  (loads ringseq._C, registering torch.ops.ringseq.*)
    from ringseq.kernels.extension import extension_available, extension_has_cuda

    assert extension_available(), "ringseq._C is not built: run benchmarks/gpu_check.sh or " \
        "`RINGSEQ_CUDA=1 pip install --no-build-isolation --no-deps -e .`"
    assert extension_has_cuda(), "ringseq._C was built without CUDA kernels: rebuild with RINGSEQ_CUDA=1"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        pytest.skip("the CUDA kernels need compute capability >= 8.0")


def _gen(*key) -> torch.Generator:
    """A CUDA generator seeded from the test parameters: every check gets its own inputs."""
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))


def _randn(shape, dtype, gen):
    return torch.randn(shape, device="cuda", dtype=torch.float32, generator=gen).to(dtype)


def _inputs(s_q, s_k, d, dtype, gen, strided=False, b=B, h=H, h_kv=H_KV):
    """q, k, v, dout; strided: views whose only contiguous dim is the last (row/head strides
    differ from a dense tensor's, k/v stored head-major), as a ring shard or a packed qkv has."""
    if not strided:
        return (_randn((b, s_q, h, d), dtype, gen), _randn((b, s_k, h_kv, d), dtype, gen),
                _randn((b, s_k, h_kv, d), dtype, gen), _randn((b, s_q, h, d), dtype, gen))
    q = _randn((b, s_q, h + 3, d), dtype, gen)[:, :, 1:h + 1]                # padded heads
    k = _randn((b, h_kv, s_k, 2 * d), dtype, gen)[..., :d].transpose(1, 2)     # head-major, padded
    v = _randn((b, s_k + 5, h_kv, d), dtype, gen)[:, 5:]                       # offset rows
    dout = _randn((b, s_q, h, 2 * d), dtype, gen)[..., d:]                     # wide rows
    assert not q.is_contiguous() and not k.is_contiguous() and not dout.is_contiguous()
    return q, k, v, dout


def _poison(*specs):
    """Fills blocks of the given (shape, dtype) with NaN and frees them into the caching
    allocator, so the next allocations of those sizes (the kernel's outputs) start as NaN."""
    bufs = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in specs]
    del bufs


def _fwd(q, k, v, scale, causal, cfg):
    b, s_q, h, d = q.shape
    _poison(((b, s_q, h, d), q.dtype), ((b, h, s_q), torch.float32))
    out, lse = torch.ops.ringseq.fwd(q, k, v, scale, causal, cfg)
    torch.cuda.synchronize()
    return out, lse


def _bwd(dout, q, k, v, out, lse, scale, causal, cfg, delta=None):
    _poison((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    grads = torch.ops.ringseq.bwd(dout, q, k, v, out, lse, scale, causal, delta, cfg)
    torch.cuda.synchronize()
    return grads


def _check(name, got, ref64, plain, factor, dtype):
    assert torch.isfinite(got[~torch.isinf(ref64)]).all(), f"{name}: NaN/inf where the reference is finite"
    assert_close_per_design(got, ref64, plain, name=name, factor=factor, floor=default_floor(dtype))


@pytest.mark.parametrize("s_q,s_k", SHAPES, ids=[f"sq{a}-sk{b}" for a, b in SHAPES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEADDIMS, ids=[f"d{d}" for d in HEADDIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_fwd_bwd_match_float64_reference(dtype, d, causal, s_q, s_k):
    scale = d ** -0.5
    strided = (s_q + s_k + d) % 3 == 0  # a third of the shapes run on strided views
    for cfg in tile_configs(d):
        q, k, v, dout = _inputs(s_q, s_k, d, dtype, _gen(dtype, d, causal, s_q, s_k, cfg), strided)
        r_out, r_lse, r_dq, r_dk, r_dv = reference_grads(q, k, v, dout, scale, causal, torch.float64)
        p_out, p_lse, p_dq, p_dk, p_dv = reference_grads(q, k, v, dout, scale, causal, dtype)

        out, lse = _fwd(q, k, v, scale, causal, cfg)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"cfg {cfg}: NaN in fwd"
        _check(f"out (cfg {cfg})", out, r_out, p_out, 2.0, dtype)
        _check(f"lse (cfg {cfg})", lse, r_lse, p_lse, 2.0, dtype)
        no_key = torch.isneginf(r_lse)
        if no_key.any():  # rows that see no key: out exactly 0, lse -inf
            assert torch.isneginf(lse[no_key]).all()
            assert (out.transpose(1, 2)[no_key] == 0).all()

        dq, dk, dv = _bwd(dout, q, k, v, out, lse, scale, causal, cfg)
        assert dq.dtype == dk.dtype == dv.dtype == dtype
        _check(f"dq (cfg {cfg})", dq, r_dq, p_dq, 3.0, dtype)
        _check(f"dk (cfg {cfg})", dk, r_dk, p_dk, 3.0, dtype)
        _check(f"dv (cfg {cfg})", dv, r_dv, p_dv, 3.0, dtype)
        if no_key.any():
            assert (dq.transpose(1, 2)[no_key] == 0).all(), "rows with no key must get dq = 0"


@pytest.mark.parametrize("d", HEADDIMS, ids=[f"d{d}" for d in HEADDIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_mha_with_explicit_scale(dtype, d):
    """h == h_kv and a softmax_scale other than d**-0.5: the scale enters once in out, lse,
    dq and dk (a doubled or missing scale shows up here and not with the default)."""
    scale = 0.3
    for cfg in tile_configs(d):
        q, k, v, dout = _inputs(1000, 1000, d, dtype, _gen("mha", dtype, d, cfg), h=4, h_kv=4)
        r_out, r_lse, r_dq, r_dk, r_dv = reference_grads(q, k, v, dout, scale, True, torch.float64)
        p_out, p_lse, p_dq, p_dk, p_dv = reference_grads(q, k, v, dout, scale, True, dtype)
        out, lse = _fwd(q, k, v, scale, True, cfg)
        _check(f"out (cfg {cfg})", out, r_out, p_out, 2.0, dtype)
        _check(f"lse (cfg {cfg})", lse, r_lse, p_lse, 2.0, dtype)
        dq, dk, dv = _bwd(dout, q, k, v, out, lse, scale, True, cfg)
        _check(f"dq (cfg {cfg})", dq, r_dq, p_dq, 3.0, dtype)
        _check(f"dk (cfg {cfg})", dk, r_dk, p_dk, 3.0, dtype)
        _check(f"dv (cfg {cfg})", dv, r_dv, p_dv, 3.0, dtype)


@pytest.mark.parametrize("s_q,s_k", [(128, 128), (1000, 1000), (1000, 128), (200, 4096)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEADDIMS, ids=[f"d{d}" for d in HEADDIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_bwd_accum_adds_into_float32(dtype, d, causal, s_q, s_k):
    """bwd_accum (the ring's per-step call) adds the gradients into NaN-free float32 buffers,
    with a caller-supplied delta, leaving rows it does not own untouched."""
    scale = d ** -0.5
    for cfg in tile_configs(d):
        gen = _gen("accum", dtype, d, causal, s_q, s_k, cfg)
        q, k, v, dout = _inputs(s_q, s_k, d, dtype, gen)
        r_out, r_lse, r_dq, r_dk, r_dv = reference_grads(q, k, v, dout, scale, causal, torch.float64)
        _, _, p_dq, p_dk, p_dv = reference_grads(q, k, v, dout, scale, causal, dtype)
        out, lse = _fwd(q, k, v, scale, causal, cfg)
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
        init = [torch.randn(t.shape, device="cuda", generator=gen) for t in (q, k, v)]
        acc = [t.clone() for t in init]
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, scale, causal, delta, *acc, cfg)
        torch.cuda.synchronize()
        for name, a, i0, ref, plain in zip(("dq", "dk", "dv"), acc, init, (r_dq, r_dk, r_dv),
                                           (p_dq, p_dk, p_dv)):
            assert a.dtype == torch.float32
            _check(f"{name}_accum (cfg {cfg})", a - i0, ref, plain, 3.0, dtype)
        # a second call adds again (ring steps accumulate), bit-for-bit the same increment order
        acc2 = [t.clone() for t in acc]
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, scale, causal, delta, *acc2, cfg)
        for name, a1, a2, i0 in zip(("dq", "dk", "dv"), acc, acc2, init):
            torch.testing.assert_close(a2 - a1, a1 - i0, rtol=1e-3, atol=1e-3, msg=f"{name}: 2nd add")


@pytest.mark.parametrize("cfg", TILE_CONFIGS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeated_calls_are_bitwise_identical(causal, cfg):
    """No atomics: the same inputs give the same bits, call after call."""
    for dtype, d in ((torch.bfloat16, 128), (torch.float16, 64)):
        q, k, v, dout = _inputs(777, 1531, d, dtype, _gen("det", causal, cfg, d))
        scale = d ** -0.5
        out1, lse1 = _fwd(q, k, v, scale, causal, cfg)
        g1 = _bwd(dout, q, k, v, out1, lse1, scale, causal, cfg)
        for _ in range(2):
            out2, lse2 = _fwd(q, k, v, scale, causal, cfg)
            g2 = _bwd(dout, q, k, v, out2, lse2, scale, causal, cfg)
            assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
            for a, b in zip(g1, g2):
                assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", TILE_CONFIGS)
def test_strides_do_not_change_the_result(cfg):
    """The kernels read through strides: a strided view gives bitwise the same result as its
    contiguous copy."""
    for causal in (False, True):
        q, k, v, dout = _inputs(333, 517, 128, torch.bfloat16, _gen("strides", cfg, causal), strided=True)
        dense = [t.contiguous() for t in (q, k, v, dout)]
        scale = 128 ** -0.5
        out_s, lse_s = _fwd(q, k, v, scale, causal, cfg)
        out_d, lse_d = _fwd(*dense[:3], scale, causal, cfg)
        assert torch.equal(out_s, out_d) and torch.equal(lse_s, lse_d)
        g_s = _bwd(dout, q, k, v, out_s, lse_s, scale, causal, cfg)
        g_d = _bwd(dense[3], *dense[:3], out_d, lse_d, scale, causal, cfg)
        for a, b in zip(g_s, g_d):
            assert torch.equal(a, b)


def _dense(t):
    """A copy with the standard strides of its shape (.contiguous() keeps the strides of size-1
    dimensions, which torch ignores when it judges contiguity)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


@pytest.mark.parametrize("cfg", TILE_CONFIGS)
def test_size_one_dims_with_odd_strides_are_accepted(cfg):
    """Views whose size-1 dimensions have odd strides (a one-sequence batch sliced out of a
    buffer, one kv head, a one-token decoding step) pass the alignment check, since the
    kernels never use those strides, and give bitwise the result of dense copies."""
    d, dtype, scale = 128, torch.bfloat16, 128 ** -0.5
    gen = _gen("size1", cfg)
    buf = _randn((1 << 22,), dtype, gen)
    cases = [  # (q shape, q strides, kv shape, kv strides): odd strides only where the size is 1
        ((1, 300, 4, d), (3, 4 * d, d, 1), (1, 257, 1, d), (5, d, 7, 1)),
        ((2, 1, 4, d), (4 * d * 8, 3, d, 1), (2, 190, 1, d), (190 * d, d, 1, 1)),
        ((1, 65, 1, d), (11, d, 9, 1), (1, 1, 1, d), (1, 3, 5, 1)),
    ]
    for q_shape, q_strides, kv_shape, kv_strides in cases:
        q = buf.as_strided(q_shape, q_strides, 0)
        k = buf.as_strided(kv_shape, kv_strides, 1 << 20)
        v = buf.as_strided(kv_shape, kv_strides, 2 << 20)
        dout = buf.as_strided(q_shape, q_strides, 3 << 20)
        dense = [_dense(t) for t in (q, k, v, dout)]
        for causal in (False, True):
            out, lse = _fwd(q, k, v, scale, causal, cfg)
            out_d, lse_d = _fwd(*dense[:3], scale, causal, cfg)
            assert torch.equal(out, out_d) and torch.equal(lse, lse_d), (q_shape, kv_shape, causal)
            grads = _bwd(dout, q, k, v, out, lse, scale, causal, cfg)
            grads_d = _bwd(dense[3], *dense[:3], out_d, lse_d, scale, causal, cfg)
            for a, b in zip(grads, grads_d):
                assert torch.equal(a, b), (q_shape, kv_shape, causal)


def test_config_2_at_d64_runs_config_0():
    """At d=64 tile config 2 is config 0's 128 x 64 tile: the same kernels, the same bits."""
    q, k, v, dout = _inputs(1000, 777, 64, torch.float16, _gen("cfg2-d64"))
    for causal in (False, True):
        res = [_fwd(q, k, v, 0.125, causal, cfg) for cfg in (0, 2)]
        grads = [_bwd(dout, q, k, v, *res[0], 0.125, causal, cfg) for cfg in (0, 2)]
        for a, b in zip((*res[0], *grads[0]), (*res[1], *grads[1])):
            assert torch.equal(a, b)


def test_unknown_tile_config_is_rejected():
    q, k, v, _ = _inputs(64, 64, 64, torch.bfloat16, _gen("cfg-bad"))
    for cfg in (-1, len(TILE_CONFIGS)):
        with pytest.raises((ValueError, RuntimeError), match="tile_config"):
            _fwd(q, k, v, 0.125, False, cfg)


def test_blockwise_bwd_with_global_lse_adds_up():
    """A ring step calls bwd_accum on one kv block with the GLOBAL out/lse/delta: the per-block
    gradients must add up to the full gradient. The accumulators are strided views (slices of
    the full dk/dv buffers), as a ring's travelling buffers can be."""
    d, dtype, scale = 64, torch.bfloat16, 0.125
    q, k, v, dout = _inputs(512, 1000, d, dtype, _gen("ring-block"))
    for cfg in tile_configs(d):
        out, lse = _fwd(q, k, v, scale, False, cfg)
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
        acc = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
        for lo, hi in ((0, 300), (300, 701), (701, 1000)):
            torch.ops.ringseq.bwd_accum(dout, q, k[:, lo:hi], v[:, lo:hi], out, lse, scale, False,
                                        delta, acc[0], acc[1][:, lo:hi], acc[2][:, lo:hi], cfg)
        r = reference_grads(q, k, v, dout, scale, False, torch.float64)
        p = reference_grads(q, k, v, dout, scale, False, dtype)
        for name, got, ref, plain in zip(("dq", "dk", "dv"), acc, r[2:], p[2:]):
            _check(f"{name} (blockwise, cfg {cfg})", got, ref, plain, 3.0, dtype)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_schedule_on_one_gpu(layout, causal):
    """The ring's forward/backward loops over simulated ranks, run through the CUDA kernel."""
    import ringseq

    if not hasattr(ringseq, "simulate_ring"):
        pytest.skip("ringseq.simulate_ring is not available")
    d, dtype, world = 128, torch.bfloat16, 4
    q, k, v, dout = _inputs(1024, 1024, d, dtype, _gen("ring", layout, causal))
    res = ringseq.simulate_ring(q, k, v, layout=layout, world_size=world, causal=causal,
                                backend="ringseq", dout=dout)
    out, lse, dq, dk, dv = res
    r = reference_grads(q, k, v, dout, None, causal, torch.float64)
    p = reference_grads(q, k, v, dout, None, causal, dtype)
    _check("ring out", out, r[0], p[0], 2.0, dtype)
    _check("ring lse", lse, r[1], p[1], 2.0, dtype)
    for name, got, ref, plain in zip(("dq", "dk", "dv"), (dq, dk, dv), r[2:], p[2:]):
        _check(f"ring {name}", got, ref, plain, 3.0, dtype)


def test_ring_flash_attn_func_without_group_on_cuda():
    import ringseq

    if not hasattr(ringseq, "ring_flash_attn_func"):
        pytest.skip("ringseq.ring_flash_attn_func is not available")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a default process group exists")
    d, dtype = 64, torch.float16
    q, k, v, dout = _inputs(700, 700, d, dtype, _gen("ring-func"))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = ringseq.ring_flash_attn_func(qg, kg, vg, causal=True, backend="ringseq")
    out.backward(dout)
    r = reference_grads(q, k, v, dout, None, True, torch.float64)
    p = reference_grads(q, k, v, dout, None, True, dtype)
    _check("out", out.detach(), r[0], p[0], 2.0, dtype)
    for name, got, ref, plain in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), r[2:], p[2:]):
        _check(name, got, ref, plain, 3.0, dtype)


def test_unsupported_inputs_raise_value_error():
    gen = _gen("unsupported")
    q32, k32, v32 = (torch.randn((1, 16, 2, 64), device="cuda", generator=gen) for _ in range(3))
    with pytest.raises(ValueError) as info:
        torch.ops.ringseq.fwd(q32, k32, v32, 0.125, False, 0)
    msg = str(info.value).lower()
    assert "bfloat16" in msg and "float16" in msg, f"message should name the supported dtypes: {msg}"

    q96, k96, v96 = (torch.randn((1, 16, 2, 96), device="cuda", generator=gen).half() for _ in range(3))
    with pytest.raises(ValueError) as info:
        torch.ops.ringseq.fwd(q96, k96, v96, 96 ** -0.5, False, 0)
    msg = str(info.value)
    assert "64" in msg and "128" in msg, f"message should name the supported head dims: {msg}"
    dout96 = torch.randn_like(q96)
    lse = torch.zeros((1, 2, 16), device="cuda")
    with pytest.raises(ValueError):
        torch.ops.ringseq.bwd(dout96, q96, k96, v96, q96, lse, 96 ** -0.5, False, None, 0)


# ---------------------------------------------------------------- spans, bands, soft-cap
def _span_cases():
    """(name, s_q, s_k, spans or None, causal, softcap); spans as 6-tuples (ringseq.kernels.spans)."""
    from ringseq.kernels import UNBOUNDED as U, document_spans, window_band

    def win(s_q, s_k, left, right, causal):
        return [(0, s_q, 0, s_k, *window_band(s_q, s_k, (left, right), causal))]

    docs = [0, 1, 3, 20, 275, 700, 1100]
    return [
        ("window256", 1000, 1000, win(1000, 1000, 256, 0, True), False, 0.0),
        ("window17-br", 333, 1000, win(333, 1000, 17, 0, True), False, 0.0),
        ("window-2sided", 1000, 517, win(1000, 517, 100, 37, False), False, 0.0),
        ("band-empty-rows", 600, 300, [(0, 600, 0, 300, 100, 140)], False, 0.0),
        ("docs", 1100, 1100, [tuple(s) for s in document_spans(docs, docs, True)], False, 0.0),
        ("pieces", 900, 1000, [(0, 200, 50, 300, -U, 50), (300, 450, 400, 500, -100, 20)], False, 0.0),
        ("softcap5-dense", 1000, 1000, None, True, 5.0),
        ("softcap50-window", 1000, 1000, win(1000, 1000, 256, 0, True), False, 50.0),
        ("softcap5-docs", 1100, 1100, [tuple(s) for s in document_spans(docs, docs, True)], False, 5.0),
    ]


SPAN_CASES = _span_cases()


@pytest.mark.parametrize("case", SPAN_CASES, ids=[c[0] for c in SPAN_CASES])
@pytest.mark.parametrize("d", HEADDIMS, ids=[f"d{d}" for d in HEADDIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spans_bands_softcap_match_float64_reference(dtype, d, case):
    """Windows (bottom-right), shifted bands with empty rows, packed documents, ring pieces
    that leave rows uncovered, soft-cap 5 and 50: every tile configuration against float64."""
    name, s_q, s_k, spans, causal, softcap = case
    scale = 0.5 if softcap == 5.0 else d ** -0.5  # cap 5 then changes P a lot
    spans_t = None if spans is None else torch.tensor(spans, dtype=torch.int64)
    covered_q = torch.zeros(s_q, dtype=torch.bool, device="cuda")
    covered_k = torch.zeros(s_k, dtype=torch.bool, device="cuda")
    for qs, ql, ks, kl, _, _ in (spans or [(0, s_q, 0, s_k, 0, 0)]):
        covered_q[qs:qs + ql] = True
        covered_k[ks:ks + kl] = True
    for cfg in tile_configs(d):
        q, k, v, dout = _inputs(s_q, s_k, d, dtype, _gen("spans", name, dtype, d, cfg), strided=cfg == 1)
        kw = dict(spans=spans, softcap=softcap)
        r_out, r_lse, r_dq, r_dk, r_dv = reference_grads(q, k, v, dout, scale, causal, torch.float64, **kw)
        p_out, p_lse, p_dq, p_dk, p_dv = reference_grads(q, k, v, dout, scale, causal, dtype, **kw)
        b, _, h, _ = q.shape
        _poison(((b, s_q, h, d), dtype), ((b, h, s_q), torch.float32))
        out, lse = torch.ops.ringseq.fwd(q, k, v, scale, causal, cfg, spans_t, softcap)
        torch.cuda.synchronize()
        _check(f"{name} out (cfg {cfg})", out, r_out, p_out, 2.0, dtype)
        _check(f"{name} lse (cfg {cfg})", lse, r_lse, p_lse, 2.0, dtype)
        assert (out[:, ~covered_q] == 0).all() and torch.isneginf(lse[:, :, ~covered_q]).all()
        _poison((q.shape, dtype), (k.shape, dtype), (v.shape, dtype))
        dq, dk, dv = torch.ops.ringseq.bwd(dout, q, k, v, out, lse, scale, causal, None, cfg, spans_t, softcap)
        torch.cuda.synchronize()
        _check(f"{name} dq (cfg {cfg})", dq, r_dq, p_dq, 3.0, dtype)
        _check(f"{name} dk (cfg {cfg})", dk, r_dk, p_dk, 3.0, dtype)
        _check(f"{name} dv (cfg {cfg})", dv, r_dv, p_dv, 3.0, dtype)
        assert (dq[:, ~covered_q] == 0).all() and (dk[:, ~covered_k] == 0).all() and (dv[:, ~covered_k] == 0).all()


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_bwd_accum_with_spans_leaves_uncovered_rows(softcap):
    """bwd_accum with spans adds into the covered rows only (ring steps of documents)."""
    from ringseq.kernels import UNBOUNDED as U

    spans = torch.tensor([(0, 200, 50, 300, -U, 50), (300, 450, 400, 500, -100, 20)], dtype=torch.int64)
    q, k, v, dout = _inputs(900, 1000, 128, torch.bfloat16, _gen("accum-spans", softcap))
    rows = [tuple(r) for r in spans.tolist()]
    r_out, r_lse, r_dq, r_dk, r_dv = reference_grads(q, k, v, dout, 0.5, False, torch.float64, spans=rows,
                                                     softcap=softcap)
    _, _, p_dq, p_dk, p_dv = reference_grads(q, k, v, dout, 0.5, False, torch.bfloat16, spans=rows,
                                             softcap=softcap)
    out, lse = torch.ops.ringseq.fwd(q, k, v, 0.5, False, 0, spans, softcap)
    gen = _gen("accum-spans-init", softcap)
    init = [torch.randn(t.shape, device="cuda", generator=gen) for t in (q, k, v)]
    acc = [t.clone() for t in init]
    torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, 0.5, False, None, *acc, 0, spans, softcap)
    torch.cuda.synchronize()
    for name, a, i0, ref, plain in zip(("dq", "dk", "dv"), acc, init, (r_dq, r_dk, r_dv), (p_dq, p_dk, p_dv)):
        _check(f"{name}_accum", a - i0, ref, plain, 3.0, torch.bfloat16)
    assert torch.equal(acc[0][:, 200:300], init[0][:, 200:300]) and torch.equal(acc[0][:, 750:], init[0][:, 750:])
    assert torch.equal(acc[1][:, :50], init[1][:, :50]) and torch.equal(acc[2][:, 900:], init[2][:, 900:])
