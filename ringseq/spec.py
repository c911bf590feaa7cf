"""One attention call's options, resolved and validated once: the :class:`AttnSpec`.

Every public entry point (``flash_attn_func`` and its forms, the ring functions, Ulysses, USP,
the double ring, the transformers backend, the plugin through them) calls :func:`attn_spec`
once with the user's arguments and this rank's tensors. It checks every argument (through the
parsers of :mod:`ringseq._args`, in one error style: ``"{function}: {argument} must be ...,
got ..."``), applies every default and returns a frozen ``AttnSpec`` that flows down to the
kernels unchanged: nothing below re-checks or re-resolves (``RINGSEQ_DEBUG_CHECKS=1`` makes the
kernels re-check their inputs, for debugging).

The custom operator (:mod:`ringseq.engine.op`) takes the spec as one string
(:meth:`AttnSpec.key`, decoded by :func:`spec_from_key`), with the document boundaries and the
kernel spans beside it as tensors. :meth:`AttnSpec.signature` is the only cross-rank signature:
every rank of a sequence-parallel call must agree on it (checked by the call's begin
collective, :mod:`ringseq.engine.integrity`).
"""
from __future__ import annotations

import dataclasses
import functools
import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ._args import (check_alibi_slopes, check_bool, check_cu_seqlens, check_dropout,
                    check_softmax_scale, parse_window)
from ._dist import with_message
from ._hash import ints_field
from .kernels import AttentionBackend, backend_by_key, backend_key, check_qkv, get_backend
from .kernels.checks import FLASH_FORM, InputForm
from .kernels.checks import count_check, resolve_scale
from .kernels.spans import UNBOUNDED, as_spans_tensor, check_softcap, spans_of_documents
from .masks import AttnMask

