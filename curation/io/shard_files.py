"""Reading shard files: each checked against the sizes and hashes its ``index.json`` records, every name the index
records checked before it is used, and the per-machine cache of decompressed shards that readers map.

Split from :mod:`curation.io.shards` (which re-exports these names) so that module stays a readable size.

An index entry of the kind this project writes (MDS version 2, zstd or uncompressed, xxh64: :mod:`curation.io.mds`)
is read here (:func:`shard_entries`), decompressed with ``zstd`` and hashed with ``xxhash`` directly, so reading such
shards imports neither ``streaming`` nor the torch it imports (the run inspector reads shards without torch); any
other entry is ``streaming``'s own reader, as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
import zstd

from curation.io import storage
from curation.io.mds import MDS_ENCODINGS, SHARD_HASH
from curation.io.paths import safe_join

__all__ = ["ShardIntegrityError", "ShardIndexError", "FileInfo", "ShardEntry", "shard_entries", "check_bytes",
           "load_shard_file", "check_shard_file", "shard_file", "check_index_names", "decode_sample", "raw_cache_dir",
           "raw_cache_path", "map_file"]


class ShardIntegrityError(ValueError):
    """A shard file is missing, unreadable or does not match the hash in its index (names the file)."""


class ShardIndexError(ValueError):
    """An ``index.json`` is not an MDS index: one line naming the file, the shard and the key."""


#: What an MDS index (version 2, streaming's ``MDSWriter``) records for each shard, and for each of its files.
_SHARD_KEYS = {"version": int, "format": str, "column_names": list, "column_encodings": list, "column_sizes": list,
               "compression": (str, type(None)), "hashes": list, "raw_data": dict, "zip_data": (dict, type(None)),
               "samples": int, "size_limit": (int, type(None))}
_FILE_KEYS = {"basename": str, "bytes": int, "hashes": dict}


def _check_keys(entry: object, keys: dict[str, Any], index: str, where: str) -> None:
    if not isinstance(entry, dict):
        raise ShardIndexError(f"{index}: {where} is {type(entry).__name__}, not a mapping: not an MDS index")
    for key, kind in keys.items():
        if key not in entry:
            raise ShardIndexError(f"{index}: {where} has no {key!r} key (an MDS index records {', '.join(keys)}); "
                                  "restore the index or write the dataset again")
        if not isinstance(entry[key], kind) or (kind is int and isinstance(entry[key], bool)):
            raise ShardIndexError(f"{index}: {where}.{key} is {type(entry[key]).__name__}, not what an MDS index "
                                  "records; restore the index or write the dataset again")


@dataclass(frozen=True)
class FileInfo:
    """A shard file as an index records it (``streaming``'s ``FileInfo``'s fields)."""

    basename: str
    bytes: int
    hashes: dict[str, str]


@dataclass
class ShardEntry:
    """One shard of an ``index.json`` of the kind :mod:`curation.io.mds` writes, with the attributes of
    ``streaming``'s ``MDSReader`` that the readers here use (``index``: the entry as the file holds it)."""

    column_names: list[str]
    column_encodings: list[str]
    column_sizes: list[int | None]
    compression: str | None
    hashes: list[str]
    raw_data: FileInfo
    zip_data: FileInfo | None
    samples: int
    size_limit: int | None
    index: dict[str, Any] = field(default_factory=dict, repr=False)
    _streaming: Any = field(default=None, repr=False)

    def decode_sample(self, data: bytes) -> dict[str, Any]:
        """``streaming``'s own decoding of one sample (the readers use :func:`curation.io.mds.sample_decoder`)."""
        if self._streaming is None:
            from streaming.base.format import reader_from_json

            self._streaming = reader_from_json("", None, self.index)
        return self._streaming.decode_sample(data)


def _file_info(obj: Any) -> FileInfo | None:
    if not (isinstance(obj, dict) and isinstance(obj.get("basename"), str) and type(obj.get("bytes")) is int
            and isinstance(obj.get("hashes", {}), dict)):
        return None
    return FileInfo(obj["basename"], obj["bytes"], dict(obj.get("hashes", {})))


def _entry(obj: Any) -> ShardEntry | None:
    """``obj`` as a :class:`ShardEntry` when it is one of ours (MDS v2, zstd or none, known encodings), else None."""
    if not isinstance(obj, dict) or obj.get("version") != 2 or obj.get("format") != "mds":
        return None
    comp, names, encodings, sizes = (obj.get(k) for k in ("compression", "column_names", "column_encodings",
                                                          "column_sizes"))
    if comp is not None and comp != "zstd" and not str(comp).startswith("zstd:"):
        return None
    if not (isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)
            and len(names) == len(encodings) == len(sizes) and all(e in MDS_ENCODINGS for e in encodings)):
        return None
    raw, zipped = _file_info(obj.get("raw_data")), _file_info(obj.get("zip_data")) if obj.get("zip_data") else None
    if raw is None or (obj.get("zip_data") and zipped is None) or (zipped is None) != (comp is None) \
            or type(obj.get("samples")) is not int:
        return None
    return ShardEntry(list(names), list(encodings), list(sizes), comp, list(obj.get("hashes") or []), raw, zipped,
                      obj["samples"], obj.get("size_limit"), index=dict(obj))


