"""Ring attention as one opaque custom operator, so ``torch.compile(fullgraph=True)`` traces a
model that uses it without looking inside the ring.

``ringseq::ring_attention(q, k, v, ...) -> (out, lse)`` builds the plan and runs the engine's
forward loop; its registered backward is ``ringseq::ring_attention_backward``. Objects that
cannot be operator arguments (the layout, the process group, the backend) travel as registry
keys: a registered layout or backend by name, the default process group as ``"default"``, any
other object (a process group, a user's Layout, or a user's own :class:`ringseq.Transport`
passed as ``group=``) by a key that names it in a process-local registry. Communication, checks and the
control collectives all happen inside the operator, at run time: the traced graph holds none of
them, and the fake implementation only computes output shapes.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor

from .comm import Transport, get_comm
from .kernels.autograd import _backend, backend_key
from .kernels.checks import accum_dtype
from .layouts import LAYOUTS, Layout
from .plan import make_plan, resolve_grad_comm_dtype
from .ring import _ring_backward, _ring_forward

__all__ = ["ring_attention_op"]

_OBJECTS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _key(obj, prefix: str) -> str:
    key = f"{prefix}#{id(obj)}"
    _OBJECTS[key] = obj
    return key


def _layout_key(lay: Layout) -> str:
    return lay.name if LAYOUTS.get(lay.name) is lay else _key(lay, f"layout:{lay.name}")


def _group_key(group) -> str:
    return "default" if group is None else _key(group, "group")


def _lookup(key: str, what: str):
    obj = _OBJECTS.get(key)
    if obj is None:
        raise RuntimeError(f"ringseq: the {what} of this ring call no longer exists ({key}); "
                           f"keep it alive until the backward has run")
    return obj


def _resolve_layout(key: str) -> Layout:
    return LAYOUTS[key] if key in LAYOUTS else _lookup(key, "layout")


def _resolve_group(key: str):
    return None if key == "default" else _lookup(key, "process group")


def _gdt_key(grad_comm_dtype) -> str:
    if grad_comm_dtype is None or grad_comm_dtype == "input":
        return grad_comm_dtype or ""
    # A floating dtype passes, anything else raises the plan's own error, here.
    dt = resolve_grad_comm_dtype(grad_comm_dtype, torch.float32, torch.float32)
    return "dtype:" + str(dt).replace("torch.", "")


def _resolve_gdt(key: str):
    if key.startswith("dtype:"):
        return getattr(torch, key[len("dtype:"):])
    return key or None


def _plan(q, k, v, softmax_scale, causal, layout, group, backend, grad_comm_dtype, needs_grad,
          window_left, window_right, softcap, cu_seqlens):
    g = _resolve_group(group)
    return make_plan(q, k, v, transport=g if isinstance(g, Transport) else get_comm(g),
                     softmax_scale=softmax_scale, causal=causal,
                     layout=_resolve_layout(layout), backend=_backend(backend),
                     grad_comm_dtype=_resolve_gdt(grad_comm_dtype), needs_grad=needs_grad,
                     window_size=(window_left, window_right), softcap=softcap,
                     cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist())


@torch.library.custom_op("ringseq::ring_attention", mutates_args=())
def _ring_op(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool,
             layout: str,
             group: str, backend: str, grad_comm_dtype: str, needs_grad: bool,
             window_left: int, window_right: int, softcap: float,
             cu_seqlens: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    plan = _plan(q, k, v, softmax_scale, causal, layout, group, backend, grad_comm_dtype,
                 needs_grad, window_left, window_right, softcap, cu_seqlens)
    with torch.autocast(q.device.type, enabled=False):
        out_acc, lse = _ring_forward(q, k, v, plan)
    return out_acc.to(q.dtype), lse


@_ring_op.register_fake
def _(q, k, v, softmax_scale, causal, layout, group, backend, grad_comm_dtype, needs_grad,
      window_left, window_right, softcap, cu_seqlens):
    b, s, h, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, s), dtype=accum_dtype(q.dtype)))


@torch.library.custom_op("ringseq::ring_attention_backward", mutates_args=())
def _ring_backward_op(dout: Optional[Tensor], grad_lse: Optional[Tensor], q: Tensor, k: Tensor,
                      v: Tensor, out: Tensor, lse: Tensor, softmax_scale: Optional[float],
                      causal: bool,
                      layout: str, group: str, backend: str, grad_comm_dtype: str,
                      window_left: int, window_right: int, softcap: float,
                      cu_seqlens: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    plan = _plan(q, k, v, softmax_scale, causal, layout, group, backend, grad_comm_dtype, True,
                 window_left, window_right, softcap, cu_seqlens)
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()
    if grad_lse is not None:
        plan.backend.require_lse_grad()
    # A backward run under the caller's autocast must not lower the kernels' accumulation.
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, plan, grad_lse)
    return dq, dk, dv


@_ring_backward_op.register_fake
def _(dout, grad_lse, q, k, v, out, lse, softmax_scale, causal, layout, group, backend,
      grad_comm_dtype, window_left, window_right, softcap, cu_seqlens):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _no_double_backward(ctx, *grads):
    raise RuntimeError("ringseq: differentiating ring attention twice (create_graph=True, e.g. a "
                       "gradient penalty) is not supported: the backward is not differentiable")


_ring_backward_op.register_autograd(_no_double_backward)


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, layout, group, backend, grad_comm_dtype, _,
     window_left, window_right, softcap, cu_seqlens) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (softmax_scale, causal, layout, group, backend, grad_comm_dtype, window_left,
                window_right, softcap, cu_seqlens)
    # The registry holds objects weakly; the graph keeps them alive until its backward.
    ctx.keep = (tuple(_OBJECTS.get(key) for key in (layout, group)), _backend(backend))
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, grad_lse):
    # Every rank of the ring must run the backward loop, even one whose inputs need no
    # gradient (the signature's requires_grad made all ranks agree that one follows).
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_backward_op(dout, grad_lse, q, k, v, out, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * 11


_ring_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention_op(q, k, v, *, softmax_scale, causal, layout: Layout, group, backend,
                      grad_comm_dtype, window_size=(-1, -1), softcap=0.0,
                      cu_seqlens=None) -> Tuple[Tensor, Tensor]:
    """(out, lse) of ring attention on this rank's shards (see ringseq.ring_flash_attn_func),
    through the ``ringseq::ring_attention`` operator. ``backend`` is an AttentionBackend."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    scale = None if softmax_scale is None else float(softmax_scale)
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64, device="cpu")
    return _ring_op(q, k, v, scale, bool(causal), _layout_key(layout), _group_key(group),
                    backend_key(backend), _gdt_key(grad_comm_dtype), needs_grad,
                    int(window_size[0]), int(window_size[1]), float(softcap), cu_seqlens)
