"""The contract every attention backend implements, and the edge cases they share."""
from __future__ import annotations

from typing import Optional, Tuple

import einops
import torch

from .checks import DEBUG_CHECKS, accum_dtype, check_qkv, no_key_rows
from .merge import merge_into
from .spans import as_spans_tensor, check_softcap, check_spans


class AttentionBackend:
    """Block attention with log-sum-exp: ``(out, lse)`` forward, ``(dq, dk, dv)`` backward.

    Shapes (flash-attn conventions): q (b, s_q, h, d); k, v (b, s_k, h_kv, d) with
    ``h % h_kv == 0``; out like q in q's dtype; lse (b, h, s_q) float32 (float64 for float64
    inputs), natural log. Causal masking is bottom-right aligned (key j visible to query i iff
    ``j <= i + s_k - s_q``); a row that sees no key has ``out = 0`` and ``lse = -inf``.

    The backward accepts the *global* ``out``/``lse`` of a ring (merged over blocks): then the
    per-block gradients add up to the full ones. ``delta`` = rowsum(dout * out), (b, h, s_q) in
    the accumulation dtype, may be passed precomputed.

    Spans, bands and soft-capping (docs/kernels.md, ``ringseq.kernels.spans``): every call takes
    the keyword-only ``spans=None`` (None, an int64 (n, 6) CPU tensor or a list of
    ``(q_start, q_len, k_start, k_len, band_lo, band_hi)`` tuples; not combined with
    ``causal=True``) and ``softcap=0.0``. Rows outside every span get ``out = 0, lse = -inf``
    and zero gradients (untouched accumulators in the ``*_accum`` forms). A backend that cannot
    compute them raises NotImplementedError (``supports_spans`` / ``supports_softcap``).

    Two ways in:

    * ``fwd`` / ``fwd_accum`` / ``bwd`` / ``bwd_accum`` validate their arguments
      (:meth:`check_call`) and then run: for code that calls a backend directly.
    * ``run_fwd`` / ``run_fwd_accum`` / ``run_bwd`` / ``run_bwd_accum`` trust them: the engine
      calls these with what an entry point validated once (an :class:`ringseq.spec.AttnSpec`
      and a layout's block schedule). ``RINGSEQ_DEBUG_CHECKS=1`` makes them validate too.

    Subclasses implement ``_fwd`` and ``_bwd`` for non-empty inputs (and may override
    ``_fwd_accum`` / ``_bwd_accum`` to accumulate in place); this class handles empty tensors
    and the accumulate defaults. A subclass that supports spans or a soft-cap receives them as
    the keyword arguments ``spans`` (a checked tensor, or None) and ``softcap`` (a float) of
    its hooks, and only when a call uses them: a subclass written before spans existed keeps
    working for plain calls.
    """

    name = "base"
    #: honours a caller's ``delta`` (needed for gradients flowing into ``lse``)
    supports_delta = True
    #: ``bwd`` may be given the merged out/lse of a ring instead of this call's own
    supports_global_backward = True
    #: takes ``spans`` (bands, documents, windows) / ``softcap`` (see the class docstring)
    supports_spans = False
    supports_softcap = False

    def join_failed(self, kind: int) -> None:
        """Called by a ring loop instead of this block kernel on a rank whose call already
        failed. A kernel that is itself a collective call (the double ring's inner lap) meets
        its peers there, so that they raise instead of waiting; others do nothing."""

    def accum_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return accum_dtype(dtype)

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, headdim: int) -> str | None:
        """Why this backend cannot run such inputs, or None when it can."""
        return None

    def delta(self, dout: torch.Tensor, out: torch.Tensor, grad_lse=None) -> torch.Tensor:
        """The ``delta`` this backend's backward takes: rowsum(dout * out) - grad_lse, (b, h,
        s_q) contiguous in the accumulation dtype (dout, out: (b, s_q, h, d)). This default is
        :func:`compute_delta`; a kernel whose dP sums in an order of its own returns the sum in
        that order, so that dP - delta cancels exactly where plain attention's does."""
        return compute_delta(dout, out, grad_lse)

    def require_lse_grad(self, fn: Optional[str] = None) -> None:
        """Raises RuntimeError (naming ``fn`` when given) when this backend cannot take a
        caller's ``delta``, i.e. cannot backpropagate a gradient that flows into ``lse``."""
        if not self.supports_delta:
            where = f"{fn}: " if fn else ""
            raise RuntimeError(f"{where}backend {self.name!r} cannot backpropagate through lse "
                               f"(the lse a call returned with return_lse=True or "
                               f"return_attn_probs=True reached the loss; this backend's kernel "
                               f"computes its delta from dout and out itself): use "
                               f"backend='ringseq' or 'reference', or lse.detach()")

    def features_reason(self, *, spans: bool, softcap: float) -> Optional[str]:
        """Why this backend cannot compute a call that needs spans (bands, windows, documents)
        or a soft-cap, or None."""
        if spans and not self.supports_spans:
            return "does not support spans (bands, sliding windows, packed documents)"
        if softcap > 0.0 and not self.supports_softcap:
            return f"does not support logit soft-capping (softcap={softcap})"
        return None

    def check_features(self, fn: str, *, spans: bool, softcap: float,
                       alternatives=("ringseq", "reference")) -> None:
        """NotImplementedError (naming ``fn`` and the ``alternatives`` to use: names, or a
        function giving them, called only for the error) when a call needs spans or a soft-cap
        and this backend cannot compute them."""
        reason = self.features_reason(spans=spans, softcap=softcap)
        if reason is not None:
            if callable(alternatives):
                alternatives = alternatives()
            use = " or ".join(repr(a) for a in alternatives)
            raise NotImplementedError(f"{fn}: backend {self.name!r} {reason}; use backend={use}")

    def check_call(self, q, k, v, causal: bool, spans=None, softcap=0.0, *,
                   fn: str = "attention") -> Tuple[Optional[torch.Tensor], float]:
        """Validates one call: tensors (:func:`check_qkv`), what this backend supports, and the
        spans and soft-cap. Returns ``(spans as a checked int64 tensor or None, softcap as a
        float)``; raises ValueError / TypeError / NotImplementedError naming ``fn``."""
        check_qkv(q, k, v, fn=fn)
        reason = self.unsupported_reason(q.device, q.dtype, q.shape[-1])
        if reason is not None:
            raise ValueError(f"{fn}: backend {self.name!r} cannot run these inputs: {reason}")
        softcap = check_softcap(softcap, fn)
        try:
            spans = as_spans_tensor(spans)
            check_spans(spans, q.shape[1], k.shape[1], bool(causal))
        except (TypeError, ValueError) as exc:  # (the span rules' messages name no function)
            raise type(exc)(f"{fn}: {exc}") from None
        self.check_features(fn, spans=spans is not None, softcap=softcap)
        return spans, softcap

    @staticmethod
    def _extra(spans, softcap) -> dict:
        """The keyword arguments of the hooks for a call that uses spans or a soft-cap."""
        return {} if spans is None and softcap == 0.0 else {"spans": spans, "softcap": softcap}

    @staticmethod
    def _empty(q, k, spans) -> bool:
        return q.numel() == 0 or k.shape[1] == 0 or (spans is not None and spans.shape[0] == 0)

    # -- validating calls ------------------------------------------------------------------
    @staticmethod
    def _check_shapes(fn: str, q, v, rows=(), stats=(), others=()) -> None:
        """ValueError naming ``fn`` and the argument unless each of ``rows`` (name, tensor) has
        q's rows with v's head dim (b, s_q, h, d_v), each of ``stats`` (b, h, s_q) and each of
        ``others`` (name, tensor, shape) its shape: a kernel would read past a shorter one."""
        b, s_q, h, _ = q.shape
        want = ([(n, t, (b, s_q, h, v.shape[-1])) for n, t in rows]
                + [(n, t, (b, h, s_q)) for n, t in stats] + list(others))
        for name, t, shape in want:
            if not torch.is_tensor(t) or tuple(t.shape) != tuple(shape):
                got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
                raise ValueError(f"{fn}: {name} must have shape {tuple(shape)} (from q "
                                 f"{tuple(q.shape)} and v {tuple(v.shape)}), got {got}")

    def fwd(self, q, k, v, softmax_scale: float, causal: bool, *, spans=None, softcap: float = 0.0):
        """``(out, lse)``; ``softmax_scale`` is a resolved float (the callers apply the
        default); ``spans`` and ``softcap`` as in the class docstring."""
        spans, softcap = self.check_call(q, k, v, causal, spans, softcap, fn=f"{self.name}.fwd")
        return self.run_fwd(q, k, v, softmax_scale, causal, spans=spans, softcap=softcap)

    def fwd_accum(self, q, k, v, softmax_scale: float, causal: bool, out_acc, lse_acc, *,
                  spans=None, softcap: float = 0.0) -> None:
        """Merges this block's attention into a running (out_acc, lse_acc) in place: out_acc
        (b, s_q, h, d) and lse_acc (b, h, s_q) in the accumulation dtype (views allowed); rows
        with lse_acc = -inf hold nothing yet."""
        spans, softcap = self.check_call(q, k, v, causal, spans, softcap,
                                         fn=f"{self.name}.fwd_accum")
        self._check_shapes(f"{self.name}.fwd_accum", q, v, rows=[("out_acc", out_acc)],
                           stats=[("lse_acc", lse_acc)])
        self.run_fwd_accum(q, k, v, softmax_scale, causal, out_acc, lse_acc, spans=spans,
                           softcap=softcap)

    def bwd(self, dout, q, k, v, out, lse, softmax_scale: float, causal: bool, delta=None, *,
            spans=None, softcap: float = 0.0):
        """``(dq, dk, dv)`` in the input dtype."""
        spans, softcap = self.check_call(q, k, v, causal, spans, softcap, fn=f"{self.name}.bwd")
        self._check_shapes(f"{self.name}.bwd", q, v, rows=[("dout", dout), ("out", out)],
                           stats=[("lse", lse)] + ([("delta", delta)] if delta is not None
                                                   else []))
        if delta is not None:
            self.require_lse_grad(f"{self.name}.bwd")
        return self.run_bwd(dout, q, k, v, out, lse, softmax_scale, causal, delta, spans=spans,
                            softcap=softcap)

    def bwd_accum(self, dout, q, k, v, out, lse, softmax_scale: float, causal: bool, delta,
                  dq_accum, dk_accum, dv_accum, *, spans=None, softcap: float = 0.0) -> None:
        """Adds this block's gradients into accumulation-dtype buffers (views allowed); rows
        outside every span get zero added."""
        spans, softcap = self.check_call(q, k, v, causal, spans, softcap,
                                         fn=f"{self.name}.bwd_accum")
        self._check_shapes(f"{self.name}.bwd_accum", q, v, rows=[("dout", dout), ("out", out)],
                           stats=[("lse", lse)] + ([("delta", delta)] if delta is not None
                                                   else []),
                           others=[("dq_accum", dq_accum, q.shape), ("dk_accum", dk_accum, k.shape),
                                   ("dv_accum", dv_accum, v.shape)])
        self.run_bwd_accum(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum,
                           dk_accum, dv_accum, spans=spans, softcap=softcap)

    # -- trusted calls (the engine) --------------------------------------------------------
    def run_fwd(self, q, k, v, softmax_scale, causal, *, spans=None, softcap=0.0):
        if DEBUG_CHECKS:
            spans, softcap = self.check_call(q, k, v, causal, spans, softcap, fn="run_fwd")
        if self._empty(q, k, spans):
            b, s_q, h, _ = q.shape
            out = torch.zeros_like(q, memory_format=torch.contiguous_format)
            lse = torch.full((b, h, s_q), float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
            return out, lse
        return self._fwd(q, k, v, float(softmax_scale), bool(causal), **self._extra(spans, softcap))

    def run_fwd_accum(self, q, k, v, softmax_scale, causal, out_acc, lse_acc, *, spans=None,
                      softcap=0.0) -> None:
        if DEBUG_CHECKS:
            spans, softcap = self.check_call(q, k, v, causal, spans, softcap, fn="run_fwd_accum")
        if self._empty(q, k, spans):
            return
        self._fwd_accum(q, k, v, float(softmax_scale), bool(causal), out_acc, lse_acc,
                        **self._extra(spans, softcap))

    def run_bwd(self, dout, q, k, v, out, lse, softmax_scale, causal, delta=None, *, spans=None,
                softcap=0.0):
        if DEBUG_CHECKS:
            spans, softcap = self.check_call(q, k, v, causal, spans, softcap, fn="run_bwd")
        if self._empty(q, k, spans):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return self._bwd(dout, q, k, v, out, lse, float(softmax_scale), bool(causal),
                         delta if self.supports_delta else None, **self._extra(spans, softcap))

    def run_bwd_accum(self, dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum,
                      dk_accum, dv_accum, *, spans=None, softcap=0.0) -> None:
        if DEBUG_CHECKS:
            spans, softcap = self.check_call(q, k, v, causal, spans, softcap, fn="run_bwd_accum")
        if self._empty(q, k, spans):
            return
        self._bwd_accum(dout, q, k, v, out, lse, float(softmax_scale), bool(causal),
                        delta if self.supports_delta else None, dq_accum, dk_accum, dv_accum,
                        **self._extra(spans, softcap))

    # -- hooks -----------------------------------------------------------------------------
    def _fwd(self, q, k, v, scale, causal, **spans_softcap):
        raise NotImplementedError

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta, **spans_softcap):
        raise NotImplementedError

    def _fwd_accum(self, q, k, v, scale, causal, out_acc, lse_acc, **spans_softcap) -> None:
        # rows outside every span come back with lse = -inf, so they stay untouched
        o_b, l_b = self._fwd(q, k, v, scale, causal, **spans_softcap)
        merge_into(out_acc, lse_acc, o_b, l_b)

    def _bwd_accum(self, dout, q, k, v, out, lse, scale, causal, delta, dq_accum, dk_accum,
                   dv_accum, **spans_softcap) -> None:
        dq, dk, dv = self._bwd(dout, q, k, v, out, lse, scale, causal, delta, **spans_softcap)
        dq_accum.add_(dq)
        dk_accum.add_(dk)
        dv_accum.add_(dv)

    def __repr__(self):
        return f"<attention backend {self.name!r}>"

    # A backend's registry key (kernels/registry.py) names this object in this process only.
    def __deepcopy__(self, memo):
        return self  # stateless: a copied model keeps using the same kernels

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_registry_key", None)
        return state


