"""Work units of ``prepare``: deterministic stretches of a source's input, each tokenized and packed on its own.

**The unit rule.** A source's files (sorted, as :func:`~curation.ingest.corpus.resolve_paths` lists them) are
cut into units of about ``unit_bytes`` input bytes, in order: small files share a unit, a large plain ``.jsonl``
file is cut at byte offsets (a line belongs to the unit its first byte is in) and a large ``.parquet`` file at
row groups; other files (``.jsonl.zst``, ``.txt``, pre-tokenized inputs) are never cut, and a source with
``skip_documents`` or ``max_documents`` is one unit (its documents are counted in order). The cuts depend on
the files, their sizes and ``unit_bytes`` only: never on the number of workers.

**A unit's output.** Its documents (each followed by EOS) are packed into sequences of exactly ``seq_len``
tokens and written as parts of ``sequences_per_part`` sequences, ``<source>/part-<unit>-<k>``, each shuffled
within itself by the seed ``(seed, source index, unit · 2³² + k)`` (for unit 0 the seed parts had before units
existed: a source of one unit, every source of the demo, is packed exactly as before). The fewer than
``seq_len`` tokens left at the end of a unit are dropped and counted (``dropped_tokens``). A unit's parts are
therefore a function of its input alone, and the same for any number of workers, in any order.

**Progress and resume.** After each part the unit's task saves its :class:`~schemas.manifest.UnitRecord`
(``<source>/unit-<unit>.json``: the parts, each with the reader position just after it, the counts and bad
records so far, ``done`` at the end). A killed unit resumes from its last finished part: the document the part
ended in is read again and its tokens already written are skipped (the record never holds tokens, so memory
stays bounded by one part plus the document being read); a ``done`` unit is never run again.

Everything here runs in-process (the world size 1 of ``prepare``) and, unchanged, as a Ray task
(:mod:`curation.engine.ray_backend.prepare_pool`): the arguments and the result are plain picklable values.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from curation.ingest.corpus import (
    BadRecordError,
    Document,
    FileSpan,
    detect_format,
    iter_documents,
    parquet_row_groups,
)
from curation.ingest.fingerprint import span_fingerprint, stat_input
from curation.ingest.packing import Packer
from curation.ingest.token_sources import TokenRecord, iter_token_records
from curation.ingest.tokenizer import PIECE_CHARS, shared_tokenizer
from curation.io import storage
from curation.io.atomic import write_unit_record
from curation.io.paths import UnsafeNameError, check_relative, safe_join
from curation.io.shards import write_part
from curation.io.stop import check_stop
from schemas.config import SourceConfig
from schemas.manifest import BadRecord, ShardRecord, UnitRecord
from schemas.shards import CANDIDATE, token_dtype

__all__ = ["WorkUnit", "PackSettings", "UnitResult", "plan_units", "run_unit", "PartRewritten", "read_documents",
           "check_record", "load_record", "RECORD_NAME"]

#: A unit record's file name in its source's folder (``unit-00012.json``: the unit's number).
RECORD_NAME = re.compile(r"unit-(\d{5,9})\.json")

_ENCODE_BATCH = 256
_BATCH_CHARS = 1 << 20
#: Pieces of a huge document encoded together: one per tokenizer thread, so a huge document is tokenized on every
#: core too, in this process; at most 4 (each costs ~40 MB of the tokenizer's memory, and a core of a container
#: with a CPU quota is not one of os.cpu_count(): the cores this process may run on are counted).
_PIECES_AT_ONCE = min(4, int(os.environ.get("RAYON_NUM_THREADS")
                             or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
                             or 1))


@dataclass(frozen=True)
class WorkUnit:
    """One unit of a source: where its input is and where its parts go."""

    out: str  # the group's output directory (candidates/ or validation/)
    source_index: int  # the source's index in its group (seeds the shuffle)
    source: SourceConfig
    index: int  # the unit's number within its source
    spans: tuple[FileSpan, ...]
    bytes: int  # input bytes (for balancing and progress)

    def part_name(self, k: int) -> str:
        return f"{self.source.name}/part-{self.index:05d}-{k:05d}"

    @property
    def record_path(self) -> str:
        return os.path.join(self.out, self.source.name, f"unit-{self.index:05d}.json")

    @property
    def span_list(self) -> list[list]:
        """The spans as a unit record holds them."""
        return [[s.path, s.start, s.stop] for s in self.spans]

    def fresh_record(self) -> UnitRecord:
        return UnitRecord(source=self.source.name, unit=self.index, spans=self.span_list)

    def fingerprints(self) -> list[list]:
        """``[size, mtime_ns, content hash]`` of each span's file, as a unit record keeps them (see
        :func:`span_fingerprint`)."""
        return [span_fingerprint(s, self._format(s)) for s in self.spans]

    def changed_input(self, recorded: list[list], *, missing_ok: bool = False) -> str | None:
        """The first file of this unit whose content changed since ``recorded`` (its record's fingerprints) were
        taken, else ``None``: a file of the same size and mtime is taken as unchanged, another one is hashed (a
        copy, or a touch, keeps its hash). A record without fingerprints (an older version's) is not checked;
        ``missing_ok``: a file that is gone is not either."""
        if not recorded:
            return None
        for span, old in zip(self.spans, recorded, strict=False):
            try:
                size, mtime = stat_input(span.path)
            except OSError:
                if missing_ok and not os.path.lexists(span.path):  # gone (``missing_ok``): nothing to compare
                    continue
                return span.path
            if [size, mtime] == list(old[:2]):
                continue
            if span_fingerprint(span, self._format(span))[2] != old[2]:
                return span.path
        return None

    def _format(self, span: FileSpan) -> str | None:
        return None if self.source.pre_tokenized or span.whole else _format(span.path, self.source)


def check_record(record: UnitRecord, path: str, source: str, index: int) -> UnitRecord:
    """``record``, read from ``path``, when it is the record of unit ``index`` of ``source`` as this code writes it:
    its source and unit, and every part named as :meth:`WorkUnit.part_name` names it. A record is read back from
    disk or a bucket, so it is untrusted: a part name is what a rerun deletes (a unit redone) or reads.

    Raises:
        UnsafeNameError: one line naming ``path`` and the field.
    """
    if record.source != source:
        raise UnsafeNameError(f"{path}: source {record.source!r} is not this record's source {source!r}; refused: "
                              "restore the file or delete the directory")
    if record.unit != index:
        raise UnsafeNameError(f"{path}: unit {record.unit} is not this record's unit {index}; refused: restore the "
                              "file or delete the directory")
    for k, part in enumerate(record.parts):
        check_relative(part.name, what=f"parts[{k}].name", source_file=path)
        expected = f"{source}/part-{index:05d}-{k:05d}"
        if part.name != expected:
            raise UnsafeNameError(f"{path}: parts[{k}].name {part.name!r} is not the name this unit's part {k} has "
                                  f"({expected!r}); refused: restore the file or delete the directory")
    return record


def load_record(unit: WorkUnit) -> UnitRecord:
    """The unit's saved record (:func:`check_record`: its file must stay inside the output directory, its names
    must be the unit's own)."""
    path = safe_join(unit.out, f"{unit.source.name}/unit-{unit.index:05d}.json", what="unit record",
                     source_file=unit.out)
    return check_record(UnitRecord.load(path), path, unit.source.name, unit.index)


@dataclass(frozen=True)
class PackSettings:
    """What every unit of a run shares (the settings that determine its parts, and the tokenizer)."""

    seq_len: int
    seed: int
    sequences_per_part: int
    shard_size_limit: int
    skip_bad_records: bool
    tokenizer_path: str
    eos_token: str
    tokenizer_fingerprint: str


@dataclass
class UnitResult:
    """What a unit's run reports back: its record (as saved), the tokens it tokenized in this run, and the bad
    record that stopped it (``skip_bad_records: false``)."""

    unit: WorkUnit
    record: UnitRecord
    tokens: int = 0
    error: BadRecord | None = None
    cpu_seconds: float = 0.0  # CPU time of this run of the unit (its process, every thread)


class PartRewritten(Exception):  # noqa: N818 (a signal, not an error)
    """Stops :func:`run_unit` once the part it was asked to rewrite is on disk."""


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
def plan_units(out: str, source_index: int, source: SourceConfig, files: list[str], unit_bytes: int,
               ) -> list[WorkUnit]:
    """The source's work units (see the module docstring for the rule)."""
    if not files:
        return []
    if source.skip_documents or source.max_documents is not None:  # documents are counted in order: one unit
        spans = tuple(FileSpan(p) for p in files)
        return [WorkUnit(out, source_index, source, 0, spans, sum(_size(p) for p in files))]
    units: list[WorkUnit] = []
    current: list[FileSpan] = []
    filled = 0

    def add(span: FileSpan, nbytes: int) -> None:
        nonlocal current, filled
        current.append(span)
        filled += nbytes
        if filled >= unit_bytes:
            units.append(WorkUnit(out, source_index, source, len(units), tuple(current), filled))
            current, filled = [], 0

    for path in files:
        size = _size(path)
        fmt = None if source.pre_tokenized else _format(path, source)  # pre-tokenized inputs are read whole
        if fmt == "jsonl" and size > unit_bytes - filled:  # cut at byte offsets
            start = 0
            while start < size:
                stop = min(size, start + unit_bytes - filled)
                add(FileSpan(path, start, None if stop == size else stop), stop - start)
                start = stop
        elif fmt == "parquet" and size > unit_bytes - filled and len(groups := _row_group_bytes(path)) > 1:
            first = 0  # cut at row groups
            for i in range(len(groups)):
                last = i == len(groups) - 1
                if filled + sum(groups[first:i + 1]) >= unit_bytes or last:
                    span = FileSpan(path) if first == 0 and last else FileSpan(path, first, None if last else i + 1)
                    add(span, sum(groups[first:i + 1]))
                    first = i + 1
        else:
            add(FileSpan(path), size)
    if current:
        units.append(WorkUnit(out, source_index, source, len(units), tuple(current), filled))
    return units


def _row_group_bytes(path: str) -> list[int]:
    try:
        return [nbytes for _, nbytes in parquet_row_groups(path)]
    except BadRecordError:
        return []  # read whole; the reader reports it


def _size(path: str) -> int:
    """Bytes of an input file, or of the files of an input directory (an MDS dataset)."""
    try:
        if os.path.isdir(path):
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)
        return os.path.getsize(path)
    except OSError:
        return 0  # the reader reports it (file:0: cannot open)


def _format(path: str, source: SourceConfig) -> str | None:
    try:
        return detect_format(path, source.format)
    except BadRecordError:
        return None  # read whole; the reader reports it


# ------------------------------------------------------------------------------------------------
# running a unit
# ------------------------------------------------------------------------------------------------
def read_documents(source: SourceConfig, spans: list[FileSpan], skip_bad: bool, *, start_file: int = 0,
                   start_record: int = 0, vocab_size: int | None = None,
                   ) -> Iterator[Document | TokenRecord | BadRecordError]:
    """A source's documents in ``spans`` (a pre-tokenized source's token records, whole inputs, their ids checked
    against ``vocab_size``) from a resume position; bad records raise unless ``skip_bad`` (then they are yielded
    to count). ``skip_documents`` are skipped when reading from the start."""
    at_start = start_file == 0 and start_record == 0
    to_skip = source.skip_documents if at_start else 0  # a resume position is already past them
    if source.pre_tokenized:
        assert vocab_size is not None, "token records are checked against the tokenizer's vocabulary"
        items = iter_token_records(source, files=[s.path for s in spans], vocab_size=vocab_size,
                                   start_file=start_file, start_record=start_record)
    else:
        items = iter_documents(source, spans=spans, start_file=start_file, start_record=start_record, stream=True)
    for item in items:
        if to_skip:
            to_skip -= not isinstance(item, BadRecordError)
            continue
        if isinstance(item, BadRecordError) and not skip_bad:
            raise item
        yield item


def _batches(items: Iterator[Document | TokenRecord | BadRecordError],
             ) -> Iterator[list[Document | TokenRecord | BadRecordError]]:
    """Items in encode batches of at most ``_ENCODE_BATCH`` records and about ``_BATCH_CHARS`` characters (or
    bytes of token ids: a huge document or record ends its batch, so at most one is held at a time)."""
    batch: list[Document | TokenRecord | BadRecordError] = []
    chars = 0
    for item in items:
        batch.append(item)
        if isinstance(item, Document):
            chars += _BATCH_CHARS if item.stream is not None else len(item.text)
        elif isinstance(item, TokenRecord):
            chars += item.ids.nbytes
        if len(batch) >= _ENCODE_BATCH or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _remove_leftovers(unit: WorkUnit, record: UnitRecord) -> None:
    """Delete what a killed run of this unit left: part directories its record does not list (the unfinished
    part) and a half-written record. Only this unit's files: other units may be running beside it."""
    folder = safe_join(unit.out, unit.source.name, what="source folder", source_file=unit.out)
    if not os.path.isdir(folder):
        return
    prefix = f"part-{unit.index:05d}-"
    recorded = {os.path.basename(p.name) for p in record.parts}
    for entry in sorted(os.listdir(folder)):
        if entry.startswith(prefix) and (entry.endswith(".tmp") or entry not in recorded):
            storage.remove(os.path.join(folder, entry))  # an object-store directory's objects too
    if os.path.exists(unit.record_path + ".tmp"):
        os.unlink(unit.record_path + ".tmp")


def _save_record(unit: WorkUnit, record: UnitRecord) -> None:
    """Save the unit's record after a finished part (uploaded, for an object-store directory, after the part)."""
    write_unit_record(unit.record_path, record)
    storage.publish(unit.record_path)


def run_unit(unit: WorkUnit, settings: PackSettings, *, rewrite: tuple[UnitRecord, ShardRecord] | None = None,
             on_part: Callable[[UnitRecord], None] | None = None) -> UnitResult:
    """Tokenize, pack and write one work unit as parts of ``sequences_per_part`` sequences (resumable).

    Resumes from the unit's saved record (``unit.record_path``): a ``done`` unit returns at once, an unfinished
    one continues after its last finished part. After each part the record is saved (the part is on disk
    before the record says so), ``on_part`` is called with it, and a stop signal is polled
    (:func:`~curation.io.stop.check_stop`: in-process, a SIGTERM stops here, between parts).

    Memory is bounded by one part plus the document being read: a document longer than ``PIECE_CHARS`` is
    tokenized and packed piece by piece. A part is written as soon as its sequences are full, i.e. while a
    document is being fed, so it ends inside that document (or at its EOS): its resume state is the document's
    position and how many of its tokens are written (``skip``).

    With ``rewrite`` (the unit's record before a finished part, and that part's record), only that part is
    written again, then :class:`PartRewritten` is raised; nothing is saved.

    Returns:
        The unit's record and the tokens tokenized; with ``skip_bad_records: false`` a bad record stops the
        unit and is returned as ``error`` (its finished parts are kept).
    """
    cpu = time.process_time()
    tok = shared_tokenizer(settings.tokenizer_path, eos_token=settings.eos_token,
                           fingerprint=settings.tokenizer_fingerprint)
    if rewrite is not None:
        record, target = rewrite
    else:
        target = None
        started = storage.refresh(unit.record_path)  # a worker on another node: the bucket's copy
        if started:
            record = load_record(unit)
        else:  # the inputs as this run reads them: a rerun redoes the unit when they change (never mixes)
            record = unit.fresh_record()
            record.inputs = unit.fingerprints()
        if record.done:
            return UnitResult(unit, record)
        _remove_leftovers(unit, record)
    n, seq_len = settings.sequences_per_part, settings.seq_len
    state = dict(record.parts[-1].state) if record.parts else {"file": 0, "record": 0, "skip": 0}
    k = len(record.parts)
    counts = record.counts
    dtype = np.dtype(token_dtype(tok.vocab_size))
    packer = Packer(seq_len=seq_len, eos_id=tok.eos_id)
    pending: list[np.ndarray] = []
    to_skip = state["skip"]  # tokens of the first document already in finished parts
    fed = 0  # tokens of the current document so far (with the skipped ones)
    doc_pos = (state["file"], state["record"])  # reader position of the current document
    tokens = 0

    def flush(seqs: list[np.ndarray], state: dict) -> None:
        nonlocal k
        name = unit.part_name(k)
        if seqs:
            key = (unit.index << 32) | k
            order = np.random.default_rng([settings.seed, unit.source_index, key]).permutation(len(seqs))
            write_part(
                os.path.join(unit.out, name), CANDIDATE,
                ({"tokens": seqs[i].astype(dtype), "source": unit.source.name} for i in order),
                vocab_size=tok.vocab_size, size_limit=settings.shard_size_limit,
            )
        counts.sequences += len(seqs)
        if state.get("done"):
            counts.dropped_tokens = len(packer.carry)
        part = ShardRecord(name=name, source=unit.source.name, part=k, samples=len(seqs), tokens=len(seqs) * seq_len,
                           state=state)
        if target is not None:
            if part != target:
                raise ValueError(f"{unit.out}/{name}: regenerated as {part}, but the manifest recorded {target}: the "
                                 "input files changed since this directory was prepared; prepare into a new output_dir")
            raise PartRewritten()
        record.parts.append(part)
        record.done = bool(state.get("done"))
        _save_record(unit, record)  # the part is on disk (and in the bucket) before its record says so
        k += 1
        if on_part is not None:
            on_part(record)
        check_stop(f"after finishing {unit.out}/{name}")  # SIGTERM/SIGINT: stop here, between parts (curation.io.stop)

    def feed(ids: np.ndarray) -> None:
        nonlocal pending, fed, to_skip
        fed += len(ids)
        if to_skip:  # the start of the resumed document is in finished parts already
            cut = min(to_skip, len(ids))
            ids, to_skip = ids[cut:], to_skip - cut
        pending.extend(packer.extend(ids))
        while len(pending) >= n:
            seqs, pending = pending[:n], pending[n:]
            # The part's last sequence ends in `ids` (fewer than n were pending before): all that is not
            # written yet belongs to the current document, so a rerun resumes inside it.
            written = fed - len(packer.carry) - len(pending) * seq_len
            assert fed - len(ids) < written <= fed
            flush(seqs, {"file": doc_pos[0], "record": doc_pos[1], "skip": written})

    eos = np.asarray([tok.eos_id], dtype=np.int64)
    source = unit.source
    try:
        items = read_documents(source, list(unit.spans), settings.skip_bad_records, start_file=state["file"],
                               start_record=state["record"], vocab_size=tok.vocab_size)
        stop = False
        for batch in _batches(items):
            short = [d.text for d in batch if isinstance(d, Document) and d.stream is None and len(d.text) <= PIECE_CHARS]
            encoded = iter(tok.encode_batch(short))
            for item in batch:  # in input order, so counts match the saved position exactly
                if isinstance(item, BadRecordError):
                    record.add_bad_record(BadRecord(source=source.name, file=item.file, line=item.line,
                                                    reason=item.reason))
                    continue
                doc_pos, fed = (item.file_index, item.next_record - 1), 0
                if isinstance(item, TokenRecord):  # ids as they are; a stream's pieces hold their own EOS
                    pieces, ends = [item.ids], source.token_rows == "documents"
                elif item.stream is not None:  # a huge line's text, decoded piece by piece (curation.ingest.jsonstream)
                    pieces = tok.encode_stream(item.pieces(), piece_chars=PIECE_CHARS, at_once=_PIECES_AT_ONCE)
                else:
                    pieces = ([np.asarray(next(encoded), dtype=np.int64)] if len(item.text) <= PIECE_CHARS
                              else tok.encode_pieces(item.text, piece_chars=PIECE_CHARS, at_once=_PIECES_AT_ONCE))
                    ends = True
                for ids in pieces:
                    feed(ids)
                if ends:
                    feed(eos)
                # Counted once complete: a part written in the middle saves the counts without it, and a
                # rerun reads it again.
                counts.documents += 1
                counts.tokens += fed
                tokens += fed
                if source.max_documents is not None and counts.documents >= source.max_documents:
                    stop = True
                    break
            if stop:
                break
    except BadRecordError as e:  # the unit stops; its record stays as saved after its last finished part
        saved = load_record(unit) if os.path.exists(unit.record_path) else unit.fresh_record()
        return UnitResult(unit, saved, tokens, BadRecord(source=source.name, file=e.file, line=e.line,
                                                         reason=e.reason), time.process_time() - cpu)
    flush(pending, {"done": True})
    return UnitResult(unit, record, tokens, cpu_seconds=time.process_time() - cpu)
