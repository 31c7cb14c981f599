"""The output directory's part ledger (written by the coordinator only) and the trainer's part reader.

* :class:`PartLedger`: a part is recorded only after it is on disk; the root index lists recorded
  parts in step order.
* :class:`PartCache`: the trainer's reader of the rows of one step from a finished part.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from curation.io import storage
from curation.io.paths import safe_join
from curation.io.shards import ShardReader, publish_parts, recovery_hint, verify_part
from schemas.manifest import Manifest, ShardRecord, SourceCounts
from schemas.records import config_diff
from schemas.shards import SPECS


# ------------------------------------------------------------------------------------------------
# the output directory's manifest (single writer)
# ------------------------------------------------------------------------------------------------
@dataclass
class PartResult:
    """What a worker reports after writing a unit's part."""

    worker: int
    unit: str
    name: str  # part directory relative to the output directory
    first: int
    stop: int
    samples: int
    tokens: int
    kept_tokens: int
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # source → sequences/tokens/kept_tokens
    seconds: float = 0.0
    scored_tokens: int = 0


@dataclass(frozen=True)
class LedgerSpec:
    """What an engine's output directory records (built with the engine's work; opened by the coordinator, the
    ledger's single writer, with :meth:`open`). The fields are :class:`PartLedger`'s.

    Attributes:
        out_dir: the output directory.
        kind: ``scored`` or ``selected``.
        job: producing job.
        run_key: what must be equal for a rerun to resume here (JSON).
        config: the job's resolved config (JSON, as recorded).
        vocab_size: the candidate shards' vocabulary.
        seq_len: their sequence length.
        tokenizer_fingerprint: their tokenizer's.
        model_fingerprints: fingerprints of given weights (batch curation).
        extra: more manifest fields (JSON).
    """

    out_dir: str
    kind: str
    job: str
    run_key: Mapping[str, Any]
    config: Mapping[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None
    seq_len: int | None = None
    tokenizer_fingerprint: str | None = None
    model_fingerprints: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def open(self) -> PartLedger:
        """The output directory's ledger (created, or opened and checked against ``run_key``)."""
        return PartLedger(self.out_dir, kind=self.kind, job=self.job, run_key=self.run_key, config=dict(self.config),
                          vocab_size=self.vocab_size, seq_len=self.seq_len,
                          tokenizer_fingerprint=self.tokenizer_fingerprint,
                          model_fingerprints=dict(self.model_fingerprints), extra=dict(self.extra))


class PartLedger:
    """The manifest of an engine output directory (scored or selected shards).

    Parts live in per-worker subdirectories (``worker-03/steps-000000010-000000015``). A part is recorded
    (with its step range in ``state``) only after the worker has written it completely; the root
    ``index.json`` lists recorded parts in step order, so the directory reads like a single-process one
    (:class:`curation.io.scored_shards.ScoredShards`, ``StreamingDataset``). On opening, part directories that are not
    recorded (a killed worker's half-written ``.tmp`` or an unrecorded copy) are removed, and every recorded
    part is checked against the hashes in its index: a damaged or missing one is unrecorded (its counts
    subtracted, listed in :attr:`dropped`) so that the rerun redoes its unit.

    Args:
        out_dir: the output directory.
        kind: ``scored`` or ``selected``.
        job: producing job (new manifest).
        run_key: what must be equal for a rerun to resume here (stream, plan, models, settings); a
            directory written with another run key is refused, except for the plan's ``total_steps`` raised
            (an extended run: the key and ``config`` are updated; :meth:`keep_units` then unrecords a part cut
            short by the old ``total_steps``).
        fields: other manifest fields (``config``, ``vocab_size``, ``seq_len``, fingerprints, ``extra``).
    """

    def __init__(self, out_dir: str, *, kind: str, job: str, run_key: Mapping[str, object], **fields: object) -> None:
        self.out_dir = out_dir
        self.spec = SPECS[kind]
        os.makedirs(out_dir, exist_ok=True)
        storage.pull(out_dir)  # an object-store directory, on whatever node this runs: its cache = the bucket
        key = json.loads(json.dumps(dict(run_key)))
        existing = Manifest.load_if_exists(out_dir)
        if existing is not None:
            old = existing.extra.get("run_key")
            if existing.kind == kind and old != key and _extends(old, key):
                existing.extra["run_key"] = key
                existing.config = fields.get("config", existing.config)
                existing.complete = False
                old = key
            if existing.kind != kind or old != key:
                diff = [d.split(":", 1)[0] for d in config_diff(old or {}, key)]  # the leaf keys that differ
                raise ValueError(
                    f"{out_dir} holds {existing.kind} shards of a different run (differs in: {', '.join(diff) or 'kind'}); "
                    "use a new output directory or delete this one"
                )
            self.manifest = existing
        else:
            extra = dict(fields.pop("extra", {}) or {})
            extra["run_key"] = key
            self.manifest = Manifest(kind=kind, job=job, extra=extra, **fields)
        self.dropped: list[str] = self._drop_damaged()
        self._remove_unrecorded()
        self._publish()

    def _drop_damaged(self) -> list[str]:
        """Unrecord the parts whose files are missing or do not match their hashes; their units are redone."""
        dropped = []
        for rec in list(self.manifest.shards):
            problem = verify_part(self._part(rec.name)) if rec.complete else None
            if problem is None:
                continue
            if "sources" not in rec.state:
                raise ValueError(
                    f"{self.out_dir}/{rec.name} is damaged ({problem}) and this directory was written before parts "
                    "recorded their own counts, so it cannot be redone in place; use a new output directory"
                )
            warnings.warn(f"{self.out_dir}/{rec.name} is damaged ({problem}); its steps "
                          f"[{rec.state['first_step']}, {rec.state['stop_step']}) will be redone", stacklevel=3)
            self.manifest.shards.remove(rec)
            for src, c in rec.state["sources"].items():
                left = self.manifest.counts(src).model_dump()
                self.manifest.sources[src] = SourceCounts(**{k: v - c.get(k, 0) for k, v in left.items()})
            self.manifest.complete = False
            dropped.append(rec.name)
        return dropped

    def _part(self, name: str) -> str:
        """The directory of the part ``name`` (a manifest's: untrusted), refused when it leads outside the output
        directory (:func:`curation.io.paths.safe_join`; the name itself was checked when the manifest loaded)."""
        return safe_join(self.out_dir, name, what="part", source_file=storage.display(Manifest.path_in(self.out_dir)))

    def _worker_dirs(self) -> list[tuple[str, str]]:
        """``(name, path)`` of the ``worker-*`` folders, each refused when it leads outside (a symbolic link)."""
        return [(entry, safe_join(self.out_dir, entry, what="worker folder", source_file=self.out_dir))
                for entry in sorted(os.listdir(self.out_dir))
                if entry.startswith("worker-") and os.path.isdir(os.path.join(self.out_dir, entry))]

    def _remove_unrecorded(self) -> None:
        recorded = {r.name for r in self.manifest.shards if r.complete}
        for entry, path in self._worker_dirs():
            for part in sorted(os.listdir(path)):
                if part.endswith(".tmp") or f"{entry}/{part}" not in recorded:
                    storage.remove(os.path.join(path, part))

    def keep_units(self, names: set[str]) -> list[str]:
        """Unrecord (and remove) the recorded parts whose unit is not one of ``names`` (the plan's): an extended
        run's part cut short at the old ``total_steps``, whose unit the longer plan holds whole. Returns them."""
        gone = [r for r in self.manifest.shards if r.complete and r.state.get("unit") not in names]
        for rec in gone:
            self.manifest.shards.remove(rec)
            for src, c in rec.state.get("sources", {}).items():
                left = self.manifest.counts(src).model_dump()
                self.manifest.sources[src] = SourceCounts(**{k: v - c.get(k, 0) for k, v in left.items()})
            storage.remove(os.path.join(self.out_dir, rec.name))
        if gone:
            self.manifest.complete = False
            self._publish()
        return [r.name for r in gone]

    def done_units(self) -> dict[str, ShardRecord]:
        """unit name → its record."""
        return {r.state["unit"]: r for r in self.manifest.shards if r.complete}

    def record(self, result: PartResult) -> ShardRecord:
        """Record a finished part (it must be on disk), merge the index, save the manifest."""
        if result.unit in self.done_units():
            raise ValueError(f"{self.out_dir}: {result.unit} is already recorded")
        if not storage.fetch(os.path.join(self.out_dir, result.name, "index.json")):  # (a worker on another node)
            raise ValueError(f"{self.out_dir}/{result.name}: the part is not on disk")
        rec = ShardRecord(
            name=result.name, samples=result.samples, tokens=result.tokens,
            state={"unit": result.unit, "first_step": result.first, "stop_step": result.stop,
                   "kept_tokens": result.kept_tokens, "worker": result.worker, "sources": result.sources,
                   "seconds": round(result.seconds, 4)},  # (the worker's time on it: its throughput, inspector)
        )
        self.manifest.shards.append(rec)
        self.manifest.shards.sort(key=lambda r: int(r.state["first_step"]))
        for src, c in result.sources.items():
            self.manifest.sources[src] = self.manifest.counts(src) + SourceCounts(**c)
        # Other copies of the same unit (an unrecorded leftover of a crashed attempt) go first.
        for entry, path in self._worker_dirs():
            other = os.path.join(path, result.unit)
            if f"{entry}/{result.unit}" != result.name and os.path.isdir(other):
                storage.remove(other)
        self._publish()
        return rec

    def finish(self, extra: Mapping[str, object] | None = None) -> None:
        self.manifest.complete = True
        if extra:
            self.manifest.extra.update(extra)
        self._publish()

    def _publish(self) -> None:
        publish_parts(self.out_dir, self.manifest)


def _extends(old: object, new: Mapping[str, object]) -> bool:
    """Whether run key ``new`` is ``old`` with the plan's ``total_steps`` raised (an extended run)."""
    if not isinstance(old, Mapping):
        return False
    try:
        a, b = old["plan"]["schedule"]["total_steps"], new["plan"]["schedule"]["total_steps"]
    except (KeyError, TypeError):
        return False

    def without(key: Mapping[str, object]) -> dict[str, object]:
        out = json.loads(json.dumps(dict(key)))
        out["plan"]["schedule"].pop("total_steps")
        return out

    return isinstance(a, int) and isinstance(b, int) and b > a and without(old) == without(new)


# ------------------------------------------------------------------------------------------------
# the trainer's view of finished parts
# ------------------------------------------------------------------------------------------------
class PartCache:
    """Rows of one step from a finished part directory (parts are immutable once recorded).

    Reads the part's own ``index.json``, not the root index, so it never races with the coordinator
    rewriting the root index. Keeps the last few parts open.
    """

    def __init__(self, out_dir: str, batch_size: int, *, keep: int = 4) -> None:
        self.out_dir = out_dir
        self.batch_size = batch_size
        self.keep = keep
        self._open: dict[str, ShardReader] = {}

    def rows(self, part: str, first: int, step: int) -> list[dict[str, Any]]:
        reader = self._open.get(part)
        if reader is None:
            path = safe_join(self.out_dir, part, what="part", source_file=Manifest.path_in(self.out_dir))
            reader = ShardReader(path,
                                 hint=lambda name: recovery_hint(self.out_dir, os.path.join(part, name)))
            self._open[part] = reader
            while len(self._open) > self.keep:
                self._open.pop(next(iter(self._open)))
        b = self.batch_size
        start = (step - first) * b
        if start + b > len(reader):
            raise ValueError(f"{self.out_dir}/{part}: holds {len(reader)} rows, step {step} needs rows "
                             f"[{start}, {start + b})")
        return [reader[start + i] for i in range(b)]
