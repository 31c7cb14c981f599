"""Prepare's work units as Ray tasks: the pool ``jobs/prepare.py`` hands to :func:`curation.ingest.prepare.prepare`.

Plumbing only: each unit runs :func:`curation.ingest.units.run_unit` (the same function world size 1 calls in
its own process) as a task of one CPU, with the tokenizer on one thread (``RAYON_NUM_THREADS=1``: one worker is
one core, so N workers use N cores and never oversubscribe them); a worker process imports the Ray-free ingest
modules only (the task is ``run_unit`` itself, pickled by reference). At most ``workers`` units run at once,
handed out in plan order; results come back as they finish. The driver stays the single writer of the manifests.

* **Another node**: a unit and the settings travel :func:`~curation.io.carried.carry` ied, so a task on a node whose
  object-store cache lies elsewhere (``BLADE_CACHE_DIR``) writes the parts of an ``s3://`` output directory into its
  own cache and the bucket, and reads a tokenizer or an input from the bucket into its own cache; the result comes
  back the same way. ``resources`` (the config's): custom Ray resources each task asks for besides its CPU, to keep
  the units on the nodes started with them.
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
from collections.abc import Iterator, Mapping, Sequence

import ray
from ray import ObjectRef
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from curation.engine.ray_backend.reach import check_shared
from curation.engine.ray_backend.session import ray_session  # not actors: that imports torch and the engine
from curation.ingest import units as ingest_units
from curation.ingest.units import PackSettings, UnitResult, WorkUnit
from curation.io.carried import Carried, carry
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


def run_unit(unit: Carried[WorkUnit], settings: Carried[PackSettings]) -> Carried[UnitResult]:
    """:func:`curation.ingest.units.run_unit` in a task, on the values as this process sees them (its title is
    ``ray::run_unit``)."""
    return carry(ingest_units.run_unit(unit.here(), settings.here()))


class RayUnitPool:
    """Runs work units as Ray tasks, at most ``workers`` at once (inside a Ray session), each asking for one CPU and
    ``resources``, each on the node with the most room left for them (:meth:`_node`)."""

    def __init__(self, workers: int, resources: dict[str, float] | None = None) -> None:
        self.workers = workers
        self.resources = dict(resources or {})
        self._task = ray.remote(run_unit)
        self.room = _room(self.resources)  # node id → units it can run at once
        self.placed: dict[ObjectRef, str] = {}  # running task → its node

    def _node(self) -> dict[str, object]:
        """The options placing the next unit: on the node whose room is the least used by this pool's running units
        (then the first), softly (a node lost, or full of others' work, lets Ray run it elsewhere). Handing each
        unit to a node, rather than to Ray's queue, keeps every node busy however short a unit is: Ray gives a task
        to a worker of the same kind that just finished one, on the node it is, before another node's new worker is
        up, so short units would all run on the driver's node."""
        options = {"num_cpus": 1, "max_retries": MAX_RETRIES, "retry_exceptions": False, "resources": self.resources,
                   "runtime_env": {"env_vars": {"RAYON_NUM_THREADS": "1"}}}
        if len(self.room) > 1:
            used = {n: 0 for n in self.room}
            for node in self.placed.values():
                used[node] = used.get(node, 0) + 1
            node = min(self.room, key=lambda n: used[n] / self.room[n])
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            options["_node"] = node
        return options

    def run(self, units: Sequence[WorkUnit], settings: PackSettings) -> Iterator[UnitResult]:
        """Yield every unit's result as it finishes. Leaving early (the driver met bad input) lets the running
        units finish; so does a stop signal (for ``STOP_WAIT_S``), which then raises
        :class:`~curation.io.stop.StopRequested`."""
        todo = list(units)[::-1]
        running: dict[ObjectRef, WorkUnit] = {}
        settings_ref = ray.put(carry(settings))
        finished = False
        try:
            while todo or running:
                while todo and len(running) < self.workers:
                    unit, options = todo.pop(), self._node()
                    node = options.pop("_node", None)
                    ref = self._task.options(**options).remote(carry(unit), settings_ref)
                    running[ref] = unit
                    if node is not None:
                        self.placed[ref] = node
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
                    self.placed.pop(ref, None)
                    try:
                        result = ray.get(ref).here()
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


def _room(resources: Mapping[str, float]) -> dict[str, int]:
    """How many units (one CPU and ``resources`` each) each alive node of the cluster can run at once (nodes with
    room for none left out)."""
    room = {}
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        have = n["Resources"]
        fits = [have.get("CPU", 0.0), *(have.get(k, 0.0) / v for k, v in resources.items() if v > 0)]
        if (count := int(min(fits))) > 0:
            room[n["NodeID"]] = count
    return room


@contextlib.contextmanager
def ray_unit_pool(ray_cfg: RayConfig, workers: int | None, units: int, needs: Mapping[str, str] | None = None, *,
                  resources: Mapping[str, float] | None = None) -> Iterator[RayUnitPool]:
    """A pool of ``workers`` (``None``: the cluster's CPUs) but at most ``units`` tasks asking for ``resources`` each,
    in a Ray session of ``ray_cfg`` (a new local instance by default, or a cluster), with the stop signals caught
    again. ``needs``: the local paths the tasks read or write (``{setting: path}``); on a cluster of several nodes,
    one that a node able to run them cannot reach is refused before any unit starts
    (:func:`~curation.engine.ray_backend.reach.check_shared`)."""
    with ray_session(ray_cfg.address, num_cpus=ray_cfg.num_cpus, include_dashboard=ray_cfg.include_dashboard,
                     need_cpus=workers or 1):
        cpus = int(ray.cluster_resources().get("CPU", 1))
        check_shared(needs or {}, resources=resources, hint=" (local inputs: stage_inputs=s3://... uploads them)")
        check_stop("before the work units started")  # a signal that came before ray.init replaced the handler
        with GracefulStop(what=f"the work units in progress (up to {STOP_WAIT_S:.0f}s)"):
            yield RayUnitPool(max(1, min(workers or cpus, units)), dict(resources or {}))
