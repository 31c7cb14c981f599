"""The engine–trainer seam, declared (docs/DESIGN.md §4): what a trainer may call of a running engine
(:class:`EngineHandle`), what the driver that started it calls (:class:`EngineDriver`), and what a trainer is handed
to read the engine's shards (:class:`EngineFeed`, whose :meth:`EngineFeed.rows` waits for a step and reads it).

Ray-free, so that both sides import it: the engine's handles implement the protocols (the driver's
:class:`~curation.engine.ray_backend.RayEngine` both, :class:`~curation.engine.ray_backend.EngineClient`, the one a
data-parallel trainer worker holds, the trainer's), the trainer's Composer glue (:mod:`training.runs.engine_feed`,
:mod:`training.selection.shard_scores`, :mod:`training.runs.rank`) is typed with them and imports no ray. The
answers are the typed records of :mod:`curation.engine.report`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
from torch import nn

from curation.core.refresh_data import RecentMasks
from curation.core.stream import CandidateStream
from curation.engine.ledger import PartCache
from curation.engine.plan import TrainingPlan
from curation.engine.report import EngineProgress, EngineReport, PartInfo
from curation.engine.weights import Weights

__all__ = ["EngineHandle", "EngineDriver", "EngineFeed", "StepRows"]


@runtime_checkable
class EngineHandle(Protocol):
    """What a trainer may call of a running engine; every call may raise
    :class:`~curation.engine.plan.EngineError` (the engine failed: a worker met bad data, a refresh failed).

    Attributes:
        wait_seconds: the trainer's time spent in :meth:`wait_part` so far.
        waits: ``(step, seconds)`` of each of those waits that took 50 ms or more.
    """

    wait_seconds: float
    waits: list[tuple[int, float]]

    def wait_part(self, step: int, *, timeout_s: float = 1800.0) -> PartInfo:
        """Block until the part holding ``step`` is recorded."""
        ...

    def trainer_at(self, step: int) -> None:
        """The step the trainer is about to take (back-pressure: workers stay ``lookahead`` steps ahead)."""
        ...

    def publish_proxy(self, step: int, model: nn.Module, recent: RecentMasks | None = None) -> None:
        """Hand over the proxy ``u^(step)`` (and, at a refresh source, the recent masks)."""
        ...

    def reference(self, version: int, *, timeout_s: float = 1800.0) -> Weights:
        """The weights of reference ``version`` (waits until the refresh has made them)."""
        ...

    def progress(self) -> EngineProgress:
        """Units done and in all, tokens scored and kept, units redone."""
        ...


@runtime_checkable
class EngineDriver(Protocol):
    """What the process that started an engine calls of it (never a trainer)."""

    def check(self) -> None:
        """Raise :class:`~curation.engine.plan.EngineError` when the engine failed (a scoring worker died for good,
        or met bad data)."""
        ...

    def for_workers(self) -> EngineHandle:
        """The handle to give trainer processes elsewhere (picklable: the data-parallel worker group's)."""
        ...

    def finish_units(self) -> None:
        """After the trainer: do the units still to do (parts found damaged on opening)."""
        ...

    def finish(self, extra: Mapping[str, object] | None = None) -> int:
        """Every unit is done: the output directory's manifest is marked complete (with ``extra`` fields); the objects
        the engine's coordinator uploaded (an object-store output directory)."""
        ...

    def report(self, *, job_seconds: float | None = None) -> EngineReport:
        """The engine's account of the run (``job_seconds``: the whole job's time this run, as the caller measured)."""
        ...

    def close(self) -> None:
        """End the engine: its workers finish the unit in hand, then every actor ends."""
        ...


@dataclass(frozen=True)
class StepRows:
    """The ``b`` rows of one step, read from the engine's finished part holding it.

    Attributes:
        step: the step.
        where: the part's directory, for messages (``<out_dir>/<part>``).
        ref_version: the reference version that scored them.
    """

    step: int
    where: str
    ref_version: int
    rows: Sequence[Mapping[str, object]]

    def column(self, name: str) -> np.ndarray:
        """The column ``name`` of the rows, stacked (``(b, L)`` for a token column, ``(b,)`` for a scalar one)."""
        return np.stack([np.asarray(r[name]) for r in self.rows])


@dataclass(frozen=True)
class EngineFeed:
    """What a trainer next to a running engine reads: the handle, the shard directory the workers write, the
    candidate stream and the training plan they follow, how long to wait for a step. Built by
    :meth:`curation.engine.training_curation.TrainingCuration.feed`; handed as it is to every trainer process (the
    open parts it reads are its own: they do not travel).

    Attributes:
        handle: the running engine.
        out_dir: the workers' shards: ``scored/`` (exact mode) or ``selected/`` (pipelined).
        stream: the candidate stream (sample ids of each step).
        plan: the training plan (its schedule is the run's; which steps to publish).
        timeout_s: fail when a step's part does not arrive within this time.
    """

    handle: EngineHandle
    out_dir: str
    stream: CandidateStream
    plan: TrainingPlan
    timeout_s: float = 1800.0
    _parts: PartCache = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_parts", PartCache(self.out_dir, self.stream.batch_size))

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in vars(self).items() if k != "_parts"}

    def __setstate__(self, state: dict[str, object]) -> None:
        vars(self).update(state)
        self.__post_init__()

    def rows(self, step: int) -> StepRows:
        """The rows of ``step`` from the workers' part holding it, once it is written (waits up to ``timeout_s``).

        Raises:
            EngineError: the engine failed, or the part did not come in time.
            ValueError: the part holds fewer rows than the step needs.
        """
        info = self.handle.wait_part(step, timeout_s=self.timeout_s)
        return StepRows(step, f"{self.out_dir}/{info.part}", info.ref_version,
                        self._parts.rows(info.part, info.first, step))
