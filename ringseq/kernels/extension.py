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

from .base import AttentionBackend, compute_delta
from .checks import accum_dtype, default_scale

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


def cpu_isa() -> str | None:
    """The ISA level the CPU kernel runs: "baseline", "avx2" or "avx512" (None when
    ringseq._C is not built). Chosen at the first kernel call from cpuid, or forced with
    RINGSEQ_CPU_ISA=baseline|avx2|avx512 (read at that first call); a forced level this CPU or
    this build lacks raises RuntimeError here and in every kernel call."""
    return None if _C is None else _C.cpu_isa()


def cpu_isa_levels() -> list:
    """ISA levels built into ringseq._C that this CPU can run, lowest first ([] if not built)."""
    return [] if _C is None else list(_C.cpu_isa_supported())


if _C is not None:

    @torch.library.register_fake("ringseq::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal, tile_config=0):
        b, s_q, h, _ = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty((b, h, s_q), dtype=accum_dtype(q.dtype))
        return out, lse

    @torch.library.register_fake("ringseq::fwd_accum")
    def _fwd_accum_fake(q, k, v, softmax_scale, causal, out_acc, lse_acc, tile_config=0):
        return None

    @torch.library.register_fake("ringseq::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, delta=None, tile_config=0):
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                torch.empty_like(k, memory_format=torch.contiguous_format),
                torch.empty_like(v, memory_format=torch.contiguous_format))

    @torch.library.register_fake("ringseq::bwd_accum")
    def _bwd_accum_fake(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum,
                        dk_accum, dv_accum, tile_config=0):
        return None

    def _fwd_setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal, *rest = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.tile_config = rest[0] if rest else 0

    def _fwd_backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # autograd may hand in expanded (stride-0) gradients
        delta = compute_delta(grad_out, out, grad_lse)
        dq, dk, dv = torch.ops.ringseq.bwd(grad_out, q, k, v, out, lse, ctx.softmax_scale,
                                           ctx.causal, delta, ctx.tile_config)
        return dq, dk, dv, None, None, None

    torch.library.register_autograd("ringseq::fwd", _fwd_backward, setup_context=_fwd_setup_context)


class ExtensionBackend(AttentionBackend):
    """The C++/CUDA kernels of this package (CPU: every float dtype; CUDA: see README)."""

    name = "ringseq"

    def __init__(self, tile_config: int = 0):
        self.tile_config = int(tile_config)

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
        scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        torch.ops.ringseq.fwd_accum(q, k, v, scale, bool(causal), out_acc, lse_acc, self.tile_config)

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta):
        return torch.ops.ringseq.bwd(dout, q, k, v, out, lse, scale, causal, delta, self.tile_config)

    def bwd_accum(self, dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum, dk_accum,
                  dv_accum) -> None:
        self._check(q, k, v)
        scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, scale, bool(causal), delta, dq_accum,
                                    dk_accum, dv_accum, self.tile_config)
