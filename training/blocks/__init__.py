"""Building blocks of every trainer: the masked-loss model, data loaders, the Composer trainer, checkpoints,
callbacks and logs, the run summary, FSDP sharding, and meters. They know nothing of how a run is wired."""
