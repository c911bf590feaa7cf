"""CPU kernel float32 accuracy on positive inputs (issue 17, item 4).

On ``torch.rand`` inputs (b=1, h=1, s=256, d=32, causal, loss ``out.sum()``) the CPU kernel's
error against float64 attention exceeds docs/design.md's rule as a pure ratio (out <= 2x, dq,
dk, dv <= 3x the error of plain float32 attention; torch's CPU SDPA is about 1x). Tracked here
as a strict xfail until the CPU kernel work fixes it: when it passes, remove the marker.
"""
from __future__ import annotations

import pytest
import torch

import ringseq
from ringseq.kernels import extension_available

from utils import max_err, reference_grads

SEEDS = range(8)


@pytest.mark.skipif(not extension_available(), reason="ringseq._C is not built")
@pytest.mark.xfail(strict=True, reason="issue 17 item 4: CPU kernel fp32 error on torch.rand "
                                       "inputs is above 3x (dq) / 2x (out) plain fp32 "
                                       "attention's; owned by the CPU kernel work (csrc/cpu/)")
def test_cpu_kernel_fp32_error_ratio_on_rand_inputs():
    worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    for seed in SEEDS:
        torch.manual_seed(seed)
        q, k, v = (torch.rand(1, 256, 1, 32) for _ in range(3))
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = ringseq.flash_attn_func(qs, ks, vs, causal=True, backend="ringseq")
        out.sum().backward()
        dout = torch.ones_like(out)
        ref = reference_grads(q, k, v, dout, causal=True)                       # float64
        plain = reference_grads(q, k, v, dout, causal=True, dtype=torch.float32)
        for name, got, j in (("out", out, 0), ("dq", qs.grad, 2), ("dk", ks.grad, 3),
                             ("dv", vs.grad, 4)):
            worst[name] = max(worst[name], max_err(got, ref[j]) / max_err(plain[j], ref[j]))
    bound = {"out": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
    over = {n: round(r, 2) for n, r in worst.items() if r > bound[n]}
    assert not over, (f"error / plain-fp32 error above the rule (out 2x, grads 3x) over seeds "
                      f"{list(SEEDS)}: {over}; all: { {n: round(r, 2) for n, r in worst.items()} }")
