"""Every attention call of ringseq as one opaque custom operator, so ``torch.compile`` (with
``fullgraph=True``) traces a model that uses any of them without looking inside.

``ringseq::attention(q, k, v, spec, placement, documents, spans) -> (out, lse, saved)`` decodes
the call's :class:`ringseq.spec.AttnSpec` (a string, :meth:`AttnSpec.key`) and its
:class:`ringseq.engine.placement.Placement` (a string) and runs the placement's forward; its
registered backward is ``ringseq::attention_backward``. Single-device attention, the ring,
Ulysses, USP and the double ring differ only in the placement. Communication, the integrity
protocol and the control collectives all happen inside the operator, at run time: the traced
graph holds none of them, and the fake implementation only computes output shapes.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..kernels.checks import accum_dtype
from ..spec import AttnSpec, spec_from_key
from .integrity import FWD, call_tag, current_tag
from .placement import LOCAL, NO_RING, Placement, placement_from_key
from .ring import refuse_on_error

__all__ = ["run_attention"]


def _no_autocast(device_type: str):
    """Autocast off inside the operator: the kernels choose their own accumulation dtype, which
    a caller's autocast (still on in here) would lower."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


@torch.library.custom_op("ringseq::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, spec: str, placement: str,
                  documents: Optional[Tensor], spans: Optional[Tensor]
                  ) -> Tuple[Tensor, Tensor, List[Tensor]]:
    sp = spec_from_key(spec, documents, spans)
    with _no_autocast(q.device.type):
        out, lse, saved = placement_from_key(placement).forward(q, k, v, sp)
    # Outputs must be fresh tensors with the fake's layout (torch.compile trusts the fake).
    # The last saved tensor is the call tag this forward ran under, read at run time (also
    # when compiled), for its backward to carry: that may run on another thread, or later.
    tag = torch.tensor(current_tag(), dtype=torch.int64, device="cpu")  # ()
    return out.contiguous(), lse.contiguous(), [t.contiguous() for t in saved] + [tag]


@_attention_op.register_fake
def _(q, k, v, spec, placement, documents, spans):
    b, s_q, h, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((b, h, s_q), dtype=accum_dtype(q.dtype))
    saved = placement_from_key(placement).saved_like(q, k, v, spec_from_key(spec))
    return out, lse, saved + [torch.empty((), dtype=torch.int64, device="cpu")]


@torch.library.custom_op("ringseq::attention_backward", mutates_args=())
def _attention_backward_op(dout: Optional[Tensor], dlse: Optional[Tensor], q: Tensor, k: Tensor,
                           v: Tensor, out: Tensor, lse: Tensor, saved: List[Tensor], spec: str,
                           placement: str, documents: Optional[Tensor],
                           spans: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    sp = spec_from_key(spec, documents, spans)
    *saved, tag = saved
    with _no_autocast(q.device.type), call_tag(int(tag)):
        grads = placement_from_key(placement).backward(dout, dlse, q, k, v, out, lse,
                                                       saved, sp)
    return tuple(g.contiguous() for g in grads)


@_attention_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, saved, spec, placement, documents, spans):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _name_the_call(ctx, inputs, output):
    ctx.fn = spec_from_key(inputs[8]).fn  # inputs[8]: the spec key


def _no_double_backward(ctx, *grads):
    raise RuntimeError(f"{ctx.fn}: differentiating attention twice (create_graph=True, e.g. a "
                       f"gradient penalty) is not supported: its backward is not differentiable")


_attention_backward_op.register_autograd(_no_double_backward, setup_context=_name_the_call)


