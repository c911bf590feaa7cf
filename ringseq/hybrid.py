"""Old import path of Ulysses x ring parallelism (kept for users of ``ringseq.hybrid``):
:mod:`ringseq.parallel.groups`, :mod:`ringseq.parallel.sp_layout`, :mod:`ringseq.parallel.usp`."""
from .parallel.groups import (SP_MODES, SequenceParallelGroups, check_model_heads,  # noqa: F401
                              make_sp_groups, resolve_sp_sizes, sp_groups_from_tables)
from .parallel.sp_layout import SequenceParallelLayout  # noqa: F401
from .parallel.usp import usp_attn_func, usp_placement, usp_sdpa  # noqa: F401

__all__ = ["SP_MODES", "SequenceParallelGroups", "SequenceParallelLayout", "check_model_heads",
           "make_sp_groups", "resolve_sp_sizes", "sp_groups_from_tables", "usp_attn_func",
           "usp_placement", "usp_sdpa"]
