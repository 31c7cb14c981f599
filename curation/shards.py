"""MDS shard groups: write one resumable part at a time, merge part indexes, read back.

An output directory holds parts (``<group>/part-00000/`` …), each a complete MDS directory with its own
``index.json``, written only after all its samples are in. The root ``index.json`` lists the shards of the
finished parts, in manifest order, so ``StreamingDataset(local=root)`` and llm-foundry read the whole
directory. A part directory not recorded as complete in the manifest is a leftover of a killed run and is
removed before being written again, so no sample is ever written twice.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from schemas.manifest import atomic_write_text
from schemas.shards import ShardSpec, validate_shard_dir

__all__ = ["write_part", "merge_part_indexes", "remove_incomplete_parts", "open_shards", "read_column"]


def write_part(
    part_dir: str,
    spec: ShardSpec,
    samples: Iterable[dict[str, Any]],
    *,
    vocab_size: int,
    size_limit: int = 1 << 26,
) -> int:
    """Write ``samples`` as one MDS directory (zstd); replaces a leftover directory. Returns the count."""
    from streaming import MDSWriter

    if os.path.exists(part_dir):
        shutil.rmtree(part_dir)
    tmp = part_dir + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    n = 0
    columns = spec.mds_columns(vocab_size=vocab_size)
    with MDSWriter(out=tmp, columns=columns, compression="zstd", size_limit=size_limit, progress_bar=False) as w:
        for sample in samples:
            w.write(sample)
            n += 1
    os.replace(tmp, part_dir)  # the part appears whole or not at all
    return n


def merge_part_indexes(root: str, parts: Sequence[str]) -> int:
    """Write ``root/index.json`` listing the shards of ``parts`` (relative dirs), in order.

    Parts without an ``index.json`` (empty parts) are skipped. Returns the number of samples listed.
    """
    shards: list[dict[str, Any]] = []
    total = 0
    for part in parts:
        index_path = os.path.join(root, part, "index.json")
        if not os.path.exists(index_path):
            continue
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        for shard in index["shards"]:
            shard = dict(shard)
            for key in ("raw_data", "zip_data"):
                if shard.get(key):
                    shard[key] = {**shard[key], "basename": os.path.join(part, shard[key]["basename"])}
            shards.append(shard)
            total += shard["samples"]
    atomic_write_text(os.path.join(root, "index.json"), json.dumps({"version": 2, "shards": shards}, indent=1))
    return total


def remove_incomplete_parts(root: str, group: str, completed: set[str]) -> list[str]:
    """Delete part directories under ``root/group`` that the manifest does not list as complete."""
    removed = []
    base = os.path.join(root, group)
    if not os.path.isdir(base):
        return removed
    for entry in sorted(os.listdir(base)):
        rel = os.path.join(group, entry.removesuffix(".tmp"))
        if entry.endswith(".tmp") or rel not in completed:
            shutil.rmtree(os.path.join(base, entry))
            removed.append(rel)
    return removed


def open_shards(path: str, spec: ShardSpec | str | None = None):
    """A ``streaming.LocalDataset`` over an MDS directory, validated against ``spec`` first."""
    from streaming import LocalDataset

    if spec is not None:
        validate_shard_dir(path, spec)
    return LocalDataset(local=path)


def read_column(path: str, column: str) -> list[Any]:
    """All values of one column, in order (tests and small tools)."""
    ds = open_shards(path)
    out = []
    for i in range(len(ds)):
        v = ds[i][column]
        out.append(np.asarray(v) if isinstance(v, np.ndarray) else v)
    return out
