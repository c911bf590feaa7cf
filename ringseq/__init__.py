"""ringseq: ring sequence parallelism for PyTorch with its own flash-attention kernels."""
from .kernels import available_backends
from .ops import flash_attn_func, get_backend

__version__ = "0.1.0"

__all__ = ["__version__", "available_backends", "flash_attn_func", "get_backend"]

# --- ring API (ringseq/ring.py, ringseq/layouts.py, ringseq/nn.py) ---
from .comm import RingComm, RingMismatchError, set_consistency_check
from .layouts import Layout, get_layout, positions, register_layout, shard, unshard
from .nn import (RingAttention, ring_flash_attn_func, ring_flash_attn_kvpacked_func,
                 ring_flash_attn_qkvpacked_func, ring_sdpa)
from .ring import simulate_ring

__all__ += ["RingAttention", "RingComm", "RingMismatchError", "Layout", "get_layout",
            "positions", "register_layout", "ring_flash_attn_func",
            "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func", "ring_sdpa",
            "set_consistency_check", "shard", "simulate_ring", "unshard"]
# --- end ring API ---

# --- data and loss for sequence-parallel training (ringseq/data.py, ringseq/loss.py) ---
# (ringseq.integrations.transformers is imported explicitly: transformers stays optional)
from .data import shard_batch
from .loss import sharded_cross_entropy

__all__ += ["shard_batch", "sharded_cross_entropy"]
# --- end data and loss ---

# --- plugin (ringseq/plugin/; imports torch.distributed and DataLoader, never transformers) ---
from .plugin import Booster, Plugin, RingSequenceParallelPlugin

__all__ += ["Booster", "Plugin", "RingSequenceParallelPlugin"]
# --- end plugin ---
from .kernels.extension import cpu_isa; __all__ += ["cpu_isa"]  # noqa: E402,E702 (CPU kernel ISA level)
