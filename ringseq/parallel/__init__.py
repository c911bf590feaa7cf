"""Parallelism beyond the plain ring, composed with it on one DeviceMesh (each module imported
on its own; importing this package imports nothing heavy; docs/parallelism.md, docs/sp_modes.md).

Sequence-parallel modes, as placements of the one engine:

``ulysses``        all-to-all over heads (:class:`~ringseq.parallel.ulysses.UlyssesPlacement`).
``groups``         the Ulysses x ring groups and their sizes.
``sp_layout``      where a 2-D (ring x Ulysses) group's tokens live.
``usp``            Ulysses x ring attention, every mode.
``double_ring``    a ring of inner rings.

Training compositions (the plugin's ``tp_size`` / ``zero_stage`` / checkpointing):

``dims``           :class:`~ringseq.parallel.dims.ParallelDims`, the frozen, validated sizes of
                   a dp x sp x tp mesh (no process group needed).
``modules``        where a model's decoder layers and tied parameters are.
``tp``             DTensor tensor parallelism with Megatron sequence parallelism on the "tp" dim.
``fsdp``           FSDP2 (``fully_shard``) over the flattened dp x sp dims, summing gradients.
``grad_sync``      gradient reduction of replicated (zero_stage=0) tensor-parallel models.
``optim``          rebuilding a user's optimizer over re-parameterized (sharded) parameters.
``checkpointing``  activation checkpointing that keeps the attention operator's outputs instead
                   of repeating its communication.
"""
