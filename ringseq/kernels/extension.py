"""ringseq's own kernels (``torch.ops.ringseq.*``): loading, fake impls, autograd, backend.

Operators (csrc/ops.cpp):
  fwd(q, k, v, softmax_scale, causal, tile_config=0) -> (out, lse)
  fwd_accum(q, k, v, softmax_scale, causal, out_acc!, lse_acc!, tile_config=0) -> ()   (CPU)
  bwd(dout, q, k, v, out, lse, softmax_scale, causal, delta=None, tile_config=0) -> (dq, dk, dv)
  bwd_accum(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum!, dk_accum!,
            dv_accum!, tile_config=0) -> ()
"""
from __future__ import annotations

import torch

from .autograd import _fake_checks, attention_backward, backend_key, fake_attention_outputs
from .base import AttentionBackend

_IMPORT_ERROR: Exception | None = None
try:
    from .. import _C  # noqa: F401  (registers torch.ops.ringseq.*)
except ImportError as exc:  # not built: the Python backends still work
    _C = None
    _IMPORT_ERROR = exc


def extension_available() -> bool:
    return _C is not None


def extension_has_cuda() -> bool:
    return _C is not None and bool(getattr(_C, "WITH_CUDA", False))


if _C is not None:

    @torch.library.register_fake("ringseq::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal, tile_config=0):
        _fake_checks(q, k, v)
        return fake_attention_outputs(q)

    @torch.library.register_fake("ringseq::fwd_accum")
    def _fwd_accum_fake(q, k, v, softmax_scale, causal, out_acc, lse_acc, tile_config=0):
        _fake_checks(q, k, v)
        b, s_q, h, _ = q.shape
        torch._check(out_acc.shape == q.shape, lambda: "out_acc must have the shape of q")
        torch._check(lse_acc.shape == (b, h, s_q), lambda: "lse_acc must be (b, h, s_q)")
        return None

    def _check_grad_inputs(dout, q, k, v, out, lse):
        _fake_checks(q, k, v)
        b, s_q, h, _ = q.shape
        torch._check(dout.shape == q.shape and out.shape == q.shape,
                     lambda: "dout and out must have the shape of q")
        torch._check(lse.shape == (b, h, s_q), lambda: "lse must be (b, h, s_q)")

    @torch.library.register_fake("ringseq::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, delta=None, tile_config=0):
        _check_grad_inputs(dout, q, k, v, out, lse)
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    @torch.library.register_fake("ringseq::bwd_accum")
    def _bwd_accum_fake(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum,
                        dk_accum, dv_accum, tile_config=0):
        _check_grad_inputs(dout, q, k, v, out, lse)
        torch._check(dq_accum.shape == q.shape and dk_accum.shape == k.shape
                     and dv_accum.shape == v.shape,
                     lambda: "dq/dk/dv accumulators must have the shapes of q/k/v")
        return None

    def _fwd_setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal, *rest = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal, ExtensionBackend.instance(rest[0] if rest else 0))
        ctx.set_materialize_grads(False)

    def _fwd_backward(ctx, grad_out, grad_lse):
        # The raw operator's gradient (for callers of torch.ops.ringseq.fwd): the same rule
        # as flash_attn_func's, in one place.
        softmax_scale, causal, be = ctx.args
        grads = attention_backward(be, *ctx.saved_tensors, softmax_scale, causal, grad_out,
                                   grad_lse, ctx.needs_input_grad[:3])
        return (*grads, None, None, None)

    torch.library.register_autograd("ringseq::fwd", _fwd_backward, setup_context=_fwd_setup_context)


class ExtensionBackend(AttentionBackend):
    """The C++/CUDA kernels of this package (CPU: every float dtype; CUDA: see README)."""

    name = "ringseq"
    _INSTANCES: dict = {}

    def __init__(self, tile_config: int = 0):
        self.tile_config = int(tile_config)

    @classmethod
    def instance(cls, tile_config: int = 0) -> "ExtensionBackend":
        """The shared instance for ``tile_config`` (backends hold no per-call state)."""
        if tile_config not in cls._INSTANCES:
            inst = cls._INSTANCES[tile_config] = cls(tile_config)
            backend_key(inst)  # registered eagerly: torch.compile may trace the first use
        return cls._INSTANCES[tile_config]

    def unsupported_reason(self, device, dtype, headdim):
        if _C is None:
            return f"ringseq._C is not built ({_IMPORT_ERROR})"
        if device.type == "cuda":
            if not extension_has_cuda():
                return "ringseq was built without CUDA kernels"
            if dtype not in (torch.float16, torch.bfloat16):
                return f"the CUDA kernel supports float16 and bfloat16, got {dtype}"
            if headdim not in (64, 128):
                return f"the CUDA kernel supports head dims 64 and 128, got {headdim}"
        elif device.type != "cpu":
            return f"ringseq kernels run on CPU and CUDA tensors, got {device}"
        return None

    def _fwd(self, q, k, v, scale, causal):
        return torch.ops.ringseq.fwd(q, k, v, scale, causal, self.tile_config)

    def fwd_accum(self, q, k, v, softmax_scale, causal, out_acc, lse_acc) -> None:
        if q.device.type != "cpu":  # the CUDA kernel has no merge mode yet
            return super().fwd_accum(q, k, v, softmax_scale, causal, out_acc, lse_acc)
        self._check(q, k, v)
        torch.ops.ringseq.fwd_accum(q, k, v, float(softmax_scale), bool(causal), out_acc, lse_acc,
                                    self.tile_config)

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta):
        return torch.ops.ringseq.bwd(dout, q, k, v, out, lse, scale, causal, delta, self.tile_config)

    def bwd_accum(self, dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum, dk_accum,
                  dv_accum) -> None:
        self._check(q, k, v)
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, float(softmax_scale), bool(causal),
                                    delta, dq_accum, dk_accum, dv_accum, self.tile_config)
