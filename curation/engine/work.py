"""What one engine is asked to do, built once from a job's config: :class:`EngineWork` (the input of
:class:`~curation.engine.ray_backend.RayEngine`; built by :mod:`curation.engine.batch_curation` and
:mod:`curation.engine.training_curation`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from curation.core.policies import RefreshMode
from curation.engine.ledger import LedgerSpec
from curation.engine.plan import TrainingPlan, WorkUnit
from curation.engine.refresh_runner import RefreshSpec
from curation.engine.workers import WorkerSpec

__all__ = ["EngineWork"]


@dataclass(frozen=True)
class EngineWork:
    """The work of an engine (``jobs/curate.py``, ``jobs/curate_and_train.py``): how many workers run it is an
    operational setting apart (``WorkersConfig``). Every part is a typed object, handed as it is to the actors.

    Attributes:
        units: the work units.
        worker_spec: settings of every scoring worker.
        ledger: what the output directory's :class:`~curation.engine.ledger.PartLedger` records.
        engine_dir: where weights versions are kept.
        plan: the training plan (refresh sources, snapshot steps); ``None`` for batch curation.
        refresh_mode: the policy's :class:`~curation.core.policies.RefreshMode` (``NONE``: given weights).
        refresh_spec: settings of the refresh actor (``None``: no refresh).
    """

    units: Sequence[WorkUnit]
    worker_spec: WorkerSpec
    ledger: LedgerSpec
    engine_dir: str
    plan: TrainingPlan | None = None
    refresh_mode: RefreshMode = RefreshMode.NONE
    refresh_spec: RefreshSpec | None = None
