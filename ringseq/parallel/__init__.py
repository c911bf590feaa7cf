"""Parallel dimensions composed with sequence parallelism on one DeviceMesh.

Modules (each imported on its own; importing this package imports nothing heavy):

``dims``           :class:`~ringseq.parallel.dims.ParallelDims`, the frozen, validated sizes of
                   a dp x sp x tp mesh (no process group needed).
``modules``        where a model's decoder layers and tied parameters are.
``tp``             DTensor tensor parallelism with Megatron sequence parallelism on the "tp" dim.
``fsdp``           FSDP2 (``fully_shard``) over the flattened dp x sp dims, summing gradients.
``grad_sync``      gradient reduction of replicated (zero_stage=0) tensor-parallel models.
``optim``          rebuilding a user's optimizer over re-parameterized (sharded) parameters.
``checkpointing``  activation checkpointing that keeps the ring's output instead of repeating
                   its communication.

docs/parallelism.md describes the mesh and the gradient argument.
"""
