"""What one engine does, built once from a job's config: :class:`EngineWork`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from curation.core.policies import RefreshMode
from curation.engine.plan import TrainingPlan, WorkUnit
from curation.engine.refresh_runner import RefreshSpec
from curation.engine.workers import WorkerSpec

__all__ = ["EngineWork"]


@dataclass
class EngineWork:
    """The work of an engine (``jobs/curate.py``, ``jobs/curate_and_train.py``): how many workers run it is an
    operational setting apart (``WorkersConfig``).

    Attributes:
        units: the work units.
        worker_spec: settings of every scoring worker.
        ledger: keyword arguments of the output directory's :class:`~curation.engine.ledger.PartLedger`.
        engine_dir: where weights versions are kept.
        plan: the training plan (refresh sources, snapshot steps); ``None`` for batch curation.
        refresh_mode: the policy's :class:`~curation.core.policies.RefreshMode` (``NONE``: given weights).
        refresh_spec: settings of the refresh actor (``None``: no refresh).
    """

    units: Sequence[WorkUnit]
    worker_spec: WorkerSpec
    ledger: dict[str, Any]
    engine_dir: str
    plan: TrainingPlan | None = None
    refresh_mode: RefreshMode = RefreshMode.NONE
    refresh_spec: RefreshSpec | None = None
