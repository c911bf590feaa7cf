"""Input checks shared by every attention backend.

The extension repeats the same checks in C++ (csrc/ops.cpp) for direct ``torch.ops`` callers;
these give the same errors for the Python backends and before any work starts.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Tuple

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # (a torch built without distributed: no tensor is one)
    DTensor = ()

#: ``RINGSEQ_DEBUG_CHECKS=1``: the engine's trusted kernel calls validate their inputs again
#: (normally an entry point validates once, see ringseq.spec).
DEBUG_CHECKS = os.environ.get("RINGSEQ_DEBUG_CHECKS", "0").strip() not in ("", "0")

#: Validations run so far in this process, by name (tests count them per call).
CHECK_COUNTS: Counter = Counter()


def count_check(name: str) -> None:
    # Not while dynamo traces: it would replay the increment and guard on the counter's
    # value, so every later call would recompile (and fullgraph hit its recompile limit).
    if not torch.compiler.is_compiling():
        CHECK_COUNTS[name] += 1


FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of lse, delta and gradient accumulators: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def resolve_scale(softmax_scale, headdim: int) -> float:
    """The softmax scale of a call: ``headdim ** -0.5`` when None, else ``softmax_scale`` as a
    float. The one place the default is applied (public entry points call it once)."""
    return headdim ** -0.5 if softmax_scale is None else float(softmax_scale)


def given(x) -> str:
    """How a value appears in an error message: a tensor by its shape, an array by its type and
    shape, anything else by its repr cut to 200 characters (before: a nested list given for q
    put its whole repr, 5 million characters, into the message)."""
    if isinstance(x, torch.Tensor):
        return f"a torch.Tensor of shape {tuple(x.shape)}"
    shape = getattr(x, "shape", None)
    if isinstance(shape, tuple) and shape and all(isinstance(n, int) for n in shape):
        # (an array; a NumPy scalar, shape (), shows its value)
        return f"a {type(x).__module__}.{type(x).__name__} of shape {shape}"
    text = repr(x)
    if len(text) > 200:
        text = f"{text[:160]} ... ({len(text)} characters)"
    return f"{text} ({type(x).__name__})"


def is_bool(value) -> bool:
    """A bool, NumPy's included (NumPy 2 names its type ``bool``, NumPy 1 ``bool_``)."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy"
                                       and kind.__name__ in ("bool", "bool_"))


def check_bool(fn: str, name: str, value) -> bool:
    """``value`` as a Python bool when it is a bool (NumPy's included, as :func:`is_bool`);
    TypeError naming ``name`` otherwise (0/1, None and tensors are refused: a flag is never
    inferred from a number)."""
    if not is_bool(value):
        raise TypeError(f"{fn}: {name} must be a bool (True or False), got {given(value)}")
    return bool(value)


