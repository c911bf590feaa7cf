"""Checks of the non-tensor arguments of the public attention functions.

Every public entry point (``flash_attn_func`` and its packed forms, the ring functions, their
flash-attn / ring-flash-attention named bindings, ``ring_sdpa``) runs its scalar arguments
through these checks before any work, so that a call written for another signature fails
loudly instead of running as something else. Each error names the function, the parameter,
what was given and what is expected:

- ``TypeError``: a value of the wrong kind (a bool or None where a number is expected, a
  non-bool flag, a tensor as a scale).
- ``ValueError``: a value of the right kind outside its range (a negative dropout, a NaN
  scale).
- ``NotImplementedError``: a valid flash-attn value for a feature ringseq does not have
  (dropout, ALiBi, sliding windows, softcapping).

:func:`check_window_softcap` is the one place where ``window_size`` and ``softcap`` are
interpreted; the sliding-window work replaces its "not implemented" branch.
"""
from __future__ import annotations

import math
import numbers
from typing import Tuple

import torch

__all__ = ["autocast_inputs", "check_bool", "check_dropout", "check_alibi_slopes", "check_softmax_scale",
           "check_window_softcap", "check_flash_args", "split_kv", "split_qkv"]

WINDOW_OFF = (-1, -1)
SOFTCAP_OFF = 0.0

_SYM_NUMBERS = tuple(t for t in (getattr(torch, "SymFloat", None), getattr(torch, "SymInt", None))
                     if t is not None)


def _is_number(x) -> bool:
    # bool is an int in Python, but never a number here (a flag passed in a number's place)
    return (isinstance(x, numbers.Real) or isinstance(x, _SYM_NUMBERS)) and not isinstance(x, bool)


def _finite(x) -> bool:
    # comparisons, not math.isfinite: they also work on symbolic floats under torch.compile
    return -math.inf < x < math.inf


