"""The engine–trainer seam, declared (docs/DESIGN.md §4): what a trainer may call of a running engine
(:class:`EngineHandle`), and what a trainer is handed to read the engine's shards (:class:`EngineFeed`).

Ray-free, so that both sides import it: the engine's handles implement the protocol (the driver's
:class:`~curation.engine.ray_backend.RayEngine`, and :class:`~curation.engine.ray_backend.EngineClient`, the one a
data-parallel trainer worker holds), the trainer's Composer glue (:mod:`training.runs.engine_feed`,
:mod:`training.selection.shard_scores`, :mod:`training.runs.group`) is typed with it and imports no ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import nn

from curation.core.refresh_data import RecentMasks
from curation.core.stream import CandidateStream
from curation.engine.plan import TrainingPlan
from curation.engine.weights import Weights

__all__ = ["EngineHandle", "EngineFeed"]


@runtime_checkable
class EngineHandle(Protocol):
    """What a trainer may call of a running engine; every call may raise
    :class:`~curation.engine.plan.EngineError` (the engine failed: a worker met bad data, a refresh failed).

    Attributes:
        wait_seconds: the trainer's time spent in :meth:`wait_part` so far.
    """

    wait_seconds: float

    def wait_part(self, step: int, *, timeout_s: float = 1800.0) -> dict[str, Any]:
        """Block until the part holding ``step`` is recorded; ``{part, first, stop, ref_version}``."""
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

    def progress(self) -> dict[str, Any]:
        """Units done and in all, tokens scored and kept, units redone."""
        ...

    def check(self) -> None:
        """Raise :class:`~curation.engine.plan.EngineError` when the engine failed (a no-op where another process
        checks it)."""
        ...

    def close(self) -> None:
        """End the engine (the driver's handle; a trainer worker's handle leaves that to the driver)."""
        ...

    def for_workers(self) -> EngineHandle:
        """The handle to give trainer processes elsewhere (picklable; the data-parallel worker group's)."""
        ...


@dataclass(frozen=True)
class EngineFeed:
    """What a trainer next to a running engine reads: the handle, the shard directory the workers write, the
    candidate stream and the training plan they follow, how long to wait for a step. Built by
    :meth:`curation.engine.training_curation.TrainingCuration.feed`; handed as it is to every trainer process.

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

    def for_workers(self) -> EngineFeed:
        """The same feed for trainer processes elsewhere (their handle: :meth:`EngineHandle.for_workers`)."""
        return dataclasses.replace(self, handle=self.handle.for_workers())
