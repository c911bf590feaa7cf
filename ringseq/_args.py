"""Parsers of the public attention functions' non-tensor arguments: the one place each rule is
written.

Every public entry point builds its :class:`ringseq.spec.AttnSpec` through these (see
``ringseq.spec.attn_spec``), so a call written for another signature fails loudly instead of
running as something else. Each error names the function, the parameter, what was given and
what is expected (``"{function}: {parameter} must be ..., got ..."``):

- ``TypeError``: a value of the wrong kind (a bool or None where a number is expected, a
  non-bool flag, a tensor as a scale).
- ``ValueError``: a value of the right kind outside its range (a negative dropout, a NaN
  scale, boundaries that decrease).
- ``NotImplementedError``: a valid flash-attn value for a feature ringseq does not have
  (dropout, ALiBi).
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
import sys
from typing import List, Optional, Tuple

import torch

from .kernels.checks import SDPA_FORM, check_bool, count_check, given, is_bool
from .kernels.spans import parse_window

__all__ = ["autocast_inputs", "check_alibi_slopes", "check_bool", "check_cu_seqlens",
           "check_dropout", "check_returns", "check_softmax_scale", "given", "is_bool",
           "parse_window", "sdpa_inputs", "split_kv", "split_qkv"]

WINDOW_OFF = (-1, -1)

_SYM_NUMBERS = tuple(t for t in (getattr(torch, "SymFloat", None), getattr(torch, "SymInt", None))
                     if t is not None)


def _is_number(x) -> bool:
    # bool is an int in Python, but never a number here (a flag passed in a number's place)
    return (isinstance(x, numbers.Real) or isinstance(x, _SYM_NUMBERS)) and not isinstance(x, bool)


def _finite(x) -> bool:
    # comparisons, not math.isfinite: they also work on symbolic floats under torch.compile
    return -math.inf < x < math.inf


def divisors(n: int) -> List[int]:
    """The divisors of ``n`` >= 1 in increasing order (trial division up to its square root:
    a prime world size of 1,000,000,007 takes 31,623 steps, not a billion)."""
    low, high = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            low.append(d)
            if d != n // d:
                high.append(n // d)
    return low + high[::-1]


#: Past this, an error message names "the divisors of n" instead of listing them (listing
#: would take minutes at int64 sizes; before: an error for world_size=2**40 never came).
LISTED_DIVISORS_MAX = 1 << 40


def shown_divisors(n: int):
    """``n``'s divisors for an error message: the list, or words for a huge ``n``."""
    return divisors(n) if n <= LISTED_DIVISORS_MAX else f"the divisors of {n}"


