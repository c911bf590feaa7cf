"""ringseq's own kernels (``torch.ops.ringseq.*``): loading, fake impls, autograd, backend.

Operators (csrc/ops.cpp); spans / softcap: docs/kernels.md, "Spans, bands and softcap":
  fwd(q, k, v, softmax_scale, causal, tile_config=0, spans=None, softcap=0.0) -> (out, lse)
  fwd_accum(q, k, v, softmax_scale, causal, out_acc!, lse_acc!, tile_config=0, spans=None,
            softcap=0.0) -> ()   (CPU)
  bwd(dout, q, k, v, out, lse, softmax_scale, causal, delta=None, tile_config=0, spans=None,
      softcap=0.0) -> (dq, dk, dv)
  bwd_accum(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum!, dk_accum!,
            dv_accum!, tile_config=0, spans=None, softcap=0.0) -> ()
  _tiles_visited(reset=False) -> [fwd, bwd]: (q tile, kv tile) pairs the CPU kernels computed,
            summed over batch and heads (a test statistic)
  _softmax_exp(x, non_positive=False) -> exp(x): the CPU kernels' softmax exp at the active ISA
            level (float32 CPU tensors; for tests)
"""
from __future__ import annotations

import torch

from .checks import accum_dtype
from .grad import attention_backward, fake_attention_outputs, fake_checks
from .registry import backend_key
from .base import AttentionBackend
from .spans import spans_given

_IMPORT_ERROR: Exception | None = None
try:
    from .. import _C  # noqa: F401  (registers torch.ops.ringseq.*)
except ImportError as exc:  # not built: the Python backends still work
    _C = None
    _IMPORT_ERROR = exc


def _not_built_reason() -> str:
    """Why ringseq._C is missing, and what to do. A package without the compiled file (a
    checkout never built, or one that shadows an installed ringseq: python run from its root)
    said Python's words for it, "partially initialized module ... circular import", which
    named neither the folder nor the build."""
    import os
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exc = _IMPORT_ERROR
    if getattr(exc, "name", None) in ("_C", "ringseq._C") or "'_C'" in str(exc):
        return (f"ringseq._C is not built: {package} has no compiled ringseq/_C*.so (build it "
                f"there with `pip install --no-build-isolation -e .`, or run from outside a "
                f"source checkout to use an installed ringseq)")
    return f"ringseq._C in {package} failed to load ({exc})"


def extension_available() -> bool:
    return _C is not None


def extension_has_cuda() -> bool:
    return _C is not None and bool(getattr(_C, "WITH_CUDA", False))


def cpu_isa() -> str | None:
    """The ISA level the CPU kernel runs: "baseline", "avx2", "avx512", "avx512bf16" or "amx" (None
    when ringseq._C is not built). Chosen at the first kernel call from cpuid (the best level,
    but avx512 rather than avx512bf16 on Intel CPUs without usable AMX:
    ringseq._C._cpu_isa_auto()), or forced with RINGSEQ_CPU_ISA=baseline|avx2|avx512|avx512bf16|amx
    (read at that first call); a forced level this CPU or this build lacks raises RuntimeError
    here and in every kernel call."""
    return None if _C is None else _C.cpu_isa()


def forced_level_error() -> str | None:
    """The error of a ``RINGSEQ_CPU_ISA`` level this CPU or this build lacks (an unknown
    name too), None where the CPU kernel's level runs (or ringseq._C is not built). Not read
    while torch.compile traces (the kernel raises it then)."""
    if _C is None or torch.compiler.is_compiling():
        return None
    try:
        _C.cpu_isa()  # (the level chosen at the first call is kept: a lookup after it)
    except RuntimeError as exc:
        return str(exc)
    return None


def cpu_isa_levels() -> list:
    """ISA levels built into ringseq._C that this CPU can run, lowest first ([] if not built)."""
    return [] if _C is None else list(_C.cpu_isa_supported())


def _spansfake_checks(spans, softcap, causal):
    """The fake impls' checks of spans / softcap (their values are the binding's to check)."""
    torch._check(softcap >= 0.0, lambda: f"softcap must be a finite float >= 0 (0.0: off), got {softcap}")
    if spans is not None:
        torch._check(not causal, lambda: "spans and causal=True cannot be combined")
        torch._check(spans.dim() == 2 and spans.shape[1] == 6,
                     lambda: f"spans must be (n, 6), got shape {tuple(spans.shape)}")
        torch._check(spans.dtype == torch.int64, lambda: f"spans must be int64, got {spans.dtype}")
        torch._check(spans.device.type == "cpu", lambda: f"spans must be a CPU tensor, got {spans.device}")


