"""Old import path of the byte counters (kept for users of ``ringseq.commstats``):
:mod:`ringseq.engine.counting`."""
from .engine.counting import CommCounter, count_bytes, record  # noqa: F401

__all__ = ["CommCounter", "count_bytes", "record"]
