"""One autograd path for single-device attention over every backend.

``attention(q, k, v, scale, causal, backend)`` is the custom operator ``ringseq::attention``
(forward ``(out, lse)``) whose backward is the custom operator ``ringseq::attention_backward``;
both take the backend by its registry key (a string), so ``torch.compile`` sees two opaque
ops with fake implementations whatever the backend (ours, SDPA, the reference, flash-attn).
The gradient rule lives in :func:`attention_backward` alone; the extension's raw operator
``ringseq::fwd`` uses it too for callers of ``torch.ops.ringseq.fwd``.
"""
from __future__ import annotations

import itertools
import weakref
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .base import AttentionBackend, compute_delta
from .checks import accum_dtype

__all__ = ["attention", "attention_backward", "backend_key"]


def _fake_checks(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Shape relations every op's fake (meta) implementation insists on, so a traced graph
    fails at trace time on inputs the kernel would refuse (same rules as checks.check_qkv)."""
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "q, k, v must be 4-dim (batch, seqlen, nheads, headdim)")
    torch._check(k.shape == v.shape, lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    torch._check(q.shape[0] == k.shape[0], lambda: "q and k/v must have the same batch size")
    torch._check(q.shape[3] == k.shape[3], lambda: "q and k/v must have the same head dim")
    torch._check(k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0,
                 lambda: "nheads must be divisible by nheads_kv")
    torch._check(q.dtype == k.dtype == v.dtype, lambda: "q, k and v must have the same dtype")


def fake_attention_outputs(q: Tensor) -> Tuple[Tensor, Tensor]:
    """(out like q, contiguous; lse (b, h, s_q) in the accumulation dtype)."""
    b, s_q, h, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((b, h, s_q), dtype=accum_dtype(q.dtype))


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
        delta = compute_delta(grad_out, out, grad_lse)
    grads = be.bwd(grad_out, q, k, v, out, lse, softmax_scale, causal, delta, spans=spans,
                   softcap=softcap)
    return tuple(g if need else None for g, need in zip(grads, needs))


# ------------------------------------------------------------------ backends by key
# Weak: a backend made for one call (e.g. the double ring's) dies with it; the autograd
# graph keeps the ones its backward needs alive (ctx.keep).
_BY_KEY: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count()


def backend_key(be: AttentionBackend) -> str:
    """The string that names ``be`` in the custom ops (registered on first use; the built-in
    backends at creation, so that torch.compile only reads an attribute)."""
    key = be.__dict__.get("_registry_key")
    if key is None:
        key = f"{be.name}#{next(_NEXT_KEY)}"
        _BY_KEY[key] = be
        be._registry_key = key
    return key


def _backend(key: str) -> AttentionBackend:
    return _BY_KEY[key]


@torch.library.custom_op("ringseq::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
                  backend: str, spans: Optional[Tensor] = None,
                  softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
    out, lse = _backend(backend).fwd(q, k, v, softmax_scale, causal, spans=spans, softcap=softcap)
    # Outputs must be fresh tensors with the fake's layout (torch.compile trusts the fake).
    return out.contiguous(), lse.contiguous()


@_attention_op.register_fake
def _(q, k, v, softmax_scale, causal, backend, spans=None, softcap=0.0):
    _fake_checks(q, k, v)
    torch._check(softcap >= 0.0, lambda: f"softcap must be >= 0 (0 = off), got {softcap}")
    torch._check(spans is None or not causal, lambda: "spans and causal=True cannot be combined")
    return fake_attention_outputs(q)


@torch.library.custom_op("ringseq::attention_backward", mutates_args=())
def _attention_backward_op(grad_out: Optional[Tensor], grad_lse: Optional[Tensor], q: Tensor,
                           k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           softmax_scale: float, causal: bool, backend: str,
                           needs: List[bool], spans: Optional[Tensor] = None,
                           softcap: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    grads = attention_backward(_backend(backend), q, k, v, out, lse, softmax_scale, causal,
                               grad_out, grad_lse, needs, spans=spans, softcap=softcap)
    # Custom ops return tensors: zero-size placeholders stand for the gradients not asked for.
    return tuple(g.contiguous() if g is not None else t.new_empty(0)
                 for g, t in zip(grads, (q, k, v)))


@_attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, softmax_scale, causal, backend, needs, spans=None,
      softcap=0.0):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if need
                 else t.new_empty(0) for t, need in zip((q, k, v), needs))


def _no_double_backward(ctx, *grads):
    raise RuntimeError("ringseq: differentiating attention twice (create_graph=True, e.g. a "
                       "gradient penalty) is not supported: its backward is not differentiable")


_attention_backward_op.register_autograd(_no_double_backward)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, backend, spans, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.spans = spans  # an int64 CPU tensor without gradient, or None
    ctx.args = (softmax_scale, causal, backend, softcap)
    # An output nobody used then arrives as None, not zeros: no delta to compute (or refuse)
    # for an lse that carries no gradient.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3])
    if not any(needs):
        return None, None, None, None, None, None, None, None
    softmax_scale, causal, backend, softcap = ctx.args
    dq, dk, dv = _attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, softmax_scale,
                                        causal, backend, needs, ctx.spans, softcap)
    ctx.keep = _BY_KEY.get(backend)
    return ((dq if needs[0] else None), (dk if needs[1] else None), (dv if needs[2] else None),
            None, None, None, None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
              be: AttentionBackend, *, spans=None, softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
    """Differentiable ``(out, lse)`` of ``be`` on validated inputs (see ringseq.flash_attn_func).

    ``spans`` (None, an int64 (n, 6) CPU tensor or a list of 6-tuples) and ``softcap``:
    ringseq.kernels.spans; checked here, before any work."""
    spans, softcap = be.prepare_spans(q, k, causal, spans, softcap)
    return _attention_op(q, k, v, float(softmax_scale), bool(causal), backend_key(be), spans, softcap)