def _setup_context(ctx, inputs, output):
    q, k, v, spec, placement, documents, spans = inputs
    out, lse, saved = output
    if not placement_from_key(placement).backward_reads_inputs:
        # Only their shapes: the placement saved what its backward reads (Ulysses: the head
        # shards), and q, k, v would otherwise be freed after the forward.
        q, k, v = (t.new_zeros(()).expand(t.shape) for t in (q, k, v))
    ctx.save_for_backward(q, k, v, out, lse, *saved)
    ctx.args = (spec, placement, documents, spans)
    # The registries hold objects weakly: the graph keeps the ones its backward needs alive
    # (a layout or backend made for one call, the process groups).
    ctx.keep = (placement_from_key(placement), spec_from_key(spec).backend)
    # An output nobody used arrives as None, not zeros: no delta to compute (or refuse) for an
    # lse that carries no gradient.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, _dsaved):
    # Every rank of a sequence-parallel call must run the backward, even one whose inputs need
    # no gradient (the signature's requires_grad made all ranks agree that one follows).
    q, k, v, out, lse, *saved = ctx.saved_tensors
    spec, placement, documents, spans = ctx.args
    dq, dk, dv = _attention_backward_op(dout, dlse, q, k, v, out, lse, saved, spec, placement,
                                        documents, spans)
    needs = ctx.needs_input_grad
    return ((dq if needs[0] else None), (dk if needs[1] else None), (dv if needs[2] else None),
            None, None, None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _refuse_transforms(fn: str, *tensors: Tensor) -> None:
    """RuntimeError for inputs of forward-mode AD (``torch.autograd.forward_ad``) or of a
    ``torch.func`` transform (``jvp``, ``grad``, ``vmap``, ...): the operator has a backward
    only, and torch gives such a custom operator a zero tangent without a word (jvp) or an
    error that does not name it."""
    from torch.autograd.forward_ad import unpack_dual
    if any(unpack_dual(t).tangent is not None for t in tensors):
        raise RuntimeError(f"{fn}: forward-mode AD (a dual tensor input) is not supported by "
                           f"ringseq attention: its derivative is defined by its backward only. "
                           f"Use reverse mode (loss.backward(), torch.autograd.grad)")
    functorch = torch._C._functorch
    if any(functorch.is_functorch_wrapped_tensor(t) and not functorch.is_functionaltensor(t)
           for t in tensors):  # (functionalize computes no derivative: fine)
        raise RuntimeError(f"{fn}: torch.func transforms (jvp, grad, vmap, jacrev, ...) are not "
                           f"supported by ringseq attention; use torch.autograd (loss.backward(), "
                           f"torch.autograd.grad) and batch along the batch dimension")


_FUNCTORCH_KERNELS: list = []  # (the libraries holding them stay alive with the module)


def _refuse_at_functorch_layer(op, name: str) -> None:
    """The operator ``op`` (``ringseq::<name>``, its spec key 4th) refuses torch.func transforms
    at functorch's own dispatch key, where they reach it also inside ``torch.compile`` (whose
    trace skips :func:`_refuse_transforms`: a compiled ``torch.func.jvp`` gave a zero tangent
    without a word). ``functionalize`` computes no derivative: the operator runs below it."""
    def at_functorch_layer(*args, **kwargs):
        from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
        interpreter = retrieve_current_functorch_interpreter()
        kind = interpreter.key().name
        level = interpreter.level()
        if not any(torch.is_tensor(t) and torch._C._functorch.maybe_get_level(t) == level
                   for t in pytree.tree_leaves((args, kwargs))):
            # the transform is over something else (attention's inputs are constants to it):
            # the operator runs below it, as plain attention
            with interpreter.lower():
                return op(*args, **kwargs)
        if kind == "Functionalize":
            from torch._subclasses.functional_tensor import FunctorchFunctionalizeAPI
            api = FunctorchFunctionalizeAPI(interpreter)
            inner, inner_kwargs = api.unwrap_tensors((args, kwargs))
            with api.redispatch_to_next():
                result = op(*inner, **inner_kwargs)
            return api.wrap_tensors(result)
        fn = spec_from_key(args[3]).fn if len(args) > 3 and isinstance(args[3], str) else name
        raise RuntimeError(f"{fn}: torch.func transforms ({kind.lower()} here; jvp, grad, vmap, "
                           f"jacrev, ...) and forward-mode AD are not supported by ringseq "
                           f"attention, compiled or not: its derivative is defined by its "
                           f"backward only. Use torch.autograd (loss.backward(), "
                           f"torch.autograd.grad) and batch along the batch dimension")
    lib = torch.library.Library("ringseq", "IMPL")
    lib.impl(name, at_functorch_layer, "FuncTorchDynamicLayerFrontMode")
    _FUNCTORCH_KERNELS.append(lib)


_refuse_at_functorch_layer(torch.ops.ringseq.attention.default, "attention")


def run_attention(q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec,
                  placement: Placement) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of attention with ``spec`` (validated by the caller) placed by
    ``placement``, through the ``ringseq::attention`` operator; differentiable in q, k, v and
    lse (out in q's dtype, lse (b, h, s_q) float32, float64 for float64 inputs). Raises
    RuntimeError under forward-mode AD and torch.func's transforms (see _refuse_transforms)."""
    if not torch.compiler.is_compiling():  # (dynamo's trace holds fake tensors, no duals)
        # (a placement of the user's own without refusal_group: refused here alone, as before)
        group = getattr(placement, "refusal_group", lambda: NO_RING)()
        if group is NO_RING:
            _refuse_transforms(spec.fn, q, k, v)
        else:  # the peers raise RingPeerError at the call's begin instead of waiting there
            with refuse_on_error(group, FWD):
                _refuse_transforms(spec.fn, q, k, v)
    out, lse, _ = _attention_op(q, k, v, spec.key(), placement.key(), spec.documents_tensor(),
                                spec.spans)
    return out, lse


def span_attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
                   backend, *, spans=None, softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
    """Differentiable ``(out, lse)`` of ``backend`` with explicit kernel ``spans`` (the kernels'
    own interface, docs/kernels.md; validated here by ``backend.check_call``): for tests and
    benchmarks that drive spans directly. Public code builds spans from windows and documents
    (``ringseq.flash_attn_varlen_func``)."""
    from ..masks import AttnMask
    spans, softcap = backend.check_call(q, k, v, causal, spans, softcap, fn="span_attention")
    spec = AttnSpec(fn="span_attention", softmax_scale=float(softmax_scale),
                    mask=AttnMask(causal=bool(causal)), softcap=softcap, backend=backend,
                    grad_comm_dtype=backend.accum_dtype(q.dtype), needs_grad=False, spans=spans)
    return run_attention(q, k, v, spec, LOCAL)