def shard_entries(directory: str, shards: object) -> list[Any]:
    """The shards an ``index.json`` of ``directory`` lists: :class:`ShardEntry` for ours, ``streaming``'s reader for
    any other; each entry checked first against what an MDS index records (a key left out, the ``hashes`` of a file
    say, is an error here, not a bare ``TypeError`` from ``streaming``, nor a shard read without its hash check).

    Raises:
        ShardIndexError: naming the index, the shard and the key.
    """
    index = storage.display(os.path.join(directory, "index.json"))  # (an object-store index: by its URL)
    if not isinstance(shards, list):
        raise ShardIndexError(f"{index}: 'shards' is {type(shards).__name__}, not a list of shards: not an MDS index")
    out: list[Any] = []
    for i, obj in enumerate(shards):
        _check_keys(obj, _SHARD_KEYS, index, f"shards[{i}]")
        if obj["version"] != 2 or obj["format"] != "mds":
            raise ShardIndexError(f"{index}: shards[{i}] is version {obj['version']!r:.20} in format "
                                  f"{obj['format']!r:.40}; only MDS shards of version 2 are read")
        for name in ("raw_data", "zip_data"):
            if obj[name] is not None:
                _check_keys(obj[name], _FILE_KEYS, index, f"shards[{i}].{name}")
        entry = _entry(obj)
        if entry is None:
            from streaming.base.format import reader_from_json

            try:
                entry = reader_from_json(directory, None, obj)
            except (TypeError, KeyError, ValueError, AssertionError) as e:  # what the checks above did not foresee
                raise ShardIndexError(f"{index}: shards[{i}] cannot be read ({type(e).__name__}: "
                                      f"{str(e)[:200]})") from None
        out.append(entry)
    return out


def _hash(algo: str, data: bytes) -> str:
    if algo == "xxh64":
        return xxhash.xxh64(data).hexdigest()
    from streaming.base.hashing import get_hash

    return get_hash(algo, data)


def check_bytes(data: bytes, info: Any, path: str) -> None:
    """Compare ``data`` with the size and the hash recorded for it: ``xxh64`` when recorded, else the first
    algorithm the index names (MDS directories written by others may record another one, or none: then the
    size is all there is to check)."""
    get_hash = _hash
    hashes = getattr(info, "hashes", None) or {}
    algo = SHARD_HASH if SHARD_HASH in hashes else next(iter(hashes), None)
    expected = hashes.get(algo) if algo is not None else None
    if len(data) != info.bytes or (expected is not None and get_hash(algo, data) != expected):
        got, want = (f", {algo} {get_hash(algo, data)}", f", {algo} {expected}") if expected is not None else ("", "")
        raise ShardIntegrityError(
            f"{path}: corrupt shard ({len(data)} bytes{got}; its index records {info.bytes} bytes{want})"
        )


def load_shard_file(directory: str, shard: Any) -> bytes:
    """The raw (decompressed) bytes of one shard (a ``streaming`` shard reader of ``directory``'s index), checked
    against the sizes and hashes its index records.

    In the cache of an object-store directory, a shard not cached yet is downloaded first, and one whose cached
    copy fails the check is downloaded again once (a damaged cache); a downloaded copy that fails is damaged in
    the bucket, and the error names its URL.

    Raises:
        ShardIntegrityError: the file is missing or unreadable, fails to decompress, or does not match.
    """
    return _with_refetch(directory, shard, _read_shard)


def check_shard_file(directory: str, shard: Any) -> None:
    """:func:`load_shard_file`'s checks of the shard's file alone (a zstd shard's compressed bytes against its
    recorded size and hash), without decompressing it: what a reader of a decompressed copy checks first.

    Raises:
        ShardIntegrityError: the file is missing, unreadable or does not match.
    """
    _with_refetch(directory, shard, _check_shard)


def _with_refetch(directory: str, shard: Any, read: Callable[[str, Any], Any]) -> Any:
    path = shard_file(directory, shard)
    downloaded = not os.path.exists(path) and storage.fetch(path)
    try:
        return read(directory, shard)
    except ShardIntegrityError:
        if downloaded or storage.url_of(directory) is None or not os.path.exists(path):
            raise
        os.unlink(path)  # a damaged cached copy: download it once more
        storage.fetch(path)
        return read(directory, shard)


