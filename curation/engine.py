"""The Ray-free core of the curation engine (DESIGN.md §3): plan, coordinator state, part ledger, weights.

The Ray actors of :mod:`curation.ray_engine` are thin wrappers around these plain classes, which run
in-process in tests:

* :class:`WorkUnit` / :func:`plan_training_units` / :func:`plan_batch_units`: the work is cut into
  *step ranges* of the deterministic candidate stream; each unit is scored with one reference version
  (and, pipelined, one proxy snapshot) and becomes one MDS part.
* :class:`TrainingPlan`: which proxy snapshots the trainer publishes (refresh start points, pipelined
  snapshots every ``P`` steps) and which refresh each snapshot starts.
* :class:`Coordinator`: which unit a worker does next (dependencies on published weights, the
  look-ahead bound over the trainer = back-pressure), completion, failures, redo after a restart.
* :class:`PartLedger`: the output directory's manifest, written by one process only (the coordinator):
  a part is recorded only after it is on disk, the root index lists recorded parts in step order.
* :class:`Weights`: model weights as numpy arrays (what goes into the object store once per version),
  saved as safetensors.
* :class:`PartCache`: the trainer's reader of the rows of one step from a finished part.

Pure Python + numpy/torch: no ray, no composer.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from curation.schedule import WARMUP_EPISODE, Schedule
from curation.shards import ShardReader, publish_parts, recovery_hint, verify_part
from schemas.manifest import Manifest, ShardRecord, SourceCounts
from schemas.outdir import config_diff
from schemas.shards import SPECS

__all__ = [
    "EngineError",
    "ScoringDataError",
    "WorkUnit",
    "plan_training_units",
    "plan_batch_units",
    "TrainingPlan",
    "Coordinator",
    "PartResult",
    "PartLedger",
    "Weights",
    "PartCache",
    "worker_dir",
]

#: Weights kinds in the registry: a proxy snapshot (version = its step) or a reference (version = episode).
PROXY, REFERENCE = "proxy", "reference"


class EngineError(RuntimeError):
    """The engine cannot go on (a worker failed on bad data, a refresh failed, a worker died for good)."""


class ScoringDataError(ValueError):
    """Bad candidate data met by a worker; the message names the shard file and record. Not retried."""


def worker_dir(worker_id: int) -> str:
    """Subdirectory of a worker's parts."""
    return f"worker-{worker_id:02d}"


# ------------------------------------------------------------------------------------------------
# work units and the plan
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkUnit:
    """Steps ``first ≤ t < stop`` of the candidate stream, written as one part.

    Attributes:
        first: first step.
        stop: step after the last.
        output: ``scored`` (``ℓ(w̃)`` per token) or ``selected`` (finished masks).
        ref_version: reference version scoring these steps; ``-1``: none (warm-up: every valid token kept).
        proxy_version: step of the proxy snapshot ``u^(s)`` used for ``ℓ(u)`` (selected output), or ``None``.
    """

    first: int
    stop: int
    output: str
    ref_version: int = WARMUP_EPISODE
    proxy_version: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.first < self.stop:
            raise ValueError(f"a work unit needs 0 <= first < stop, got [{self.first}, {self.stop})")
        if self.output not in ("scored", "selected"):
            raise ValueError(f"output must be 'scored' or 'selected', got {self.output!r}")

    @property
    def name(self) -> str:
        """Part directory name (same layout as the single-process writers: ``steps-<first>-<stop>``)."""
        return f"steps-{self.first:09d}-{self.stop:09d}"

    @property
    def steps(self) -> range:
        return range(self.first, self.stop)

    def needs(self) -> list[tuple[str, int]]:
        """Registry keys of the weights this unit is scored with."""
        keys = []
        if self.ref_version >= 0:
            keys.append((REFERENCE, self.ref_version))
        if self.proxy_version is not None:
            keys.append((PROXY, self.proxy_version))
        return keys

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkUnit:
        return cls(**d)


