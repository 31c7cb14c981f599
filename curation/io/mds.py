"""Writing MDS shard directories without importing ``streaming``: the bytes of ``streaming.MDSWriter``.

``import streaming`` loads torch and transformers (its dataset modules import them): 5–6 s of CPU per process
on a 2-core machine, a fifth of preparing a 45 MB corpus and paid again by every worker process. This module
writes the same files as ``MDSWriter(out=..., columns=..., compression="zstd", hashes=["xxh64"],
size_limit=...)`` for the column encodings our shard specs use (``schemas.shards``: ``ndarray:<dtype>``,
``str``, the integer scalars), byte for byte: the same sample encoding, shard cuts at the same size limit, the
same zstd level (3, the ``zstd`` package streaming uses) and hashes, and the same ``index.json``
(``tests/curation/io/test_mds.py`` compares every file with ``MDSWriter``'s). Reading stays with ``streaming``'s
shard readers, except that :func:`sample_decoder` decodes a sample of these encodings (the same values as the
reader's ``decode_sample``, without its per-column look-ups: a scoring worker decodes every sample it scores).

A scoring worker reads and writes a whole step at a time: :class:`RowBlock` holds rows column by column (a token
column as one ``(n, L)`` array); :func:`write_mds` encodes a block from each column's bytes made once (the same
bytes as row by row), and :func:`batch_decoder` decodes the samples of a step into such columns (``None`` for
anything it cannot decode in one piece; the caller then decodes row by row, which names what is wrong).

A shard file is ``[samples: uint32][offsets: uint32 × (samples + 1)][config JSON][samples]``; a sample is
``[sizes of its variable-size columns: uint32 each][each column's bytes]``, columns in sorted name order.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
import zstd

__all__ = ["MDS_ENCODINGS", "SHARD_HASH", "RowBlock", "batch_decoder", "sample_decoder", "write_mds"]

#: Hash recorded for every shard file (MDS ``hashes``); fast enough to check on every load.
SHARD_HASH = "xxh64"

#: Scalar encodings (fixed size) and their numpy types.
_SCALARS = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "int8": np.int8,
            "int16": np.int16, "int32": np.int32, "int64": np.int64, "float16": np.float16,
            "float32": np.float32, "float64": np.float64}
#: ndarray value dtypes and their one-byte codes (streaming's ``NDArray._value_dtype2int``).
_NDARRAY_DTYPES = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "float16": 18, "uint32": 32, "int32": 33,
                   "float32": 34, "uint64": 64, "int64": 65, "float64": 66}
_NP_DTYPES = {d: np.dtype(d) for d in _NDARRAY_DTYPES}
#: Every encoding this writer supports (``ndarray:<dtype>`` with a fixed dtype and a free shape).
MDS_ENCODINGS = ("str", *_SCALARS, *(f"ndarray:{d}" for d in _NDARRAY_DTYPES))
_ZSTD_LEVEL = 3  # streaming's "zstd" = Zstandard(level=3)
_SHAPE_DTYPES = ((1 << 8, np.uint8, 0), (1 << 16, np.uint16, 1), (1 << 32, np.uint32, 2))


def _check_encodings(columns: dict[str, str]) -> None:
    bad = {k: v for k, v in columns.items() if v not in MDS_ENCODINGS}
    if bad:
        raise ValueError(f"unsupported MDS column encodings {bad}; supported: {', '.join(MDS_ENCODINGS)}")


def _ndarray_head(shape: tuple[int, ...]) -> bytes:
    """``ndarray:<dtype>``'s bytes before the values: ``[ndim << 2 | shape dtype code][shape]``."""
    if not shape or len(shape) >= 64 or 0 in shape:
        raise ValueError(f"an ndarray column needs 1 to 63 axes and at least one element, got shape {shape}")
    largest = max(shape)
    shape_dtype, code = next(((t, c) for bound, t, c in _SHAPE_DTYPES if largest < bound), (np.uint64, 3))
    return bytes([(len(shape) << 2) | code]) + np.asarray(shape, shape_dtype).tobytes()


def _encode_ndarray(dtype: str, value: Any) -> bytes:
    """``ndarray:<dtype>``: ``[ndim << 2 | shape dtype code][shape][values]`` (dtype fixed by the column)."""
    arr = np.asarray(value)
    if arr.dtype != _NP_DTYPES[dtype]:  # (a dtype comparison: `.name` costs more than the rest of a row's encoding)
        raise ValueError(f"wrong dtype: expected {dtype}, got {arr.dtype.name}")
    if arr.ndim == 1 and 0 < arr.shape[0] < 1 << 16:  # a sequence: the same bytes as below, built directly
        n = arr.shape[0]
        head = bytes((4, n)) if n < 1 << 8 else b"\x05" + n.to_bytes(2, sys.byteorder)
        return head + arr.tobytes()
    return _ndarray_head(arr.shape) + arr.tobytes()


