"""ringseq: ring sequence parallelism for PyTorch with its own flash-attention kernels.

``import ringseq`` loads the attention API (single device and ring), layouts, data sharding
and the sharded loss; the training plugin (``ringseq.plugin``: DataLoader, DDP) loads on
first use of ``ringseq.Booster`` / ``ringseq.RingSequenceParallelPlugin`` / ``ringseq.Plugin``,
and transformers only through ``ringseq.integrations.transformers``.
"""
from ._dist import RingMismatchError, set_consistency_check
from .comm import RingComm, Transport
from .data import shard_batch
from .hybrid import SequenceParallelGroups, make_sp_groups, usp_attn_func, usp_sdpa
from .kernels import available_backends
from .layouts import Layout, get_layout, positions, register_layout, shard, unshard
from .loss import sharded_cross_entropy
from .nn import (RingAttention, ring_flash_attn_func, ring_flash_attn_kvpacked_func,
                 ring_flash_attn_qkvpacked_func, ring_sdpa)
from .ops import flash_attn_func, get_backend
from .sim import simulate_ring
from .ulysses import ulysses_attn_func

__version__ = "0.1.0"

_PLUGIN_NAMES = ("Booster", "Plugin", "RingSequenceParallelPlugin")

__all__ = ["__version__", "available_backends", "flash_attn_func", "get_backend",
           "RingAttention", "RingComm", "RingMismatchError", "Layout", "Transport",
           "get_layout", "positions", "register_layout", "ring_flash_attn_func",
           "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func", "ring_sdpa",
           "set_consistency_check", "shard", "simulate_ring", "unshard",
           "shard_batch", "sharded_cross_entropy", "SequenceParallelGroups", "make_sp_groups",
           "ulysses_attn_func", "usp_attn_func", "usp_sdpa", *_PLUGIN_NAMES]


def __getattr__(name):
    if name in _PLUGIN_NAMES:
        from . import plugin
        return getattr(plugin, name)
    raise AttributeError(f"module 'ringseq' has no attribute {name!r}")
