"""ringseq: ring sequence parallelism for PyTorch with its own flash-attention kernels."""
from .kernels import available_backends
from .ops import flash_attn_func, get_backend

__version__ = "0.1.0"

__all__ = ["__version__", "available_backends", "flash_attn_func", "get_backend"]

# --- ring API (ringseq/ring.py, ringseq/layouts.py, ringseq/nn.py) ---
# --- end ring API ---