def _encode_sample(columns: list[tuple[str, str]], sample: dict[str, Any]) -> bytes:
    sizes: list[int] = []
    data: list[bytes] = []
    for name, encoding in columns:
        value = sample[name]
        if encoding == "str":
            if not isinstance(value, str):
                raise ValueError(f"column {name!r} (str) got {type(value).__name__}")
            datum = value.encode("utf-8")
            sizes.append(len(datum))
        elif encoding.startswith("ndarray:"):
            datum = _encode_ndarray(encoding.split(":", 1)[1], value)
            sizes.append(len(datum))
        else:
            datum = _SCALARS[encoding](value).tobytes()
        data.append(datum)
    return struct.pack(f"={len(sizes)}I", *sizes) + b"".join(data)


@dataclass(frozen=True)
class RowBlock:
    """``n`` rows given column by column, for :func:`write_mds`: an ``ndarray`` column as one array of shape
    ``(n, *row shape)``, a ``str`` column as a sequence of ``n`` strings, a scalar column as ``n`` values or one
    value for every row. Iterating gives the rows as the dicts :func:`write_mds` also takes."""

    columns: dict[str, Any]
    n: int

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            yield {k: (v[i] if isinstance(v, (np.ndarray, list, tuple)) else v) for k, v in self.columns.items()}


