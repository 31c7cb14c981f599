"""Reading corpora: ``.jsonl``, ``.jsonl.zst`` (streamed), ``.parquet`` and ``.txt`` → documents.

Every document carries its file and 1-based line (or row) number, so bad input is reported as
``path:line: reason``. Documents are produced in a deterministic order (sorted, deduplicated paths; file
order within a file) and each has a resumable position ``(file_index, next_record_index)``.

A reader may be given :class:`FileSpan` s instead of whole files: the records of a plain ``.jsonl`` file that
start in a byte range (a line belongs to the span its first byte is in), or the rows of a range of a
``.parquet`` file's row groups. Work units of ``prepare`` are such spans (``curation.ingest.units``); a span's
line numbers are counted from the file's start only when one is needed (a document's ``line``, a bad record),
so reading the last span of a large file does not read the file before it.
"""

from __future__ import annotations

import functools
import glob
import io
import json
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import zstandard

from curation.ingest import jsonstream
from curation.ingest.jsonstream import LineError, LongLine, StreamedText
from curation.ingest.zstd_frames import TruncatedZstdError, ZstdFrames
from curation.io.stop import interruptible
from schemas.config import SourceConfig

__all__ = ["Document", "BadRecordError", "FileSpan", "resolve_paths", "detect_format", "iter_inputs", "input_error",
           "iter_documents", "parquet_row_groups", "SPLITTABLE_FORMATS"]

#: Formats whose files a work unit may read in part (:class:`FileSpan`): byte ranges, row-group ranges.
SPLITTABLE_FORMATS = ("jsonl", "parquet")

T = TypeVar("T")
P = TypeVar("P")


class BadRecordError(ValueError):
    """One input record (or a whole file) is unusable. ``str(e)`` is ``file:line: reason``."""

    def __init__(self, file: str, line: int, reason: str):
        self.file, self.line, self.reason = file, line, reason
        where = f"{file}:{line}" if line > 0 else file
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class FileSpan:
    """The part of one input file a reader reads: all of it (``start == 0``, ``stop is None``), the records of a
    ``.jsonl`` file whose first byte is in ``[start, stop)``, or the rows of the row groups ``[start, stop)`` of
    a ``.parquet`` file (``stop is None``: to the end)."""

    path: str
    start: int = 0
    stop: int | None = None

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop is None


class _LineBase:
    """Lines of a file before a span's first byte ``offset``, counted once, when first needed."""

    def __init__(self, path: str, offset: int = 0) -> None:
        self.path, self.offset = path, offset

    @functools.cached_property
    def value(self) -> int:
        count, left = 0, self.offset
        if left == 0:
            return 0
        with open(self.path, "rb") as f:
            while left > 0:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    break
                count, left = count + chunk.count(b"\n"), left - len(chunk)
        return count


_NO_LINES_BEFORE = _LineBase("", 0)


@dataclass(frozen=True)
class Document:
    """A document's text, where it came from, and the resume position just after it."""

    text: str  # "" when ``stream`` is set
    file: str
    span_line: int  # 1-based line (jsonl/txt) or row (parquet) of the record, counted from its span's start
    file_index: int  # index into the files (or spans) read
    next_record: int  # records of this file (span) consumed once this document is taken
    lines_before: _LineBase = field(default=_NO_LINES_BEFORE, repr=False, compare=False)
    stream: StreamedText | None = field(default=None, repr=False, compare=False)  # the text of a huge line

    @property
    def line(self) -> int:
        """1-based line (row) of the record in its file."""
        return self.lines_before.value + self.span_line

    def pieces(self) -> Iterator[str]:
        """The text as consecutive pieces: ``[text]``, or a streamed line's text decoded from the file again."""
        try:
            yield from (self.text,) if self.stream is None else self.stream.pieces()
        except LineError as e:  # checked whole before: the file changed since
            raise BadRecordError(self.file, self.line, f"changed while it was read ({e})") from None