def as_int(value) -> Optional[int]:
    """``value`` as a Python int when it is an integer of any kind (NumPy's, a 0-d integer
    tensor), else None (a bool, a float, a string, a tensor of bools, of several elements or
    on the meta device: never read as a count)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return None
    if isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool
                                            or value.is_meta):
        return None  # (torch reads a 1-element tensor and True as indices too)
    try:
        return operator.index(value)
    except TypeError:  # (a float tensor, NumPy's bool)
        return None


def check_size_and_rank(fn: str, size_name: str, size, rank_name: str, rank,
                        owner: str = "") -> Tuple[int, int]:
    """(size, rank) as Python ints: a group's size >= 1 and a rank in [0, size). TypeError
    naming ``fn`` for values that are no ints, ValueError for others; ``owner`` (e.g. "the
    transport's ") names whose they are."""
    s, r = as_int(size), as_int(rank)
    if s is None or r is None:
        raise TypeError(f"{fn}: {owner}{size_name} and {rank_name} must be ints, got "
                        f"{size_name}={size!r}, {rank_name}={rank!r}")
    if s < 1 or not 0 <= r < s:
        raise ValueError(f"{fn}: {owner}{size_name} must be >= 1 and {'its ' if owner else ''}"
                         f"{rank_name} in [0, {size_name}), got {size_name}={s}, "
                         f"{rank_name}={r}")
    return s, r


def check_ignore_index(fn: str, ignore_index) -> int:
    """``ignore_index`` (the label of no target) as a Python int, of any int kind (NumPy's, a
    0-d tensor): the one rule of every function that takes it. TypeError for anything else (True
    or 0.5 would become a real target), ValueError outside int64 (labels are int64), both
    naming ``fn``."""
    value = as_int(ignore_index)
    if value is None:
        raise TypeError(f"{fn}: ignore_index must be an int, got {given(ignore_index)}")
    if not -2 ** 63 <= value < 2 ** 63:
        raise ValueError(f"{fn}: ignore_index must be an int64 (labels are int64), got {value}")
    return value


def int_if_integer(value):
    """``value`` as a Python int when it is an integer of any kind (:func:`as_int`: NumPy's
    sizes pass as ints), else ``value`` itself, for the caller's check to refuse and name."""
    number = as_int(value)
    return value if number is None else number


def check_softmax_scale(fn: str, softmax_scale, name: str = "softmax_scale"):
    """None (the default ``headdim ** -0.5``) or a finite real number, else TypeError /
    ValueError naming ``name``. Returns the value unchanged."""
    if softmax_scale is None:
        return None
    if not _is_number(softmax_scale):
        raise TypeError(f"{fn}: {name} must be a float or None (None: headdim ** -0.5), got "
                        f"{given(softmax_scale)}")
    if not _finite(softmax_scale):
        raise ValueError(f"{fn}: {name} must be finite, got {softmax_scale!r}")
    # (the kernels scale in float32 for 16- and 32-bit inputs: beyond its range, NaN outputs;
    # compared as a float: a NumPy float16 cast the bound to its own type, inf, with a warning)
    try:
        value = softmax_scale if isinstance(softmax_scale, (int, float) + _SYM_NUMBERS) else \
            float(softmax_scale)
    except OverflowError:  # (a Fraction past float's range)
        value = math.inf
    if not -_FLOAT32_MAX <= value <= _FLOAT32_MAX:
        raise ValueError(f"{fn}: {name} must be within float32's range (|scale| <= "
                         f"{_FLOAT32_MAX:.4g}), got {softmax_scale!r}")
    return softmax_scale


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


# ringseq <= 0.1 took (q, k, v, softmax_scale, causal, ...): such a positional call now puts
# the scale into dropout_p, which always fails; say why.
# Where a misplaced positional argument lands in dropout_p: flash-attn's order (q, k, v,
# dropout_p, softmax_scale, ...) and SDPA's (query, key, value, attn_mask, dropout_p, ...).
_ORDINALS = {1: "1st", 2: "2nd", 3: "3rd"}


@functools.lru_cache(maxsize=None)
def _order_hint(fn: str) -> str:
    """Where dropout_p sits among ``fn``'s positional arguments (a scale passed there by
    position is the usual mistake), from the public function's own signature."""
    # (the package is loaded by the time its functions are called; this layer below it does
    # not import it)
    package = sys.modules.get(__name__.rpartition(".")[0])
    try:
        names = list(inspect.signature(getattr(package, fn)).parameters)
        place = names.index("dropout_p") + 1
    except (AttributeError, TypeError, ValueError):
        return (". Note: dropout_p comes before softmax_scale among flash-attn's positional "
                "arguments; pass the scale as softmax_scale=")
    return (f". Note: the {_ORDINALS.get(place, f'{place}th')} positional argument of {fn} is "
            f"dropout_p, as in flash-attn; pass the scale as softmax_scale=")
_SDPA_ORDER_HINT = (". Note: the 5th positional argument is dropout_p, as in "
                    "F.scaled_dot_product_attention; pass the scale as scale=")


def check_dropout(fn: str, dropout_p, sdpa_order: bool = False) -> None:
    """ringseq has no attention dropout: ``dropout_p`` must be a number, and 0.

    flash-attn applies ``dropout_p`` whenever it is given (its functions have no train/eval
    switch; model code passes ``self.dropout if self.training else 0.0``). Any
    ``dropout_p > 0`` raises NotImplementedError, in training and in evaluation alike, rather
    than silently computing attention without dropout. ``sdpa_order``: the message's hint
    names SDPA's argument order instead of flash-attn's."""
    # (the hint is looked up only on the way to an error: compiled code never traces it)
    def hint():
        return _SDPA_ORDER_HINT if sdpa_order else _order_hint(fn)
    if not _is_number(dropout_p):
        raise TypeError(f"{fn}: dropout_p must be a float in [0, 1], got {given(dropout_p)}"
                        f"{hint()}")
    # (a probability, 1.0 included as torch's dropout takes it: then unsupported as any > 0)
    if not (0.0 <= dropout_p <= 1.0):
        raise ValueError(f"{fn}: dropout_p must be in [0, 1], got {dropout_p!r}{hint()}")
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"{fn}: dropout_p={dropout_p!r} is not supported: ringseq has no attention dropout "
            f"(pass 0.0, in training too: `p if self.training else 0.0` becomes 0.0)"
            f"{hint()}")