def _encode_block(columns: list[tuple[str, str]], block: RowBlock) -> list[bytes]:
    """The samples of ``block``, each the bytes :func:`_encode_sample` gives for its row.

    Each column's values become bytes once (an ``ndarray`` column: one ``tobytes`` of the whole array); a row is
    then one join of its slices. At a step's few rows this costs less than the calls of a vectorised layout."""
    n = block.n
    if n == 0:
        return []
    pieces: list[bytes | list[bytes]] = []  # per column: one value for every row, or the rows' own
    sizes: list[int | list[int]] = []  # per variable-size column, likewise

    def rows_of(flat: bytes, width: int) -> list[bytes]:
        return [flat[i * width : (i + 1) * width] for i in range(n)]

    for name, encoding in columns:
        value = block.columns[name]
        if encoding == "str":
            values = list(value)
            if len(values) != n or not all(isinstance(v, str) for v in values):
                bad = next((type(v).__name__ for v in values if not isinstance(v, str)), f"{len(values)} values")
                raise ValueError(f"column {name!r} (str) got {bad} for a block of {n} rows")
            encoded = [v.encode("utf-8") for v in values]
            pieces.append(encoded)
            sizes.append([len(e) for e in encoded])
        elif encoding.startswith("ndarray:"):
            arr = np.asarray(value)
            dtype = encoding.split(":", 1)[1]
            if arr.dtype != _NP_DTYPES[dtype]:
                raise ValueError(f"column {name!r}: wrong dtype: expected {dtype}, got {arr.dtype.name}")
            if arr.ndim < 2 or arr.shape[0] != n:
                raise ValueError(f"column {name!r}: a block of {n} rows needs an array of shape ({n}, ...), "
                                 f"got {arr.shape}")
            head, flat = _ndarray_head(arr.shape[1:]), arr.tobytes()
            pieces += [head, rows_of(flat, len(flat) // n)]
            sizes.append(len(head) + len(flat) // n)
        else:  # a scalar column: one value for every row (a step, an episode), or the rows' own
            arr = np.asarray(value)
            if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != n):
                raise ValueError(f"column {name!r} ({encoding}): {arr.shape} values for a block of {n} rows")
            typed = arr.astype(_SCALARS[encoding])
            if arr.dtype.kind in "iub" and typed.dtype.kind in "iu" and not np.array_equal(typed, arr):
                bad = arr if arr.ndim == 0 else arr[typed != arr][0]
                raise ValueError(f"column {name!r} ({encoding}): {bad} is out of its range")
            pieces.append(typed.tobytes() if arr.ndim == 0 else rows_of(typed.tobytes(), typed.itemsize))
    head = struct.Struct(f"={len(sizes)}I")
    if all(isinstance(size, int) for size in sizes):
        pieces.insert(0, head.pack(*sizes))
    else:
        per_row = [[size] * n if isinstance(size, int) else size for size in sizes]
        pieces.insert(0, [head.pack(*row) for row in zip(*per_row, strict=True)])
    return [b"".join([p if isinstance(p, bytes) else p[i] for p in pieces]) for i in range(n)]


_SHAPE_CODES = {c: t for _, t, c in _SHAPE_DTYPES} | {3: np.uint64}


def sample_decoder(names: Sequence[str], encodings: Sequence[str], sizes: Sequence[int | None]
                   ) -> Callable[[bytes], dict[str, Any]] | None:
    """A decoder of one sample's bytes for a shard with these columns (an MDS reader's ``column_names``,
    ``column_encodings``, ``column_sizes``), or ``None`` when a column has an encoding this module does not
    write (read those with ``streaming``'s reader).

    It gives what ``streaming``'s ``MDSReader.decode_sample`` gives: ``str`` as ``str``, scalars as numpy scalars,
    ``ndarray:<dtype>`` as read-only arrays over the sample's bytes, and (an encoding it reads but does not write:
    llm-foundry's older token datasets, the columns a pre-tokenized source does not decode) ``bytes`` as the
    column's raw ``bytes``. Bytes that do not decode raise (``ValueError``, ``struct.error``,
    ``UnicodeDecodeError``), as they do there.
    """
    if any(e not in MDS_ENCODINGS and e != "bytes" for e in encodings):
        return None
    columns = [(name, e, np.dtype(e.split(":", 1)[1]) if e.startswith("ndarray:") else _SCALARS.get(e), size)
               for name, e, size in zip(names, encodings, sizes, strict=True)]
    head = struct.Struct(f"={sum(1 for *_, size in columns if not size)}I")

    def decode(data: bytes) -> dict[str, Any]:
        var = iter(head.unpack_from(data, 0))
        idx = head.size
        sample: dict[str, Any] = {}
        for name, encoding, dtype, fixed in columns:
            size = fixed or next(var)
            value = data[idx : idx + size]
            idx += size
            if encoding == "str":
                sample[name] = value.decode("utf-8")
            elif encoding == "bytes":
                sample[name] = bytes(value)
            elif fixed:
                sample[name] = np.frombuffer(value, dtype)[0]
            else:
                byte = value[0]
                ndim, width = byte >> 2, 1 << (byte & 3)
                shape = np.frombuffer(value[1 : 1 + ndim * width], _SHAPE_CODES[byte & 3])
                sample[name] = np.frombuffer(value[1 + ndim * width :], dtype).reshape(shape)
        return sample

    return decode


_COUNT = struct.Struct("=I")
_OFFSETS = struct.Struct("=2I")


def batch_decoder(names: Sequence[str], encodings: Sequence[str], sizes: Sequence[int | None]
                  ) -> Callable[[Sequence[tuple[Any, int]]], dict[str, Any] | None] | None:
    """Like :func:`sample_decoder`, for many samples at once: ``decode(samples)`` takes ``(raw shard bytes, index
    in that shard)`` pairs (of any shards with these columns) and gives each column for all of them, in that
    order: an ``ndarray`` column as one ``(n, *row shape)`` array, a ``str`` column as a list, a scalar column
    as a 1-D array; the values :func:`sample_decoder` gives, stacked.

    It gives ``None`` where it cannot decode them in one piece: indices outside their shard, offsets or sizes
    that do not fit, rows whose ``ndarray`` shapes differ, bytes that are not UTF-8. Decode those row by row
    (which stacks them, or raises naming the record).
    """
    if any(e not in MDS_ENCODINGS for e in encodings):
        return None
    columns = [(name, e, np.dtype(e.split(":", 1)[1]) if e.startswith("ndarray:") else np.dtype(_SCALARS[e])
                if e != "str" else None, size) for name, e, size in zip(names, encodings, sizes, strict=True)]
    head = struct.Struct(f"={sum(1 for *_, size in columns if not size)}I")

    def decode(samples: Sequence[tuple[Any, int]]) -> dict[str, Any] | None:
        pieces: list[list[bytes]] = [[] for _ in columns]
        for data, i in samples:
            try:
                if not 0 <= i < _COUNT.unpack_from(data, 0)[0]:
                    return None
                begin, end = _OFFSETS.unpack_from(data, 4 + 4 * i)
                var = iter(head.unpack_from(data, begin))
            except struct.error:
                return None
            idx = begin + head.size
            for (_, _, _, fixed), piece in zip(columns, pieces, strict=True):
                stop = idx + (fixed or next(var))
                piece.append(data[idx:stop])
                idx = stop
            if idx > end or end > len(data):
                return None
        try:
            return _stack_columns(columns, pieces)
        except (ValueError, UnicodeDecodeError):
            return None

    return decode


def _stack_columns(columns: list[tuple[str, str, Any, int | None]], pieces: list[list[bytes]]) -> dict[str, Any] | None:
    """:func:`batch_decoder`'s columns from each row's bytes of each column."""
    n = len(pieces[0]) if pieces else 0
    out: dict[str, Any] = {}
    for (name, encoding, dtype, fixed), piece in zip(columns, pieces, strict=True):
        if encoding == "str":
            out[name] = [p.decode("utf-8") for p in piece]
        elif fixed:
            out[name] = np.frombuffer(b"".join(piece), dtype)
        else:  # ndarray: every row of the same shape, or row by row
            first = piece[0]
            ndim, code = (first[0] >> 2, first[0] & 3) if first else (0, 0)
            skip = 1 + ndim * (1 << code)
            if not 0 < ndim < 64 or any(len(p) != len(first) or p[:skip] != first[:skip] for p in piece):
                return None
            shape = tuple(int(x) for x in np.frombuffer(first[1:skip], _SHAPE_CODES[code]))
            if len(first) != skip + math.prod(shape) * dtype.itemsize:
                return None
            out[name] = np.frombuffer(b"".join([p[skip:] for p in piece]), dtype).reshape(n, *shape)
    return out


def _file_info(data: bytes, basename: str) -> dict[str, Any]:
    return {"basename": basename, "bytes": len(data), "hashes": {SHARD_HASH: xxhash.xxh64(data).hexdigest()}}


def write_mds(out: str, columns: dict[str, str], samples: Iterable[dict[str, Any] | RowBlock], *,
              size_limit: int) -> int:
    """Write ``samples`` into the new directory ``out`` as zstd MDS shards with xxh64 hashes; returns the count.

    Each item is one sample (a dict of column values) or a :class:`RowBlock` of several.

    The files equal those of ``streaming.MDSWriter(out=out, columns=columns, compression="zstd",
    hashes=["xxh64"], size_limit=size_limit)`` given the same samples.

    Raises:
        ValueError: an encoding outside :data:`MDS_ENCODINGS`, or a value that does not fit its column.
    """
    _check_encodings(columns)
    if not 0 < size_limit < 2**32:
        raise ValueError(f"size_limit must be in (0, 2**32), got {size_limit}")
    order = [(name, columns[name]) for name in sorted(columns)]
    names = [name for name, _ in order]
    encodings = [enc for _, enc in order]
    config = {"version": 2, "format": "mds", "compression": "zstd", "hashes": [SHARD_HASH], "size_limit": size_limit,
              "column_names": names, "column_encodings": encodings,
              "column_sizes": [None if e == "str" or e.startswith("ndarray:") else _SCALARS[e]().nbytes
                               for e in encodings]}
    config_data = json.dumps(config, sort_keys=True).encode("utf-8")
    empty_shard = 4 + 4 + len(config_data)
    os.makedirs(out, exist_ok=True)
    shards: list[dict[str, Any]] = []
    pending: list[bytes] = []
    size = empty_shard

    def flush() -> None:
        lengths = np.fromiter(map(len, pending), np.int64, len(pending))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        offsets += 4 + len(offsets) * 4 + len(config_data)
        raw = np.uint32(len(pending)).tobytes() + offsets.tobytes() + config_data + b"".join(pending)
        zipped = zstd.compress(raw, _ZSTD_LEVEL)
        raw_name = f"shard.{len(shards):05}.mds"
        _write_file(os.path.join(out, raw_name + ".zstd"), zipped)
        shards.append({"samples": len(pending), "raw_data": _file_info(raw, raw_name),
                       "zip_data": _file_info(zipped, raw_name + ".zstd"), **config})

    n = 0
    for item in samples:
        for data in _encode_block(order, item) if isinstance(item, RowBlock) else (_encode_sample(order, item),):
            if size_limit < size + len(data) + 4:
                flush()
                pending, size = [], empty_shard
            pending.append(data)
            size += len(data) + 4
            n += 1
    if pending:
        flush()
    # (dumps: json.dump encodes in Python, 10× slower)
    _write_file(os.path.join(out, "index.json"), json.dumps({"version": 2, "shards": shards}, sort_keys=True).encode())
    return n


def _write_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path``; an error (a full disk: ``write`` and ``close`` name no file) names ``path``."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        e.filename = e.filename or path
        raise
