"""CPU kernel float32 accuracy on positive inputs (issue 17, item 4).

``torch.rand`` inputs make every score positive and every output a long average of positive
values, where a long float32 accumulation chain shows: before the kernels' reductions were cut
into partial sums of 32 terms (csrc/cpu/gemm.h, kChunk), b=1, h=1, s=256, d=32, causal gave
out 2.3x and dq 3.6x the error of plain float32 attention against float64 (docs/design.md's
rule: out <= 2x, gradients <= 3x). The rule is checked here as a pure ratio (no floor), for the
reported case and wider ones, at every ISA level this CPU runs.
"""
from __future__ import annotations

import pytest
import torch

import ringseq
from ringseq.kernels import extension_available

from utils import max_err, reference_grads

pytestmark = pytest.mark.skipif(not extension_available(), reason="ringseq._C is not built")

BOUND = {"out": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}


def _worst_ratios(s, d, h, causal, seeds):
    worst = dict.fromkeys(BOUND, 0.0)
    for seed in seeds:
        torch.manual_seed(seed)
        q, k, v = (torch.rand(1, s, h, d) for _ in range(3))
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = ringseq.flash_attn_func(qs, ks, vs, causal=causal, backend="ringseq")
        out.sum().backward()
        dout = torch.ones_like(out)
        ref = reference_grads(q, k, v, dout, causal=causal)                       # float64
        plain = reference_grads(q, k, v, dout, causal=causal, dtype=torch.float32)
        for name, got, j in (("out", out, 0), ("dq", qs.grad, 2), ("dk", ks.grad, 3),
                             ("dv", vs.grad, 4)):
            worst[name] = max(worst[name], max_err(got, ref[j]) / max_err(plain[j], ref[j]))
    return worst


@pytest.mark.parametrize("s, d, h, causal, seeds", [
    (256, 32, 1, True, range(8)),     # the reported case
    (256, 32, 1, False, range(4)),
    (1000, 64, 2, True, range(2)),    # several key tiles: the online-softmax rescales too
    (517, 128, 1, True, range(2)),
])
def test_fp32_error_within_design_rule_on_rand_inputs(isa, s, d, h, causal, seeds):
    worst = _worst_ratios(s, d, h, causal, seeds)
    over = {n: round(r, 2) for n, r in worst.items() if r > BOUND[n]}
    assert not over, (f"{isa}: error / plain-fp32 error above the rule (out 2x, grads 3x) "
                      f"over seeds {list(seeds)}: {over}; all: "
                      f"{ {n: round(r, 2) for n, r in worst.items()} }")