__all__ = ["AttnSpec", "attn_spec", "bound_layout", "check_grad_comm_dtype", "check_layout",
           "check_self_attention", "dtype_code", "local_spans", "named_layout", "spec_from_key"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    """A small integer for a dtype, the same on every rank (99: not a float dtype we know)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else 99


@dataclass(frozen=True)
class AttnSpec:
    """What an attention call computes, besides its tensors and where it runs.

    Attributes:
        fn: the public function that was called (errors name it).
        softmax_scale: the resolved scale.
        mask: causal, window ``(left, right)`` (flash-attn's convention) and, for
            sequence-parallel calls, the GLOBAL document boundaries of a packed sequence
            (:class:`ringseq.masks.AttnMask`).
        softcap: logit soft-capping (0: off).
        backend: the block kernel.
        grad_comm_dtype: the dtype in which a ring's travelling dK/dV accumulators move.
        needs_grad: whether a backward follows (part of the signature: no rank runs a
            backward alone).
        spans: the kernel spans of local attention (a checked int64 (n, 6) CPU tensor), or
            None for plain (causal) attention: windows and packed documents of a
            single-device call, or of the gathered sequence of an all-to-all.
    """

    fn: str
    softmax_scale: float
    mask: AttnMask
    softcap: float
    backend: AttentionBackend
    grad_comm_dtype: torch.dtype
    needs_grad: bool
    # not compared (nor hashed): a spec is a cache key, and tensors do not compare as one value;
    # the caches that use specs (plans) are for calls without spans
    spans: Optional[torch.Tensor] = dataclasses.field(default=None, compare=False)

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def window(self) -> Tuple[int, int]:
        return self.mask.window

    @property
    def documents(self) -> Optional[Tuple[int, ...]]:
        return self.mask.cu_seqlens

    # -- the custom operator's encoding --------------------------------------------------------
    def key(self) -> str:
        """Everything but the documents and spans (which travel as tensors) as one string:
        the same options give the same string, so a compiled graph keeps one constant. It
        begins with the operator's format (:data:`OPERATOR_FORMAT`)."""
        gdt = str(self.grad_comm_dtype).replace("torch.", "")
        return "|".join((_FORMAT_FIELD, self.fn, float(self.softmax_scale).hex(),
                         str(int(self.causal)), str(self.window[0]), str(self.window[1]),
                         float(self.softcap).hex(), backend_key(self.backend), gdt,
                         str(int(self.needs_grad))))

    def documents_tensor(self) -> Optional[torch.Tensor]:
        """The documents as the custom operator takes them (an int64 CPU tensor) or None."""
        if self.documents is None:
            return None
        return torch.tensor(self.documents, dtype=torch.int64)

    # -- the cross-rank signature ---------------------------------------------------------------
    def signature(self, q_shape: Sequence[int], nheads_kv: int, dtype: torch.dtype, *,
                  extra: Sequence[tuple] = ()) -> Tuple[tuple, ...]:
        """``(name, value[, kind])`` fields every rank of a sequence-parallel call must agree
        on: the local shapes (q (b, s_local, h, d), ``nheads_kv``) and dtype, every option of
        the spec, and ``extra`` (the placement's own: layout, world size, degrees)."""
        b, s, h, d = q_shape
        return (
            ("batch", b), ("local seqlen", s), ("nheads", h), ("nheads_kv", nheads_kv),
            ("headdim", d), ("dtype", dtype_code(dtype), "dtype"),
            ("causal", self.causal, "bool"), ("requires_grad", self.needs_grad, "bool"),
            ("grad_comm_dtype", dtype_code(self.grad_comm_dtype), "dtype"),
            float_field("softmax_scale", self.softmax_scale, dtype),
            ("window left", self.window[0]), ("window right", self.window[1]),
            float_field("softcap", self.softcap, dtype),
            ints_field("documents (cu_seqlens)", self.documents),
        ) + tuple(extra)


FLOAT = "float"  # the kind of a signature field holding a float64's bits (float_field)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def float_field(name: str, x: float, dtype: torch.dtype) -> tuple:
    """A cross-rank signature field comparing a float as the kernels use it on inputs of
    ``dtype``: ``(name, bits, FLOAT)``, the bits (as an int64 float64) of ``x`` rounded to float32
    for 16- and 32-bit inputs (the kernels scale and cap in float32 there: ``None`` and
    ``1 / math.sqrt(d)`` are one scale), exactly for float64 (before: micro-units, so a softcap
    of 4e-7 on one rank met 0, "off", on another and the call ran both). -0.0 is 0.0; a
    mismatch shows the floats."""
    x = float(x) + 0.0
    if dtype != torch.float64 and abs(x) <= _FLOAT32_MAX:  # (beyond: refused by the checks)
        x = struct.unpack("<f", struct.pack("<f", x))[0]
    return (name, struct.unpack("<q", struct.pack("<d", x))[0], FLOAT)


def float_of_field(bits: int) -> float:
    """The float a :func:`float_field` value holds."""
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def float_field_text(bits: int) -> str:
    """A :func:`float_field` value as a mismatch message shows it: the shortest decimal that
    rounds to it in float32 when it is a float32 (0.1, not 0.10000000149011612), else repr."""
    x = float_of_field(bits)
    if abs(x) < _FLOAT32_MAX:  # (9 digits tell any float32 apart)
        for digits in range(1, 10):
            text = f"{x:.{digits}g}"
            if struct.unpack("<f", struct.pack("<f", float(text)))[0] == x:
                return repr(float(text))  # (100.0, not 1e+02)
    return repr(x)


# The format of the attention operator's outputs and saved tensors, which the spec key (a
# constant of every compiled graph) carries: torch.compile's on-disk caches key a graph by its
# code and constants, not by the operator's implementation, so a graph compiled by a ringseq
# whose operator saved other tensors would be reused (its backward then unpacks another list).
# Raise it whenever the operator's fake outputs change.
OPERATOR_FORMAT = 3  # 2: the ring placements save the control counts their backwards name;
#                     3: the Ulysses placement too
_FORMAT_FIELD = f"format{OPERATOR_FORMAT}"


@functools.lru_cache(maxsize=256)
def _scalars_from_key(key: str) -> AttnSpec:
    fmt, fn, scale, causal, left, right, softcap, be, gdt, grad = key.split("|")
    if fmt != _FORMAT_FIELD:
        raise ValueError(f"a key of format {fmt!r}, not this ringseq's {_FORMAT_FIELD!r}")
    return AttnSpec(fn=fn, softmax_scale=float.fromhex(scale),
                    mask=AttnMask(causal=causal == "1", window=(int(left), int(right))),
                    softcap=float.fromhex(softcap), backend=backend_by_key(be),
                    grad_comm_dtype=getattr(torch, gdt), needs_grad=grad == "1")


def spec_from_key(key: str, documents: Optional[torch.Tensor] = None,
                  spans: Optional[torch.Tensor] = None) -> AttnSpec:
    """The spec :meth:`AttnSpec.key` encoded, with the documents and spans given beside it.
    ValueError for a string no :meth:`AttnSpec.key` made (the operator called by hand)."""
    try:
        spec = _scalars_from_key(key)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"ringseq::attention: spec must be a key made by AttnSpec.key() of "
                         f"this ringseq (10 fields separated by '|', the first "
                         f"{_FORMAT_FIELD!r}), got {key!r}") from None
    if documents is None and spans is None:
        return spec
    mask = spec.mask if documents is None else dataclasses.replace(
        spec.mask, cu_seqlens=tuple(documents.tolist()))
    return dataclasses.replace(spec, mask=mask, spans=spans)


GRAD_COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_grad_comm_dtype(fn: str, grad_comm_dtype) -> None:
    """ValueError / TypeError naming ``fn`` unless ``grad_comm_dtype`` is one the ring takes."""
    _resolve_grad_comm_dtype(fn, grad_comm_dtype, torch.float32, torch.float32)


def _resolve_grad_comm_dtype(fn: str, grad_comm_dtype, dtype: torch.dtype,
                             acc: torch.dtype) -> torch.dtype:
    """None -> the accumulation dtype; "input" -> ``dtype``; one of :data:`GRAD_COMM_DTYPES`
    as is (float8 cannot be added to: the travelling partial gradients are sums)."""
    if grad_comm_dtype is None:
        return acc
    if isinstance(grad_comm_dtype, str) and grad_comm_dtype == "input":
        return dtype
    if grad_comm_dtype in GRAD_COMM_DTYPES:
        return grad_comm_dtype
    kind = ValueError if isinstance(grad_comm_dtype, (str, torch.dtype)) else TypeError
    raise kind(f"{fn}: grad_comm_dtype must be None, 'input', torch.float16, torch.bfloat16, "
               f"torch.float32 or torch.float64, got {grad_comm_dtype!r}")


def attn_spec(fn: str, q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False,
              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
              backend=None, grad_comm_dtype=None, documents=None, varlen: bool = False,
              needs_grad: Optional[bool] = None, form: InputForm = FLASH_FORM) -> AttnSpec:
    """Validates one attention call and resolves its defaults (see the module doc).

    Args:
        fn: the public function's name (every error names it).
        q: (b, s_q, h, d); k, v: (b, s_k, h_kv, d): this rank's tensors (checked by
            :func:`ringseq.kernels.checks.check_qkv`).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic:
            flash-attn's arguments (``deterministic`` must be a bool and has no effect:
            ringseq's kernels are deterministic; the "sdpa" and "flash_attn" backends are as
            their library is).
        backend: a backend name, instance or None (:func:`ringseq.kernels.get_backend`).
        grad_comm_dtype: None, ``"input"``, torch.float16, torch.bfloat16, torch.float32 or
            torch.float64 (ring calls).
        documents: GLOBAL document boundaries of a packed sequence (sequence-parallel calls),
            or None.
        varlen: the call packs sequences (its kernel spans come from :func:`local_spans`).
        needs_grad: default: grad mode and any input requiring grad.
        form: how the caller passed q, k, v (its names and shapes in the errors).

    Raises TypeError / ValueError / NotImplementedError naming ``fn`` and the argument.
    """
    count_check("attn_spec")
    check_dropout(fn, dropout_p)
    check_softmax_scale(fn, softmax_scale)
    check_bool(fn, "causal", causal)
    window = parse_window(fn, window_size)
    softcap = check_softcap(softcap, fn)
    check_alibi_slopes(fn, alibi_slopes)
    check_bool(fn, "deterministic", deterministic)
    check_qkv(q, k, v, fn=fn, form=form)
    if documents is not None:
        documents = check_cu_seqlens(fn, "cu_seqlens", documents)
    be = get_backend(backend, q.device, q.dtype, q.shape[-1], fn=fn, softcap=softcap,
                     spans=varlen or window != (-1, -1) or documents is not None)
    acc = be.accum_dtype(q.dtype)
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return AttnSpec(fn=fn, softmax_scale=resolve_scale(softmax_scale, q.shape[-1]),
                    mask=AttnMask(causal=causal, window=window, cu_seqlens=documents),
                    softcap=softcap, backend=be,
                    grad_comm_dtype=_resolve_grad_comm_dtype(fn, grad_comm_dtype, q.dtype, acc),
                    needs_grad=bool(needs_grad))


def local_spans(spec: AttnSpec, seqlen_q: int, seqlen_k: int, cu_seqlens_q=None,
                cu_seqlens_k=None, window_clamp: Optional[int] = None) -> AttnSpec:
    """``spec`` with the kernel spans of local attention over ``seqlen_q`` queries and
    ``seqlen_k`` keys: one span per document (``cu_seqlens_q`` / ``cu_seqlens_k``, validated by
    the caller, else the spec's own documents, which then cover both), each with the spec's
    window as a bottom-right aligned band; unchanged for plain (causal) attention.
    ``window_clamp``: flash-attn 2's rule for a window side given as wide as this or
    unbounded (its kernels clamp at ``seqlen_k``, varlen at ``max_seqlen_k``): a side at least
    this wide is unbounded, and with the left side bounded an unbounded right side is this
    wide, which hides every key from the first ``seqlen_q - seqlen_k - window_clamp`` rows of
    a document with that many more queries than keys (the left side never binds at this
    width)."""
    if cu_seqlens_q is None:
        if spec.window == (-1, -1) and spec.documents is None:
            return spec
        cu_seqlens_q = cu_seqlens_k = spec.documents or (0, seqlen_q)
        if spec.documents is None:
            cu_seqlens_k = (0, seqlen_k)
    window = spec.window
    if window_clamp is not None:
        window = tuple(-1 if w >= window_clamp else w for w in window)
        if window[0] >= 0 and window[1] < 0:  # (flash-attn's set_params_fprop; no wider than
            window = (window[0], min(window_clamp, UNBOUNDED))  # int64 spans hold)
    rows = [sp for sp in spans_of_documents(cu_seqlens_q, cu_seqlens_k, spec.causal, window)
            if sp[1] > 0 and sp[3] > 0]  # empty documents give nothing: out 0, lse -inf
    spans = as_spans_tensor(rows) if rows else torch.zeros((0, 6), dtype=torch.int64)
    return dataclasses.replace(spec, spans=spans)


def check_self_attention(spec: AttnSpec, q, k, form: InputForm = FLASH_FORM) -> None:
    """Sequence-parallel attention splits ONE sequence: q and k/v shards of the same length
    (named as ``form`` says the caller passed them)."""
    if q.shape[1] != k.shape[1]:
        a, b, c = form.names
        raise ValueError(f"{spec.fn}: {a} and {b}/{c} must be shards of one sequence (the same "
                         f"local length), got {a} {form.shape(q)} and {b} {form.shape(k)}")


def check_layout(spec: AttnSpec, layout, world_size: int, s_local: int,
                 documents_name: str = "cu_seqlens") -> None:
    """A sequence-parallel call of ``spec`` on local shards of ``s_local`` tokens over
    ``world_size`` ranks placed by ``layout`` (bound to the call's documents): the documents
    must be the GLOBAL boundaries, the layout must take the local length, and the backend must
    compute a block's gradients from a ring's merged out/lse. ValueError naming ``spec.fn``.
    (A user's layout is checked further where the ring plans the call:
    :func:`check_user_layout`.)"""
    check_global_documents(spec, world_size, s_local, documents_name)
    try:
        layout.check_local_seqlen(s_local, world_size)
    except (ValueError, NotImplementedError) as exc:  # (a user's layout may raise its own)
        raise named_layout_error(spec, exc) from None
    # (a forward without a backward needs no such gradients: inference runs on any backend)
    if world_size > 1 and spec.needs_grad and not spec.backend.supports_global_backward:
        raise ValueError(f"{spec.fn}: backend {spec.backend.name!r} cannot compute a block's "
                         f"gradients from the merged output of a ring; use backend='ringseq' "
                         f"or 'reference' for training (a forward without gradients runs on "
                         f"it)")


def check_user_layout(spec: AttnSpec, layout, world_size: int, s_local: int) -> None:
    """A user's layout: its positions a permutation, its causal tasks inside the shard (each
    checked once per length; nothing for a built-in layout), where the ring plans a call
    (``engine.plan.make_plan``). ValueError (NotImplementedError for a missing method)
    naming ``spec.fn``."""
    try:
        layout.check_positions(s_local * world_size, world_size)
        if spec.mask.plain and spec.mask.causal:  # (the one schedule _tasks makes)
            layout.check_tasks(world_size, s_local)
    except (ValueError, NotImplementedError) as exc:  # (a user's layout may raise its own)
        raise named_layout_error(spec, exc) from None


def named_layout_error(spec: AttnSpec, exc: BaseException) -> BaseException:
    kind = NotImplementedError if isinstance(exc, NotImplementedError) else ValueError
    return with_message(exc, f"{spec.fn}: {exc}", fallback=kind)


def documents_name(cu_seqlens) -> str:
    """Where a call's documents came from, for its errors: its ``cu_seqlens``, or (None) its
    layout's own boundaries."""
    return ("cu_seqlens" if cu_seqlens is not None else
            "the boundaries of layout Documents(cu_seqlens)")


def check_global_documents(spec: AttnSpec, world_size: int, s_local: int,
                           documents_name: str = "cu_seqlens", layouts: bool = True) -> None:
    """The call's documents (``documents_name``: where the caller gave them) end at the
    global length, ``s_local`` tokens on each of ``world_size`` ranks; ValueError naming
    ``spec.fn`` (and the per-rank boundaries ring-flash-attention passes, when they look like
    them; ``layouts``: the call places tokens by a layout, whose documents forms the message
    names)."""
    total = s_local * world_size
    if spec.documents is None or spec.documents[-1] == total:
        return
    hint = ""
    if spec.documents[-1] == s_local:
        hint = (" (per-rank boundaries, as ring-flash-attention passes them? Its shards, each "
                "document cut into W pieces, are layout='documents_contiguous' "
                "(zigzag_ring_...: 'documents_zigzag'); the default 'documents' places other "
                "tokens on each rank)" if layouts else
                " (per-rank boundaries, as ring-flash-attention passes them? Pass those of the "
                "whole sequence, whose contiguous shards the ranks hold)")
    raise ValueError(
        f"{spec.fn}: {documents_name} must be the GLOBAL document boundaries of the whole "
        f"packed sequence (the same on every rank, ending at the global length {total} = "
        f"local length {s_local} x world size {world_size}), got boundaries ending at "
        f"{spec.documents[-1]}{hint}")


def named_layout(fn: str, layout, takes_documents: bool = True):
    """The :class:`ringseq.layouts.Layout` ``layout`` names (or is); ValueError naming ``fn``.
    ``takes_documents=False``: ``fn`` has no ``cu_seqlens`` argument, so a per-batch documents
    layout (``"documents"``, ...), which needs each batch's boundaries, is refused here rather
    than at every call with advice ``fn`` cannot follow."""
    from .layouts import get_layout
    from .layouts.base import check_hashable
    from .layouts.documents import PerBatchDocuments
    lay = get_layout(layout, fn)
    check_hashable(fn, lay)
    if not takes_documents and isinstance(lay, PerBatchDocuments):
        raise ValueError(
            f"{fn}: layout {lay.name!r} is per batch: it needs each batch's GLOBAL document "
            f"boundaries, which {fn} does not take; pass a layout bound to them, "
            f"ringseq.layouts.{lay.cls.__name__}(cu_seqlens), or call the flash-attn form, "
            f"which takes them: ringseq.ring_flash_attn_func or, on a hybrid mesh, "
            f"ringseq.usp_attn_func (..., layout={lay.name!r}, cu_seqlens=...)")
    return lay


def bound_layout(fn: str, layout, documents):
    """``layout`` bound to a call's GLOBAL ``documents`` (the per-batch documents layouts need
    them; a layout built for other boundaries refuses them); ValueError naming ``fn``."""
    try:
        return layout.bind(documents)
    except ValueError as exc:
        raise ValueError(f"{fn}: {exc}") from None
