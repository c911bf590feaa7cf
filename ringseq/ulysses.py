"""Old import path of Ulysses attention (kept for users of ``ringseq.ulysses``):
:mod:`ringseq.parallel.ulysses`."""
from .parallel.ulysses import (UlyssesPlacement, all_to_all, kv_replication,  # noqa: F401
                               ulysses_attn_func, ulysses_heads, valid_ulysses_degrees)

__all__ = ["UlyssesPlacement", "all_to_all", "kv_replication", "ulysses_attn_func",
           "ulysses_heads", "valid_ulysses_degrees"]
