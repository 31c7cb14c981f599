"""Prepare's work units as Ray tasks: the pool ``jobs/prepare.py`` hands to :func:`curation.ingest.prepare.prepare`.

Plumbing only: each unit runs :func:`curation.ingest.units.run_unit` (the same function world size 1 calls in
its own process) as a task of one CPU, with the tokenizer on one thread (``RAYON_NUM_THREADS=1``: one worker is
one core, so N workers use N cores and never oversubscribe them); a worker process imports the Ray-free ingest
modules only (the task is ``run_unit`` itself, pickled by reference). At most ``workers`` units run at once,
handed out in plan order; results come back as they finish. The driver stays the single writer of the manifests.

* **A killed worker** (SIGKILL, out of memory, a lost node): Ray runs the task again (``max_retries``); the unit
  resumes from its record on disk, so its finished parts are kept and none is written twice.
* **Bad input** (``skip_bad_records: false``): the unit returns the bad record; the driver stops handing out
  units, the running ones finish, and it raises the first error in plan order.
* **SIGTERM / SIGINT**: ``ray.init`` replaces the driver's SIGTERM handler, so the pool catches the signals again
  (:class:`~curation.io.stop.GracefulStop`) once Ray is up; on the first one no further unit starts, the running ones
  finish (up to ``STOP_WAIT_S``; one still running then is ended with the Ray session, dropping its part in
  progress: its record says what it finished), the driver saves the manifests and the job stops (exit 143 /
  130); a rerun continues every unit from its last finished part. (Not ``ray.cancel``: cancelling a task that is
  just finishing crashed Ray 2.60's driver, "Tried to complete task that was not pending".)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import ray
from ray import ObjectRef
from ray.exceptions import RayTaskError

from curation.engine.ray_backend.session import ray_session  # not actors: that imports torch and the engine
from curation.ingest.units import PackSettings, UnitResult, WorkUnit, run_unit
from curation.io.stop import GracefulStop, StopRequested, check_stop, stop_signal
from schemas.config import RayConfig

__all__ = ["RayUnitPool", "ray_unit_pool"]

#: A task is run again this often after its worker died (the unit resumes from its record).
MAX_RETRIES = 3
#: After a stop signal, how long the running units may take to finish.
STOP_WAIT_S = 30.0


def _unwrap(err: RayTaskError) -> BaseException:
    """The task's own exception (a ValueError, an OSError naming the file...), not Ray's wrapper."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, Exception) else err


class RayUnitPool:
    """Runs work units as Ray tasks, at most ``workers`` at once (inside a Ray session)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._task = ray.remote(run_unit).options(
            num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False,
            runtime_env={"env_vars": {"RAYON_NUM_THREADS": "1"}},
        )

    def run(self, units: Sequence[WorkUnit], settings: PackSettings) -> Iterator[UnitResult]:
        """Yield every unit's result as it finishes. Leaving early (the driver met bad input) lets the running
        units finish; so does a stop signal (for ``STOP_WAIT_S``), which then raises
        :class:`~curation.io.stop.StopRequested`."""
        todo = list(units)[::-1]
        running: dict[ObjectRef, WorkUnit] = {}
        settings_ref = ray.put(settings)
        finished = False
        try:
            while todo or running:
                while todo and len(running) < self.workers:
                    unit = todo.pop()
                    running[self._task.remote(unit, settings_ref)] = unit
                ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
                signum = stop_signal()
                if signum is not None:
                    done, late = ray.wait(list(running), num_returns=len(running), timeout=STOP_WAIT_S)
                    running.clear()
                    raise StopRequested(signum, f"after the work units in progress finished ({len(done)}" + (
                        f"; {len(late)} still running after {STOP_WAIT_S:.0f}s ended, their parts in progress dropped)"
                        if late else ")"))
                for ref in ready:
                    running.pop(ref)
                    try:
                        result = ray.get(ref)
                    except RayTaskError as e:
                        raise _unwrap(e) from None
                    yield result
            finished = True
        finally:
            if not finished and running:
                self._settle(running)

    @staticmethod
    def _settle(running: dict[ObjectRef, WorkUnit]) -> None:
        """Let the running units finish (their results are on disk, in their records)."""
        for ref in list(running):
            with contextlib.suppress(Exception):
                ray.get(ref)


@contextlib.contextmanager
def ray_unit_pool(ray_cfg: RayConfig, workers: int | None, units: int) -> Iterator[RayUnitPool]:
    """A pool of ``workers`` (``None``: the cluster's CPUs) but at most ``units`` tasks, in a Ray session of
    ``ray_cfg`` (a new local instance by default, or a cluster), with the stop signals caught again."""
    with ray_session(ray_cfg.address, num_cpus=ray_cfg.num_cpus, include_dashboard=ray_cfg.include_dashboard,
                     need_cpus=workers or 1):
        cpus = int(ray.cluster_resources().get("CPU", 1))
        check_stop("before the work units started")  # a signal that came before ray.init replaced the handler
        with GracefulStop(what=f"the work units in progress (up to {STOP_WAIT_S:.0f}s)"):
            yield RayUnitPool(max(1, min(workers or cpus, units)))
