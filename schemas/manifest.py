"""Run manifests: the JSON file written next to every output directory (docs/DESIGN.md §5).

A manifest records what produced the directory (schema version, resolved config, tokenizer and model
fingerprints), what it holds (per-source counts) and which shards are finished, so that a rerun skips
finished work and never writes a shard twice. Saved atomically by :mod:`curation.io.atomic` (write to a temporary
file, then ``os.replace``), so a kill never leaves a half-written manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from schemas.shards import SCHEMA_VERSION

__all__ = [
    "MANIFEST_NAME",
    "BadRecord",
    "SourceCounts",
    "ShardRecord",
    "Manifest",
    "UnitRecord",
    "sha256_file",
    "check_path_name",
    "check_relative_name",
    "one_line",
    "PATH_NAME_RULE",
    "RESERVED_NAMES",
]

MANIFEST_NAME = "manifest.json"
#: At most this many bad records are listed individually; all are counted.
MAX_LISTED_BAD_RECORDS = 200


#: Files a job writes beside the folders named after sources (``candidates/index.json`` ...).
RESERVED_NAMES = ("index.json", "manifest.json", "config.yaml")

#: The rule for a config value used as one path component (a folder named after a source or a model).
PATH_NAME_RULE = ("1 to 100 characters, only letters, digits, '-', '_', '.', not starting with '.' or '-' (so "
                  "never '.', '..' or a hidden name like '.lock'), no path separator, and none of "
                  + ", ".join(RESERVED_NAMES))


def check_path_name(v: str, what: str = "name") -> str:
    """Return ``v`` when it is safe as one path component (:data:`PATH_NAME_RULE`), else raise ``ValueError``
    naming ``what`` and stating the rule."""
    if not (0 < len(v) <= 100 and v[0] not in ".-" and all(c.isalnum() or c in "-_." for c in v)
            and v not in RESERVED_NAMES):
        raise ValueError(f"{what} {v!r} is used as a folder name and must be {PATH_NAME_RULE}")
    return v


def check_relative_name(v: str) -> str:
    """``v`` when it is a relative path (``/``-separated, at most 8 components) of names that each follow
    :data:`PATH_NAME_RULE` (a part directory ``<source>/part-00000-00001``), else ``ValueError``: a name read back
    from a manifest is untrusted, and a part is read, rewritten or deleted through it."""
    parts = v.split("/") if isinstance(v, str) else []
    if not 0 < len(parts) <= 8:
        raise ValueError(f"{v!r:.120} is not a relative path of 1 to 8 names")
    for p in parts:
        try:
            check_path_name(p)
        except ValueError:
            raise ValueError(f"{v!r:.120} is not a relative path of names that are each {PATH_NAME_RULE}") from None
    return v


def one_line(e: Exception) -> str:
    """A pydantic validation error as one line: the first error's field path and message (and how many more)."""
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    errs = errors()
    first = errs[0]
    loc = ".".join(str(x) for x in first.get("loc", ())) or "(top level)"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    return f"{loc}: {msg}{more}".replace("\n", "\\n")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BadRecord(_Strict):
    """One input record that was skipped (``skip_bad_records``) with the reason."""

    source: str
    file: str
    line: int = Field(description="1-based line (or row) number; 0 when the whole file is bad")
    reason: str


class SourceCounts(_Strict):
    """Counts for one named source; ``+`` merges two counts."""

    documents: int = 0
    tokens: int = 0
    sequences: int = 0
    bad_records: int = 0
    dropped_tokens: int = Field(0, description="remainder tokens that did not fill a last sequence")
    kept_tokens: int = Field(0, description="tokens with loss_mask=1 (selected-token shards)")

    def __add__(self, other: SourceCounts) -> SourceCounts:
        return SourceCounts(**{k: getattr(self, k) + getattr(other, k) for k in type(self).model_fields})


class ShardRecord(_Strict):
    """A finished shard group (an MDS subdirectory with its own index.json)."""

    name: Annotated[str, AfterValidator(check_relative_name)] = Field(
        description="subdirectory, relative to the output directory")
    source: str | None = None
    part: int = 0
    samples: int
    tokens: int
    complete: bool = True
    state: dict[str, Any] = Field(default_factory=dict, description="producer state after this shard (resume)")


