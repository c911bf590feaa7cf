"""ringseq: ring sequence parallelism for PyTorch with its own flash-attention kernels.

The attention functions take flash-attn 2's and ring-flash-attention's signatures under their
names (``flash_attn_func``, ``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``, ...), so
code written for either runs by changing the import (README: "Drop-in for flash-attn and
ring-flash-attention").

``import ringseq`` loads the attention API (single device and ring), layouts, data sharding
and the sharded loss; the training plugin (``ringseq.plugin``: DataLoader, DDP) loads on
first use of ``ringseq.Booster`` / ``ringseq.RingSequenceParallelPlugin`` / ``ringseq.Plugin``,
and transformers only through ``ringseq.integrations.transformers``.
"""
import warnings as _warnings

with _warnings.catch_warnings():
    # torch warns on import when NumPy is not installed ("Failed to initialize NumPy");
    # ringseq never uses NumPy, and the README's main-job install has none. Only this import
    # is silenced: the filter is restored afterwards.
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch as _torch  # noqa: F401

from ._dist import (RingBrokenError, RingDesyncError, RingError, RingMismatchError, RingPeerError,
                    RingTimeoutError, set_consistency_check, set_ring_timeout)
from .engine.integrity import call_tag
from .engine.ring import Ring, get_comm, get_ring, reset_ring
from .engine.sim import simulate_ring
from .engine.transport import RingComm, Transport
from .compat import (stripe_flash_attn_func, stripe_flash_attn_kvpacked_func,
                     stripe_flash_attn_qkvpacked_func, zigzag_ring_flash_attn_func,
                     zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func)
from .data import shard_batch
from .kernels import available_backends
from .kvcache import flash_attn_with_kvcache, ring_flash_attn_with_kvcache
from .gathering import unshard
from .layouts import Layout, get_layout, positions, register_layout, shard
from .loss import sharded_cross_entropy
from .nn import (RingAttention, ring_flash_attn_func, ring_flash_attn_kvpacked_func,
                 ring_flash_attn_qkvpacked_func, ring_flash_attn_varlen_func,
                 ring_flash_attn_varlen_kvpacked_func, ring_flash_attn_varlen_qkvpacked_func,
                 ring_sdpa)
from .ops import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                  flash_attn_varlen_qkvpacked_func, get_backend)
from .parallel.groups import SequenceParallelGroups, make_sp_groups
from .parallel.ulysses import ulysses_attn_func
from .parallel.usp import usp_attn_func, usp_sdpa
from .kernels.extension import cpu_isa  # the CPU kernel's ISA level

__version__ = "0.2.0"  # the one place: setup.py reads it

_PLUGIN_NAMES = ("Booster", "Plugin", "RingSequenceParallelPlugin")

_COMPAT_NAMES = ["flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
                 "zigzag_ring_flash_attn_qkvpacked_func", "stripe_flash_attn_func",
                 "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
                 "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func"]

__all__ = ["__version__", "available_backends", "flash_attn_func", "get_backend",
           "RingAttention", "RingComm", "RingMismatchError", "Layout", "Transport",
           "RingBrokenError", "RingDesyncError", "RingError", "RingPeerError", "RingTimeoutError",
           "Ring", "call_tag", "get_comm", "get_ring", "reset_ring",
           "set_ring_timeout",
           "get_layout", "positions", "register_layout", "ring_flash_attn_func",
           "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
           "ring_flash_attn_varlen_func", "flash_attn_varlen_func", "ring_sdpa",
           "set_consistency_check", "shard", "simulate_ring", "unshard",
           "shard_batch", "sharded_cross_entropy", "SequenceParallelGroups", "make_sp_groups",
           "ulysses_attn_func", "usp_attn_func", "usp_sdpa", "cpu_isa",
           "flash_attn_with_kvcache", "ring_flash_attn_with_kvcache", *_COMPAT_NAMES,
           *_PLUGIN_NAMES]


def __getattr__(name):
    if name in _PLUGIN_NAMES:
        from . import plugin
        return getattr(plugin, name)
    raise AttributeError(f"module 'ringseq' has no attribute {name!r}")
