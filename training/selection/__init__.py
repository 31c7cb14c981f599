"""The selection algorithm and the reference it owns: :class:`BladeAlgorithm` (exact online BLADE as a Composer
``Algorithm``), :class:`InProcessReference` (one owner of ``w̃``'s weights, AdamW state and where they live; its
host storage in :mod:`~training.selection.host_buffers`), the scores written by others
(:mod:`~training.selection.shard_scores`) and the engine-fed trainer's record (:class:`EngineSelection`)."""
