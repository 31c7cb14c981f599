"""Corpus ingestion: read corpus files, tokenize, pack into sequences, write candidate/validation shards."""