def _given(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a torch.Tensor of shape {tuple(x.shape)}"
    return f"{x!r} ({type(x).__name__})"


def check_bool(fn: str, name: str, value) -> bool:
    """``value`` itself when it is a bool; TypeError naming ``name`` otherwise (0/1, None and
    tensors are refused: a flag is never inferred from a number)."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool (True or False), got {_given(value)}")
    return value


def check_softmax_scale(fn: str, softmax_scale, name: str = "softmax_scale"):
    """None (the default ``headdim ** -0.5``) or a finite real number, else TypeError /
    ValueError naming ``name``. Returns the value unchanged."""
    if softmax_scale is None:
        return None
    if not _is_number(softmax_scale):
        raise TypeError(f"{fn}: {name} must be a float or None (None: headdim ** -0.5), got "
                        f"{_given(softmax_scale)}")
    if not _finite(softmax_scale):
        raise ValueError(f"{fn}: {name} must be finite, got {softmax_scale!r}")
    return softmax_scale


# ringseq <= 0.1 took (q, k, v, softmax_scale, causal, ...): such a positional call now puts
# the scale into dropout_p, which always fails; say why.
_ORDER_HINT = (". Note: the 4th positional argument is dropout_p, as in flash-attn; pass the "
               "scale as softmax_scale=")


def check_dropout(fn: str, dropout_p) -> None:
    """ringseq has no attention dropout: ``dropout_p`` must be a number, and 0.

    flash-attn applies ``dropout_p`` whenever it is given (its functions have no train/eval
    switch; model code passes ``self.dropout if self.training else 0.0``). Any
    ``dropout_p > 0`` raises NotImplementedError, in training and in evaluation alike, rather
    than silently computing attention without dropout."""
    if not _is_number(dropout_p):
        raise TypeError(f"{fn}: dropout_p must be a float in [0, 1), got {_given(dropout_p)}"
                        f"{_ORDER_HINT}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"{fn}: dropout_p must be in [0, 1), got {dropout_p!r}{_ORDER_HINT}")
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"{fn}: dropout_p={dropout_p!r} is not supported: ringseq has no attention dropout "
            f"(pass 0.0, in training too: `p if self.training else 0.0` becomes 0.0)"
            f"{_ORDER_HINT}")


def check_alibi_slopes(fn: str, alibi_slopes) -> None:
    """ALiBi is not implemented: anything but None raises NotImplementedError."""
    if alibi_slopes is not None:
        raise NotImplementedError(f"{fn}: alibi_slopes is not supported by ringseq (got "
                                  f"{_given(alibi_slopes)}); pass alibi_slopes=None")


def check_window_softcap(fn: str, window_size=WINDOW_OFF,
                         softcap=SOFTCAP_OFF) -> Tuple[Tuple[int, int], float]:
    """The one interpretation of flash-attn's ``window_size`` and ``softcap``.

    ``window_size`` is ``(left, right)`` with ints, ``-1`` meaning unbounded on that side;
    ``softcap`` is a number, 0.0 meaning off. Returns ``((left, right), softcap)`` normalized;
    malformed values raise TypeError / ValueError naming the parameter.
    """
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                        for w in window_size)):
        raise TypeError(f"{fn}: window_size must be a pair of ints (left, right), (-1, -1) "
                        f"for no window, got {_given(window_size)}")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise ValueError(f"{fn}: window_size entries must be >= 0, or -1 for unbounded, got "
                         f"{tuple(window_size)}")
    if not _is_number(softcap):
        raise TypeError(f"{fn}: softcap must be a float (0.0: off), got {_given(softcap)}")
    if not (_finite(softcap) and softcap >= 0):
        raise ValueError(f"{fn}: softcap must be a finite float >= 0 (0.0: off), got "
                         f"{softcap!r}")
    return (left, right), float(softcap)


def check_flash_args(fn: str, *, dropout_p, softmax_scale, causal, window_size=WINDOW_OFF,
                     softcap=SOFTCAP_OFF, alibi_slopes=None, deterministic=False,
                     return_attn_probs=False, return_lse=False) -> None:
    """Every non-tensor argument of a flash-attn style call (see the module docstring).

    ``deterministic`` must be a bool and has no effect: ringseq's own kernels (the default
    backend, CPU and CUDA) are deterministic (fixed accumulation order, no atomics), forward
    and backward; the "sdpa" and "flash_attn" backends are as deterministic as their library.
    ``return_attn_probs`` and ``return_lse`` must be bools and not both True (they ask for
    different return conventions)."""
    check_dropout(fn, dropout_p)
    check_softmax_scale(fn, softmax_scale)
    check_bool(fn, "causal", causal)
    check_window_softcap(fn, window_size, softcap)
    check_alibi_slopes(fn, alibi_slopes)
    check_bool(fn, "deterministic", deterministic)
    check_bool(fn, "return_attn_probs", return_attn_probs)
    check_bool(fn, "return_lse", return_lse)
    if return_attn_probs and return_lse:
        raise ValueError(f"{fn}: pass return_attn_probs=True (flash-attn's (out, softmax_lse, "
                         f"None)) or return_lse=True (ringseq's (out, lse)), not both")


def _check_packed(fn: str, name: str, t, n: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor {layout}, got {_given(t)}")
    if t.dim() != 5 or t.shape[2] != n:
        raise ValueError(f"{fn}: {name} must be {layout}, got shape {tuple(t.shape)}")


def autocast_inputs(q, k, v):
    """q, k, v in autocast's dtype when autocast is on for their device (float64 and
    non-float tensors excepted), as ``F.scaled_dot_product_attention`` does: under autocast
    models hand over mixed dtypes (transformers' RoPE returns float32 q/k next to a bf16 v),
    which the kernels would refuse."""
    dev = q.device.type
    if not torch.is_autocast_enabled(dev):
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (q, k, v))


def split_kv(fn: str, kv):
    """(k, v) as strided views of ``kv`` (batch, seqlen_k, 2, nheads_kv, headdim); ValueError
    for another shape. Gradients come back packed."""
    _check_packed(fn, "kv", kv, 2, "(batch, seqlen, 2, nheads_kv, headdim)")
    return kv[:, :, 0], kv[:, :, 1]


def split_qkv(fn: str, qkv):
    """(q, k, v) as strided views of ``qkv`` (batch, seqlen, 3, nheads, headdim)."""
    _check_packed(fn, "qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)")
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
