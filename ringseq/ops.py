"""Single-device attention with log-sum-exp: the Python face of the kernels.

``flash_attn_func`` takes flash-attn's (batch, seqlen, nheads, headdim) layout and runs on any
backend of ``ringseq.kernels`` through one differentiable custom operator
(``ringseq.kernels.autograd``); ``get_backend`` resolves the name the ring uses.
"""
from __future__ import annotations

import torch

from .kernels import AttentionBackend, available_backends, check_qkv, get_backend, resolve_scale
from .kernels.autograd import attention


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
    be = get_backend(backend, q.device, q.dtype, q.shape[-1])
    out, lse = attention(q, k, v, resolve_scale(softmax_scale, q.shape[-1]), causal, be)
    return (out, lse) if return_lse else out


__all__ = ["AttentionBackend", "available_backends", "flash_attn_func", "get_backend"]
