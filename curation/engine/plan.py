"""The engine's plan (docs/DESIGN.md §3): how the work is cut into units and which weights each needs.

* :class:`WorkUnit` / :func:`plan_training_units` / :func:`plan_batch_units`: the work is cut into
  *step ranges* of the deterministic candidate stream; each unit is scored with one reference version
  (and, pipelined, one proxy snapshot) and becomes one MDS part.
* :class:`TrainingPlan`: which proxy snapshots the trainer publishes (refresh start points, pipelined
  snapshots every ``P`` steps) and which refresh each snapshot starts.

The rest of the Ray-free engine: :mod:`curation.engine.coordinator` (which unit a worker does next),
:mod:`curation.engine.state` (weights registry, resume, snapshot retention, refresh triggering, stats),
:mod:`curation.engine.ledger` (the output manifest), :mod:`curation.engine.weights` (weights in the
object store). :mod:`curation.engine.ray_backend` wraps them in actors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from curation.core.schedule import WARMUP_EPISODE, Schedule
from curation.io.shards import part_name

__all__ = ["EngineError", "WorkerGroupFailed", "ScoringDataError", "WorkUnit", "plan_training_units", "plan_batch_units", "TrainingPlan",
           "worker_dir", "PROXY", "REFERENCE"]

#: Weights kinds in the registry: a proxy snapshot (version = its step) or a reference (version = episode).
PROXY, REFERENCE = "proxy", "reference"


class EngineError(RuntimeError):
    """The engine cannot go on (a worker failed on bad data, a refresh failed, a worker died for good)."""


class WorkerGroupFailed(RuntimeError):
    """The data-parallel trainer's worker group (on Ray Train) failed more often than its restarts allow (the
    workers' errors by rank)."""


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
        """Part directory name (the single-process writers' layout: :func:`curation.io.shards.part_name`)."""
        return part_name(self.first, self.stop)

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
    w = schedule.warmup
    episodes = schedule.episode_starts(stop_step)
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

    def extension_gaps(self, old_stop: int, range_steps: int) -> list[str]:
        """What a run of ``old_stop`` steps extended to this plan would need and cannot have: a proxy snapshot
        ``u^(s)``, ``s < old_stop``, for a step the shorter run did not plan (a pipelined unit past ``old_stop``
        whose snapshot period began before it; an overlapped refresh due at or after ``old_stop`` whose source is
        before it). The trainer resumes at ``old_stop`` at the latest and never publishes an earlier step again.
        Empty when the extension continues exactly (always in exact mode with synchronous refreshes)."""
        gaps = {u.proxy_version: f"the pipelined unit {u.name}" for u in reversed(self.units(range_steps))
                if u.stop > old_stop and u.proxy_version is not None and u.proxy_version < old_stop}
        for version in self.refresh_versions():
            source = self.refresh_source(version)
            if self.schedule.refresh_step(version) >= old_stop > source:
                gaps.setdefault(source, f"the overlapped refresh {version}")
        return [f"u^({s}) for {what}" for s, what in sorted(gaps.items())]

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.to_dict(), "mode": self.mode, "refreshes": self.refreshes,
                "snapshot_period": self.snapshot_period, "overlap_steps": self.overlap_steps}