def resolve_paths(source: SourceConfig, *, skip_missing: bool = False) -> list[str]:
    """Expand the source's paths/globs into a sorted, deduplicated file list.

    Raises:
        BadRecordError: a pattern matches nothing (names the pattern and the source); ``skip_missing``: it is
            skipped instead (a path that is a directory is still refused).
    """
    files: set[str] = set()
    for pattern in source.paths:
        if glob.has_magic(pattern):
            matched = [p for p in glob.glob(pattern, recursive=True) if not os.path.isdir(p)]
            if not matched and not skip_missing:
                raise BadRecordError(pattern, 0, f"no file matches this pattern (source '{source.name}')")
            files.update(_regular(p, source) for p in matched)
        elif not os.path.exists(pattern):
            if not skip_missing:
                raise BadRecordError(pattern, 0, f"no such file (source '{source.name}')")
        else:
            if os.path.isdir(pattern):
                raise BadRecordError(pattern, 0, f"is a directory; give files or a glob (source '{source.name}')")
            files.add(_regular(pattern, source))
    return sorted(files)


def _regular(path: str, source: SourceConfig) -> str:
    """``path`` when it is a regular file (or a link to one); a FIFO, socket or device is refused up front: reading
    one waits for a writer for ever, or never ends."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise BadRecordError(path, 0, f"cannot open: {e.strerror or e} (source '{source.name}')") from e
    if not stat.S_ISREG(mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise BadRecordError(path, 0, f"is {kind}, not a regular file: inputs are read as files, more than once "
                                      f"(source '{source.name}')")
    return path


def detect_format(path: str, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    for ext, name in ((".jsonl.zst", "jsonl.zst"), (".jsonl", "jsonl"), (".json", "jsonl"),
                      (".parquet", "parquet"), (".txt", "txt")):
        if path.endswith(ext):
            return name
    raise BadRecordError(path, 0, "cannot tell the format from the extension; set the source's `format`")


def _span_start(path: str, start: int) -> int:
    """Offset of the first line that starts at or after byte ``start`` (the file's size when none does)."""
    if start == 0:
        return 0
    try:
        with open(path, "rb") as f:
            f.seek(start - 1)
            jsonstream.skip_line(f)  # the rest of the line holding byte start - 1 (just its newline when one ends there)
            return f.tell()
    except OSError as e:
        raise BadRecordError(path, 0, f"cannot open: {e.strerror or e}") from e


def _open_lines(path: str, fmt: str, start: int = 0, stop: int | None = None, *, huge: bool = False,
                ) -> Iterator[bytes | LongLine]:
    """Raw lines (bytes, with newline) of a plain or zstd-compressed text file; of a plain file, the lines
    starting in ``[start, stop)`` (``start`` a line start: see :func:`_span_start`). With ``huge``, a line over
    ``jsonstream.STREAM_LINE_BYTES`` comes as a :class:`LongLine` (read through, never held whole)."""
    try:
        with interruptible(f"opening {path}"):  # a stop signal ends a wait here (a FIFO that came after the check)
            raw = open(path, "rb")  # noqa: SIM115 - closed in finally
    except OSError as e:
        raise BadRecordError(path, 0, f"cannot open: {e.strerror or e}") from e
    lines = 0
    try:
        if fmt == "jsonl.zst":
            stream = io.BufferedReader(ZstdFrames(raw), buffer_size=1 << 20)
        else:
            stream = raw
            raw.seek(start)
        pos = start
        try:
            for line in (jsonstream.long_lines(stream, path, fmt, start) if huge else stream):
                if stop is not None and pos >= stop:
                    break
                pos += len(line) if isinstance(line, bytes) else line.length
                lines += 1
                held = [line]
                del line  # suspended at the yield, this frame must not hold the line: a huge one is freed by its reader
                yield held.pop()
        except zstandard.ZstdError as e:
            raise BadRecordError(path, lines + 1, f"corrupt zstd stream: {e}") from e
        except TruncatedZstdError as e:
            raise BadRecordError(
                path, lines + 1,
                f"truncated zstd file: {e} (the file is incomplete, e.g. an interrupted download or copy; "
                f"{lines} complete lines were read before it)",
            ) from e
    finally:
        raw.close()


def _decode(path: str, line_no: int, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecordError(path, line_no, str(jsonstream.not_utf8(data[e.start], e.start + 1))) from e


def _text_of(record: object, source: SourceConfig, path: str, line: int) -> str:
    if not isinstance(record, dict):
        raise BadRecordError(path, line, f"expected a JSON object, got {type(record).__name__}")
    if source.template is not None:
        try:
            text = source.template.format_map(record)
        except KeyError as e:
            fields = ", ".join(sorted(map(str, record))) or "none"
            raise BadRecordError(
                path, line, f"missing field {e.args[0]!r} used by the template (fields present: {fields})"
            ) from None
        except (ValueError, IndexError) as e:
            raise BadRecordError(path, line, f"template {source.template!r} failed: {e}") from None
    else:
        if source.text_field not in record:
            fields = ", ".join(sorted(map(str, record))) or "none"
            raise BadRecordError(
                path, line, f"missing text field {source.text_field!r} (fields present: {fields})"
            )
        text = record[source.text_field]
        if not isinstance(text, str):
            raise BadRecordError(
                path, line, f"field {source.text_field!r} is {type(text).__name__}, expected a string"
            )
    return _checked_text(text, path, line)


def _checked_text(text: str, path: str, line: int) -> str:
    """``text`` when a tokenizer can take it: not blank, no lone surrogate (``\\ud800`` in JSON, common in scraped
    dumps, is valid JSON but not Unicode text)."""
    if not text.strip():
        raise BadRecordError(path, line, "empty document")
    if (at := jsonstream.find_surrogate(text)) is not None:
        raise BadRecordError(path, line, str(jsonstream.lone_surrogate(text, at)))
    return text


def _rebased(e: BadRecordError, base: _LineBase) -> BadRecordError:
    """``e`` with its span-relative line made a line of the file."""
    return e if base.offset == 0 or e.line <= 0 else BadRecordError(
        e.file, base.value + e.line, e.reason)


def _jsonl_records(path: str, fmt: str, source: SourceConfig, start: int, span: FileSpan, base: _LineBase,
                   stream: bool = False) -> Iterator[tuple[int, int, object]]:
    """(record index, line, text or BadRecordError) for a jsonl file (span); record index = 0-based line index
    in the span, line = 1-based line in the span (``base`` turns it into a line of the file). ``stream``: a huge
    line's text comes as a :class:`StreamedText` (not with a ``template``: that needs the whole record)."""
    seen_content = False
    # A huge line (one document of 100 MB) is held once while its document is tokenized: its bytes, their decoded
    # string and the parsed record are dropped as soon as the next form exists (no copy by strip() either).
    for idx, data in enumerate(_open_lines(path, fmt, base.offset, span.stop, huge=stream and source.template is None)):
        if isinstance(data, LongLine):  # streamed: checked whole in one pass, its text read again in pieces
            seen_content = True
            if idx >= start:
                try:
                    value = jsonstream.long_line_text(data, source.text_field)
                    if value is not None and not isinstance(value, StreamedText):
                        value = _text_of(value, source, path, idx + 1)  # the record minus its long strings
                except LineError as e:
                    value = BadRecordError(path, idx + 1, str(e))
                except BadRecordError as e:
                    value = e
                if value is not None:
                    yield idx, idx + 1, _rebased(value, base) if isinstance(value, BadRecordError) else value
            continue
        blank = data.isspace() or not data
        seen_content = seen_content or not blank
        if idx < start:
            continue
        line = idx + 1
        if blank:
            continue  # blank lines between records are tolerated
        try:
            text = _decode(path, line, data)
            del data
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise BadRecordError(path, line, str(jsonstream.malformed_json(e.msg, e.colno))) from None
            del text
            value = _text_of(record, source, path, line)
            del record
            yield idx, line, value
            del value
        except BadRecordError as e:
            yield idx, line, _rebased(e, base)
    if not seen_content and span.whole:
        yield -1, 0, BadRecordError(path, 0, "file is empty")


def _txt_records(path: str, source: SourceConfig, start: int) -> Iterator[tuple[int, int, object]]:
    """Records of a text file: the whole file, blank-line paragraphs, or lines. A line that is not UTF-8 makes its
    record bad (every such line: each is named by its own line)."""
    lines: list[tuple[int, str]] = []
    bad: dict[int, BadRecordError] = {}
    for idx, data in enumerate(_open_lines(path, "txt")):
        try:
            lines.append((idx + 1, _decode(path, idx + 1, data)))
        except BadRecordError as e:
            bad[idx + 1] = e
            lines.append((idx + 1, ""))
    first_bad = next(iter(bad.values()), None)
    if not bad and not any(s.strip() for _, s in lines):  # (bad lines are records: each is named below)
        yield -1, 0, BadRecordError(path, 0, "file is empty")
        return
    mode = source.txt_split
    if mode == "file":
        if start == 0:
            yield 0, 1, first_bad or "".join(s for _, s in lines)
        return
    # group into records: each line, or runs of non-blank lines (a bad line counts as one that is not blank)
    records: list[tuple[int, list[tuple[int, str]]]] = []
    if mode == "line":
        records = [(n, [(n, s)]) for n, s in lines if s.strip() or n in bad]
    else:
        current: list[tuple[int, str]] = []
        for n, s in lines:
            if s.strip() or n in bad:
                current.append((n, s))
            elif current:
                records.append((current[0][0], current))
                current = []
        if current:
            records.append((current[0][0], current))
    for ridx, (first, group) in enumerate(records):
        if ridx < start:
            continue
        bad_here = next((bad[n] for n, _ in group if n in bad), None)
        yield ridx, first, bad_here or "".join(s for _, s in group).strip("\n")


def _parquet_file(path: str):  # noqa: ANN202 - a pyarrow.parquet.ParquetFile (pyarrow is imported when needed)
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError with its own message
        raise BadRecordError(path, 0, f"cannot read parquet: {e}") from e


def parquet_row_groups(path: str) -> list[tuple[int, int]]:
    """``(rows, compressed bytes)`` of each row group of a parquet file (its footer only): where work units may
    cut it."""
    meta = _parquet_file(path).metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    return [(g.num_rows, sum(g.column(j).total_compressed_size for j in range(g.num_columns))) for g in groups]


def _parquet_records(path: str, source: SourceConfig, start: int, span: FileSpan,
                     ) -> Iterator[tuple[int, int, object]]:
    """(record index, row, text or BadRecordError) of the span's row groups; record index = 0-based row in the
    span, row = 1-based row in the file."""
    pf = _parquet_file(path)
    if pf.metadata.num_rows == 0:
        yield -1, 0, BadRecordError(path, 0, "file is empty (0 rows)")
        return
    names = pf.schema_arrow.names
    if source.template is None and source.text_field not in names:
        raise BadRecordError(
            path, 0, f"missing text column {source.text_field!r} (columns: {', '.join(names)})"
        )
    groups = list(range(pf.metadata.num_row_groups))[span.start:span.stop]
    before = sum(pf.metadata.row_group(i).num_rows for i in range(span.start))
    row = 0
    for batch in pf.iter_batches(batch_size=4096, row_groups=groups):
        if row + batch.num_rows <= start:
            row += batch.num_rows
            continue
        for rec in _batch_rows(batch):
            if row >= start:
                line = before + row + 1
                try:
                    if isinstance(rec, LineError):
                        raise BadRecordError(path, line, str(rec))
                    yield row, line, _text_of(rec, source, path, line)
                except BadRecordError as e:
                    yield row, line, e
            row += 1


def _batch_rows(batch) -> list[dict | LineError]:  # noqa: ANN001 - a pyarrow.RecordBatch
    """The rows of a parquet batch as dicts; a row whose strings are not UTF-8 (a writer that did not check them) as
    the reason, in the words of the JSONL reader."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        rows: list[dict | LineError] = []
        for i in range(batch.num_rows):
            try:
                rows.extend(batch.slice(i, 1).to_pylist())
            except UnicodeDecodeError as e:
                rows.append(jsonstream.not_utf8(e.object[e.start], e.start + 1))
        return rows


def iter_inputs(
    files: Sequence[P], start_file: int, start_record: int,
    records: Callable[[int, P, int], Iterator[T | BadRecordError]],
) -> Iterator[T | BadRecordError]:
    """The items of ``files`` (paths, or :class:`FileSpan` s) from a resume position: ``records(file_index, file,
    first)`` yields one file's items from its record ``first`` on; a :class:`BadRecordError` it raises (a file
    that cannot be used at all) is yielded, and reading goes on with the next file."""
    for fi in range(start_file, len(files)):
        try:
            yield from records(fi, files[fi], start_record if fi == start_file else 0)
        except BadRecordError as e:
            yield e
        except OSError as e:  # a read error (EIO): its message names the input, not the job's output
            raise input_error(e, getattr(files[fi], "path", files[fi])) from None


def input_error(e: OSError, path: object) -> OSError:
    """``e``, an error reading the input ``path``, naming it when it names no file (EIO names none)."""
    if e.filename is None:
        e.filename = os.fspath(path) if isinstance(path, str | os.PathLike) else str(path)
    return e


def iter_documents(
    source: SourceConfig,
    *,
    start_file: int = 0,
    start_record: int = 0,
    files: list[str] | None = None,
    spans: list[FileSpan] | None = None,
    stream: bool = False,
) -> Iterator[Document | BadRecordError]:
    """Stream a source's documents from a resume position; bad records are yielded, not raised.

    Args:
        source: the source config.
        start_file: index into the file (or span) list to start from.
        start_record: records of that file (span) already consumed.
        files: the resolved file list (default: :func:`resolve_paths`).
        spans: read these parts of files instead (a work unit's); ``file_index`` then counts spans.
        stream: a huge ``.jsonl`` line gives a document whose ``pieces()`` decode its text again, never held whole.

    Yields:
        :class:`Document` or :class:`BadRecordError` (the caller decides: fail, or count and skip).
        A file that cannot be opened at all yields a single error with line 0.
    """
    if spans is None:
        spans = [FileSpan(p) for p in (resolve_paths(source) if files is None else files)]

    def documents(fi: int, span: FileSpan, first: int) -> Iterator[Document | BadRecordError]:
        path = span.path
        fmt = detect_format(path, source.format)
        if not span.whole and fmt not in SPLITTABLE_FORMATS:
            raise ValueError(f"{path}: a {fmt} file is read whole, not in spans ({span})")
        base = _NO_LINES_BEFORE
        if fmt in ("jsonl", "jsonl.zst"):
            base = _LineBase(path, _span_start(path, span.start))
            records = _jsonl_records(path, fmt, source, first, span, base, stream)
        elif fmt == "parquet":
            records = _parquet_records(path, source, first, span)
        elif fmt == "txt":
            records = _txt_records(path, source, first)
        else:  # a pre-tokenized format: curation.ingest.token_sources reads it
            raise BadRecordError(path, 0, f"format {fmt!r} holds token ids, not text (source '{source.name}')")
        for idx, line, item in records:
            if isinstance(item, BadRecordError):
                yield item
            else:  # a huge line's text comes as a StreamedText
                streamed = item if isinstance(item, StreamedText) else None
                yield Document(text="" if streamed else item, file=path, span_line=line, file_index=fi,
                               next_record=idx + 1, lines_before=base, stream=streamed)

    yield from iter_inputs(spans, start_file, start_record, documents)
