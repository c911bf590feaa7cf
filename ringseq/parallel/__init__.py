"""Sequence-parallel modes beyond the plain ring, as placements of the one engine:
:mod:`.ulysses` (all-to-all over heads), :mod:`.groups` (the Ulysses x ring groups and their
sizes), :mod:`.usp` (Ulysses x ring attention), :mod:`.double_ring` (a ring of inner rings),
:mod:`.sp_layout` (where a 2-D group's tokens live)."""
