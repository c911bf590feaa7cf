"""The gradient rule of single-device attention, and the shape rules of fake implementations.

:func:`attention_backward` is the one place that turns a call's saved tensors and upstream
gradients into ``(dq, dk, dv)``: the engine's local attention (``ringseq.engine.op``) and the
extension's raw operator ``ringseq::fwd`` (for callers of ``torch.ops.ringseq.fwd``) use it.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .base import AttentionBackend
from .checks import accum_dtype

__all__ = ["attention_backward", "fake_attention_outputs", "fake_checks", "lse_grad_for"]


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fake_checks(op: str, q: Tensor, k: Tensor, v: Tensor, tile_config=0) -> None:
    """What every op's fake (meta) implementation insists on, so a traced graph fails at trace
    time on inputs the kernel would refuse (the binding's rules): shapes, a float dtype shared
    by q, k and v, a tile configuration 0..2. Errors name the operator (``ringseq::<op>``) and
    what was given."""
    name = f"ringseq::{op}"
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: f"{name}: q, k, v must be 4-dim (batch, seqlen, nheads, headdim), got "
                         f"{q.dim()}, {k.dim()} and {v.dim()} dims")
    torch._check(k.shape == v.shape,
                 lambda: f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    torch._check(q.shape[0] == k.shape[0],
                 lambda: f"{name}: q and k/v must have the same batch size, got {q.shape[0]} "
                         f"and {k.shape[0]}")
    torch._check(q.shape[3] == k.shape[3],
                 lambda: f"{name}: q and k/v must have the same head dim, got {q.shape[3]} and "
                         f"{k.shape[3]}")
    torch._check(k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0,
                 lambda: f"{name}: nheads must be divisible by nheads_kv, got {q.shape[2]} and "
                         f"{k.shape[2]}")
    torch._check(q.dtype == k.dtype == v.dtype,
                 lambda: f"{name}: q, k and v must have the same dtype, got {q.dtype}, "
                         f"{k.dtype} and {v.dtype}")
    torch._check(q.dtype in _FLOATS,
                 lambda: f"{name}: q, k, v must be float16, bfloat16, float32 or float64, got "
                         f"{q.dtype}")
    torch._check(not isinstance(tile_config, bool) and tile_config in (0, 1, 2),
                 lambda: f"{name}: tile_config must be 0, 1 or 2, got {tile_config!r}")


def fake_attention_outputs(q: Tensor) -> Tuple[Tensor, Tensor]:
    """(out like q, contiguous; lse (b, h, s_q) in the accumulation dtype)."""
    b, s_q, h, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((b, h, s_q), dtype=accum_dtype(q.dtype))


def lse_grad_for(be: AttentionBackend, grad_lse: Optional[Tensor]) -> Optional[Tensor]:
    """The lse gradient a backward of ``be`` takes: ``grad_lse``, or None where ``be`` cannot
    take one and it is all zeros (it then changes no gradient): torch.compile's backward hands
    in zeros for an lse that reached no loss, where eager autograd hands in None (before:
    refused under compile alone). Reads one bool back from the device, only for such
    backends given an lse gradient."""
    if be.supports_delta or grad_lse is None:
        return grad_lse
    return grad_lse if bool(grad_lse.any()) else None


def attention_backward(be: AttentionBackend, q, k, v, out, lse, softmax_scale: float,
                       causal: bool, grad_out: Optional[Tensor], grad_lse: Optional[Tensor],
                       needs: Sequence[bool] = (True, True, True), *, spans=None,
                       softcap: float = 0.0):
    """(dq, dk, dv) of single-device attention, ``None`` for inputs that need no gradient.

    ``grad_out`` / ``grad_lse`` may be None (no gradient reached that output); a gradient
    into lse needs a backend that takes a precomputed delta (RuntimeError otherwise).
    ``spans`` / ``softcap``: those of the forward (ringseq.kernels.spans)."""
    if not any(needs):
        return None, None, None
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    else:
        grad_out = grad_out.contiguous()  # autograd may hand in expanded (stride-0) gradients
    delta = None
    if grad_lse is not None:
        be.require_lse_grad()
        delta = be.delta(grad_out, out, grad_lse)
    grads = be.run_bwd(grad_out, q, k, v, out, lse, softmax_scale, causal, delta, spans=spans,
                       softcap=softcap)
    return tuple(g if need else None for g, need in zip(grads, needs))