def check_tensor_of_rank(fn: str, name: str, t, dims: int, layout: str) -> None:
    """TypeError (naming ``fn`` and ``name``) unless ``t`` is a tensor, ValueError unless it
    has ``dims`` dimensions (``layout`` names them): the words of every entry point's tensors."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a {dims}-dim tensor {layout}, got {given(t)}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be a {dims}-dim tensor {layout}, got {t.dim()} dims "
                         f"with shape {tuple(t.shape)}")


@dataclasses.dataclass(frozen=True)
class InputForm:
    """How the caller passed q, k, v: its names for them, the shapes it gives them
    (``layouts``: q's, then k's and v's) and their kind (``"flash"``: flash-attn's (b, s, h, d);
    ``"sdpa"``: SDPA's (b, h, s, d), transposed; ``"varlen"``: (total, h, d), a batch of one).
    :meth:`to_flash` checks and converts them; the errors after it name them as given."""

    names: Tuple[str, str, str] = ("q", "k", "v")
    kind: str = "flash"
    layouts: Tuple[str, str] = ("(batch, seqlen_q, nheads, headdim)",
                                "(batch, seqlen_k, nheads_kv, headdim)")

    def shape(self, t: torch.Tensor) -> tuple:
        """``t``'s shape as the caller gave it."""
        s = tuple(t.shape)
        if self.kind == "sdpa":
            return (s[0], s[2], s[1], s[3])
        return s[1:] if self.kind == "varlen" else s

    def to_flash(self, fn: str, q, k, v) -> tuple:
        """(q, k, v) as flash-attn's (b, s, h, d) views of the tensors as given in this form;
        TypeError (naming ``fn`` and the argument) for a non-tensor, ValueError for another
        number of dimensions. The one check of the tensors' kind and rank for every form."""
        dims = 3 if self.kind == "varlen" else 4
        for name, t, layout in zip(self.names, (q, k, v), self.layouts + self.layouts[1:]):
            check_tensor_of_rank(fn, name, t, dims, layout)
        if self.kind == "sdpa":
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.kind == "varlen":
            return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # (1, total, h, d) views
        return q, k, v

    def packed(self, packed: str) -> "InputForm":
        """This form for a call given ``packed`` (``"kv"`` or ``"qkv"``) instead of those
        tensors: they are named as its parts ("qkv's k part"), what the caller can fix."""
        parts = tuple(f"{packed}'s {name} part" for name in packed)
        return dataclasses.replace(self, names=self.names[:3 - len(parts)] + parts)


FLASH_FORM = InputForm()
SDPA_FORM = InputForm(("query", "key", "value"), "sdpa",
                      ("(batch, nheads, seqlen, headdim)", "(batch, nheads_kv, seqlen, headdim)"))
VARLEN_FORM = InputForm(kind="varlen", layouts=("(total, nheads, headdim)",
                                                "(total, nheads_kv, headdim)"))
# (the ring's varlen functions take each rank's share of the packed tokens)
RING_VARLEN_FORM = InputForm(kind="varlen", layouts=("(total_local, nheads, headdim)",
                                                     "(total_local, nheads_kv, headdim)"))


def refuse_dtensors(fn: str, named) -> None:
    """TypeError naming ``fn`` when a tensor of ``named`` ((name, tensor) pairs) is a DTensor:
    ringseq's operators take each rank's local tensors (before: DTensor's "no sharding strategy
    registered" for ringseq's operator, or its advice to make every input a DTensor)."""
    distributed = [n for n, t in named if isinstance(t, DTensor)]
    if distributed:
        names = ", ".join(n for n, _ in named[:-1]) + f" and {named[-1][0]}"
        raise TypeError(f"{fn}: {names} must be this rank's local tensors, got "
                        f"{', '.join(distributed)} as DTensor: pass .to_local() of each (a "
                        f"tensor-parallel projection with use_local_output=True gives them)")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fn: str = "attention",
              form: InputForm = FLASH_FORM) -> None:
    """Raises (naming ``fn``, and the tensors as ``form`` says the caller passed them) when
    q (b, s_q, h, d), k, v (b, s_k, h_kv, d) do not fit together: TypeError for a non-tensor,
    ValueError for shapes, dtypes, devices and strides."""
    count_check("check_qkv")
    a, b, c = form.names
    sh = form.shape
    # (tensors of another form come converted by its to_flash, which checked them as given)
    FLASH_FORM.to_flash(fn, q, k, v)
    refuse_dtensors(fn, ((a, q), (b, k), (c, v)))
    on_meta = [n for n, t in ((a, q), (b, k), (c, v)) if t.device.type == "meta"]
    if on_meta:  # no data: a kernel would read garbage
        raise ValueError(f"{fn}: {a}, {b} and {c} must be tensors with data (CPU or CUDA), got "
                         f"{', '.join(on_meta)} on the meta device")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: {a}, {b} and {c} must be on the same device, got {a} on "
                         f"{q.device}, {b} on {k.device}, {c} on {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: {a}, {b} and {c} must have the same dtype, got {a} {q.dtype}, "
                         f"{b} {k.dtype}, {c} {v.dtype}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: {a}, {b} and {c} must be float32, float64, bfloat16 or "
                         f"float16, got {q.dtype}")
    shapes = f"{a} {sh(q)}, {b} {sh(k)}, {c} {sh(v)}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"{fn}: {a}, {b} and {c} must have the same batch size, got {shapes}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"{fn}: {a}, {b} and {c} must have the same head dim (last "
                         f"dimension), got {shapes}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: {b} and {c} must have the same shape, got {b} {sh(k)} and "
                         f"{c} {sh(v)}")
    if k.shape[2] == 0:
        raise ValueError(f"{fn}: {b} and {c} need at least one head, got {b} {sh(k)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{fn}: nheads of {a} must be divisible by nheads_kv of {b} and {c}, "
                         f"got nheads={q.shape[2]} and nheads_kv={k.shape[2]}")
    if q.shape[3] == 0:
        raise ValueError(f"{fn}: headdim must be positive, got {a} {sh(q)}")
    for name, t in ((a, q), (b, k), (c, v)):
        if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:  # (empty: nothing to read)
            raise ValueError(f"{fn}: {name} must be contiguous in its last (head) dimension, got "
                             f"a stride of {t.stride(-1)} there; call .contiguous() on it (only "
                             f"the last dimension needs to be contiguous)")


def no_key_rows(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of leading query rows that see no key (bottom-right causal alignment)."""
    if seqlen_k == 0:
        return seqlen_q
    if not causal:
        return 0
    # row i sees key 0 iff 0 <= i + s_k - s_q
    return max(0, min(seqlen_q, seqlen_q - seqlen_k))


def causal_mask(seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """Boolean (s_q, s_k) mask, True where key j is visible to query i: j <= i + s_k - s_q."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)