def check_alibi_slopes(fn: str, alibi_slopes) -> None:
    """ALiBi is not implemented: anything but None raises NotImplementedError."""
    if alibi_slopes is not None:
        raise NotImplementedError(f"{fn}: alibi_slopes is not supported by ringseq (got "
                                  f"{given(alibi_slopes)}); pass alibi_slopes=None")


@torch.compiler.disable(reason="ringseq reads document boundaries (cu_seqlens) given as a "
                        "tensor on the host, which a graph cannot: under "
                        "torch.compile(fullgraph=True) pass them as a list of ints")
def _boundaries_on_host(cu_seqlens: torch.Tensor) -> list:
    """The values of a boundaries tensor on the host. Under torch.compile, a graph break
    (without fullgraph, the code around it stays compiled) or, with fullgraph=True, dynamo's
    error carrying the reason above (a data-dependent read failed the trace with a message
    that named neither the argument nor the way out)."""
    return cu_seqlens.tolist()


def check_cu_seqlens(fn: str, name: str, cu_seqlens, total: Optional[int] = None,
                     what: str = "the packed length") -> Tuple[int, ...]:
    """Document boundaries ``(0, n_0, n_0 + n_1, ..., total)`` as a tuple of ints: a 1-D
    int32/int64 tensor (read on the host) or a sequence of ints, starting at 0, never
    decreasing and, when ``total`` is given, ending at it (``what`` names that length)."""
    count_check("check_cu_seqlens")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{fn}: {name} must be an int32 or int64 tensor (number of "
                            f"documents + 1,), got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"{fn}: {name} must be a 1-D tensor (number of documents + 1,), "
                             f"got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.is_meta:
            raise ValueError(f"{fn}: {name} must hold its values (they are read on the host), "
                             f"got a tensor on the meta device")
        cu = _boundaries_on_host(cu_seqlens)  # host copy: spans and layouts are planned on the host
    else:
        # A string is a sequence too: its characters are no boundaries.
        items = None if isinstance(cu_seqlens, str) else _as_list(cu_seqlens)
        if items is None or not all(isinstance(c, numbers.Integral) and not isinstance(c, bool)
                                    for c in items):
            raise TypeError(f"{fn}: {name} must be a 1-D int32 / int64 tensor or a sequence of "
                            f"ints, got {given(cu_seqlens)}")
        cu = items
    cu = tuple(int(c) for c in cu)
    if len(cu) < 2:
        raise ValueError(f"{fn}: {name} needs at least one sequence: (0, n_0, ...), the number "
                         f"of sequences + 1 entries, got {cu}")
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{fn}: {name} must start at 0 and never decrease (0, n_0, n_0 + n_1, "
                         f"...), got {cu}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"{fn}: {name} must end at {what} ({total}), got {cu[-1]}")
    return cu


def _as_list(value) -> Optional[list]:
    """``list(value)``, or None when ``value`` is not iterable."""
    try:
        return list(value)
    except TypeError:
        return None


def check_returns(fn: str, return_attn_probs, return_lse) -> None:
    """``return_attn_probs`` and ``return_lse`` must be bools and not both True (they ask for
    different return conventions)."""
    check_bool(fn, "return_attn_probs", return_attn_probs)
    check_bool(fn, "return_lse", return_lse)
    if return_attn_probs and return_lse:
        raise ValueError(f"{fn}: pass return_attn_probs=True (flash-attn's (out, softmax_lse, "
                         f"None)) or return_lse=True (ringseq's (out, lse)), not both")


def sdpa_inputs(fn: str, query, key, value, attn_mask, dropout_p, is_causal, scale,
                enable_gqa):
    """``F.scaled_dot_product_attention``'s arguments checked for a sequence-parallel SDPA form:
    returns (q, k, v) as (b, s, h, d) views of query / key / value (b, h, s, d). ``attn_mask``
    must be None (the mask comes from ``is_causal`` and the layout; ValueError), ``dropout_p``
    0 (NotImplementedError above 0, as :func:`check_dropout`)."""
    check_softmax_scale(fn, scale, name="scale")
    check_bool(fn, "is_causal", is_causal)
    check_bool(fn, "enable_gqa", enable_gqa)
    if attn_mask is not None:
        raise ValueError(f"{fn}: attn_mask must be None (the mask comes from is_causal and "
                         f"the layout; windows, soft-capping and packed documents are in the "
                         f"flash-attn-style forms, e.g. ring_flash_attn_func / usp_attn_func), "
                         f"got {given(attn_mask)}")
    check_dropout(fn, dropout_p, sdpa_order=True)
    q, k, v = SDPA_FORM.to_flash(fn, query, key, value)  # (b, s, h, d) views
    h, h_kv = q.shape[2], k.shape[2]
    if not enable_gqa and h != h_kv and h_kv != 1 and h_kv > 0 and h % h_kv == 0:
        # (heads that do not divide are refused by the common head check: enable_gqa would
        # not help them)
        # (as F.scaled_dot_product_attention refuses it; one K/V head it broadcasts)
        raise ValueError(f"{fn}: query has {h} heads and key {h_kv}: grouped-query attention "
                         f"needs enable_gqa=True, got enable_gqa=False")
    return q, k, v


def _check_packed(fn: str, name: str, t, n: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor {layout}, got {given(t)}")
    if t.dim() != 5 or t.shape[2] != n:
        raise ValueError(f"{fn}: {name} must be {layout}, got shape {tuple(t.shape)}")


def split_kv(fn: str, kv):
    """(k, v) as strided views of ``kv`` (batch, seqlen_k, 2, nheads_kv, headdim); ValueError
    for another shape. Gradients come back packed."""
    _check_packed(fn, "kv", kv, 2, "(batch, seqlen, 2, nheads_kv, headdim)")
    return kv[:, :, 0], kv[:, :, 1]


def split_packed_varlen(fn: str, name: str, t, n: int, heads: str):
    """The ``n`` tensors packed in ``t`` (total, n, nheads, headdim), as views (gradients come
    back packed); TypeError / ValueError naming ``fn`` and ``name`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor (total, {n}, {heads}, headdim), got "
                        f"{type(t).__name__}")
    if t.dim() != 4 or t.shape[1] != n:
        raise ValueError(f"{fn}: {name} must be (total, {n}, {heads}, headdim), got "
                         f"{tuple(t.shape)}")
    return t.unbind(1)


def split_qkv(fn: str, qkv):
    """(q, k, v) as strided views of ``qkv`` (batch, seqlen, 3, nheads, headdim)."""
    _check_packed(fn, "qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)")
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def autocast_inputs(q, k, v):
    """q, k, v in autocast's dtype when autocast is on for their device (float64 and
    non-float tensors excepted), as ``F.scaled_dot_product_attention`` does: under autocast
    models hand over mixed dtypes (transformers' RoPE returns float32 q/k next to a bf16 v),
    which the kernels would refuse."""
    if not isinstance(q, torch.Tensor):
        return q, k, v  # the spec's tensor check names the argument
    dev = q.device.type
    if dev == "meta" or not torch.is_autocast_enabled(dev):  # (meta: the spec's check names it)
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in (q, k, v))