def _check_shard(directory: str, shard: Any) -> None:
    path, zipped = _stored_file(directory, shard)
    with _reading(path):
        data = map_file(path)
    check_bytes(data, shard.zip_data if zipped else shard.raw_data, storage.display(path))


def _stored_file(directory: str, shard: Any) -> tuple[str, bool]:
    """The file a shard is read from, and whether it is the compressed one: the uncompressed file when it is
    there (or the shard is not compressed), else the compressed one."""
    raw = shard_file(directory, shard, raw=True)
    if os.path.exists(raw) or shard.zip_data is None:
        return raw, False
    return shard_file(directory, shard), True


@contextlib.contextmanager
def _reading(path: str) -> Iterator[None]:
    """Turn an OSError while reading a shard file into one ShardIntegrityError line naming the file."""
    try:
        yield
    except OSError as e:
        where = storage.display(e.filename if isinstance(e.filename, str) else path)
        raise ShardIntegrityError(f"{where}: cannot read shard file ({e.strerror or e})") from e


def shard_file(directory: str, shard: Any, *, raw: bool = False) -> str:
    """The path of a shard's file (``raw``: its uncompressed one) in ``directory``, from the basename its
    ``index.json`` records: untrusted, so checked to be a relative path of plain names that stays inside
    ``directory`` (:func:`curation.io.paths.safe_join`).

    Raises:
        UnsafeNameError: one line naming the index and the field.
    """
    field = "raw_data" if raw or shard.zip_data is None else "zip_data"
    return safe_join(directory, getattr(shard, field).basename, what=f"{field}.basename",
                     source_file=storage.display(os.path.join(directory, "index.json")))


def check_index_names(directory: str, shards: Sequence[Any]) -> None:
    """Check every file name the index of ``directory`` records (:func:`shard_file`) before anything is read."""
    for shard in shards:
        shard_file(directory, shard, raw=True)
        if shard.zip_data is not None:
            shard_file(directory, shard)


def _decompress(compression: str, data: bytes) -> bytes:
    if compression == "zstd" or compression.startswith("zstd:"):
        return zstd.decompress(data)
    from streaming.base.compression import decompress

    return decompress(compression, data)


def _read_shard(directory: str, shard: Any) -> bytes:
    path, zipped = _stored_file(directory, shard)
    with _reading(path), open(path, "rb") as f:
        data = f.read()
    where = storage.display(path)
    if zipped:
        check_bytes(data, shard.zip_data, where)
        try:
            data = _decompress(shard.compression, data)
        except Exception as e:  # zstd raises ZstdError, other codecs their own
            raise ShardIntegrityError(f"{where}: corrupt shard: cannot decompress ({e})") from e
    check_bytes(data, shard.raw_data, where)
    return data


def decode_sample(shard: Any, data: bytes, local: int,
                  decode: Callable[[bytes], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Sample ``local`` of a shard whose raw bytes are ``data`` (from :func:`load_shard_file`), decoded by
    ``decode`` (:func:`curation.io.mds.sample_decoder`) or the shard's reader. Garbage bytes raise numpy, struct or
    unicode errors (callers name the shard)."""
    begin, end = _OFFSETS.unpack_from(data, (1 + local) * 4)
    return (decode or shard.decode_sample)(data[begin:end])


_OFFSETS = struct.Struct("=2I")

def raw_cache_dir() -> str:
    """Where decompressed shards are kept for random access: ``$BLADE_CACHE_DIR/raw-shards``, one file per shard
    named by the hash and size its index records (so the same shard is decompressed once per machine, whatever
    directory, job or process reads it). Safe to delete at any time."""
    return os.path.join(storage.cache_root(), "raw-shards")


_XXH64_HEX = re.compile(r"[0-9a-f]{16}")


def raw_cache_path(shard: Any) -> str | None:
    """The cache file of a zstd shard whose index records its raw bytes' xxh64 and size, else ``None``. The name is
    made of those two fields only, checked to be 16 hex digits and an int (the index is untrusted)."""
    info = shard.raw_data
    digest = (getattr(info, "hashes", None) or {}).get(SHARD_HASH)
    size = getattr(info, "bytes", None)
    if shard.zip_data is None or not isinstance(digest, str) or not _XXH64_HEX.fullmatch(digest) \
            or type(size) is not int or size < 0:
        return None
    return os.path.join(raw_cache_dir(), f"{digest}-{size}.mds")


def map_file(path: str) -> mmap.mmap | bytes:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""  # (an empty file cannot be mapped)
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
