"""The flash-attn package as a peer backend (optional: only when it is installed).

Only its public API is used: ``flash_attn_func(..., return_attn_probs=True)`` returns the
log-sum-exp. That API cannot take a ring's merged out/lse in its backward, so this backend
serves single-device attention and benchmarks; the ring refuses it for training.
"""
from __future__ import annotations

import torch

from .base import AttentionBackend


def flash_attn_module():
    """The imported flash_attn package, or None when it is not installed."""
    try:
        import flash_attn
    except Exception:  # ImportError, or a broken build whose import raises
        return None
    return flash_attn


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_delta = False
    supports_global_backward = False

    def unsupported_reason(self, device, dtype, headdim):
        if flash_attn_module() is None:
            return "the flash-attn package is not installed (pip install flash-attn)"
        if device.type != "cuda":
            return f"flash-attn runs on CUDA tensors only, got {device}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn supports float16 and bfloat16, got {dtype}"
        return None

    def _fwd(self, q, k, v, scale, causal):
        fa = flash_attn_module()
        out, lse, _ = fa.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale,
                                         causal=causal, return_attn_probs=True)
        # flash-attn gives a row without keys lse +inf; the contract (and the ring's merge)
        # has -inf: the log of an empty sum
        return out, lse.masked_fill(torch.isposinf(lse), float("-inf"))

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta):
        # The public API has no backward entry point: recompute the forward under autograd.
        # This is exact only for this call's own out/lse (see supports_global_backward).
        fa = flash_attn_module()
        with torch.enable_grad():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            o = fa.flash_attn_func(qg, kg, vg, dropout_p=0.0, softmax_scale=scale, causal=causal)
            dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), dout)
        return dq, dk, dv