def compute_delta(dout: torch.Tensor, out: torch.Tensor, grad_lse=None) -> torch.Tensor:
    """delta = rowsum(dout * out) - grad_lse: (b, h, s_q), contiguous, accumulation dtype.

    dout, out: (b, s_q, h, d); grad_lse: (b, h, s_q) or None. Since d lse_i / d s_ij = p_ij,
    a gradient on lse enters the backward as dS = P (dP - (D - dlse)): folding it into delta
    keeps one kernel for both cases.
    """
    acc = accum_dtype(out.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc)
    return delta.contiguous()


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see no key) replaced by 0 so that exp(s - lse) stays 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def expand_kv(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, s, h_kv, d) -> (b, s, h, d) with query head i reading kv head i // (h / h_kv)."""
    h_kv = t.shape[2]
    if h_kv == nheads:
        return t
    return einops.repeat(t, "b s hk d -> b s (hk g) d", g=nheads // h_kv)


def reduce_kv(t: torch.Tensor, nheads_kv: int) -> torch.Tensor:
    """Inverse of expand_kv for gradients: sums the query heads that share a kv head."""
    if t.shape[2] == nheads_kv:
        return t
    return einops.reduce(t, "b s (hk g) d -> b s hk d", "sum", hk=nheads_kv)


__all__ = ["AttentionBackend", "compute_delta", "finite_lse", "expand_kv", "reduce_kv", "no_key_rows"]
