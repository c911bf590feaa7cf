"""GPU tests of the CUDA split-KV decoding kernels (flash_fwd_split_kernel and its merge):
flash_attn_with_kvcache on CUDA tensors, and plain single-token calls that split.

Marker `cuda`; everything skips without an NVIDIA GPU (run through benchmarks/gpu_check.sh).
Same rules as tests/test_kernel_cuda.py: float64 references, docs/design.md's tolerance,
fresh random inputs, outputs poisoned with NaN before each call (a NaN-filled block of the
output's size is freed into the caching allocator right before, so the kernel's output most
likely lands on it and any element it fails to write stays NaN).
"""
from __future__ import annotations

import pytest
import torch

from test_kvcache import attention_rows, grid_sample, run_flash_case, visible
from utils import assert_close_per_design, scaled_floor

HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]


@pytest.fixture(scope="module", autouse=True)
def cuda_extension():
    import ringseq  # noqa: F401
    from ringseq.kernels.extension import extension_available, extension_has_cuda

    assert extension_available() and extension_has_cuda(), \
        "ringseq._C lacks its CUDA kernels: rebuild with RINGSEQ_CUDA=1"
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the CUDA kernels need compute capability >= 8.0")


def _poison(shape, dtype):
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")  # freed at once: reused next


# flash-attn's grid on the GPU: head dims the kernel runs (64, 128; 59 takes the torch path)
CASES = [c for c in grid_sample(24, seed=2) if c["d"] in (64, 128)]


@pytest.mark.parametrize("case", CASES)
def test_flash_attn_kvcache_grid_on_cuda(case):
    b, s_q, h = 2, case["seqlens"][0], 6
    _poison((b, s_q, h, case["d"]), case["dtype"])
    run_flash_case(case, device="cuda", seed=11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 0, 7, 500])
def test_split_kernel_and_merge_match_float64(dtype, d, num_splits):
    # Single-token GQA decoding, rows of different lengths (one empty), a window and a
    # soft-cap: every split count gives float64's attention within the design tolerance.
    from ringseq import flash_attn_with_kvcache
    gen = torch.Generator(device="cuda").manual_seed(d * 1000 + num_splits)
    b, h, h_kv, cap = 3, 16, 4, 5000
    q = torch.randn(b, 1, h, d, device="cuda", generator=gen).to(dtype)
    kc = torch.randn(b, cap, h_kv, d, device="cuda", generator=gen).to(dtype)
    vc = torch.randn(b, cap, h_kv, d, device="cuda", generator=gen).to(dtype)
    lengths = [0, 4999, 1234]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    for window, softcap in (((-1, -1), 0.0), ((700, 0), 0.0), ((-1, -1), 10.0)):
        _poison((b, 1, h, d), dtype)
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                           window_size=window, softcap=softcap,
                                           num_splits=num_splits, return_softmax_lse=True)
        keys = [kc[i, :n].cpu() for i, n in enumerate(lengths)]
        vals = [vc[i, :n].cpu() for i, n in enumerate(lengths)]
        masks = [visible(1, n, True, window) for n in lengths]
        ref = attention_rows(q.cpu(), keys, vals, masks, d ** -0.5, softcap, torch.float64)
        plain = attention_rows(q.cpu(), keys, vals, masks, d ** -0.5, softcap, dtype)
        floor = scaled_floor(dtype, ref[0])
        assert_close_per_design(out.cpu(), ref[0], plain[0], "out", floor=floor)
        assert_close_per_design(lse.cpu(), ref[1], plain[1].to(lse.dtype), "lse", floor=floor)


def test_rows_with_values_out_of_range_get_nan_not_reads_outside_the_cache():
    # On CUDA the lengths stay on the device (no synchronization to check them): a row whose
    # length exceeds the cache gets NaN, the other rows their attention.
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 1, 8, 64, device="cuda", generator=gen).half()
    kc = torch.randn(2, 100, 2, 64, device="cuda", generator=gen).half()
    vc = torch.randn(2, 100, 2, 64, device="cuda", generator=gen).half()
    seqlens = torch.tensor([50, 1000], dtype=torch.int32, device="cuda")
    out, lse = torch.ops.ringseq.fwd_kvcache(q, kc, vc, seqlens, None, None, 0.125, False)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_single_token_calls_split_and_match_float64(dtype):
    # torch.ops.ringseq.fwd with one query row and a long key sequence runs the GQA rows view
    # and the split kernel (few heads x batch): same attention as float64.
    from utils import reference_grads
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 1, 8, 128, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, 20000, 2, 128, device="cuda", generator=gen).to(dtype)
    v = torch.randn(1, 20000, 2, 128, device="cuda", generator=gen).to(dtype)
    for causal in (False, True):
        _poison(q.shape, dtype)
        out, lse = torch.ops.ringseq.fwd(q, k, v, 128 ** -0.5, causal)
        dout = torch.zeros_like(q)
        ref = reference_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), 128 ** -0.5, causal)
        plain = reference_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), 128 ** -0.5, causal, dtype=dtype)
        floor = scaled_floor(dtype, ref[0])
        assert_close_per_design(out.cpu(), ref[0], plain[0], "out", floor=floor)
        assert_close_per_design(lse.cpu(), ref[1], plain[1].to(lse.dtype), "lse", floor=floor)
