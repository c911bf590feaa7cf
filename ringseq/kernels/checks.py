"""Input checks shared by every attention backend.

The extension repeats the same checks in C++ (csrc/ops.cpp) for direct ``torch.ops`` callers;
these give the same errors for the Python backends and before any work starts.
"""
from __future__ import annotations

import os
from collections import Counter

import torch

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


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fn: str = "attention") -> None:
    """Raises (naming ``fn``) when q (b, s_q, h, d), k, v (b, s_k, h_kv, d) do not fit
    together: TypeError for a non-tensor, ValueError for shapes, dtypes, devices and strides."""
    count_check("check_qkv")
    for name, t, layout in (("q", q, "(batch, seqlen_q, nheads, headdim)"),
                            ("k", k, "(batch, seqlen_k, nheads_kv, headdim)"),
                            ("v", v, "(batch, seqlen_k, nheads_kv, headdim)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor {layout}, got "
                            f"{type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be a 4-dim tensor {layout}, got {t.dim()} dims "
                             f"with shape {tuple(t.shape)}")
    on_meta = [n for n, t in (("q", q), ("k", k), ("v", v)) if t.device.type == "meta"]
    if on_meta:  # no data: a kernel would read garbage
        raise ValueError(f"{fn}: q, k and v must be tensors with data (CPU or CUDA), got "
                         f"{', '.join(on_meta)} on the meta device")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k and v must be on the same device, got q on {q.device}, "
                         f"k on {k.device}, v on {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k and v must have the same dtype, got q {q.dtype}, "
                         f"k {k.dtype}, v {v.dtype}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: q, k and v must be float32, float64, bfloat16 or float16, got "
                         f"{q.dtype}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"{fn}: q, k and v must have the same batch size, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"{fn}: q, k and v must have the same head dim (last dimension), got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have the same shape, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    if k.shape[2] == 0:
        raise ValueError(f"{fn}: k and v need at least one head (flash-attn's layout: "
                         f"(batch, seqlen, nheads_kv, headdim)), got k {tuple(k.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{fn}: nheads of q must be divisible by nheads_kv of k and v, got "
                         f"nheads={q.shape[2]} and nheads_kv={k.shape[2]}")
    if q.shape[3] == 0:
        raise ValueError(f"{fn}: headdim must be positive, got q {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
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
