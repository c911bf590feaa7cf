"""Single-device attention with log-sum-exp: the Python face of the kernels.

``flash_attn_func`` takes flash-attn's (batch, seqlen, nheads, headdim) layout and runs on any
backend of ``ringseq.kernels``; ``get_backend`` resolves the name the ring uses.
"""
from __future__ import annotations

import torch

from .kernels import (AttentionBackend, available_backends, check_qkv, compute_delta,
                      default_scale, get_backend)


class _BackendAttention(torch.autograd.Function):
    """Autograd for the Python backends (the extension's op has its own, registered with
    torch.library.register_autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, backend):
        out, lse = backend.fwd(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.backend = softmax_scale, causal, backend
        # Unused outputs then arrive as None: no zero-filled lse gradient to test on the host.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        backend = ctx.backend
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
        delta = None
        if grad_lse is not None:
            if not backend.supports_delta:
                raise RuntimeError(f"backend {backend.name!r} cannot backpropagate through lse; "
                                   f"use backend='ringseq' or 'reference'")
            delta = compute_delta(grad_out, out, grad_lse)
        dq, dk, dv = backend.bwd(grad_out, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                 delta)
        return dq, dk, dv, None, None, None


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, backend=None):
    """Exact attention of q against k, v with an optional log-sum-exp output.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
            ``nheads % nheads_kv == 0`` (GQA/MQA without expanding K/V). Only the last
            dimension must be contiguous. float32, float64, bfloat16 or float16 (CUDA kernel:
            float16/bfloat16 with head dim 64 or 128; use backend="sdpa" otherwise).
        softmax_scale: defaults to ``headdim ** -0.5``.
        causal: bottom-right aligned mask: key j is visible to query i iff
            ``j <= i + seqlen_k - seqlen_q``. Rows that see no key give 0 and lse = -inf.
        return_lse: also return lse (batch, nheads, seqlen_q), float32 (float64 for float64
            inputs), natural log; gradients may flow through it.
        backend: None (ringseq's kernels where they support the inputs), "ringseq", "sdpa",
            "reference", "flash_attn", or an AttentionBackend instance.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype, and lse when ``return_lse``.

    Raises:
        ValueError: inputs that do not fit together or that the chosen backend cannot run (the
            message names the argument, what was given and what is expected).
        ValueError: also when backend "ringseq" is requested but the extension is not built.
    """
    check_qkv(q, k, v)
    if softmax_scale is None:
        softmax_scale = default_scale(q.shape[-1])
    chosen = get_backend(backend, q.device, q.dtype, q.shape[-1])
    if chosen.name == "ringseq" and q.numel() and k.shape[1]:
        out, lse = torch.ops.ringseq.fwd(q, k, v, float(softmax_scale), bool(causal),
                                         chosen.tile_config)
    else:  # Python backends, and empty inputs (kept in the autograd graph)
        out, lse = _BackendAttention.apply(q, k, v, float(softmax_scale), bool(causal), chosen)
    return (out, lse) if return_lse else out


__all__ = ["AttentionBackend", "available_backends", "flash_attn_func", "get_backend"]