def _cut(start: int, stop: int, boundaries: Iterable[int], range_steps: int) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` at every boundary, then into pieces of at most ``range_steps``."""
    cuts = sorted({b for b in boundaries if start < b < stop} | {start, stop})
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        out.extend((s, min(s + range_steps, b)) for s in range(a, b, range_steps))
    return out


def plan_training_units(
    schedule: Schedule,
    *,
    stop_step: int,
    mode: str,
    range_steps: int,
    snapshot_period: int = 1,
    refreshed: bool = True,
) -> list[WorkUnit]:
    """The work units of an online run of ``stop_step`` proxy steps.

    * ``exact``: scored units for the steps after the warm-up; each stays inside one episode (one reference).
    * ``pipelined``: selected units for every step; warm-up units need no weights, the others one reference
      version and the proxy snapshot ``u^(s)``, ``s = W + P·⌊(t − W)/P⌋``, so a unit never straddles an
      episode or snapshot boundary.

    Args:
        schedule: warm-up, τ.
        stop_step: number of proxy steps.
        mode: ``exact`` or ``pipelined``.
        range_steps: maximum steps per unit.
        snapshot_period: ``P`` (pipelined).
        refreshed: ``False`` for a static reference (``rho1``: version 0 scores every step).
    """
    if mode not in ("exact", "pipelined"):
        raise ValueError(f"mode must be 'exact' or 'pipelined', got {mode!r}")
    if range_steps < 1 or snapshot_period < 1:
        raise ValueError(f"range_steps and snapshot_period must be >= 1, got {range_steps}, {snapshot_period}")
    w, tau = schedule.warmup, schedule.tau
    episodes = range(w, stop_step, tau)
    units = []
    if mode == "exact":
        for a, b in _cut(min(w, stop_step), stop_step, episodes, range_steps):
            units.append(WorkUnit(a, b, "scored", schedule.reference_version(a, refreshed=refreshed)))
        return units
    snapshots = range(w, stop_step, snapshot_period)
    for a, b in _cut(0, stop_step, [w, *episodes, *snapshots], range_steps):
        if schedule.is_warmup(a):
            units.append(WorkUnit(a, b, "selected"))
        else:
            s = w + snapshot_period * ((a - w) // snapshot_period)
            units.append(WorkUnit(a, b, "selected", schedule.reference_version(a, refreshed=refreshed), s))
    return units


def plan_batch_units(num_steps: int, range_steps: int) -> list[WorkUnit]:
    """Units of a batch curation pass: every step selected with reference 0 and proxy 0."""
    return [WorkUnit(a, b, "selected", 0, 0) for a, b in _cut(0, num_steps, (), range_steps)]


@dataclass(frozen=True)
class TrainingPlan:
    """When the trainer publishes proxy snapshots and which refreshes they start.

    Attributes:
        schedule: warm-up / τ / total steps.
        mode: ``exact`` or ``pipelined``.
        refreshes: whether the reference is refreshed (``blade``, ``blade-nosync``); ``False`` for ``rho1``.
        snapshot_period: ``P`` (pipelined).
        overlap_steps: ``δ``: refresh ``e`` starts from ``u^(W + eτ − δ)`` (0 = synchronous).
    """

    schedule: Schedule
    mode: str
    refreshes: bool
    snapshot_period: int = 1
    overlap_steps: int = 0

    @property
    def stop_step(self) -> int:
        assert self.schedule.total_steps is not None
        return self.schedule.total_steps

    def refresh_versions(self) -> range:
        return range(self.schedule.num_refreshes() if self.refreshes else 0)

    def refresh_source(self, version: int) -> int:
        """Proxy step a refresh starts from: ``max(0, W + eτ − δ)``."""
        return max(0, self.schedule.refresh_step(version) - self.overlap_steps)

    def staleness(self, version: int) -> int:
        """``δ`` actually used by refresh ``version`` (smaller than configured when clipped at step 0)."""
        return self.schedule.refresh_step(version) - self.refresh_source(version)

    def refresh_sources(self) -> dict[int, int]:
        """proxy step → refresh version started from it."""
        return {self.refresh_source(e): e for e in self.refresh_versions()}

    def publish_steps(self) -> list[int]:
        """Steps ``s`` whose weights ``u^(s)`` (before step ``s``) the trainer publishes."""
        steps = set(self.refresh_sources())
        if self.mode == "pipelined":
            steps.update(range(self.schedule.warmup, self.stop_step, self.snapshot_period))
        return sorted(steps)

    def units(self, range_steps: int) -> list[WorkUnit]:
        return plan_training_units(
            self.schedule, stop_step=self.stop_step, mode=self.mode, range_steps=range_steps,
            snapshot_period=self.snapshot_period, refreshed=self.refreshes,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.to_dict(), "mode": self.mode, "refreshes": self.refreshes,
                "snapshot_period": self.snapshot_period, "overlap_steps": self.overlap_steps}


# ------------------------------------------------------------------------------------------------
# coordinator state
# ------------------------------------------------------------------------------------------------
class Coordinator:
    """Assignment of work units to workers (pure state; the Ray coordinator actor wraps it).

    A unit is *ready* when the weights it needs are published and, with a trainer, when it ends no more
    than ``lookahead`` steps after the step the trainer is about to take (back-pressure). Units are
    handed out in step order. A worker asking again while it still holds a unit gets the same unit back:
    that is a worker restarted by Ray redoing the unit it crashed in (counted in :attr:`redone`).

    Args:
        units: all units of the run (any order).
        done: names of units already finished (resume).
        lookahead: the back-pressure bound, or ``None`` (no trainer: batch curation).
    """

    def __init__(self, units: Iterable[WorkUnit], *, done: Iterable[str] = (), lookahead: int | None = None) -> None:
        self.units = sorted(units, key=lambda u: u.first)
        self._firsts = [u.first for u in self.units]
        self.by_name = {u.name: u for u in self.units}
        if len(self.by_name) != len(self.units):
            raise ValueError("work units overlap")
        unknown = set(done) - set(self.by_name)
        if unknown:
            raise ValueError(f"finished parts {sorted(unknown)[:3]} are not units of this plan")
        self.done: set[str] = set(done)
        self.assigned: dict[int, str] = {}
        self.published: set[tuple[str, int]] = set()
        self.lookahead = lookahead
        self.trainer_step = 0
        self.failed: str | None = None
        self.stopped = False
        self.redone = 0
        self.handed_out = 0

    # --- inputs ------------------------------------------------------------------------------
    def publish(self, kind: str, version: int) -> None:
        self.published.add((kind, int(version)))

    def retract(self, kind: str, version: int) -> None:
        self.published.discard((kind, int(version)))

    def trainer_at(self, step: int) -> None:
        """The trainer is about to take ``step`` (monotone)."""
        self.trainer_step = max(self.trainer_step, int(step))

    def fail(self, message: str) -> None:
        if self.failed is None:
            self.failed = message

    def stop(self) -> None:
        self.stopped = True

    # --- queries -----------------------------------------------------------------------------
    def ready(self, unit: WorkUnit) -> bool:
        if any(k not in self.published for k in unit.needs()):
            return False
        return self.lookahead is None or unit.stop <= self.trainer_step + self.lookahead

    def pending(self) -> list[WorkUnit]:
        """Units neither finished nor held by a worker, in step order."""
        held = set(self.assigned.values())
        return [u for u in self.units if u.name not in self.done and u.name not in held]

    def next_unit(self, worker: int) -> tuple[str, WorkUnit | None]:
        """``("work", unit)``, ``("wait", None)`` (nothing ready yet) or ``("stop", None)``."""
        if self.failed is not None or self.stopped:
            return "stop", None
        if worker in self.assigned:
            self.redone += 1
            return "work", self.by_name[self.assigned[worker]]
        pending = self.pending()
        if not pending:
            return "stop", None
        for unit in pending:
            if self.ready(unit):
                self.assigned[worker] = unit.name
                self.handed_out += 1
                return "work", unit
            if self.lookahead is not None and unit.stop > self.trainer_step + self.lookahead:
                break  # later units are further ahead still
        return "wait", None

    def complete(self, worker: int, name: str) -> WorkUnit:
        held = self.assigned.get(worker)
        if held != name:
            raise ValueError(f"worker {worker} reports {name} finished but holds {held}")
        del self.assigned[worker]
        self.done.add(name)
        return self.by_name[name]

    def unit_for(self, step: int) -> WorkUnit | None:
        i = bisect.bisect_right(self._firsts, step) - 1
        if i >= 0 and step < self.units[i].stop:
            return self.units[i]
        return None

    def finished(self) -> bool:
        return len(self.done) == len(self.units)

    def needed(self) -> set[tuple[str, int]]:
        """Weights still needed by units not finished."""
        return {k for u in self.units if u.name not in self.done for k in u.needs()}

    def progress(self) -> dict[str, Any]:
        return {
            "units_done": len(self.done), "units_total": len(self.units), "working": dict(self.assigned),
            "trainer_step": self.trainer_step, "redone": self.redone, "failed": self.failed,
        }


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


class PartLedger:
    """The manifest of an engine output directory (scored or selected shards).

    Parts live in per-worker subdirectories (``worker-03/steps-000000010-000000015``). A part is recorded
    (with its step range in ``state``) only after the worker has written it completely; the root
    ``index.json`` lists recorded parts in step order, so the directory reads like a single-process one
    (:class:`curation.scorer.ScoredShards`, ``StreamingDataset``). On opening, part directories that are not
    recorded (a killed worker's half-written ``.tmp`` or an unrecorded copy) are removed, and every recorded
    part is checked against the hashes in its index: a damaged or missing one is unrecorded (its counts
    subtracted, listed in :attr:`dropped`) so that the rerun redoes its unit.

    Args:
        out_dir: the output directory.
        kind: ``scored`` or ``selected``.
        job: producing job (new manifest).
        run_key: what must be equal for a rerun to resume here (stream, plan, models, settings); a
            directory written with another run key is refused.
        fields: other manifest fields (``config``, ``vocab_size``, ``seq_len``, fingerprints, ``extra``).
    """

    def __init__(self, out_dir: str, *, kind: str, job: str, run_key: Mapping[str, Any], **fields: Any) -> None:
        self.out_dir = out_dir
        self.spec = SPECS[kind]
        os.makedirs(out_dir, exist_ok=True)
        key = json.loads(json.dumps(dict(run_key)))
        existing = Manifest.load_if_exists(out_dir)
        if existing is not None:
            old = existing.extra.get("run_key")
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
            problem = verify_part(os.path.join(self.out_dir, rec.name)) if rec.complete else None
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

    def _remove_unrecorded(self) -> None:
        recorded = {r.name for r in self.manifest.shards if r.complete}
        for entry in sorted(os.listdir(self.out_dir)):
            path = os.path.join(self.out_dir, entry)
            if not (entry.startswith("worker-") and os.path.isdir(path)):
                continue
            for part in sorted(os.listdir(path)):
                if part.endswith(".tmp") or f"{entry}/{part}" not in recorded:
                    shutil.rmtree(os.path.join(path, part))

    def done_units(self) -> dict[str, ShardRecord]:
        """unit name → its record."""
        return {r.state["unit"]: r for r in self.manifest.shards if r.complete}

    def record(self, result: PartResult) -> ShardRecord:
        """Record a finished part (it must be on disk), merge the index, save the manifest."""
        if result.unit in self.done_units():
            raise ValueError(f"{self.out_dir}: {result.unit} is already recorded")
        if not os.path.isfile(os.path.join(self.out_dir, result.name, "index.json")):
            raise ValueError(f"{self.out_dir}/{result.name}: the part is not on disk")
        rec = ShardRecord(
            name=result.name, samples=result.samples, tokens=result.tokens,
            state={"unit": result.unit, "first_step": result.first, "stop_step": result.stop,
                   "kept_tokens": result.kept_tokens, "worker": result.worker, "sources": result.sources},
        )
        self.manifest.shards.append(rec)
        self.manifest.shards.sort(key=lambda r: int(r.state["first_step"]))
        for src, c in result.sources.items():
            self.manifest.sources[src] = self.manifest.counts(src) + SourceCounts(**c)
        # Other copies of the same unit (an unrecorded leftover of a crashed attempt) go first.
        for entry in os.listdir(self.out_dir):
            other = os.path.join(self.out_dir, entry, result.unit)
            if entry.startswith("worker-") and f"{entry}/{result.unit}" != result.name and os.path.isdir(other):
                shutil.rmtree(other)
        self._publish()
        return rec

    def finish(self, extra: Mapping[str, Any] | None = None) -> None:
        self.manifest.complete = True
        if extra:
            self.manifest.extra.update(extra)
        self._publish()

    def _publish(self) -> None:
        publish_parts(self.out_dir, self.manifest)


# ------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------
@dataclass
class Weights:
    """A state dict as numpy arrays: one object per version in Ray's object store, read zero-copy.

    Attributes:
        arrays: name → array (bfloat16 tensors are stored as their int16 bit patterns).
        bf16: names of the bfloat16 tensors.
    """

    arrays: dict[str, np.ndarray]
    bf16: tuple[str, ...] = ()

    @classmethod
    def from_state_dict(cls, model: nn.Module | Mapping[str, Tensor]) -> Weights:
        sd = model.state_dict() if isinstance(model, nn.Module) else model
        arrays, bf16 = {}, []
        for k, v in sd.items():
            v = v.detach().to("cpu")
            if v.dtype == torch.bfloat16:
                bf16.append(k)
                v = v.view(torch.int16)
            arrays[k] = v.contiguous().numpy().copy()
        return cls(arrays, tuple(bf16))

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors viewing the arrays (read-only memory is fine: ``load_state_dict`` copies)."""
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": never written to
            for k, a in self.arrays.items():
                t = torch.from_numpy(a)
                out[k] = t.view(torch.bfloat16) if k in self.bf16 else t
        return out

    def load_into(self, model: nn.Module) -> None:
        model.load_state_dict(self.state_dict(), strict=True)

    def save(self, path: str) -> str:
        """Atomically write a safetensors file."""
        from curation.models import save_weights

        return save_weights(self.state_dict(), path)

    @classmethod
    def load(cls, path: str) -> Weights:
        from safetensors.torch import load_file

        return cls.from_state_dict(load_file(path, device="cpu"))

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for k in sorted(self.arrays):
            a = self.arrays[k]
            h.update(f"{k}:{a.shape}:{a.dtype}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()


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
            reader = ShardReader(os.path.join(self.out_dir, part),
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
