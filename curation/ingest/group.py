"""One shard group of ``prepare`` (``candidates/`` or ``validation/``): its work units, their records, its manifest.

The driver holds one :class:`ShardGroup` per group and is the single writer of the group's ``manifest.json``
and root ``index.json`` (:meth:`ShardGroup.commit`, the one place they are written). The manifest is a view
of the units' records (``<source>/unit-<u>.json``, saved by the units' tasks) in plan order: sources in
config order, units in order, parts in order; so it is the same whatever order the units finished in. The
root index is written once, when every unit is done.

A rerun checks every finished part against the hashes in its index and rewrites a damaged or missing one
exactly: its unit is run again from the reader position recorded before that part until the part is written
(:func:`~curation.ingest.units.run_unit` with ``rewrite``); the rewritten shard files must hash to what the root
index recorded, else the input changed since (an error).

Directories prepared before work units existed (one stream per source, parts ``<source>/part-<k>``) are
recognised by their manifest's group key (no ``unit_bytes``): a complete one is used as it is; an unfinished
one, or a damaged part of one, cannot be continued by this version (the error says to prepare anew).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

from curation.ingest.corpus import BadRecordError, FileSpan
from curation.ingest.token_sources import resolve_token_inputs
from curation.ingest.units import (
    RECORD_NAME,
    PackSettings,
    PartRewritten,
    WorkUnit,
    check_record,
    load_record,
    plan_units,
    run_unit,
)
from curation.io import storage
from curation.io.outputs import urls_in
from curation.io.paths import safe_join
from curation.io.shards import merge_part_indexes, save_manifest, verify_part
from schemas.config import PrepareConfig, SourceConfig
from schemas.manifest import MAX_LISTED_BAD_RECORDS, BadRecord, Manifest, SourceCounts, UnitRecord
from schemas.records import config_diff
from schemas.shards import CANDIDATE

__all__ = ["ShardGroup", "group_key"]


def group_key(cfg: PrepareConfig, sources: list[SourceConfig], fingerprint: str) -> dict:
    """Everything that determines a group's content: a rerun must match it to resume."""
    return {
        "sources": [urls_in(s.model_dump(mode="json")) for s in sources],  # (an input in a bucket: its URL)
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "sequences_per_part": cfg.sequences_per_part,
        "skip_bad_records": cfg.skip_bad_records,
        "tokenizer_fingerprint": fingerprint,
        "unit_bytes": cfg.unit_bytes,
    }


