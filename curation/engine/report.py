"""What a running engine answers, as typed records (Ray-free; they travel through Ray as they are).

* :class:`PartInfo`: where the finished part holding a step is (``wait_part``).
* :class:`EngineProgress`: units done, tokens scored, units redone (``progress``).
* :class:`RunStats`: what the workers reported this run (totals and per source).
* :class:`EngineReport`: the engine's account of a run (``report``): it builds the ``engine`` section of a job's
  ``summary.json`` (:meth:`EngineReport.section`) and names the reference that ends in ``final/``
  (:attr:`EngineReport.final_reference`).

The trainer reads the first two (:class:`curation.engine.handle.EngineHandle`), the driver the last
(:class:`curation.engine.handle.EngineDriver`); nothing crosses the seam as a dict of string keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from curation.engine.ledger import PartResult
from curation.engine.plan import TrainingPlan
from curation.engine.refresh_runner import reference_path
from schemas.manifest import SourceCounts

__all__ = ["PartInfo", "EngineProgress", "RunStats", "EngineReport"]

#: One refresh's log as the refresh runner wrote it (``reference-0003.json``): version, step, source_step,
#: staleness, seconds, the losses of its K steps...
RefreshLog = Mapping[str, object]


@dataclass(frozen=True)
class PartInfo:
    """The finished part holding a step: its directory (relative to the workers' output directory), the steps it
    holds (``first ≤ t < stop``) and the reference version that scored them."""

    part: str
    first: int
    stop: int
    ref_version: int


@dataclass(frozen=True)
class EngineProgress:
    """How far the engine is.

    Attributes:
        units_done, units_total: work units finished, and in all.
        trainer_step: the step the trainer is about to take (as last reported).
        redone: units begun again after their worker restarted.
        failed: the engine's error (``None``: none).
        tokens, kept_tokens: tokens scored, and kept, by this run's workers.
        working: worker → the units it holds.
        refreshing: reference versions being refreshed.
        references: reference versions published.
    """

    units_done: int
    units_total: int
    trainer_step: int
    redone: int
    failed: str | None
    tokens: int
    kept_tokens: int
    working: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    refreshing: tuple[int, ...] = ()
    references: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (batch curation's manifest records it)."""
        return {"units_done": self.units_done, "units_total": self.units_total,
                "working": {w: list(names) for w, names in self.working.items()}, "trainer_step": self.trainer_step,
                "redone": self.redone, "failed": self.failed, "tokens": self.tokens, "kept_tokens": self.kept_tokens,
                "refreshing": list(self.refreshing), "references": list(self.references)}

    def __str__(self) -> str:
        return (f"{self.units_done} of {self.units_total} units done, trainer at step {self.trainer_step}, "
                f"{self.redone} redone, working: {dict(self.working) or 'none'}"
                + (f", failed: {self.failed}" if self.failed else ""))


@dataclass
class RunStats:
    """What the workers reported this run: totals, and per source sequences / tokens / kept tokens."""

    tokens: int = 0
    kept_tokens: int = 0
    parts: int = 0
    seconds: float = 0.0
    sources: dict[str, SourceCounts] = field(default_factory=dict)

    def add(self, result: PartResult) -> None:
        self.tokens += result.tokens
        self.kept_tokens += result.kept_tokens
        self.parts += 1
        self.seconds += result.seconds
        for src, c in result.sources.items():
            self.sources[src] = self.sources.get(src, SourceCounts()) + SourceCounts(**c)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (the summary's ``engine.scored``, batch curation's manifest)."""
        return {"tokens": self.tokens, "kept_tokens": self.kept_tokens, "parts": self.parts, "seconds": self.seconds,
                "sources": {s: {"sequences": c.sequences, "tokens": c.tokens, "kept_tokens": c.kept_tokens}
                            for s, c in self.sources.items()}}


@dataclass(frozen=True)
class EngineReport:
    """The engine's account of a run, made by its driver (:meth:`curation.engine.handle.EngineDriver.report`).

    Attributes:
        progress: units done, redone, tokens scored.
        stats: what the workers reported this run.
        refreshes: the log of every reference version (this run and the runs it resumed), in version order.
        seconds: the engine's time this run.
        engine_dir: where the weights versions are (``reference-0003.safetensors``).
        out_dir: the workers' shards (``scored/`` or ``selected/``).
        plan: the training plan (``None``: batch curation).
        workers: scoring workers.
        threads_per_worker: torch threads (and Ray CPUs) of each.
        job_seconds: the whole job's time this run, when the driver measured it.
    """

    progress: EngineProgress
    stats: RunStats
    refreshes: tuple[RefreshLog, ...]
    seconds: float
    engine_dir: str
    out_dir: str
    plan: TrainingPlan | None = None
    workers: int = 0
    threads_per_worker: int = 0
    job_seconds: float | None = None

    @property
    def final_reference(self) -> str | None:
        """The weights file of the last reference version (``final/reference.safetensors`` is a copy), if any."""
        if not self.refreshes:
            return None
        return reference_path(self.engine_dir, max(int(str(r["version"])) for r in self.refreshes))

    def section(self, *, trainer_wait_seconds: float, trainer_waits: Sequence[tuple[int, float]],
                publish_seconds: float) -> dict[str, object]:
        """The ``engine`` section of the job's ``summary.json`` (docs/REFERENCE.md, "summary.json"), with the
        trainer's side of the seam: its time waiting for parts (and each wait ≥ 50 ms) and publishing snapshots."""
        plan = self.plan
        pipelined = plan is not None and plan.mode == "pipelined"
        return {
            "mode": plan.mode if plan is not None else None,
            "refresh": None if plan is None else "overlapped" if plan.overlap_steps > 0 else "sync",
            "workers": self.workers, "threads_per_worker": self.threads_per_worker,
            "snapshot_period": plan.snapshot_period if pipelined else None,
            "staleness_delta": {str(r["version"]): r.get("staleness", 0) for r in self.refreshes},
            "trainer_wait_seconds": trainer_wait_seconds,
            "trainer_waits": [{"step": s, "seconds": w} for s, w in trainer_waits],
            "publish_seconds": publish_seconds, "units_redone_after_restart": self.progress.redone,
            "scored": self.stats.to_dict(), "engine_seconds_this_run": self.seconds,
            "job_seconds_this_run": self.job_seconds, "output_dir": self.out_dir,
        }
