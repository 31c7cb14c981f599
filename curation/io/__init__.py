"""Bytes on disk: MDS shards (write, read, verify, publish) and model weights (build, load, save)."""
