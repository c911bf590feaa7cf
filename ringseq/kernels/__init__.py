"""Attention backends behind one contract (see base.AttentionBackend).

``get_backend(name, device, dtype, headdim)`` returns one of:
  "ringseq"     this package's C++/CUDA kernels (default wherever they support the inputs)
  "sdpa"        torch's fused attention ops that return the log-sum-exp
  "reference"   plain math in float32 (float64 for float64 inputs)
  "flash_attn"  the flash-attn package, when installed (CUDA, fp16/bf16)
"""
from __future__ import annotations

import operator

import torch

from .registry import backend_by_key, backend_key
from .base import AttentionBackend, compute_delta
from .checks import FLOAT_DTYPES, accum_dtype, check_qkv, resolve_scale
from .extension import (ExtensionBackend, extension_available, extension_has_cuda,
                        forced_level_error)
from .flash_attn import FlashAttnBackend, flash_attn_module
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .spans import UNBOUNDED, Span, as_spans_tensor, document_spans, window_band

BACKEND_NAMES = ("ringseq", "sdpa", "reference", "flash_attn")

_INSTANCES: dict = {}


def _instance(name: str) -> AttentionBackend:
    return ExtensionBackend.instance(0) if name == "ringseq" else _INSTANCES[name]


# Created (and registered) at import: nothing a traced call touches is created lazily.
for _name, _cls in (("sdpa", SdpaBackend), ("reference", ReferenceBackend),
                    ("flash_attn", FlashAttnBackend)):
    backend_key(_INSTANCES.setdefault(_name, _cls()))
ExtensionBackend.instance(0)


def check_backend_name(fn: str, backend) -> None:
    """ValueError naming ``fn`` for an unknown backend name, TypeError for a value that is
    neither a name, None nor an :class:`AttentionBackend`."""
    if backend is None or isinstance(backend, AttentionBackend) or backend in BACKEND_NAMES:
        return
    kind = ValueError if isinstance(backend, str) else TypeError  # a name, or not one
    raise kind(f"{fn}: backend must be one of {', '.join(BACKEND_NAMES)}, None or an "
               f"AttentionBackend instance, got {backend!r}")


def get_backend(backend=None, device=None, dtype=None, headdim=None, *, spans: bool = False,
                softcap: float = 0.0, fn: str = "get_backend") -> AttentionBackend:
    """Resolves a backend name (or an AttentionBackend instance) for inputs on ``device``
    whose call needs ``spans`` (bands, windows, documents) and/or a ``softcap``.

    ``backend=None`` picks "ringseq" where its kernels support (device, dtype, headdim) and
    the features, else "sdpa" on CUDA (where it can: no soft-cap, no float64), else
    "reference". Raises RuntimeError (naming ``fn``) for a CPU ``device`` (given) and
    ``backend`` None or "ringseq" when ``RINGSEQ_CPU_ISA`` forces a level this CPU or build
    lacks; ValueError (naming ``fn``) for an unknown name (TypeError for a value that is not
    a name) and for a given backend (a name or an instance: the same checks) that cannot run
    such inputs; NotImplementedError naming the backends that can when a given backend
    cannot compute the features.
    """
    given_device = device is not None  # (apply checks a name before any input exists)
    device = torch.device("cpu") if device is None else torch.device(device)
    dtype_, headdim_ = dtype or torch.float32, headdim or 64
    if given_device and device.type == "cpu" and (
            backend is None or isinstance(backend, ExtensionBackend) or (
                isinstance(backend, str) and backend == "ringseq")):
        forced = forced_level_error()
        if forced is not None:  # (as documented: the level asked for, or an error naming it;
            # before: listed as available, then the kernel's error without the function's name)
            raise RuntimeError(f"{fn}: {forced}")

    def can(name) -> bool:
        be = _instance(name)
        return (be.unsupported_reason(device, dtype_, headdim_) is None
                and be.features_reason(spans=spans, softcap=softcap) is None)

    if backend is None:
        if can("ringseq"):
            return _instance("ringseq")
        if device.type == "cuda" and can("sdpa"):
            return _instance("sdpa")
        return _instance("reference")
    if isinstance(backend, AttentionBackend):
        # (an instance, a user's own included, is checked as its name would be: the engine's
        # block calls trust the spec and do not check again)
        chosen, label = backend, backend.name
    else:
        check_backend_name(fn, backend)
        chosen, label = _instance(backend), backend
    if dtype is not None:
        reason = chosen.unsupported_reason(device, dtype, headdim_)
        if reason is not None:
            raise ValueError(f"{fn}: backend {label!r} cannot run {dtype} inputs with head "
                             f"dim {headdim} on {device}: {reason}")
    # (the alternatives only on the way to an error: can() of 'flash_attn' imports the package,
    # which torch.compile(fullgraph=True) cannot trace where it is not installed)
    chosen.check_features(fn, spans=spans, softcap=softcap,
                          alternatives=lambda: [n for n in BACKEND_NAMES if n != label and can(n)])
    return chosen


def available_backends(device="cpu", dtype=torch.float32, headdim=64) -> list[str]:
    """Names of the backends (of ``BACKEND_NAMES``, in its order) that can run attention on
    inputs of ``dtype`` (float32, float64, bfloat16 or float16) with head dim ``headdim`` (an
    int >= 1) on ``device`` (a torch.device or its name) in this process.

    Raises TypeError for a device, dtype or head dim of the wrong kind, ValueError for a
    device name torch does not know, a dtype attention does not take or a head dim < 1."""
    fn = "available_backends"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{fn}: device must be a torch.device or its name, got {device!r} "
                        f"({type(device).__name__})")
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{fn}: device {device!r} is not a device torch knows ({exc})") from None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{fn}: dtype must be a torch.dtype, got {dtype!r} "
                        f"({type(dtype).__name__})")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: dtype must be one of {', '.join(map(str, FLOAT_DTYPES))} (what "
                         f"attention takes), got {dtype}")
    try:  # (NumPy's integers too; not a bool, a float or a tensor)
        if isinstance(headdim, (bool, torch.Tensor)):
            raise TypeError
        headdim = operator.index(headdim)
    except TypeError:
        raise TypeError(f"{fn}: headdim must be an int, got {headdim!r} "
                        f"({type(headdim).__name__})") from None
    if headdim < 1:
        raise ValueError(f"{fn}: headdim must be >= 1, got {headdim}")
    # (a RINGSEQ_CPU_ISA level this CPU lacks: every CPU kernel call raises)
    lacking = device.type == "cpu" and forced_level_error() is not None
    return [n for n in BACKEND_NAMES if _instance(n).unsupported_reason(device, dtype, headdim)
            is None and not (lacking and n == "ringseq")]


__all__ = [
    "AttentionBackend", "BACKEND_NAMES", "ExtensionBackend", "FlashAttnBackend",
    "ReferenceBackend", "SdpaBackend", "accum_dtype", "compute_delta", "available_backends",
    "check_backend_name", "check_qkv",
    "resolve_scale", "backend_by_key", "backend_key", "extension_available", "extension_has_cuda", "flash_attn_module",
    "get_backend", "UNBOUNDED", "Span", "as_spans_tensor", "document_spans", "window_band",
]