def _not_differentiable(name: str, why: str):
    """An autograd rule that refuses: torch runs an op without one with only a warning,
    treating its gradient as zero."""
    def refuse(ctx, *grads):
        raise RuntimeError(f"torch.ops.ringseq.{name} has no derivative: {why}")
    return refuse


if _C is not None:

    @torch.library.register_fake("ringseq::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal, tile_config=0, spans=None, softcap=0.0):
        fake_checks("fwd", q, k, v, tile_config)
        _spansfake_checks(spans, softcap, causal)
        return fake_attention_outputs(q)

    @torch.library.register_fake("ringseq::fwd_accum")
    def _fwd_accum_fake(q, k, v, softmax_scale, causal, out_acc, lse_acc, tile_config=0, spans=None,
                        softcap=0.0):
        fake_checks("fwd_accum", q, k, v, tile_config)
        _spansfake_checks(spans, softcap, causal)
        b, s_q, h, _ = q.shape
        torch._check(out_acc.shape == q.shape,
                     lambda: f"ringseq::fwd_accum: out_acc must have the shape of q "
                             f"{tuple(q.shape)}, got {tuple(out_acc.shape)}")
        torch._check(lse_acc.shape == (b, h, s_q),
                     lambda: f"ringseq::fwd_accum: lse_acc must be (b, h, s_q) = "
                             f"{(b, h, s_q)}, got {tuple(lse_acc.shape)}")
        acc = accum_dtype(q.dtype)
        torch._check(out_acc.dtype == acc and lse_acc.dtype == acc,
                     lambda: f"ringseq::fwd_accum: out_acc and lse_acc must be {acc} for "
                             f"{q.dtype} inputs, got {out_acc.dtype} and {lse_acc.dtype}")
        return None

    def _check_grad_inputs(op, dout, q, k, v, out, lse, tile_config):
        fake_checks(op, q, k, v, tile_config)
        b, s_q, h, _ = q.shape
        torch._check(dout.shape == q.shape and out.shape == q.shape,
                     lambda: f"ringseq::{op}: dout and out must have the shape of q "
                             f"{tuple(q.shape)}, got {tuple(dout.shape)} and {tuple(out.shape)}")
        torch._check(lse.shape == (b, h, s_q),
                     lambda: f"ringseq::{op}: lse must be (b, h, s_q) = {(b, h, s_q)}, got "
                             f"{tuple(lse.shape)}")

    @torch.library.register_fake("ringseq::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, delta=None, tile_config=0, spans=None,
                  softcap=0.0):
        _check_grad_inputs("bwd", dout, q, k, v, out, lse, tile_config)
        _spansfake_checks(spans, softcap, causal)
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    @torch.library.register_fake("ringseq::bwd_accum")
    def _bwd_accum_fake(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum,
                        dk_accum, dv_accum, tile_config=0, spans=None, softcap=0.0):
        _check_grad_inputs("bwd_accum", dout, q, k, v, out, lse, tile_config)
        _spansfake_checks(spans, softcap, causal)
        torch._check(dq_accum.shape == q.shape and dk_accum.shape == k.shape
                     and dv_accum.shape == v.shape,
                     lambda: "dq/dk/dv accumulators must have the shapes of q/k/v")
        return None

    @torch.library.register_fake("ringseq::delta")
    def _delta_fake(dout, out):
        torch._check(out.dim() == 4 and dout.shape == out.shape,
                     lambda: "dout must have the shape of out, (b, s_q, h, d)")
        b, s_q, h, _ = out.shape
        acc = torch.float64 if out.dtype == torch.float64 else torch.float32
        return out.new_empty((b, h, s_q), dtype=acc)

    def _fwd_setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal, *rest = inputs
        tile_config = rest[0] if len(rest) > 0 else 0
        spans = rest[1] if len(rest) > 1 else None
        softcap = rest[2] if len(rest) > 2 else 0.0
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans = spans  # an int64 CPU tensor (no gradient), or None
        ctx.args = (softmax_scale, causal, ExtensionBackend.instance(tile_config), softcap)
        ctx.n_inputs = len(inputs)
        ctx.set_materialize_grads(False)

    def _fwd_backward(ctx, grad_out, grad_lse):
        # The raw operator's gradient (for callers of torch.ops.ringseq.fwd): the same rule
        # as flash_attn_func's, in one place.
        softmax_scale, causal, be, softcap = ctx.args
        grads = attention_backward(be, *ctx.saved_tensors, softmax_scale, causal, grad_out,
                                   grad_lse, ctx.needs_input_grad[:3], spans=ctx.spans,
                                   softcap=softcap)
        return (*grads, *([None] * (ctx.n_inputs - 3)))

    torch.library.register_autograd("ringseq::fwd", _fwd_backward, setup_context=_fwd_setup_context)

    # The kernels' backward parts are not differentiable: a gradient penalty through the raw
    # operator (create_graph=True) must raise, not drop its second-order term.
    for name in ("bwd", "delta"):
        torch.library.register_autograd(f"ringseq::{name}", _not_differentiable(
            name, "differentiating the gradient of torch.ops.ringseq.fwd (create_graph=True, "
                  "e.g. a gradient penalty) is not supported"))



class ExtensionBackend(AttentionBackend):
    """The C++/CUDA kernels of this package (CPU: every float dtype; CUDA: see README)."""

    name = "ringseq"
    supports_spans = True
    supports_softcap = True
    _INSTANCES: dict = {}

    def __init__(self, tile_config: int = 0):
        if isinstance(tile_config, bool) or not isinstance(tile_config, int) or \
                not 0 <= tile_config <= 2:
            raise ValueError(f"ExtensionBackend: tile_config must be 0 (fast), 1 (conservative) "
                             f"or 2 (128x64 tiles), got {tile_config!r}")
        self.tile_config = tile_config

    @classmethod
    def instance(cls, tile_config: int = 0) -> "ExtensionBackend":
        """The shared instance for ``tile_config`` (backends hold no per-call state)."""
        if tile_config not in cls._INSTANCES:
            inst = cls._INSTANCES[tile_config] = cls(tile_config)
            backend_key(inst)  # registered eagerly: torch.compile may trace the first use
        return cls._INSTANCES[tile_config]

    def unsupported_reason(self, device, dtype, headdim):
        if _C is None:
            return _not_built_reason()
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

    # Plain calls keep the operators' original argument lists; spans / softcap are appended only
    # when used.
    def _span_args(self, spans, softcap):
        return (spans, float(softcap)) if spans_given(spans, softcap) else ()

    def _fwd(self, q, k, v, scale, causal, spans=None, softcap=0.0):
        return torch.ops.ringseq.fwd(q, k, v, scale, causal, self.tile_config,
                                     *self._span_args(spans, softcap))

    def _fwd_accum(self, q, k, v, scale, causal, out_acc, lse_acc, spans=None,
                   softcap=0.0) -> None:
        if q.device.type != "cpu":  # the CUDA kernel has no merge mode yet
            return super()._fwd_accum(q, k, v, scale, causal, out_acc, lse_acc,
                                      **self._extra(spans, softcap))
        o, lse = _unit_stride_copy(out_acc), _unit_stride_copy(lse_acc)
        torch.ops.ringseq.fwd_accum(q, k, v, scale, causal, o, lse, self.tile_config,
                                    *self._span_args(spans, softcap))
        _write_back((out_acc, lse_acc), (o, lse))

    def delta(self, dout, out, grad_lse=None):
        # On CPU summed by the kernel in its dP GEMM's order (a row that sees one key then gets
        # dS = 0 exactly, as in plain attention; torch's order left up to 5x plain fp32's dq
        # error there); on CUDA torch's sum, as the binding computes it.
        d = torch.ops.ringseq.delta(dout, out)
        return d if grad_lse is None else (d - grad_lse.to(d.dtype)).contiguous()

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta, spans=None, softcap=0.0):
        lse, delta = _unit_stride_copy(lse), _unit_stride_copy(delta)
        return torch.ops.ringseq.bwd(dout, q, k, v, out, lse, scale, causal, delta,
                                     self.tile_config, *self._span_args(spans, softcap))

    def _bwd_accum(self, dout, q, k, v, out, lse, scale, causal, delta, dq_accum, dk_accum,
                   dv_accum, spans=None, softcap=0.0) -> None:
        lse, delta = _unit_stride_copy(lse), _unit_stride_copy(delta)
        accs = (dq_accum, dk_accum, dv_accum)
        work = tuple(_unit_stride_copy(t) for t in accs)
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, scale, causal, delta, *work,
                                    self.tile_config, *self._span_args(spans, softcap))
        _write_back(accs, work)


# The kernels walk the last dimension of a statistic (b, h, s_q) or a row (.., d) with unit
# stride; the validating calls promise views of any strides (base.AttentionBackend), so a view
# strided there goes through a contiguous copy (written back for the buffers written into).
def _unit_stride_copy(t):
    if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def _write_back(buffers, work) -> None:
    for t, w in zip(buffers, work):
        if w is not t:
            t.copy_(w)
