"""The multi-rank test helper: ringseq's local gloo ranks with a timeout (ringseq/_spawn.py).

    results = run_ranks(fn, world_size, *args, timeout=120, **kwargs)
"""
from ringseq._spawn import RankError, RankTimeout, free_port, run_ranks

__all__ = ["RankError", "RankTimeout", "free_port", "run_ranks"]
