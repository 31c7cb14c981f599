"""Corpus preparation: named sources → tokenized, packed, zstd MDS candidate (and validation) shards.

Layout of ``output_dir``::

    tokenizer/tokenizer.json          (trained here, or a copy of nothing: a given tokenizer stays where it is)
    candidates/index.json             (merged index over all parts, readable by StreamingDataset)
    candidates/manifest.json          (config, tokenizer fingerprint, per-source counts, finished parts)
    candidates/<source>/part-<u>-<k>/ (part k of work unit u: ``sequences_per_part`` sequences, shuffled within)
    candidates/<source>/unit-<u>.json (work unit u's progress: its finished parts and where reading resumes)
    validation/...                    (same, for the target/validation sources)

Every source is cut into work units (:mod:`curation.ingest.units`: the unit rule, and what a unit writes); a
pool runs them: this process (world size 1: ``workers: 1``, small inputs, or no pool given) or Ray tasks
(``jobs/prepare.py`` passes :mod:`curation.engine.ray_backend.prepare_pool`), one CPU each, any number of them,
on one machine or a cluster. A unit's output depends on its input only, and the driver (this module) writes
each group's manifest and root index from the units' records in plan order (:mod:`curation.ingest.group`), so
the output directory is the same, file for file, for any number of workers and any sequence of kills and
resumes (only the manifests' ``config.workers`` and ``config.ray`` say how it was run).

Resume: a killed run, rerun with the same config, never redoes a finished unit and continues every other one
from its last finished part (the document that part ended in is read again and its tokens already written are
skipped), producing the same parts as an uninterrupted run.

Text sources are read by :mod:`curation.ingest.corpus` and tokenized; pre-tokenized ones (MDS token datasets,
parquet/arrow token columns) by :mod:`curation.ingest.token_sources`, whose records' ids are packed as they are
(``token_rows: stream``) or each followed by EOS like a text document (``token_rows: documents``). An
``s3://`` output directory is worked on in its local cache (:mod:`curation.io.storage`): every finished part,
unit record, manifest and index is uploaded as it is written, and a rerun resumes from what is in the bucket.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from curation.ingest.corpus import BadRecordError, Document, FileSpan
from curation.ingest.demo import DEMO_FILES, write_demo_corpus
from curation.ingest.group import ShardGroup
from curation.ingest.token_sources import resolve_token_inputs
from curation.ingest.tokenizer import LoadedTokenizer, load_tokenizer, share_tokenizer, train_bpe_tokenizer
from curation.ingest.units import PackSettings, UnitResult, WorkUnit, read_documents, run_unit
from curation.io import bucket_inputs, objects, storage
from curation.io.outputs import localize, open_output
from curation.io.progress import progress
from schemas.config import PrepareConfig, SourceConfig
from schemas.manifest import Manifest, UnitRecord

__all__ = ["PrepareResult", "prepare", "GROUPS", "UnitPool", "PoolFactory", "LocalPool"]

#: (subdirectory, config attribute) of the two shard groups.
GROUPS = (("candidates", "sources"), ("validation", "validation"))


class UnitPool(Protocol):
    """Runs work units (:func:`~curation.ingest.units.run_unit`) and yields their results as they finish."""

    workers: int

    def run(self, units: Sequence[WorkUnit], settings: PackSettings) -> Iterator[UnitResult]: ...


#: ``factory(workers, units, needs)``: a pool of ``workers`` processes (``None``: as many as the machine or cluster
#: has CPUs), never more than ``units``, for the ``with`` block; ``needs``: the local paths its processes read or write
#: (``{setting: path}``), which every node of a cluster must reach (the Ray pool refuses one that some node cannot).
PoolFactory = Callable[[int | None, int, Mapping[str, str]], AbstractContextManager[UnitPool]]


class LocalPool:
    """World size 1: the units one after the other in this process; ``on_part`` hears of every finished part."""

    workers = 1

    def __init__(self, on_part: Callable[[WorkUnit, UnitRecord], None] | None = None) -> None:
        self.on_part = on_part

    def run(self, units: Sequence[WorkUnit], settings: PackSettings) -> Iterator[UnitResult]:
        for unit in units:
            hook = None if self.on_part is None else (lambda record, u=unit: self.on_part(u, record))
            yield run_unit(unit, settings, on_part=hook)


@dataclass
class PrepareResult:
    tokenizer: LoadedTokenizer
    dirs: dict[str, str] = field(default_factory=dict)  # group → directory
    manifests: dict[str, Manifest] = field(default_factory=dict)
    tokens_processed: int = 0  # tokens tokenized in this run (resumed work is not counted)
    seconds: float = 0.0
    regenerated: list[str] = field(default_factory=list)  # damaged or missing parts rewritten by this run
    workers: int = 1  # processes that ran the units (1: this one)
    unit_cpu_seconds: float = 0.0  # CPU time of the units' runs (in every process)
    uploaded: str | None = None  # an s3:// output_dir: "uploaded N files to s3://…; it holds M objects (X MiB)"
    uploaded_elsewhere: int = 0  # objects the units run in other processes (Ray tasks) uploaded

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_processed / max(self.seconds, 1e-9)


def prepare(cfg: PrepareConfig, *, pool: PoolFactory | None = None) -> PrepareResult:
    """Run (or resume) the preparation described by ``cfg``, holding ``output_dir``'s lock.

    Args:
        cfg: the config.
        pool: makes the pool of worker processes (``jobs/prepare.py`` passes the Ray one) when ``cfg.workers``
            asks for more than one; without it every unit runs in this process (the output is the same).

    Raises:
        BadRecordError: bad input (names file and line) unless ``cfg.skip_bad_records``.
        OutputDirError: the output directory is in use, or was prepared with a different config
            (``output_dir/config.yaml``), or is not writable.
        ValueError: no sequence was produced.
        StopRequested: a SIGTERM / SIGINT came (finished parts are recorded; a rerun continues).
    """
    cfg = localize(cfg)  # an s3:// output_dir: its local cache (curation.io.storage), filled from the bucket
    mark = objects.upload_mark()  # this run's uploads are counted from here
    with open_output(cfg.output_dir, "prepare", {"config.yaml": cfg}) as lock:
        # a given tokenizer is loaded before the config is recorded: a wrong tokenizer.path leaves no record that
        # would refuse the corrected rerun (one trained here is saved under output_dir: recorded first)
        tok = _get_tokenizer(cfg) if cfg.tokenizer.path is not None else None
        lock.write_records()
        return _prepare_locked(cfg, pool, tok, mark)


def _demo_raw_dirs(cfg: PrepareConfig) -> list[str]:
    """Where to generate the demo corpus: the folders of configured paths named like a demo file, except
    folders that also hold other configured inputs (the user's data: overriding the sources of the
    embedded default must not write demo files next to them)."""
    paths = [p for s in [*cfg.sources, *cfg.validation] for p in s.paths]
    demo = {os.path.dirname(p) for p in paths if os.path.basename(p) in DEMO_FILES}
    other = {os.path.dirname(p) for p in paths if os.path.basename(p) not in DEMO_FILES}
    return sorted(demo - other)


def _prepare_locked(cfg: PrepareConfig, pool: PoolFactory | None, tok: LoadedTokenizer | None,
                    mark: int) -> PrepareResult:
    start = time.perf_counter()
    for raw in _demo_raw_dirs(cfg) if cfg.demo else []:
        write_demo_corpus(raw)
    cfg, recorded = _staged(cfg), cfg  # the sources as the units read them (stage_inputs: the uploaded copies)
    tok = tok or _get_tokenizer(cfg)
    share_tokenizer(tok, eos_token=cfg.tokenizer.eos_token)  # the units run in this process need not load it again
    result = PrepareResult(tokenizer=tok)
    settings = PackSettings(
        seq_len=cfg.seq_len, seed=cfg.seed, sequences_per_part=cfg.sequences_per_part,
        shard_size_limit=cfg.shard_size_limit, skip_bad_records=cfg.skip_bad_records,
        tokenizer_path=os.path.abspath(tok.path), eos_token=cfg.tokenizer.eos_token,
        tokenizer_fingerprint=tok.fingerprint,
    )
    groups: list[ShardGroup] = []
    for name, attr in GROUPS:
        sources: list[SourceConfig] = getattr(cfg, attr)
        if not sources:
            continue
        group = ShardGroup.open(recorded, name, sources, tok.fingerprint, tok.vocab_size, tok.path)
        if not group.manifest.complete:
            group.plan({s.name: _files(s, cfg.skip_bad_records) for s in sources})
        else:
            group.check_inputs()  # a changed input is refused, never reported as prepared
        result.regenerated.extend(group.repair(settings))
        groups.append(group)
        result.dirs[name] = group.out
    _run_units(cfg, groups, settings, pool, result)
    for group in groups:
        result.manifests[group.name] = group.manifest if group.manifest.complete else group.commit(final=True)
    # an object-store output_dir: every file was published as it was written; what is left (none, normally) goes now,
    # still under the lock, and the bucket's own count confirms it
    result.uploaded = storage.push_all(cfg.output_dir, since=mark, elsewhere=result.uploaded_elsewhere)
    result.seconds = time.perf_counter() - start
    return result


def _run_units(cfg: PrepareConfig, groups: list[ShardGroup], settings: PackSettings, pool: PoolFactory | None,
               result: PrepareResult) -> None:
    """Run every unfinished unit on a pool; commit the manifests as units finish and when stopped.

    Raises:
        BadRecordError: a unit met bad input (``skip_bad_records: false``): no further unit is started, the
            running ones finish, and the error of the first in plan order among those met is raised.
    """
    pending = [u for g in groups if not g.manifest.complete for u in g.pending()]
    if not pending:
        return
    by_out = {g.out: g for g in groups}
    useful = math.ceil(sum(u.bytes for u in pending) / cfg.unit_bytes) if cfg.workers is None else len(pending)
    local = pool is None or cfg.workers == 1 or min(useful, len(pending)) <= 1

    def on_part(unit: WorkUnit, record: UnitRecord) -> None:  # in this process: the manifest after every part
        by_out[unit.out].update(record)
        by_out[unit.out].commit()

    errors: list[tuple[int, BadRecordError]] = []
    order = {(u.out, u.source.name, u.index): i for i, u in enumerate(pending)}
    factory = (lambda w, n, needs: contextlib.nullcontext(LocalPool(on_part))) if local else pool
    bar = progress(len(pending), desc=f"prepare {os.path.basename(os.path.normpath(cfg.output_dir))}", unit="unit",
                   enabled=cfg.progress)
    with bar, factory(cfg.workers, len(pending), _needs(cfg, pending, settings)) as workers:
        result.workers = workers.workers
        try:
            for res in workers.run(pending, settings):
                by_out[res.unit.out].update(res.record)
                result.tokens_processed += res.tokens
                result.unit_cpu_seconds += res.cpu_seconds
                result.uploaded_elsewhere += res.uploaded if res.pid != os.getpid() else 0  # (this one counts its own)
                bar.update(1)
                if res.error is not None:
                    e = res.error
                    errors.append((order[(res.unit.out, res.unit.source.name, res.unit.index)],
                                   BadRecordError(e.file, e.line, e.reason)))
                    break  # no further unit starts; the pool lets the running ones finish
                by_out[res.unit.out].commit()
        finally:  # stopped, failed or done: the manifests say what is finished (the units' records)
            for group in groups:
                if not group.manifest.complete:
                    group.reload(pending)
                    group.commit()
    if errors:
        raise min(errors, key=lambda x: x[0])[1]


def _needs(cfg: PrepareConfig, pending: list[WorkUnit], settings: PackSettings) -> dict[str, str]:
    """The local paths the units' processes read or write, by the setting that names them (an object store's are
    not: every node reaches those through its own cache)."""
    needs = {"output_dir": cfg.output_dir, "tokenizer.path": settings.tokenizer_path}
    setting = {(name, s.name): f"{attr}.{i}.paths" for name, attr in GROUPS for i, s in enumerate(getattr(cfg, attr))}
    for unit in pending:
        for span in unit.spans:
            needs.setdefault(f"{setting[(os.path.basename(unit.out), unit.source.name)]} ({span.path})", span.path)
    return {k: p for k, p in needs.items() if storage.url_of(p) is None}


def _staged(cfg: PrepareConfig) -> PrepareConfig:
    """``cfg`` as the units read it: with ``stage_inputs``, each local input uploaded there
    (:func:`curation.io.bucket_inputs.stage`) and named by its copy; a pattern that matches nothing stays (the reader
    reports it)."""
    if cfg.stage_inputs is None:
        return cfg

    def staged(source: SourceConfig) -> SourceConfig:
        paths: list[str] = []
        for pattern in source.paths:
            try:
                local = [] if storage.url_of(pattern) else resolve_token_inputs(
                    source.model_copy(update={"paths": [pattern]}))
            except BadRecordError:
                local = []
            paths += [bucket_inputs.stage(p, storage.local_path(cfg.stage_inputs)) for p in local] or [pattern]
        return source.model_copy(update={"paths": paths})

    return cfg.model_copy(update={"sources": [staged(s) for s in cfg.sources],
                                  "validation": [staged(s) for s in cfg.validation]})


# ------------------------------------------------------------------------------------------------
def _files(source: SourceConfig, skip_bad: bool) -> tuple[list[str], list[BadRecordError]]:
    """The source's files (a pre-tokenized source's inputs: files, or MDS dataset directories), and (with
    ``skip_bad``) one bad record per pattern that matches nothing."""
    if not skip_bad:
        files, missing = resolve_token_inputs(source), []
    else:
        found: list[str] = []
        missing = []
        for pattern in source.paths:  # a missing path is one bad record, the others still count
            try:
                found.extend(resolve_token_inputs(source.model_copy(update={"paths": [pattern]})))
            except BadRecordError as e:
                missing.append(e)
        files = sorted(set(found))
    for path in files:  # an input in an object store: into this machine's cache (its units are planned from it)
        bucket_inputs.fetch_input(path)
    return files, missing


def _get_tokenizer(cfg: PrepareConfig) -> LoadedTokenizer:
    tc = cfg.tokenizer
    if tc.path is not None:
        return load_tokenizer(tc.path, eos_token=tc.eos_token)
    saved = os.path.join(cfg.output_dir, "tokenizer", "tokenizer.json")
    if os.path.exists(saved):  # resume: a trained tokenizer is saved atomically, so it is whole
        return load_tokenizer(saved, eos_token=tc.eos_token)

    def texts() -> Iterator[str]:
        for s in [*cfg.sources, *cfg.validation]:
            spans = [FileSpan(p) for p in _files(s, cfg.skip_bad_records)[0]]
            for item in read_documents(s, spans, cfg.skip_bad_records):
                if isinstance(item, Document):
                    yield item.text

    tok = train_bpe_tokenizer(
        itertools.islice(texts(), tc.train_max_documents),
        vocab_size=tc.vocab_size, min_frequency=tc.min_frequency, eos_token=tc.eos_token, save_to=saved,
    )
    storage.publish(saved)
    return tok
