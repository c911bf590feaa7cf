"""Old import path of the double ring (kept for users of ``ringseq.double_ring``):
:mod:`ringseq.parallel.double_ring`."""
from .parallel.double_ring import DoubleRingPlacement, InnerLap  # noqa: F401

__all__ = ["DoubleRingPlacement", "InnerLap"]
