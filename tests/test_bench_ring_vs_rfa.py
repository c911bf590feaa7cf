"""benchmarks/bench_ring_vs_rfa.py checks both engines against float64 before it times them:
ringseq failing the check fails the run, a peer failing it is marked WRONG (ring-flash-attn
0.1.8's float32 backward doubles dq: its buffer is reused as the result). ring-flash-attn
itself is not installed here; the check is run on ringseq and on a ring whose dq is doubled."""
from __future__ import annotations

import os
import sys

import pytest

from dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _checks(layout):
    import bench_ring_vs_rfa as bench
    import ringseq

    def doubled_dq(q, k, v):
        # the value of q, twice its gradient: what the peer's aliased dq buffer returns
        return ringseq.ring_flash_attn_func(q + (q - q.detach()), k, v, causal=True,
                                            layout=layout, backend="sdpa")

    import torch
    import torch.distributed as dist

    def nan_on_rank_1(q, k, v):  # (gloo's MAX kept or dropped a NaN by the operands' order)
        out = ringseq.ring_flash_attn_func(q, k, v, causal=True, layout=layout, backend="sdpa")
        return out * float("nan") if dist.get_rank() == 1 else out

    return (bench._check(bench._attention_fn("ringseq", layout), layout, 2, 16, torch.float32),
            bench._check(doubled_dq, layout, 2, 16, torch.float32),
            bench._check(nan_on_rank_1, layout, 2, 16, torch.float32))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_check_passes_ringseq_and_catches_a_doubled_gradient(layout):
    import bench_ring_vs_rfa as bench
    for right, doubled, nan in run_ranks(_checks, 2, layout, timeout=120):
        # (before: a NaN error compared False with the bound: "ok", and the run exited 0)
        assert bench._check_text(nan) == "WRONG (out, dq, dk, dv)", nan
        assert all(c["error"] == float("inf") for c in nan.values()), nan
        assert bench._check_text(right) == "ok", right
        assert all(c["excess"] <= 0 for c in right.values()), right
        assert bench._check_text(doubled) == "WRONG (dq)", doubled
        dq = doubled["dq"]
        assert dq["error"] > 1000 * dq["plain_error"], dq  # a wrong result, not a rounding


def test_the_flash_attn_stand_in_takes_what_flash_attn_takes():
    """fp16 / bf16 only, as flash-attn 2 (before: float32 ran, and ring-flash-attn's float32
    backward was reported wrong in a setup no real installation can make)."""
    import importlib.util

    import torch
    path = os.path.join(ROOT, "benchmarks", "peer_shim", "flash_attn", "flash_attn_interface.py")
    spec = importlib.util.spec_from_file_location("stand_in_interface", path)
    stand_in = importlib.util.module_from_spec(spec)  # (not as `flash_attn`: ringseq would
    spec.loader.exec_module(stand_in)                 # take it for the real one)
    _flash_attn_forward = stand_in._flash_attn_forward

    q = torch.randn(1, 16, 2, 8)  # (b, s, h, d)
    with pytest.raises(RuntimeError, match="flash-attn 2 takes fp16 and bf16 inputs only, got "
                                           "torch.float32"):
        _flash_attn_forward(q, q, q, causal=True)
    out, lse, _, _ = _flash_attn_forward(*(q.bfloat16(),) * 3, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(q.transpose(1, 2).double(),) * 3, is_causal=True).transpose(1, 2)
    assert out.dtype == torch.bfloat16 and float((out.double() - ref).abs().max()) < 2e-2
