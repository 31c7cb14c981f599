"""One run's output directory as the inspector reads it: which job wrote it, its records, its selected shards and its
tokenizer; local or ``s3://`` (the records come into the URL's cache, the shards one file when first read).

A run is recognised by its config records (``curation/io/outdir``): ``engine_config.yaml`` beside ``config.yaml``
is the main job's (``jobs/curate_and_train.py``), a ``config.yaml`` with ``selected`` a replay's (its selected shards
are the ones it replayed), one with ``proxy_weights`` batch curation's (``jobs/curate.py``), any other a training
run's (``jobs/train.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from curation.io import storage
from curation.io.objects import is_url
from curation.io.paths import safe_join
from schemas.manifest import Manifest, ShardRecord, sha256_file

__all__ = ["Run", "open_run", "Part", "MISSING_RUN"]

#: The one line for a path that holds no run.
MISSING_RUN = ("{path}: no run here (no config.yaml: give the output directory of jobs/train.py, "
               "jobs/curate_and_train.py, jobs/curate.py or jobs/replay.py)")

#: The metrics read from ``logs/metrics.jsonl`` (the rest of the log is skipped as it streams by).
_METRIC_PREFIXES = ("metrics/eval/", "loss/train/", "blade/", "throughput/tokens_per_sec", "time/eta")


@dataclass(frozen=True)
class Part:
    """One recorded part of the selected shards: its directory and the steps ``first ≤ t < stop`` it holds."""

    path: str
    first: int
    stop: int
    samples: int
    tokens: int


@dataclass
class Run:
    """What the inspector knows of a run before reading its shards.

    Attributes:
        path: the local directory (an ``s3://`` run's cache directory).
        shown: the path as the user gave it (its URL for an object-store run).
        job: ``train``, ``curate_and_train``, ``curate`` or ``replay``.
        config: the job's recorded config (``config.yaml``; the main job's ``engine_config.yaml``).
        summary: ``summary.json`` (``None`` before a run ends).
        selected: the selected-token shard directory (``None`` when there is none).
        manifest: its manifest.
        tokenizer: the tokenizer.json the run's shards were made with (``None`` when it cannot be found).
        tokenizer_note: why the tokenizer is missing or suspect ("" when fine).
        metrics: ``key → [(step, value)]`` of the run's JSON-lines log (the keys of ``_METRIC_PREFIXES``).
    """

    path: str
    shown: str
    job: str
    config: dict[str, Any]
    summary: dict[str, Any] | None
    selected: str | None
    manifest: Manifest | None
    tokenizer: str | None
    tokenizer_note: str = ""
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """A short label: the policy and the directory's name."""
        policy = self.policy
        base = os.path.basename(os.path.normpath(self.shown.rstrip("/"))) or self.shown
        return base if policy in (None, base) else f"{policy} ({base})"

    @property
    def policy(self) -> str | None:
        extra = self.manifest.extra if self.manifest is not None else {}
        if extra.get("policy"):
            return str(extra["policy"])
        if self.summary and self.summary.get("policy"):
            return str(self.summary["policy"])
        return "blade" if self.job == "curate" else None

    @property
    def warmup(self) -> int:
        """Steps of warm-up (every token trained on, nothing scored); 0 without a schedule."""
        extra = self.manifest.extra if self.manifest is not None else {}
        return int((extra.get("schedule") or {}).get("warmup") or 0)

    def parts(self) -> list[Part]:
        """The recorded parts in step order (each checked to stay inside the shard directory)."""
        if self.manifest is None or self.selected is None:
            return []
        out = [self._part(r) for r in self.manifest.shards if r.complete]
        return sorted(out, key=lambda p: (p.first, p.stop))

    def _part(self, r: ShardRecord) -> Part:
        path = safe_join(self.selected, r.name, what="selected part", source_file=storage.display(
            Manifest.path_in(self.selected)))
        first, stop = int(r.state.get("first_step", 0)), int(r.state.get("stop_step", 0))
        return Part(path, first, stop, int(r.samples), int(r.tokens))

    def kept_by_source(self) -> dict[str, tuple[int, int]]:
        """Exact ``source → (kept tokens, candidate positions)`` of the whole run from the manifest (every position
        but a sequence's first is a candidate)."""
        if self.manifest is None:
            return {}
        return {s: (c.kept_tokens, c.tokens - c.sequences) for s, c in sorted(self.manifest.sources.items())}


