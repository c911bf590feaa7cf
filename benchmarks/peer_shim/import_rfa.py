"""Import ring-flash-attention on CPU with the block kernel from ``flash_attn/`` next to this file.

Its transformers adapter is left out: it does not import with transformers 5.x, and the
benchmark calls only the ring functions.
"""
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
_adapters = types.ModuleType("ring_flash_attn.adapters")
_adapters.substitute_hf_flash_attn = _adapters.update_ring_flash_attn_params = None
sys.modules.setdefault("ring_flash_attn.adapters", _adapters)

import ring_flash_attn  # noqa: E402

__all__ = ["ring_flash_attn"]
