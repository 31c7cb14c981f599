"""MDS shard groups: write one resumable part at a time, merge part indexes, read back.

An output directory holds parts (``<group>/part-00000/`` …), each a complete MDS directory with its own
``index.json``, written only after all its samples are in. The root ``index.json`` lists the shards of the
finished parts, in manifest order, so ``StreamingDataset(local=root)`` and llm-foundry read the whole
directory. A part directory not recorded as complete in the manifest is a leftover of a killed run and is
removed before being written again, so no sample is ever written twice.

Integrity: every shard file is written with an ``xxh64`` hash of its compressed and of its raw bytes in the
MDS index (``StreamingDataset(..., validate_hash="xxh64")`` checks them too). :class:`ShardReader` checks
them when it first loads a shard and raises :class:`ShardIntegrityError` naming the file and saying how to
regenerate the part; :func:`verify_part` checks a whole part (jobs use it on a rerun to rewrite corrupt or
missing parts). Directories written before hashes were recorded (or by others, e.g. llm-foundry's converters)
are checked against the sizes their index records, and any other hash it records.

Parts of step-indexed directories (scored and selected-token shards) are named by :func:`part_name`; a
directory's manifest is read and checked against its shard spec by :func:`shard_dir_info`, and
:func:`check_tokenizer` refuses directories made with different tokenizers.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import mmap
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from curation.io import storage
from curation.io.atomic import atomic_write_text, write_manifest
from curation.io.bad_shards import blame
from curation.io.mds import SHARD_HASH, RowBlock, batch_decoder, sample_decoder, write_mds
from curation.io.paths import safe_join
from curation.io.shard_files import (
    ShardIndexError,
    ShardIntegrityError,
    check_bytes,
    check_index_names,
    check_shard_file,
    decode_sample,
    load_shard_file,
    map_file,
    raw_cache_dir,
    raw_cache_path,
    shard_entries,
    shard_file,
)
from schemas.manifest import Manifest, sha256_file
from schemas.shards import ShardSchemaError, ShardSpec, validate_shard_dir

__all__ = [
    "write_part", "merge_part_indexes", "publish_parts", "ShardReader", "open_shards",
    "read_column", "SHARD_HASH", "ShardIntegrityError", "verify_part", "recovery_hint", "part_name", "PART_PREFIX",
    "ShardDirInfo", "shard_dir_info", "check_tokenizer", "load_shard_file", "decode_sample", "save_manifest",
    "shard_file", "check_index_names", "check_shard_file", "raw_cache_dir", "ShardIndexError",
]

#: Every part directory's name starts with this (see :func:`part_name`).
PART_PREFIX = "steps-"


def part_name(first: int, stop: int) -> str:
    """Name of the part holding the steps ``first ≤ t < stop`` of the candidate stream.

    One layout for every writer (the trainer's selected-token shards, the single-process scorer, the
    engine's work units); zero-padded, so the names sort in step order.
    """
    return f"{PART_PREFIX}{first:09d}-{stop:09d}"


def recovery_hint(directory: str, shard_file: str) -> str:
    """How to regenerate the part holding ``shard_file`` (relative to ``directory``), from the manifest."""
    part = os.path.dirname(shard_file) or "."
    try:
        manifest = Manifest.load_if_exists(directory)
    except ValueError:
        manifest = None
    job = manifest.job if manifest is not None else None
    if job == "prepare":
        return (f"part {part} can be regenerated: rerun jobs/prepare.py with the same config and output_dir (it checks "
                "every part and rewrites the damaged ones)")
    if job == "train":
        return (f"part {part} holds masks of training steps already taken and cannot be rewritten without retraining: "
                "restore it from a copy, or train into a new output_dir")
    if job is not None:
        return (f"part {part} can be regenerated: rerun the job that wrote it ({job}) with the same config (it checks "
                "the recorded parts and redoes the damaged ones)")
    return f"regenerate part {part} with the job that wrote {directory}"


def verify_part(part_dir: str) -> str | None:
    """Check one part directory: its index and every shard file against the recorded hashes.

    Returns:
        ``None`` when intact, else what is wrong (naming the file).
    """
    index = os.path.join(part_dir, "index.json")
    try:
        storage.fetch(index)
        with open(index, encoding="utf-8") as f:
            shards = shard_entries(part_dir, json.load(f)["shards"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{index}: missing or unreadable index ({e})"
    check_index_names(part_dir, shards)  # a hostile name is an error, not damage to regenerate around
    try:
        for shard in shards:
            load_shard_file(part_dir, shard)
    except ShardIntegrityError as e:
        return str(e)
    return None


def write_part(
    part_dir: str,
    spec: ShardSpec,
    samples: Iterable[dict[str, Any] | RowBlock],
    *,
    vocab_size: int,
    size_limit: int = 1 << 26,
) -> int:
    """Write ``samples`` as one MDS directory (zstd, xxh64 hashes); replaces a leftover directory. Returns the count.

    Written by :func:`curation.io.mds.write_mds` (the bytes of ``streaming.MDSWriter``, without importing
    ``streaming`` and the torch it loads) into ``<part_dir>.tmp``, renamed into place once whole.
    """
    if os.path.exists(part_dir):
        shutil.rmtree(part_dir)
    tmp = part_dir + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    n = write_mds(tmp, spec.mds_columns(vocab_size=vocab_size), samples, size_limit=size_limit)
    os.replace(tmp, part_dir)  # the part appears whole or not at all
    storage.publish(part_dir)  # an object-store directory: uploaded now (its index.json last)
    return n


#: (merged directory, part) → (a digest of its bytes, its shards rebased on the merged directory): an output's index is
#: merged after each new part without parsing and checking every earlier part's index again (thousands of parts
#: made each merge, and a long run, quadratic); keyed by content, so a rewritten index is always read anew
_PART_SHARDS: OrderedDict[tuple[str, str], tuple[bytes, list[dict[str, Any]]]] = OrderedDict()
_PART_SHARDS_MAX = 16384
_PART_SHARDS_LOCK = threading.Lock()


def _part_shards(root: str, part: str, index_path: str) -> list[dict[str, Any]]:
    """The shard entries of one part's index, their file names relative to ``root`` (checked to stay in the part)."""
    with open(index_path, "rb") as f:
        raw = f.read()
    digest = hashlib.blake2b(raw, digest_size=16).digest()
    where = (os.path.abspath(root), part)  # rebased on root: the same part merged into another root is another entry
    with _PART_SHARDS_LOCK:
        hit = _PART_SHARDS.get(where)
        if hit is not None and hit[0] == digest:
            _PART_SHARDS.move_to_end(where)
            return hit[1]
    index = json.loads(raw)
    shards = []
    for shard in index["shards"]:
        shard = dict(shard)
        for key in ("raw_data", "zip_data"):
            if shard.get(key):
                name = safe_join(os.path.join(root, part), shard[key].get("basename"), what=f"{key}.basename",
                                 source_file=storage.display(index_path))
                shard[key] = {**shard[key], "basename": os.path.relpath(name, root).replace(os.sep, "/")}
        shards.append(shard)
    with _PART_SHARDS_LOCK:
        _PART_SHARDS[where] = (digest, shards)
        _PART_SHARDS.move_to_end(where)
        while len(_PART_SHARDS) > _PART_SHARDS_MAX:
            _PART_SHARDS.popitem(last=False)
    return shards


def merge_part_indexes(root: str, parts: Sequence[str]) -> int:
    """Write ``root/index.json`` listing the shards of ``parts`` (relative dirs), in order.

    Parts without an ``index.json`` (empty parts) are skipped. Returns the number of samples listed. A part's
    index is parsed and checked once per process while its bytes stay the same (:data:`_PART_SHARDS`).
    """
    shards: list[dict[str, Any]] = []
    manifest = storage.display(Manifest.path_in(root))
    for part in parts:
        index_path = os.path.join(safe_join(root, part, what="part", source_file=manifest), "index.json")
        if not storage.fetch(index_path):  # a part another machine wrote into an object-store directory: fetched
            continue
        shards.extend(_part_shards(root, part, index_path))
    total = sum(shard["samples"] for shard in shards)
    atomic_write_text(os.path.join(root, "index.json"), json.dumps({"version": 2, "shards": shards}, indent=1))
    storage.publish(os.path.join(root, "index.json"))
    return total


def save_manifest(out_dir: str, manifest: Manifest) -> None:
    """Save the manifest (atomically) and, for an object-store directory, upload it."""
    storage.publish(write_manifest(out_dir, manifest))


def publish_parts(out_dir: str, manifest: Any) -> None:
    """Index the manifest's complete parts, then save the manifest (after the index: the manifest never
    lists a part the index lacks)."""
    parts = [r.name for r in manifest.shards if r.complete]
    if parts:
        merge_part_indexes(out_dir, parts)
    save_manifest(out_dir, manifest)


class ShardReader:
    """Random access to the samples of a local MDS directory.

    ``streaming.LocalDataset`` only reads uncompressed shards and ``StreamingDataset`` decompresses to disk
    through shared memory; this reader needs neither, so training loaders, tests and workers can index any
    sample deterministically. With ``mapped`` (:func:`open_shards`: pools and datasets, read in any order), a
    zstd shard is decompressed once into :func:`raw_cache_dir` and memory-mapped: a random order over a pool of
    many shards (the training stream) reads each sample from the page cache, where an in-memory cache of a few
    decompressed shards decompressed a whole shard (up to 64 MB) for almost every sample. Without it (parts
    read once, in order), and for shards whose index records no xxh64 (other writers), shards are decompressed
    in memory, the last ``cache_shards`` kept.

    Each shard is checked against the hashes in its index when first read by this reader (the shard file, and a
    cached copy's bytes too);
    a damaged one raises :class:`ShardIntegrityError` naming the file and the part to regenerate (``hint``: a
    function of the shard's path relative to ``path``; default :func:`recovery_hint` from the directory's
    manifest). A cached copy that fails the check is replaced from the shard once.
    """

    def __init__(self, path: str, *, cache_shards: int = 4, hint: Callable[[str], str] | None = None,
                 mapped: bool = False):
        storage.fetch(os.path.join(path, "index.json"))  # an object-store directory's shards come when read
        with open(os.path.join(path, "index.json"), encoding="utf-8") as f:
            index = json.load(f)
        self.path = path
        self._hint = hint or (lambda name: recovery_hint(path, name))
        if not isinstance(index, dict) or "shards" not in index:
            raise ShardIndexError(f"{storage.display(os.path.join(path, 'index.json'))}: has no 'shards' list: not an "
                                  "MDS index")
        self.shards = shard_entries(path, index["shards"])  # (ours without importing streaming)
        check_index_names(path, self.shards)
        self._decoders = [sample_decoder(s.column_names, s.column_encodings, s.column_sizes)
                          if hasattr(s, "column_encodings") else None for s in self.shards]  # MDS: ours
        layouts: dict[tuple | None, Any] = {None: None}  # one decoder per column layout (built once), so a step
        self._batch_decoders = []  # over many shards decodes at once; None: a shard of another writer
        for s in self.shards:
            key = (tuple(s.column_names), tuple(s.column_encodings), tuple(s.column_sizes)) \
                if hasattr(s, "column_encodings") else None
            if key not in layouts:
                layouts[key] = batch_decoder(*key)
            self._batch_decoders.append(layouts[key])
        self._ends = np.cumsum([s.samples for s in self.shards]).tolist()
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._mapped: dict[int, bytes | mmap.mmap] = {}
        self._map_shards = mapped
        self._cache_shards = cache_shards

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _shard_bytes(self, i: int) -> bytes | mmap.mmap:
        if i in self._mapped:
            return self._mapped[i]
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        try:
            cached = raw_cache_path(self.shards[i]) if self._map_shards else None
            if cached is not None:
                self._mapped[i] = self._cached_copy(i, cached)
                return self._mapped[i]
            data = load_shard_file(self.path, self.shards[i])
        except ShardIntegrityError as e:
            raise blame(ShardIntegrityError(f"{e}; {self._hint(self._name(i))}"), self._file(i)) from e
        self._cache[i] = data
        if len(self._cache) > self._cache_shards:
            self._cache.popitem(last=False)
        return data

    def _cached_copy(self, i: int, cached: str) -> bytes | mmap.mmap:
        """Shard ``i``'s raw bytes mapped from its cache file, made from the shard (checked) when missing or
        damaged; a cache that cannot be written (read-only, full disk) leaves the bytes in memory."""
        shard = self.shards[i]
        if os.path.exists(cached):
            check_shard_file(self.path, shard)  # the shard itself, as when it is decompressed (damage is named)
            try:
                data = map_file(cached)
                check_bytes(data, shard.raw_data, cached)
                return data
            except (OSError, ShardIntegrityError):
                with contextlib.suppress(OSError):
                    os.unlink(cached)  # damaged or unreadable: made again below
        data = load_shard_file(self.path, shard)  # checked against the index
        tmp = f"{cached}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, cached)  # whole or absent; another process may replace it with the same bytes
            return map_file(cached)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return data

    def _name(self, i: int) -> str:
        shard = self.shards[i]
        return (shard.zip_data or shard.raw_data).basename

    def _file(self, i: int) -> str:
        return os.path.join(self.path, self._name(i))

    def shard_path(self, idx: int) -> str:
        """The shard file holding sample ``idx`` (what an error about the sample blames:
        :func:`curation.io.bad_shards.blame`)."""
        return os.path.join(self.path, self.locate(idx)[0])

    def locate(self, idx: int) -> tuple[str, int]:
        """``(shard file, record index within it)`` of sample ``idx`` (for error messages)."""
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.path} ({len(self)} samples)")
        i = bisect.bisect_right(self._ends, idx)
        return self._name(i), idx - (self._ends[i - 1] if i else 0)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.path} ({len(self)} samples)")
        i = bisect.bisect_right(self._ends, idx)
        local = idx - (self._ends[i - 1] if i else 0)
        data = self._shard_bytes(i)
        try:  # a shard without recorded hashes (older directories) may still be damaged
            return decode_sample(self.shards[i], data, local, self._decoders[i])
        except Exception as e:  # noqa: BLE001 - numpy/struct/unicode errors of garbage bytes
            name = storage.display(os.path.join(self.path, self._name(i)))
            raise blame(ShardIntegrityError(
                f"{name}: corrupt shard: sample {local} cannot be decoded ({type(e).__name__}: {e}); "
                f"{self._hint(self._name(i))}"
            ), self._file(i)) from e


    def gather(self, ids: Sequence[int] | np.ndarray) -> dict[str, Any] | None:
        """The samples ``ids`` column by column (see :func:`curation.io.mds.batch_decoder`: an ``ndarray`` column
        as one ``(len(ids), *row shape)`` array, ``str`` as a list), in one decode whatever shards they are in;
        the values that indexing each sample gives, stacked.

        ``None`` when they cannot be decoded that way (ids out of range, a shard of another writer, rows whose
        shapes differ, bytes that do not decode): index them one by one, which names what is wrong."""
        ids = [int(i) for i in ids]
        if not ids or min(ids) < 0 or max(ids) >= len(self):
            return None
        samples, decode, data = [], None, {}  # data: each shard's bytes fetched once per call (an in-memory LRU
        for i in ids:  # of fewer shards than the step spans would otherwise decompress one again and again)
            s = bisect.bisect_right(self._ends, i)
            if decode is not self._batch_decoders[s]:
                if decode is not None or self._batch_decoders[s] is None:
                    return None  # shards of other columns (or another writer) in one step: row by row
                decode = self._batch_decoders[s]
            if s not in data:
                data[s] = self._shard_bytes(s)
            samples.append((data[s], i - (self._ends[s - 1] if s else 0)))
        return decode(samples)


