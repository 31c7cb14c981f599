"""Work units of ``prepare``: deterministic stretches of a source's input, each tokenized and packed on its own.

**The unit rule.** A source's files (sorted, as :func:`~curation.ingest.corpus.resolve_paths` lists them) are
cut into units of about ``unit_bytes`` input bytes, in order: small files share a unit, a large plain ``.jsonl``
file is cut at byte offsets (a line belongs to the unit its first byte is in; a stretch in which no line starts,
inside one long line, makes no unit, so the units after it are numbered on) and a large ``.parquet`` file at
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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from curation.ingest.corpus import (
    BadRecordError,
    FileSpan,
    detect_format,
    parquet_row_groups,
)
from curation.ingest.fingerprint import span_fingerprint, stat_input
from curation.ingest.jsonstream import skip_line
from curation.ingest.packing import Packer
from curation.ingest.tokenizer import PIECE_CHARS, LoadedTokenizer, TextRefused, shared_tokenizer
from curation.ingest.unit_input import Doc, batches, documents, read_documents
from curation.io import bucket_inputs, objects, storage
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
        """The spans as a unit record holds them (an input in an object store by its URL: the same on every node)."""
        return [[storage.display(s.path), s.start, s.stop] for s in self.spans]

    def fresh_record(self) -> UnitRecord:
        return UnitRecord(source=self.source.name, unit=self.index, spans=self.span_list)

    def fingerprints(self) -> list[list]:
        """``[size, mtime_ns, content hash]`` of each span's file, as a unit record keeps them (see
        :func:`span_fingerprint`)."""
        bucket_inputs.fetch_inputs(s.path for s in self.spans)  # (an input in a bucket: into this node's cache)
        return [span_fingerprint(s, self._format(s)) for s in self.spans]

    def changed_input(self, recorded: list[list], *, missing_ok: bool = False) -> str | None:
        """The first file of this unit whose content changed since ``recorded`` (its record's fingerprints) were
        taken, else ``None``: a file of the same size and mtime is taken as unchanged, another one is hashed (a
        copy, or a touch, keeps its hash). A record without fingerprints (an older version's) is not checked;
        ``missing_ok``: a file that is gone is not either."""
        if not recorded:
            return None
        bucket_inputs.fetch_inputs(s.path for s in self.spans)
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
    uploaded: int = 0  # objects uploaded by this run of the unit (an object-store output_dir)
    pid: int = 0  # the process that ran it (its uploads are counted by the driver when it is another one)


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
            lines = _LineStarts(path, size)
            start = 0
            while start < size:
                stop = min(size, start + unit_bytes - filled)
                if lines.any_in(start, stop):  # a span inside one long line has no record: no unit
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


class _LineStarts:
    """Whether a line of a file starts in a byte range, asked for ranges in increasing order: each question reads at
    most from the range's start to the next line start, and one that ends before a line start known already reads
    nothing, so all of them read the file at most once (a 5 MB line cut into 1000-byte ranges is read once, not once
    per range)."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.known = (-1, 0)  # (a, the first line start at or after a), the last one found

    def first_at_or_after(self, a: int) -> int:
        """The offset of the first line starting at or after ``a`` (the file's size when none does)."""
        seen, start = self.known
        if a == 0 or a <= start and a > seen:  # no line starts in (seen, start): the same one
            return 0 if a == 0 else start
        try:
            with open(self.path, "rb") as f:
                f.seek(a - 1)
                skip_line(f)  # the rest of the line holding byte a - 1 (just its newline when one ends there)
                start = min(f.tell(), self.size)
        except OSError:
            start = a  # the reader reports it (file:0: cannot open)
        self.known = (a, start)
        return start

    def any_in(self, a: int, b: int) -> bool:
        """Whether a line starts in ``[a, b)``."""
        return self.first_at_or_after(a) < min(b, self.size)


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
    tokenized and packed piece by piece (a huge ``.jsonl`` line is never held whole either). A part is written as
    soon as its sequences are full, i.e. while a document is being fed, so it ends inside that document (or at its
    EOS): its resume state is the document's position and how many of its tokens are written (``skip``). Every kind
    of document (a short text, a long one encoded in pieces, a streamed huge line, a token record) is one
    :class:`Doc` and goes through :meth:`_UnitPacker.add`, the one place a document starts, is fed and ends.

    With ``rewrite`` (the unit's record before a finished part, and that part's record), only that part is
    written again, then :class:`PartRewritten` is raised; nothing is saved.

    Returns:
        The unit's record and the tokens tokenized; with ``skip_bad_records: false`` a bad record (one the reader
        refuses, or a text the tokenizer refuses) stops the unit and is returned as ``error`` (its finished parts
        are kept).
    """
    cpu, mark = time.process_time(), objects.upload_mark()
    tok = shared_tokenizer(settings.tokenizer_path, eos_token=settings.eos_token,
                           fingerprint=settings.tokenizer_fingerprint)
    record, target = _starting_record(unit, rewrite)
    if record.done:
        return UnitResult(unit, record)
    bucket_inputs.fetch_inputs(s.path for s in unit.spans)  # (an input in a bucket: into this node's cache)
    packer = _UnitPacker(unit, settings, tok, record, target=target, on_part=on_part)
    try:
        _pack_unit(unit, settings, tok, packer)
    except BadRecordError as e:  # the unit stops; its record stays as saved after its last finished part
        saved = load_record(unit) if os.path.exists(unit.record_path) else unit.fresh_record()
        bad = BadRecord(source=unit.source.name, file=storage.display(e.file), line=e.line, reason=e.reason)
        return UnitResult(unit, saved, packer.tokens, bad, time.process_time() - cpu, objects.uploads(since=mark), os.getpid())
    packer.finish()
    return UnitResult(unit, record, packer.tokens, cpu_seconds=time.process_time() - cpu,
                      uploaded=objects.uploads(since=mark), pid=os.getpid())


def _starting_record(unit: WorkUnit, rewrite: tuple[UnitRecord, ShardRecord] | None,
                     ) -> tuple[UnitRecord, ShardRecord | None]:
    """The record a run of ``unit`` starts from (the saved one, a fresh one, or ``rewrite``'s), and the part to
    rewrite (None: a normal run, whose leftovers of a killed run are removed first)."""
    if rewrite is not None:
        return rewrite
    if storage.refresh(unit.record_path):  # started before (a worker on another node: the bucket's copy)
        record = load_record(unit)
    else:  # the inputs as this run reads them: a rerun redoes the unit when they change (never mixes)
        record = unit.fresh_record()
        record.inputs = unit.fingerprints()
    if not record.done:
        _remove_leftovers(unit, record)
    return record, None


def _pack_unit(unit: WorkUnit, settings: PackSettings, tok: LoadedTokenizer, packer: _UnitPacker) -> None:
    """Read the unit's documents from the packer's resume position and pack them (a bad one is counted, or raised
    without ``skip_bad_records``), up to the source's ``max_documents``."""
    source = unit.source
    file_index, record_index = packer.position
    items = read_documents(source, list(unit.spans), settings.skip_bad_records, start_file=file_index,
                           start_record=record_index, vocab_size=tok.vocab_size)
    for batch in batches(items):  # in input order, so the counts match the saved position exactly
        for doc in documents(batch, tok, source, piece_chars=PIECE_CHARS, at_once=_PIECES_AT_ONCE):
            bad = doc if isinstance(doc, BadRecordError) else packer.add(doc)
            if bad is not None:
                if not settings.skip_bad_records:
                    raise bad
                packer.record.add_bad_record(BadRecord(source=source.name, file=storage.display(bad.file),
                                                       line=bad.line, reason=bad.reason))
            elif source.max_documents is not None and packer.counts.documents >= source.max_documents:
                return


class _UnitPacker:
    """One run of a unit: documents in (:meth:`add`), parts out (written as their sequences fill, each followed by
    the unit's saved record), the unit's end (:meth:`finish`). The resume state of a part is the position of the
    document it ends in and how many of that document's tokens it holds; a resumed run skips those.

    With ``target`` (a part to rewrite), the part written next must equal it, and :class:`PartRewritten` is raised
    instead of saving anything.
    """

    def __init__(self, unit: WorkUnit, settings: PackSettings, tok: LoadedTokenizer, record: UnitRecord, *,
                 target: ShardRecord | None = None, on_part: Callable[[UnitRecord], None] | None = None) -> None:
        self.unit, self.settings, self.record, self.target, self.on_part = unit, settings, record, target, on_part
        self.counts = record.counts
        self.vocab_size = tok.vocab_size
        self.dtype = np.dtype(token_dtype(tok.vocab_size))
        self.eos = np.asarray([tok.eos_id], dtype=np.int64)
        self.packer = Packer(seq_len=settings.seq_len, eos_id=tok.eos_id)
        self.pending: list[np.ndarray] = []  # full sequences not written yet (fewer than a part)
        state = dict(record.parts[-1].state) if record.parts else {"file": 0, "record": 0, "skip": 0}
        self.position: tuple[int, int] = (state["file"], state["record"])  # of the document being fed
        self.to_skip = state["skip"]  # tokens of the first document already in finished parts
        self.fed = 0  # tokens of the current document so far (with the skipped ones)
        self.tokens = 0  # tokens tokenized in this run

    def add(self, doc: Doc) -> BadRecordError | None:
        """Pack one document: its pieces, then its EOS (when it has one), then count it.

        Returns:
            The bad record it is when the tokenizer refused its text before any of its tokens were packed (nothing
            of it is packed or counted).

        Raises:
            BadRecordError: the tokenizer refused a later piece of a long text: its first tokens are packed and cannot
                be taken back, so the unit stops on it (also with ``skip_bad_records``), naming its file and line.
        """
        self.position, self.fed = doc.position, 0
        pieces = iter(doc.pieces)
        while True:
            try:
                ids = next(pieces, None)
            except TextRefused as e:
                if self.fed == 0:
                    return BadRecordError(doc.file, doc.line(), str(e))
                raise BadRecordError(doc.file, doc.line(), f"{e}, after {self.fed} of its tokens were packed (it "
                                     "cannot be skipped then): fix the text") from None
            if ids is None:
                break
            self._feed(ids)
        if doc.eos:
            self._feed(self.eos)
        # Counted once complete: a part written in the middle saves the counts without it, and a rerun reads it again.
        self.counts.documents += 1
        self.counts.tokens += self.fed
        self.tokens += self.fed
        return None

    def _feed(self, ids: np.ndarray) -> None:
        n, seq_len = self.settings.sequences_per_part, self.settings.seq_len
        self.fed += len(ids)
        if self.to_skip:  # the start of the resumed document is in finished parts already
            cut = min(self.to_skip, len(ids))
            ids, self.to_skip = ids[cut:], self.to_skip - cut
        self.pending.extend(self.packer.extend(ids))
        while len(self.pending) >= n:
            seqs, self.pending = self.pending[:n], self.pending[n:]
            # The part's last sequence ends in `ids` (fewer than n were pending before): all that is not written yet
            # belongs to the current document, so a rerun resumes inside it.
            written = self.fed - len(self.packer.carry) - len(self.pending) * seq_len
            assert self.fed - len(ids) < written <= self.fed
            self._write(seqs, {"file": self.position[0], "record": self.position[1], "skip": written})

    def finish(self) -> None:
        """The unit's end: its last part (the full sequences pending), its fewer-than-``seq_len`` tokens dropped."""
        self._write(self.pending, {"done": True})

    def _write(self, seqs: list[np.ndarray], state: dict) -> None:
        """Write part ``k`` (the next), then save the record saying so (or compare it with the part to rewrite)."""
        unit, k = self.unit, len(self.record.parts)
        name = unit.part_name(k)
        if seqs:
            key = (unit.index << 32) | k
            order = np.random.default_rng([self.settings.seed, unit.source_index, key]).permutation(len(seqs))
            write_part(
                os.path.join(unit.out, name), CANDIDATE,
                ({"tokens": seqs[i].astype(self.dtype), "source": unit.source.name} for i in order),
                vocab_size=self.vocab_size, size_limit=self.settings.shard_size_limit,
            )
        self.counts.sequences += len(seqs)
        if state.get("done"):
            self.counts.dropped_tokens = len(self.packer.carry)
        part = ShardRecord(name=name, source=unit.source.name, part=k, samples=len(seqs),
                           tokens=len(seqs) * self.settings.seq_len, state=state)
        if self.target is not None:
            if part != self.target:
                raise ValueError(f"{unit.out}/{name}: regenerated as {part}, but the manifest recorded {self.target}: "
                                 "the input files changed since this directory was prepared; prepare into a new "
                                 "output_dir")
            raise PartRewritten()
        self.record.parts.append(part)
        self.record.done = bool(state.get("done"))
        _save_record(unit, self.record)  # the part is on disk (and in the bucket) before its record says so
        if self.on_part is not None:
            self.on_part(self.record)
        check_stop(f"after finishing {unit.out}/{name}")  # SIGTERM/SIGINT: stop here, between parts (curation.io.stop)