@dataclass
class ShardGroup:
    """A group's sources, plan, unit records and manifest (see the module docstring)."""

    cfg: PrepareConfig
    name: str  # candidates | validation
    out: str
    sources: list[SourceConfig]
    manifest: Manifest
    units: list[WorkUnit] = field(default_factory=list)
    records: dict[tuple[str, int], UnitRecord] = field(default_factory=dict)
    missing: dict[str, list[BadRecordError]] = field(default_factory=dict)  # patterns matching nothing, per source

    @classmethod
    def open(cls, cfg: PrepareConfig, name: str, sources: list[SourceConfig], tokenizer_fingerprint: str,
             vocab_size: int, tokenizer_path: str) -> ShardGroup:
        """The group's manifest (a new one when there is none), checked against the config.

        Raises:
            ValueError: the directory was prepared with a different config (names the keys), or is an
                unfinished preparation of a version before work units.
        """
        out = os.path.join(cfg.output_dir, name)
        for entry in os.listdir(out) if os.path.isdir(out) else []:  # what a killed driver left of a manifest write
            if entry.startswith(".tmp-"):
                os.unlink(os.path.join(out, entry))
        key = group_key(cfg, sources, tokenizer_fingerprint)
        manifest = Manifest.load_if_exists(out)
        if manifest is not None:
            recorded = manifest.extra.get("group_key") or {}
            legacy = "unit_bytes" not in recorded
            diff = config_diff(recorded, {k: v for k, v in key.items() if not (legacy and k == "unit_bytes")})
            if diff and not manifest.shards and not manifest.complete and not any(
                    f.startswith("unit-") for _, _, files in os.walk(out) for f in files):
                manifest = None  # a failed run's manifest, which finished nothing: the corrected rerun starts anew
            elif diff:
                keys = ", ".join(d.split(":", 1)[0] for d in diff)
                raise ValueError(f"{out}: was prepared with a different config (differs in: {keys}); use a new "
                                 "output_dir or delete this one")
            if manifest is not None and legacy and not manifest.complete:
                raise ValueError(f"{out}: this unfinished preparation was started by an older version (one stream per "
                                 "source, before work units); delete the directory and rerun")
        if manifest is None:
            manifest = Manifest(
                kind=CANDIDATE.name, job="prepare", config=urls_in(cfg.model_dump(mode="json")),
                tokenizer_fingerprint=tokenizer_fingerprint, vocab_size=vocab_size, seq_len=cfg.seq_len,
                extra={"group": name, "group_key": key, "tokenizer_path": storage.canonical(tokenizer_path)},
            )
        return cls(cfg, name, out, sources, manifest)

    @property
    def legacy(self) -> bool:
        return "unit_bytes" not in self.manifest.extra.get("group_key", {})

    # --- the plan and the units' records ---------------------------------------------------------
    def plan(self, files: dict[str, tuple[list[str], list[BadRecordError]]]) -> None:
        """Cut every source into work units and load the records of those already started.

        A record written for other spans than the unit now has (its input changed since, e.g. a bad line was
        fixed, which moves the cuts after it) is removed with its parts, and the unit is prepared again, as is
        every unit a record exists for that the plan no longer has: the output is then the one of this input. So is a
        unit whose spans are the same but whose bytes are not (a same-length edit: the size, mtime and content hash
        of what it reads, recorded when it started, :meth:`WorkUnit.changed_input`): never a mix of old and new text.

        Args:
            files: per source name, its files and the patterns that matched nothing (``skip_bad_records``).
        """
        self.units = []
        for si, source in enumerate(self.sources):
            paths, self.missing[source.name] = files[source.name]
            units = plan_units(self.out, si, source, paths, self.cfg.unit_bytes)
            self.units.extend(units)
            planned = {u.index: u for u in units}
            folder = self._folder(source)
            for entry, index in self._record_files(folder):
                path = safe_join(folder, entry, what="unit record", source_file=folder)
                record = check_record(UnitRecord.load(path), path, source.name, index)  # untrusted: checked first
                unit = planned.get(index)
                changed = None
                if unit is not None and record.spans == unit.span_list:
                    changed = unit.changed_input(record.inputs)  # same cuts: the same bytes? (size, mtime, hash)
                    if changed is None:
                        self.records[(source.name, unit.index)] = record
                        continue
                    why = (f"its input {changed} changed since it was written (its size, mtime and content hash "
                           "differ from the record's); preparing the unit again")
                else:
                    now = unit.span_list if unit is not None else "no such unit"
                    why = f"its input changed since it was written ({record.spans} now {now}); preparing it again"
                warnings.warn(f"{path}: {why}", stacklevel=2)
                # Only what this code names for the unit is removed (the record's names were checked to be those).
                for k in range(len(record.parts)):
                    storage.remove(os.path.join(folder, f"part-{index:05d}-{k:05d}"))
                storage.remove(path)

    def _folder(self, source: SourceConfig) -> str:
        """The source's folder of this group (refused when it leads outside, e.g. a symbolic link)."""
        return safe_join(self.out, source.name, what="source folder", source_file=self.out)

    @staticmethod
    def _record_files(folder: str) -> list[tuple[str, int]]:
        """``(file name, unit number)`` of the unit records in ``folder``, in order."""
        entries = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        return [(e, int(m.group(1))) for e in entries if (m := RECORD_NAME.fullmatch(e))]

    def check_inputs(self) -> None:
        """For a finished group: refuse a rerun when an input its units read has changed since (the group would
        otherwise be reported complete with the counts and text of the old input). A file that is gone is not
        checked (its prepared data stays usable); a record naming a file its source does not resolve to is refused
        (:meth:`recorded_units`).

        Raises:
            ValueError: naming the changed file and the directory.
        """
        if self.legacy:
            return
        for unit in self.recorded_units():
            changed = unit.changed_input(self.record(unit).inputs, missing_ok=True)
            if changed is not None:
                raise ValueError(f"{changed}: changed since {self.out} was prepared from it (its size, mtime and "
                                 f"content hash differ from {unit.record_path}); restore the file, or prepare the "
                                 "changed input into a new output_dir")

    def recorded_units(self) -> list[WorkUnit]:
        """The units of a finished group, rebuilt from their records (no input is read).

        A record is untrusted (it may come from a bucket), and a damaged part is regenerated from the files its
        spans name: every span must name one of its source's inputs as they resolve now. When a path of the source
        is gone, the others are resolved (``skip_missing``), and a span may also name a file that is gone (there is
        nothing to read); with every path there, only a file they resolve to.

        Raises:
            ValueError: a span names another file (one line naming the record and the file).
        """
        units = []
        for si, source in enumerate(self.sources):
            folder = self._folder(source)
            inputs: tuple[set[str], bool] | None = None
            for entry, index in self._record_files(folder):
                path = safe_join(folder, entry, what="unit record", source_file=folder)
                record = check_record(UnitRecord.load(path), path, source.name, index)
                inputs = inputs or _current_inputs(source)
                for span in record.spans:
                    _check_span(span, inputs, path, source.name)
                spans = tuple(FileSpan(storage.local_path(p), start, stop) for p, start, stop in record.spans)
                units.append(WorkUnit(self.out, si, source, record.unit, spans, 0))
                self.records[(source.name, record.unit)] = record
        return units

    def pending(self) -> list[WorkUnit]:
        return [u for u in self.units if not self.record(u).done]

    def record(self, unit: WorkUnit) -> UnitRecord:
        return self.records.get((unit.source.name, unit.index)) or unit.fresh_record()

    def update(self, record: UnitRecord) -> None:
        self.records[(record.source, record.unit)] = record

    def reload(self, units: list[WorkUnit]) -> None:
        """Read the records of ``units`` again (the truth, after tasks in other processes saved them)."""
        for unit in units:
            if unit.out == self.out and storage.refresh(unit.record_path):  # written on another node: the bucket's
                self.update(load_record(unit))

    # --- damaged parts ----------------------------------------------------------------------------
    def repair(self, settings: PackSettings) -> list[str]:
        """Check every finished part; rewrite damaged or missing ones (see the module docstring).

        Returns:
            The rewritten parts' directories.
        """
        if self.legacy:
            for rec in self.manifest.shards:
                problem = verify_part(os.path.join(self.out, rec.name)) if rec.samples > 0 else None
                if problem is not None:
                    raise ValueError(
                        f"{self.out}/{rec.name} is damaged ({problem}) and was prepared by an older version (one "
                        "stream per source, before work units), whose parts this version cannot regenerate; prepare "
                        "into a new output_dir")
            return []
        units = self.units if self.units else self.recorded_units()
        damaged = []
        for unit in units:
            record = self.record(unit)
            for k, part in enumerate(record.parts):
                problem = verify_part(os.path.join(self.out, part.name)) if part.samples > 0 else None
                if problem is None:
                    continue
                warnings.warn(f"{self.out}/{part.name} is damaged ({problem}); regenerating it", stacklevel=2)
                before = record.model_copy(update={"parts": record.parts[:k], "bad_records": [],
                                                   "counts": SourceCounts(), "done": False}, deep=True)
                try:
                    run_unit(unit, settings, rewrite=(before, part))
                except PartRewritten:
                    pass
                self._check_rewritten(part.name)
                damaged.append(os.path.join(self.out, part.name))
        if damaged and self.manifest.complete:
            self._write_index()
        return damaged

    def _check_rewritten(self, part: str) -> None:
        """The rewritten part's shard hashes equal those the root index recorded for it (when it has them)."""
        root = os.path.join(self.out, "index.json")
        if not os.path.exists(root):
            return  # an unfinished run: the root index is written at the end
        with open(root, encoding="utf-8") as f:
            before = [s for s in json.load(f)["shards"] if s["zip_data"]["basename"].startswith(part + "/")]
        with open(os.path.join(self.out, part, "index.json"), encoding="utf-8") as f:
            after = json.load(f)["shards"]
        if [s["zip_data"].get("hashes") for s in before] != [s["zip_data"].get("hashes") for s in after]:
            raise ValueError(
                f"{self.out}/{part}: regenerated, but its content differs from what was written before: the input "
                "files changed since this directory was prepared; prepare into a new output_dir"
            )

    # --- the manifest and the root index: the one place they are written ---------------------------
    def commit(self, *, final: bool = False) -> Manifest:
        """Save the manifest: the units' records in plan order. ``final`` (every unit done): also the root
        ``index.json`` (before the manifest says ``complete``).

        Raises:
            ValueError: ``final``, and no sequence was produced.
        """
        m = self.manifest
        m.sources, m.bad_records, m.shards = {}, [], []
        for source in self.sources:
            counts = m.counts(source.name)
            for e in self.missing.get(source.name, []):
                m.add_bad_record(BadRecord(source=source.name, file=storage.display(e.file), line=e.line,
                                           reason=e.reason))
            for unit in self.units:
                if unit.source.name != source.name:
                    continue
                record = self.record(unit)
                m.sources[source.name] = counts = counts + record.counts
                m.bad_records.extend(record.bad_records[:MAX_LISTED_BAD_RECORDS - len(m.bad_records)])
                m.shards.extend(record.parts)
        m.extra["units"] = {s.name: sum(u.source.name == s.name for u in self.units) for s in self.sources}
        os.makedirs(self.out, exist_ok=True)
        if final:
            if not any(s.samples > 0 for s in m.shards):
                raise ValueError(
                    f"{self.out}: no sequence of {self.cfg.seq_len} tokens was produced; the {self.name} sources are "
                    "too small for seq_len (see the manifest's dropped_tokens)"
                )
            self._write_index()
            m.complete = True
        save_manifest(self.out, m)  # (uploaded, for an object-store directory, after the index)
        return m

    def _write_index(self) -> None:
        """The root ``index.json``: the shards of the manifest's parts, in its order."""
        merge_part_indexes(self.out, [s.name for s in self.manifest.shards if s.samples > 0])


def _current_inputs(source: SourceConfig) -> tuple[set[str], bool]:
    """The source's inputs now, and whether one of its paths is gone (then those that are left)."""
    try:  # (as a record names them: an input in an object store by its URL)
        return {storage.display(p) for p in resolve_token_inputs(source)}, False
    except BadRecordError:
        return {storage.display(p) for p in resolve_token_inputs(source, skip_missing=True)}, True


def _check_span(span: list, inputs: tuple[set[str], bool], record: str, source: str) -> None:
    """Refuse a record's span (``[file, start, stop]``) naming a file that is not one of the source's current
    inputs (:func:`_current_inputs`); when a path of the source is gone, the span's file may be gone too."""
    if len(span) != 3:
        raise ValueError(f"{record}: spans holds {span!r:.120}, not [file, start, stop]; refused: restore the file "
                         "or delete the directory")
    files, gone = inputs
    file = span[0]
    if isinstance(file, str) and (file in files or (gone and not os.path.lexists(file))):
        return
    raise ValueError(f"{record}: spans names {file!r:.120}, not a file of source {source!r}; refused: restore the "
                     "file or delete the directory")
