"""MDS shard groups: write one resumable part at a time, merge part indexes, read back.

An output directory holds parts (``<group>/part-00000/`` …), each a complete MDS directory with its own
``index.json``, written only after all its samples are in. The root ``index.json`` lists the shards of the
finished parts, in manifest order, so ``StreamingDataset(local=root)`` and llm-foundry read the whole
directory. A part directory not recorded as complete in the manifest is a leftover of a killed run and is
removed before being written again, so no sample is ever written twice.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from schemas.manifest import atomic_write_text
from schemas.shards import ShardSpec, validate_shard_dir

__all__ = [
    "write_part", "merge_part_indexes", "publish_parts", "remove_incomplete_parts", "ShardReader", "open_shards", "read_column",
]


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


def publish_parts(out_dir: str, manifest: Any) -> None:
    """Index the manifest's complete parts, then save the manifest (after the index: the manifest never
    lists a part the index lacks)."""
    parts = [r.name for r in manifest.shards if r.complete]
    if parts:
        merge_part_indexes(out_dir, parts)
    manifest.save(out_dir)


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


class ShardReader:
    """Random access to the samples of a local MDS directory, zstd shards decompressed in memory.

    ``streaming.LocalDataset`` only reads uncompressed shards and ``StreamingDataset`` decompresses to disk
    through shared memory; this reader needs neither (a small LRU of decompressed shards), so training
    loaders, tests and workers can index any sample deterministically.
    """

    def __init__(self, path: str, *, cache_shards: int = 4):
        from streaming.base.format import reader_from_json

        with open(os.path.join(path, "index.json"), encoding="utf-8") as f:
            index = json.load(f)
        self.path = path
        self.shards = [reader_from_json(path, None, s) for s in index["shards"]]
        self._ends = np.cumsum([s.samples for s in self.shards]).tolist()
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cache_shards = cache_shards

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _shard_bytes(self, i: int) -> bytes:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        from streaming.base.compression import decompress

        shard = self.shards[i]
        raw = os.path.join(self.path, shard.raw_data.basename)
        if os.path.exists(raw):
            with open(raw, "rb") as f:
                data = f.read()
        else:
            with open(os.path.join(self.path, shard.zip_data.basename), "rb") as f:
                data = decompress(shard.compression, f.read())
        self._cache[i] = data
        if len(self._cache) > self._cache_shards:
            self._cache.popitem(last=False)
        return data

    def locate(self, idx: int) -> tuple[str, int]:
        """``(shard file, record index within it)`` of sample ``idx`` (for error messages)."""
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.path} ({len(self)} samples)")
        i = bisect.bisect_right(self._ends, idx)
        shard = self.shards[i]
        name = (shard.zip_data or shard.raw_data).basename
        return name, idx - (self._ends[i - 1] if i else 0)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.path} ({len(self)} samples)")
        i = bisect.bisect_right(self._ends, idx)
        local = idx - (self._ends[i - 1] if i else 0)
        data = self._shard_bytes(i)
        begin, end = np.frombuffer(data, np.uint32, count=2, offset=(1 + local) * 4)
        return self.shards[i].decode_sample(data[begin:end])


def open_shards(path: str, spec: ShardSpec | str | None = None) -> ShardReader:
    """A :class:`ShardReader` over an MDS directory, validated against ``spec`` first."""
    if spec is not None:
        validate_shard_dir(path, spec)
    return ShardReader(path)


def read_column(path: str, column: str) -> list[Any]:
    """All values of one column, in order (tests and small tools)."""
    ds = open_shards(path)
    out = []
    for i in range(len(ds)):
        v = ds[i][column]
        out.append(np.asarray(v) if isinstance(v, np.ndarray) else v)
    return out