class Manifest(_Strict):
    """Manifest of one output directory."""

    schema_version: str = SCHEMA_VERSION
    kind: str = Field(description="shard spec name: candidate, scored or selected")
    job: str
    config: dict[str, Any] = Field(default_factory=dict)
    tokenizer_fingerprint: str | None = None
    model_fingerprints: dict[str, str] = Field(default_factory=dict)
    vocab_size: int | None = None
    seq_len: int | None = None
    sources: dict[str, SourceCounts] = Field(default_factory=dict)
    bad_records: list[BadRecord] = Field(default_factory=list)
    shards: list[ShardRecord] = Field(default_factory=list)
    complete: bool = False
    extra: dict[str, Any] = Field(default_factory=dict)

    # --- persistence -------------------------------------------------------------------------
    @classmethod
    def path_in(cls, directory: str) -> str:
        return os.path.join(directory, MANIFEST_NAME)

    @classmethod
    def load(cls, directory: str) -> Manifest:
        """Load ``directory/manifest.json``; errors name the file."""
        path = cls.path_in(directory)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read manifest ({e})") from e
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(
                f"{path}: schema_version {data.get('schema_version')!r} is not the supported {SCHEMA_VERSION!r}"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as e:  # one line: the field path and what is wrong, with the file
            raise ValueError(f"{path}: invalid manifest: {one_line(e)}") from None

    @classmethod
    def load_if_exists(cls, directory: str) -> Manifest | None:
        return cls.load(directory) if os.path.exists(cls.path_in(directory)) else None

    # --- bookkeeping -------------------------------------------------------------------------
    def counts(self, source: str) -> SourceCounts:
        return self.sources.setdefault(source, SourceCounts())

    def add_bad_record(self, record: BadRecord) -> None:
        self.counts(record.source).bad_records += 1
        if len(self.bad_records) < MAX_LISTED_BAD_RECORDS:
            self.bad_records.append(record)

    def completed(self) -> set[str]:
        return {s.name for s in self.shards if s.complete}

    def totals(self) -> SourceCounts:
        total = SourceCounts()
        for c in self.sources.values():
            total = total + c
        return total


class UnitRecord(_Strict):
    """Progress of one work unit of ``prepare`` (``<group>/<source>/unit-00000.json``), saved by the unit's task
    after each part it finished: the driver builds the group's manifest from these, in plan order, and a rerun
    resumes each unit from its last finished part (a ``done`` unit is never redone)."""

    source: str
    unit: int
    spans: list[list[Any]] = Field(description="the unit's input: [file, start, stop] (bytes or row groups)")
    inputs: list[list[Any]] = Field(default_factory=list, description="per span, its file's [size, mtime_ns, "
                                    "xxh3-128 of the bytes the unit reads] when the unit started (a changed input "
                                    "is detected on a rerun)")
    parts: list[ShardRecord] = Field(default_factory=list, description="finished parts, each with its resume state")
    counts: SourceCounts = Field(default_factory=SourceCounts, description="documents, tokens... of the finished "
                                 "parts (dropped_tokens once done)")
    bad_records: list[BadRecord] = Field(default_factory=list, description=f"the first {MAX_LISTED_BAD_RECORDS}")
    done: bool = False

    def add_bad_record(self, record: BadRecord) -> None:
        self.counts.bad_records += 1
        if len(self.bad_records) < MAX_LISTED_BAD_RECORDS:
            self.bad_records.append(record)

    @classmethod
    def load(cls, path: str) -> UnitRecord:
        """Load a unit record; errors name the file."""
        try:
            with open(path, encoding="utf-8") as f:
                return cls.model_validate(json.load(f))
        except ValidationError as e:
            raise ValueError(f"{path}: invalid work unit record: {one_line(e)}") from None
        except (OSError, ValueError) as e:  # json errors are ValueErrors
            raise ValueError(f"{path}: cannot read the work unit's record ({e})") from e


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes (tokenizer fingerprints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
