"""Old import path of the ring's transport and state (kept for users of ``ringseq.comm``):
:mod:`ringseq.engine.transport` and :mod:`ringseq.engine.ring`."""
from .engine.ring import Ring, check_consistent, get_comm, get_ring, reset_ring  # noqa: F401
from .engine.transport import RingComm, Transport  # noqa: F401

__all__ = ["Ring", "RingComm", "Transport", "check_consistent", "get_comm", "get_ring",
           "reset_ring"]