def _read_yaml(path: str) -> dict[str, Any] | None:
    storage.refresh(path)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{storage.display(path)}: not a config record (a YAML mapping)")
    return data


def _read_json(path: str) -> Any:
    storage.refresh(path)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{storage.display(path)}:{e.lineno}: not valid JSON ({e.msg})") from None


def _metrics(path: str) -> dict[str, list[tuple[int, float]]]:
    """The JSON-lines log's numeric metrics of interest (streamed: the log may be large)."""
    storage.refresh(path)
    out: dict[str, list[tuple[int, float]]] = {}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            if '"step"' not in line or not any(p in line for p in _METRIC_PREFIXES):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill: the rest is still read
                continue
            step = row.get("step")
            if not isinstance(step, int):
                continue
            for k, v in row.items():
                if k.startswith(_METRIC_PREFIXES) and isinstance(v, int | float):
                    out.setdefault(k, []).append((step, float(v)))
    return out


def _dig(config: dict[str, Any], *keys: str) -> Any:
    node: Any = config
    for k in keys:
        node = node.get(k) if isinstance(node, dict) else None
    return node


def _local(path: str | None, base: str) -> str | None:
    """A path recorded in a config: a URL's cache path; a relative one as the job saw it (from the current directory)
    when it is there, else beside the run."""
    if not path:
        return None
    if is_url(path):
        return storage.local_path(path)
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(base, path)


def _tokenizer(config_path: str | None, shards: str | None, manifest: Manifest | None, base: str,
               given: str | None) -> tuple[str | None, str]:
    """The tokenizer.json to decode with, and a note when it is missing or not the one the shards name."""
    candidates: list[str] = []
    if given:
        candidates.append(storage.local_path(given))
    if config_path:
        candidates.append(config_path)
    if shards is not None and manifest is not None:  # the prepared data's own tokenizer, beside the candidates
        src = manifest.extra.get("candidates") or _dig(manifest.config or {}, "candidates")
        if isinstance(src, str):
            candidates.append(os.path.join(os.path.dirname(_local(src, base) or ""), "tokenizer", "tokenizer.json"))
    for c in candidates:
        path = storage.tokenizer_json_path(c) if os.path.isdir(c) else c
        try:
            storage.fetch(path)  # (a cache path: downloaded when missing; a local path: nothing)
        except (OSError, ValueError):
            continue
        if os.path.isfile(path):
            want = manifest.tokenizer_fingerprint if manifest is not None else None
            if want and sha256_file(path) != want and not given:
                continue  # another tokenizer than the shards were made with: look further
            note = ("" if not want or sha256_file(path) == want else
                    f"{storage.display(path)} is not the tokenizer the shards were made with (sha256 differs)")
            return path, note
    return None, "the run's tokenizer was not found (--tokenizer PATH): tokens are shown as ids"


def open_run(path: str, *, tokenizer: str | None = None) -> Run:
    """Read a run's records (and, for ``s3://``, bring them into the cache).

    Raises:
        ValueError: ``path`` holds no run (one line naming it) or a record is unreadable (naming the file).
    """
    local = storage.local_path(path.rstrip("/")) if is_url(path) else path
    engine = _read_yaml(os.path.join(local, "engine_config.yaml"))
    config = _read_yaml(os.path.join(local, "config.yaml"))
    if config is None:
        raise ValueError(MISSING_RUN.format(path=path))
    if engine is not None:
        job, tok, cfg = "curate_and_train", _dig(engine, "train", "data", "tokenizer"), engine
    elif "selected" in config:
        job, tok, cfg = "replay", config.get("tokenizer"), config
    elif "proxy_weights" in config:
        job, tok, cfg = "curate", config.get("tokenizer"), config
    else:
        job, tok, cfg = "train", _dig(config, "data", "tokenizer"), config
    selected: str | None = os.path.join(local, "selected")
    if job == "replay":
        selected = _local(config.get("selected"), local)
    manifest = None
    if selected is not None:
        for name in ("index.json", "manifest.json"):
            storage.refresh(os.path.join(selected, name))
        manifest = Manifest.load_if_exists(selected)
        if manifest is None:
            selected = None
    tok_path, note = _tokenizer(_local(tok, local), selected, manifest, local, tokenizer)
    return Run(path=local, shown=path, job=job, config=cfg, summary=_read_json(os.path.join(local, "summary.json")),
               selected=selected, manifest=manifest, tokenizer=tok_path, tokenizer_note=note,
               metrics=_metrics(os.path.join(local, "logs", "metrics.jsonl")))