def open_shards(path: str, spec: ShardSpec | str | None = None) -> ShardReader:
    """A :class:`ShardReader` over an MDS directory (a pool or dataset: its shards decompressed once per machine
    and memory-mapped), validated against ``spec`` first."""
    if spec is not None:
        storage.fetch(os.path.join(path, "index.json"))  # an object-store directory not in this node's cache yet
        validate_shard_dir(path, spec)
    return ShardReader(path, mapped=True)


def read_column(path: str, column: str) -> list[Any]:
    """All values of one column, in order (tests and small tools)."""
    ds = open_shards(path)
    out = []
    for i in range(len(ds)):
        v = ds[i][column]
        out.append(np.asarray(v) if isinstance(v, np.ndarray) else v)
    return out


# ------------------------------------------------------------------------------------------------
# what a shard directory's manifest says, and the checks every job makes before reading one
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardDirInfo:
    """What a shard directory's manifest says about it."""

    path: str
    kind: str
    vocab_size: int
    seq_len: int | None
    tokenizer_fingerprint: str | None
    manifest: Manifest


def shard_dir_info(path: str, spec: str) -> ShardDirInfo:
    """Validate ``path`` against the shard ``spec`` and read its manifest.

    An object-store directory's ``index.json`` and ``manifest.json`` are brought up to date in its cache first.

    Raises:
        ShardSchemaError: wrong columns/encodings (names directory, shard and column), or no manifest.
    """
    for name in ("index.json", "manifest.json"):
        storage.refresh(os.path.join(path, name))
    validate_shard_dir(path, spec)
    if not os.path.exists(Manifest.path_in(path)):
        raise ShardSchemaError(f"{path}: no manifest.json (not written by this project's jobs)")
    m = Manifest.load(path)
    if m.vocab_size is None:
        raise ShardSchemaError(f"{Manifest.path_in(path)}: manifest has no vocab_size")
    return ShardDirInfo(path, m.kind, m.vocab_size, m.seq_len, m.tokenizer_fingerprint, m)


def check_tokenizer(infos: Sequence[ShardDirInfo], tokenizer: str | None) -> str | None:
    """All directories must come from one tokenizer (and from ``tokenizer`` when given).

    Returns:
        The common tokenizer fingerprint (``None`` when no manifest records one).

    Raises:
        ValueError: naming the two files whose tokenizers differ.
    """
    known = [(Manifest.path_in(i.path), i.tokenizer_fingerprint) for i in infos if i.tokenizer_fingerprint]
    if tokenizer is not None:
        path = storage.tokenizer_json_path(tokenizer)
        known.insert(0, (path, sha256_file(path)))
    for where, fp in known[1:]:
        if fp != known[0][1]:
            raise ValueError(
                f"tokenizer mismatch: {where} was written with tokenizer sha256 {fp[:12]}…, "
                f"but {known[0][0]} has {known[0][1][:12]}…"
            )
    return known[0][1] if known else None
