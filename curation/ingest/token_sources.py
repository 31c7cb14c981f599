"""Pre-tokenized sources: MDS token datasets and parquet / arrow columns of token ids → token records.

The token-id counterpart of :mod:`curation.ingest.corpus`: the same resolved input list, resume position
``(file_index, next_record)`` and ``BadRecordError`` (``file:line: reason``) for every unusable record, so
``prepare`` packs a record's ids exactly where it would have tokenized a document's text.

- ``format: mds``: an MDS dataset directory (``index.json`` + shards), as llm-foundry's
  ``convert_dataset_hf.py`` / ``convert_dataset_json.py`` / ``convert_text_to_mds.py`` write it with
  ``--concat_tokens``: a ``tokens`` column of fixed-length pieces of one stream of documents joined with the
  EOS (and BOS) their ``--eos_text`` / ``--bos_text`` give. The column encodings read are the two llm-foundry
  has written: ``ndarray:int32`` (v0.9.0 and later; any ``ndarray`` of an integer dtype is read) and ``bytes``
  holding raw ids (v0.8.0 and before: ``np.asarray(tokens).tobytes()``, i.e. int64; the type is the source's
  ``token_encoding_type``, as in llm-foundry's ``StreamingTextDataset``). A path is a dataset directory (or its
  ``index.json``, or a glob of either); its records are the dataset's samples in index order, and a bad one is
  named by its shard file and 1-based sample number within that shard. Every shard is checked against the
  sizes and hashes its index records (llm-foundry's converters record no hashes: then sizes and decoding).
- parquet (``tokens_field`` set) and arrow (IPC file or stream, e.g. Feather v2 or a ``datasets`` cache file):
  a column of lists of integer ids, one record per row.

Every id must be in ``[0, vocab_size)`` of the configured tokenizer; a record holding another is bad (named
with the id and its position). No EOS is added here: ``prepare`` joins records as they are
(``token_rows: stream``) or follows each with the tokenizer's EOS (``token_rows: documents``).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from curation.ingest.corpus import BadRecordError, iter_inputs, resolve_paths
from curation.io import bucket_inputs, storage
from curation.io.mds import sample_decoder
from curation.io.shards import (
    ShardIndexError,
    ShardIntegrityError,
    check_index_names,
    decode_sample,
    load_shard_file,
    shard_entries,
)
from schemas.config import SourceConfig

__all__ = ["TokenRecord", "resolve_token_inputs", "iter_token_records"]

_INDEX = "index.json"
_TABLE_BATCH = 1024  # parquet rows decoded at a time


@dataclass(frozen=True)
class TokenRecord:
    """A record's token ids (int64, each in the vocabulary), where it came from, and the resume position after
    it (the fields of :class:`curation.ingest.corpus.Document`, with ``ids`` for ``text``)."""

    ids: np.ndarray
    file: str  # the file to name for it: the MDS shard file, the parquet/arrow file
    line: int  # 1-based sample within the MDS shard, or row of the file
    file_index: int  # index into resolve_token_inputs(source)
    next_record: int  # records of this input consumed once this one is taken (MDS: samples of the dataset)


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def resolve_token_inputs(source: SourceConfig, *, skip_missing: bool = False) -> list[str]:
    """The inputs of any source, sorted: MDS dataset directories (``format: mds``), else files
    (:func:`~curation.ingest.corpus.resolve_paths`). The one resolver of a source's inputs: what ``prepare``
    reads, and what a unit record's spans are checked against.

    A path in an object store (its cache path: an ``s3://`` URL of the config, localized) is resolved against the
    bucket's listing (:func:`curation.io.bucket_inputs.resolve`; nothing is downloaded).

    Raises:
        BadRecordError: a pattern matches nothing, or a path is no MDS dataset (naming it and the source);
            ``skip_missing``: a pattern that matches nothing, or a path that does not exist, is skipped instead.
    """
    if any(storage.url_of(p) is not None for p in source.paths):
        return _with_bucket_inputs(source, skip_missing)
    if source.format != "mds":
        return resolve_paths(source, skip_missing=skip_missing)
    dirs: set[str] = set()
    for pattern in source.paths:
        if glob.has_magic(pattern):
            matched = [_dataset_dir(p) for p in glob.glob(pattern, recursive=True)]
            if not any(matched) and not skip_missing:
                raise BadRecordError(pattern, 0, f"no MDS dataset (a directory holding an index.json) matches this "
                                                 f"pattern (source '{source.name}')")
            dirs.update(d for d in matched if d)
            continue
        if not os.path.exists(pattern):
            if skip_missing:
                continue
            raise BadRecordError(pattern, 0, f"no such directory (source '{source.name}')")
        found = _dataset_dir(pattern)
        if found is None:
            raise BadRecordError(pattern, 0, _not_a_dataset(pattern, source))
        dirs.add(found)
    return sorted(dirs)


def _with_bucket_inputs(source: SourceConfig, skip_missing: bool) -> list[str]:
    """:func:`resolve_token_inputs` of a source some of whose paths are in an object store."""
    found: set[str] = set()
    for pattern in source.paths:
        matched = bucket_inputs.resolve(pattern, datasets=source.format == "mds")
        if matched is None:  # a local path beside them
            found.update(resolve_token_inputs(source.model_copy(update={"paths": [pattern]}),
                                              skip_missing=skip_missing))
        elif not matched and not skip_missing:
            what = "MDS dataset (a prefix holding an index.json)" if source.format == "mds" else "object"
            raise BadRecordError(storage.display(pattern), 0, f"no {what} matches this path in the bucket (source "
                                                              f"'{source.name}')")
        else:
            found.update(matched)
    return sorted(found)


def _dataset_dir(path: str) -> str | None:
    """The MDS dataset directory ``path`` names (the directory, or its ``index.json``), else None."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, _INDEX)):
        return os.path.normpath(path)
    if os.path.basename(path) == _INDEX and os.path.isfile(path):
        return os.path.dirname(os.path.normpath(path)) or "."
    return None


def _not_a_dataset(path: str, source: SourceConfig) -> str:
    if not os.path.isdir(path):
        return f"is a file, not an MDS dataset directory (give the directory holding {_INDEX}; source '{source.name}')"
    splits = sorted(e for e in os.listdir(path) if os.path.isfile(os.path.join(path, e, _INDEX)))
    if splits:  # llm-foundry's out_root holds one dataset per split
        return (f"has no {_INDEX}; it holds the MDS datasets {', '.join(splits)}: give one of them, e.g. "
                f"{os.path.join(path, splits[0])} (source '{source.name}')")
    return f"has no {_INDEX}: not an MDS dataset directory (source '{source.name}')"


# ------------------------------------------------------------------------------------------------
# records
# ------------------------------------------------------------------------------------------------
def iter_token_records(
    source: SourceConfig,
    *,
    files: list[str],
    vocab_size: int,
    start_file: int = 0,
    start_record: int = 0,
) -> Iterator[TokenRecord | BadRecordError]:
    """Stream a pre-tokenized source's records from a resume position; bad records are yielded, not raised.

    Args:
        source: the source config (``source.pre_tokenized``).
        files: :func:`resolve_token_inputs` of it.
        vocab_size: ids must be below it (the configured tokenizer's vocabulary, added tokens included).
        start_file: index into ``files`` to start from.
        start_record: records of that input already consumed.

    Yields:
        :class:`TokenRecord` or :class:`BadRecordError`. An input that cannot be used at all (unreadable, no
        token column, an unsupported encoding, a damaged MDS shard: that shard) yields a single error, line 0.
    """

    def records(fi: int, path: str, first: int) -> Iterator[TokenRecord | BadRecordError]:
        if source.format == "mds":
            rows = _mds_rows(path, source, first)
        else:
            rows = _table_rows(path, _table_format(path, source), source, first)
        for idx, file, line, value in rows:
            ids = value if isinstance(value, BadRecordError) else _checked_ids(
                value, vocab_size, source.token_column, file, line)
            yield ids if isinstance(ids, BadRecordError) else TokenRecord(
                ids=ids, file=file, line=line, file_index=fi, next_record=idx + 1)

    return iter_inputs(files, start_file, start_record, records)


def _checked_ids(value: Any, vocab_size: int, column: str, file: str, line: int) -> np.ndarray | BadRecordError:
    """``value`` as int64 ids when it is a non-empty 1-d integer array within the vocabulary, else the reason."""
    if value is None:
        return BadRecordError(file, line, f"column {column!r} is null")
    ids = np.asarray(value)
    if ids.dtype.kind not in "iu":
        return BadRecordError(file, line, f"column {column!r} holds {ids.dtype} values, expected integer token ids")
    if ids.ndim != 1:
        return BadRecordError(file, line, f"column {column!r} holds an array of shape {ids.shape}, expected 1-d ids")
    if ids.size == 0:
        return BadRecordError(file, line, f"column {column!r} holds no token (empty record)")
    outside = (ids < 0) | (ids >= vocab_size) if ids.dtype.kind == "i" else ids >= vocab_size
    if outside.any():
        pos = int(np.argmax(outside))
        return BadRecordError(
            file, line, f"token id {int(ids[pos])} (position {pos}) is outside the tokenizer's vocabulary "
            f"(ids 0 to {vocab_size - 1}): was this data tokenized with another tokenizer?")
    return ids.astype(np.int64)


# ------------------------------------------------------------------------------------------------
# MDS datasets
# ------------------------------------------------------------------------------------------------
def _mds_shards(path: str, source: SourceConfig) -> list[Any]:
    """The shard readers of one MDS dataset, checked to hold a readable token column.

    Raises:
        BadRecordError: naming the index (unreadable, not MDS shards, no token column, unsupported encoding).
    """
    index = os.path.join(path, _INDEX)
    try:
        with open(index, encoding="utf-8") as f:
            infos = json.load(f)["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadRecordError(index, 0, f"unreadable MDS index ({type(e).__name__}: {e})") from e
    try:
        shards = shard_entries(path, infos)
    except ShardIndexError as e:  # (its message names the index first)
        raise BadRecordError(index, 0, str(e).removeprefix(f"{index}: ")) from None
    check_index_names(path, shards)  # its file names stay inside the dataset (else an UnsafeNameError)
    column = source.token_column
    for info, shard in zip(infos, shards, strict=True):
        name = (shard.zip_data or shard.raw_data).basename
        if info.get("format") != "mds":
            raise BadRecordError(index, 0, f"shard {name} is in format {info.get('format')!r}; only MDS shards are "
                                           "read (format: mds)")
        encodings = dict(zip(shard.column_names, shard.column_encodings, strict=True))
        if column not in encodings:
            hint = (": this dataset holds text; prepare its text files as a text source instead"
                    if "text" in encodings else "; set tokens_field to the column of token ids")
            raise BadRecordError(index, 0, f"shard {name} has no column {column!r} (columns: "
                                           f"{', '.join(encodings)}){hint}")
        enc = encodings[column]
        if enc != "bytes" and enc.split(":")[0] != "ndarray":
            raise BadRecordError(index, 0, f"shard {name}: column {column!r} has encoding {enc!r}; token ids are read "
                                           "from 'bytes' (raw ids of token_encoding_type) or 'ndarray[:<int type>]'")
        # Only the token column is decoded; the others stay raw bytes: no image decoding, and a `pkl` column
        # of someone else's dataset is never unpickled (unpickling runs code).
        shard.column_encodings = ["bytes" if n != column else e for n, e in encodings.items()]
    return shards


def _mds_rows(path: str, source: SourceConfig, start: int) -> Iterator[tuple[int, str, int, object]]:
    """(dataset sample index, shard file, 1-based sample in the shard, ids or BadRecordError) from ``start``."""
    shards = _mds_shards(path, source)
    if start == 0 and sum(s.samples for s in shards) == 0:
        yield -1, path, 0, BadRecordError(os.path.join(path, _INDEX), 0, "MDS dataset is empty (0 samples)")
        return
    column, dtype = source.token_column, np.dtype(source.token_encoding_type)
    first = 0  # dataset index of the shard's first sample
    for shard in shards:
        n = shard.samples
        if first + n <= start:
            first += n
            continue
        file = os.path.join(path, (shard.zip_data or shard.raw_data).basename)
        try:
            data = load_shard_file(path, shard)
        except ShardIntegrityError as e:  # the whole shard: its own name leads the message
            reason = str(e).removeprefix(f"{file}: ")
            yield first, file, 0, BadRecordError(file, 0, f"{reason}; the input dataset is damaged: copy or convert "
                                                          "it again (or skip_bad_records: true skips this shard)")
            first += n
            continue
        # this project's decoder (the values streaming's reader gives) where it knows the encodings: llm-foundry's
        # `ndarray:<dtype>` or `bytes` token column, the others `bytes`; streaming's reader (and its ≈ 4 s of
        # imports: torch, transformers) only for the others, e.g. `ndarray` without a dtype
        decode = sample_decoder(shard.column_names, shard.column_encodings, shard.column_sizes)
        for local in range(max(start - first, 0), n):
            idx = first + local
            try:
                value = decode_sample(shard, data, local, decode)[column]
                if isinstance(value, bytes):
                    if len(value) % dtype.itemsize:
                        raise ValueError(f"{len(value)} bytes are no whole number of {dtype} ids "
                                         "(token_encoding_type)")
                    value = np.frombuffer(value, dtype)
            except Exception as e:  # noqa: BLE001 - numpy/struct/unicode errors of garbage bytes
                yield idx, file, local + 1, BadRecordError(
                    file, local + 1, f"sample {idx} of the dataset cannot be decoded ({type(e).__name__}: {e})")
                continue
            yield idx, file, local + 1, value
        first += n


# ------------------------------------------------------------------------------------------------
# parquet / arrow
# ------------------------------------------------------------------------------------------------
def _table_format(path: str, source: SourceConfig) -> str:
    if source.format != "auto":
        return source.format
    for ext, name in ((".parquet", "parquet"), (".arrow", "arrow"), (".feather", "arrow"), (".ipc", "arrow")):
        if path.endswith(ext):
            return name
    raise BadRecordError(path, 0, "pre-tokenized input is read from MDS datasets (format: mds), .parquet or "
                                  ".arrow/.feather/.ipc files; set the source's `format`")


def _table_batches(path: str, fmt: str, column: str) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches of ``column``) of a parquet or arrow IPC (file or stream) file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if fmt == "parquet":
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        return pf.schema_arrow, (pf.iter_batches(batch_size=_TABLE_BATCH, columns=[column]) if column in names
                                 else iter(()))  # (a missing column is reported by the caller)
    try:
        reader = pa.ipc.open_file(path)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:  # not the IPC file format: the stream format (e.g. a `datasets` cache file)
        stream = pa.ipc.open_stream(path)
        return stream.schema, iter(stream)


def _table_rows(path: str, fmt: str, source: SourceConfig, start: int) -> Iterator[tuple[int, str, int, object]]:
    """(row index, file, 1-based row, ids or BadRecordError) of a parquet/arrow token column, from ``start``."""
    import pyarrow as pa

    column = source.token_column
    try:
        schema, batches = _table_batches(path, fmt, column)
    except (OSError, pa.ArrowException) as e:
        raise BadRecordError(path, 0, f"cannot read {fmt}: {e}") from e
    if column not in schema.names:
        raise BadRecordError(path, 0, f"missing token column {column!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))
            and pa.types.is_integer(kind.value_type)):
        raise BadRecordError(path, 0, f"column {column!r} is {kind}, expected a list of integer token ids")
    row = 0
    try:
        for batch in batches:
            n = batch.num_rows
            if row + n > start:
                lists = _lists(batch.column(batch.schema.get_field_index(column)))
                for k, value in enumerate(lists):
                    if k >= start - row:
                        if isinstance(value, str):
                            value = BadRecordError(path, row + k + 1, f"column {column!r} {value}")
                        yield row + k, path, row + k + 1, value
            row += n
    except (OSError, pa.ArrowException) as e:
        raise BadRecordError(path, row + 1, f"cannot read {fmt} from here on: {e}") from e
    if row == 0:
        yield -1, path, 0, BadRecordError(path, 0, "file is empty (0 rows)")


def _lists(column: Any) -> Iterator[np.ndarray | str | None]:
    """The rows of an arrow list column: each an array of its integer type, ``None`` for a null row, or what
    is wrong with it (a null item). (``to_numpy`` would turn every row of a batch with a null item into floats.)"""
    import pyarrow.compute as pc

    null_row = column.is_null().to_numpy(zero_copy_only=False)
    ends = np.cumsum(pc.list_value_length(column).fill_null(0).to_numpy())
    flat = column.flatten()  # the items of the non-null rows
    null_item = flat.is_null().to_numpy(zero_copy_only=False)
    items = flat.fill_null(0).to_numpy(zero_copy_only=False)
    begins = np.concatenate([[0], ends[:-1]])
    for k, (begin, end) in enumerate(zip(begins.tolist(), ends.tolist(), strict=True)):
        if null_row[k]:
            yield None
        elif null_item[begin:end].any():
            yield "holds a null token id"
        else:
            yield items[begin:end]
