"""The engine on Ray (docs/DESIGN.md §3), plumbing only: the Ray session, actors, the object store, restarts.

With :mod:`~curation.engine.ray_backend.client` (the trainer's calls) and
:mod:`~curation.engine.ray_backend.train_group` (the data-parallel trainer's worker group), the only code of the
project that imports ray. The actors wrap the plain classes of the Ray-free
engine, which make every decision (:mod:`curation.engine.state`: registry, resume, snapshot retention,
refresh triggering, statistics; :mod:`curation.engine.workers`; :mod:`curation.engine.refresh_runner`);
the driver (a job, or the trainer's process) holds a :class:`RayEngine` inside :func:`ray_session`.

* **Coordinator** (async actor, no CPU reserved): an :class:`~curation.engine.state.EngineState` whose
  weights handles are ``ObjectRef`` (one object in the object store per version); it forwards calls, awaits
  changes and the refresh tasks it launches on the refresh actor; the single writer of the output manifest.
* **Scoring workers** (``num_gpus=1`` when the cluster has GPUs, else CPU with ``threads`` each): a loop
  ``serve()`` asks the coordinator for the next unit, fetches the weights of a version only when it
  changes (``ray.get`` of the registry's reference, never weights inside a call), runs the plain
  :class:`~curation.engine.workers.ScoringWorker`, and reports the written part without waiting (the coordinator
  records it while the next unit is scored). It asks for its next unit *ahead*, before scoring the one in hand,
  so no round trip separates two units. A worker killed mid-unit is restarted by Ray (``max_restarts``) and its
  ``serve()`` call retried (``max_task_retries``); the units it held go back to pending, so each is redone once
  and its leftover ``.tmp`` replaced. Bad data is reported with shard and record; the coordinator then stops
  every worker and the driver raises :class:`~curation.engine.plan.EngineError` with that message.
* **Refresh actor** (a GPU when one is left): :class:`~curation.engine.refresh_runner.RefreshRunner`; a new reference is
  the return value of its task, so it lands in the object store once and is registered by reference.

Every published weights version is also on disk under ``engine_dir`` (``proxy-*.safetensors`` written by
the trainer before publishing, ``reference-*.safetensors`` by the refresh), so a killed job resumes with
the same references; proxy snapshots are deleted once nothing needs them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

try:
    import ray
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.exceptions import RayActorError, RayTaskError
except ImportError as e:  # pragma: no cover - ray is a hard dependency of the project
    raise ImportError("the Ray engine needs ray: pip install 'ray[default]>=2.60,<2.61'") from e


from curation.core.policies import RefreshMode
from curation.core.refresh_data import RecentMasks
from curation.engine.ledger import LedgerSpec, PartResult
from curation.engine.plan import EngineError, ScoringDataError, TrainingPlan, WorkUnit
from curation.engine.ray_backend.client import EngineClient, engine_error, error_message
from curation.engine.refresh_runner import RefreshRunner, RefreshSpec
from curation.engine.report import EngineProgress, EngineReport, PartInfo
from curation.engine.state import EngineState, RefreshTask, gpu_shares
from curation.engine.weights import Weights
from curation.engine.work import EngineWork
from curation.engine.workers import ScoringWorker, WorkerSpec
from curation.io import objects
from curation.io.bad_shards import blame, blamed
from curation.io.cache import url_of, urls_in_text
from curation.io.carried import Carried, carry
from curation.io.progress import progress as progress_bar
from curation.io.stop import check_stop
from schemas.engine_config import WorkersConfig

__all__ = ["RayEngine", "UnitJob"]

T = TypeVar("T")


@ray.remote(num_cpus=0)
def _load_weights(path: Carried[str]) -> Weights:
    return Weights.load(path.here())


def _load_from(path: str) -> ray.ObjectRef:
    """Load saved weights into the object store in a task (on any node: the path travels carried)."""
    return _load_weights.remote(carry(path))


@dataclass(frozen=True)
class UnitJob:
    """The coordinator's answer to a worker: a unit more, and the object-store handles of the weights it needs
    (by their registry key, :meth:`~curation.engine.plan.WorkUnit.needs`; fetched when their version changes)."""

    unit: WorkUnit
    weights: Mapping[tuple[str, int], ObjectRef]


# ------------------------------------------------------------------------------------------------
# actors
# ------------------------------------------------------------------------------------------------
class _CoordinatorActor:
    """An :class:`~curation.engine.state.EngineState` (every decision) behind an async actor: waiting calls
    (``next_unit``, ``wait_part``) do not block others; handles are ``ObjectRef``; refreshes are tasks of the
    refresh actor, awaited here."""

    def __init__(self, *, units: list[WorkUnit], lookahead: int | None, ledger: Carried[LedgerSpec],
                 engine_dir: Carried[str], plan: TrainingPlan | None, refresh_mode: RefreshMode,
                 refresh: ActorHandle | None = None) -> None:
        self.refresh_actor = refresh
        ledger, engine_dir = ledger.here(), engine_dir.here()  # (at this node's cache paths)
        self._event: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.state: EngineState[ObjectRef] = EngineState(
            units, ledger=ledger.open(), engine_dir=engine_dir, lookahead=lookahead, plan=plan,
            refresh_mode=refresh_mode, load=_load_from, launch=self._launch,
        )

    # --- refreshes -----------------------------------------------------------------------------
    def _launch(self, task: RefreshTask[ObjectRef]) -> ObjectRef:
        assert self.refresh_actor is not None, "a refresh is due but the engine has no refresh actor"
        if task.static:
            weights, log = self.refresh_actor.static.options(num_returns=2).remote()
        else:
            weights, log = self.refresh_actor.refresh.options(num_returns=2).remote(
                task.version, task.proxy, task.recent, source_step=task.source_step, previous=task.previous)
        self._spawn(self._await_refresh(task.version, log))
        return weights

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_event_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await_refresh(self, version: int, log_ref: ObjectRef) -> None:
        error, shards = None, []
        try:
            await log_ref
        except Exception as e:  # the refresh raised: the engine stops with its message
            error, shards = error_message(e), blamed(e)
        self.state.refresh_done(version, error, shards)
        self._notify()

    # --- change notification -------------------------------------------------------------------
    def _notify(self) -> None:
        ev, self._event = self._event, None
        if ev is not None:
            ev.set()

    async def _wait_change(self, timeout: float) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass

    async def _until(self, answer: Callable[[], T | None], timeout: float) -> T | None:
        """``answer()`` once it is not ``None``, asked again at every change; ``None`` after ``timeout`` seconds.

        Raises:
            EngineError: the engine failed.
        """
        deadline = time.monotonic() + timeout
        while (result := answer()) is None:
            if self.state.failed is not None:
                raise self.state.error()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self._wait_change(left)
        return result

    # --- workers ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self.state.start()
        self._notify()

    async def next_unit(self, worker: int, started: bool = False) -> UnitJob | None:
        """A unit more for the worker and the handles of the weights it needs (``None``: stop); waits for one to be
        ready. ``started``: the worker's first call since it (re)started (see
        :class:`~curation.engine.coordinator.Coordinator`)."""
        if started:
            self.state.worker_started(worker)
        while True:
            status, unit = self.state.next_unit(worker)
            if status == "stop":
                return None
            if status == "work":
                assert unit is not None
                return UnitJob(unit, {key: self.state.handle(*key) for key in unit.needs()})
            await self._wait_change(5.0)

    def complete(self, worker: int, result: PartResult) -> None:
        self.state.complete(worker, result)
        self._notify()

    def fail(self, worker: int, unit: str, message: str, shards: Sequence[str] = ()) -> None:
        self.state.fail(message, shards)
        self._notify()

    # --- trainer ---------------------------------------------------------------------------------
    def trainer_at(self, step: int) -> None:
        self.state.trainer_at(step)
        self._notify()

    def publish_proxy(self, step: int, ref: list[ObjectRef], recent: RecentMasks | None = None) -> bool:
        """Register ``u^(step)`` (``ref`` is ``[ObjectRef]``); start the refresh it is the source of."""
        registered = self.state.publish_proxy(step, ref[0], recent)
        self._notify()
        return registered

    def publish_weights(self, kind: str, version: int, ref: list[ObjectRef]) -> None:
        """Register given weights (batch curation: the checkpoints); ``ref`` is ``[ObjectRef]``."""
        self.state.publish_weights(kind, version, ref[0])
        self._notify()

    async def wait_part(self, step: int, timeout: float) -> PartInfo | None:
        """The finished part holding ``step`` (``None`` after ``timeout`` seconds)."""
        return await self._until(lambda: self.state.part_info(step), timeout)

    def check_finishable(self) -> None:
        self.state.check_finishable()

    async def wait_finished(self, timeout: float) -> bool:
        return await self._until(lambda: self.state.finished() or None, timeout) is not None

    async def weights(self, kind: str, version: int, timeout: float) -> list[ObjectRef] | None:
        ready = await self._until(lambda: self.state.published(kind, version) or None, timeout)
        return None if ready is None else [self.state.handle(kind, version)]

    # --- reporting -------------------------------------------------------------------------------
    def progress(self) -> EngineProgress:
        return self.state.progress()

    def report(self) -> Carried[EngineReport]:
        """The engine's report, carried: its paths (``engine_dir``, ``out_dir``) are this node's cache paths, the
        driver's may be elsewhere."""
        return carry(self.state.report())

    def finish(self, extra: Mapping[str, object] | None = None) -> int:
        """Finish the ledger; the objects this process (the coordinator) uploaded in all."""
        self.state.finish(extra)
        return objects.uploads()

    def stop(self) -> None:
        self.state.stop()
        self._notify()


class _WorkerActor:
    """A :class:`~curation.engine.workers.ScoringWorker` serving units from the coordinator."""

    def __init__(self, spec: Carried[WorkerSpec], worker_id: int) -> None:
        self.worker = ScoringWorker(spec.here(), worker_id)
        with warnings.catch_warnings():  # the property reads a deprecated attribute internally
            warnings.simplefilter("ignore")
            self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)

    def pid(self) -> int:
        return os.getpid()

    def serve(self, coordinator: ActorHandle) -> dict[str, object]:
        """Score units until the coordinator has none left; the worker's stats, with where the time went:
        ``wait_s`` (waiting for the next unit's answer once a unit is written), ``run_s`` (scoring and writing,
        weights fetches included; ``unit_run_s``: each unit's) and ``report_s`` (waiting for the coordinator to
        have recorded a part).

        The next unit is asked for *ahead*, before the one in hand is scored, so its answer (a round trip to the
        coordinator, which may wait for weights or the trainer) arrives while this one runs. A written part's
        report is not waited for: the coordinator records it (index, manifest, an upload to a bucket) while the
        next unit is scored. One report is on its way at a time: it is waited for before the next one is sent, and
        before returning."""
        wid = self.worker.worker_id
        times = {"wait_s": 0.0, "run_s": 0.0, "report_s": 0.0}
        unit_run_s: list[float] = []
        report = None
        t0 = time.perf_counter()
        job = ray.get(coordinator.next_unit.remote(wid, True))
        times["wait_s"] += time.perf_counter() - t0
        while job is not None:
            ask = coordinator.next_unit.remote(wid)  # the unit after this one, answered while this one runs
            unit, refs = job.unit, job.weights
            t1 = time.perf_counter()
            try:
                result = self.worker.run(unit, lambda kind, version, refs=refs: ray.get(refs[(kind, version)]))
            except Exception as e:
                message = str(e) if isinstance(e, ScoringDataError) else f"{type(e).__name__}: {error_message(e)}"
                # (this node's cache paths as their URLs: the driver's cache is elsewhere)
                message, shards = urls_in_text(message), [url_of(f) or f for f in blamed(e)]
                ray.get(coordinator.fail.remote(wid, unit.name, f"worker {wid}, unit {unit.name}: {message}", shards))
                raise
            t2 = time.perf_counter()
            times["run_s"] += t2 - t1
            unit_run_s.append(t2 - t1)
            if report is not None:  # the previous part's record (its error, if any, raised here)
                ray.get(report)
            report = coordinator.complete.remote(wid, result)
            t3 = time.perf_counter()
            times["report_s"] += t3 - t2
            job = ray.get(ask)
            times["wait_s"] += time.perf_counter() - t3
        t4 = time.perf_counter()
        if report is not None:
            ray.get(report)
        times["report_s"] += time.perf_counter() - t4
        return {**self.worker.stats, **times, "unit_run_s": unit_run_s, "restarted": self.restarted,
                "niceness": os.nice(0), "uploaded": objects.uploads()}


class _RefreshActor:
    """A :class:`~curation.engine.refresh_runner.RefreshRunner`; each result is returned into the object store."""

    def __init__(self, spec: Carried[RefreshSpec]) -> None:
        self.runner = RefreshRunner(spec.here())

    def refresh(self, version: int, proxy: Weights, recent: RecentMasks, *, source_step: int,
                previous: Weights | None = None) -> tuple[Weights, dict[str, Any]]:
        try:
            return self.runner.refresh(version, proxy, recent, source_step=source_step, previous=previous)
        except Exception as e:  # its shards blamed by URL too: this node's cache paths mean nothing elsewhere
            raise blame(e, *[u for f in blamed(e) if (u := url_of(f))])  # noqa: B904 - the same error, re-raised

    def static(self) -> tuple[Weights, dict[str, Any]]:
        return self.runner.static()


# ------------------------------------------------------------------------------------------------
# driver side
# ------------------------------------------------------------------------------------------------
class RayEngine(EngineClient):
    """The driver's engine: starts the actors, checks the workers, ends them and reports
    (:class:`~curation.engine.handle.EngineDriver`); as a context manager, :meth:`close` at the end. The trainer's
    calls (:class:`~curation.engine.handle.EngineHandle`: wait for parts, publish proxy snapshots) are those of its
    :class:`~curation.engine.ray_backend.client.EngineClient`, on the coordinator: an in-process trainer uses this
    object, a data-parallel trainer's workers get a plain client (:meth:`for_workers`).

    Args:
        work: what the engine does (units, worker settings, ledger, weights directory, plan, refresh).
        workers: the scoring-worker pool: ``count``, ``threads`` (torch threads and Ray CPUs per worker),
            ``device`` (``cpu`` requests no GPU), ``gpus`` per worker (``None``:
            :func:`~curation.engine.state.gpu_shares` of the cluster's GPUs), ``max_restarts`` of a crashed worker
            (and retries of its ``serve`` call).
        lookahead: back-pressure bound (``None``: no trainer).
        reserved_gpus: GPUs of the cluster held for the data-parallel trainer group (not shared out here).
        fixed_weights: ``{(kind, version): Weights}`` put in the object store once (batch curation).
    """

    def __init__(self, work: EngineWork, workers: WorkersConfig, *, lookahead: int | None = None,
                 reserved_gpus: float = 0.0, fixed_weights: dict[tuple[str, int], Weights] | None = None) -> None:
        self.plan = work.plan
        self.count, self.threads = workers.count, workers.threads
        device, restarts = workers.device, workers.max_restarts
        total = 0.0 if device == "cpu" else float(ray.cluster_resources().get("GPU", 0.0))
        gpu_w, gpu_r = gpu_shares(total, workers.count, refresh=work.refresh_spec is not None,
                                  per_worker=workers.gpus, device=device, reserved=reserved_gpus)
        self.gpus = {"per_worker": gpu_w, "refresh": gpu_r}
        refresh = None
        if work.refresh_spec is not None:
            refresh = ray.remote(_RefreshActor).options(
                num_cpus=0, num_gpus=gpu_r, max_restarts=restarts, max_task_retries=restarts,
            ).remote(carry(work.refresh_spec))
        self.refresh = refresh
        super().__init__(ray.remote(_CoordinatorActor).options(num_cpus=0, max_concurrency=1000).remote(
            units=list(work.units), lookahead=lookahead, ledger=carry(work.ledger), engine_dir=carry(work.engine_dir),
            plan=work.plan, refresh_mode=RefreshMode(work.refresh_mode), refresh=refresh,
        ), work.engine_dir)
        # Every actor is created before waiting on any: they start (import torch, load models) in parallel.
        self.workers = [
            ray.remote(_WorkerActor).options(
                num_cpus=workers.threads, num_gpus=gpu_w, max_restarts=restarts, max_task_retries=restarts,
                resources=dict(workers.resources),
            ).remote(carry(work.worker_spec), i)
            for i in range(workers.count)
        ]
        self._pid_refs = [w.pid.remote() for w in self.workers]  # answered once each actor is up
        self.serving = {w.serve.remote(self.coordinator): i for i, w in enumerate(self.workers)}
        self.worker_results: dict[int, dict[str, object]] = {}
        self._get(self.coordinator.start.remote())
        self._fixed: list[ObjectRef] = []
        for (kind, version), w in (fixed_weights or {}).items():
            self.publish_weights(kind, version, w)

    def __enter__(self) -> RayEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers as first started (waits until they are up)."""
        return self._get(self._pid_refs)

    # --- errors --------------------------------------------------------------------------------
    def _idle(self) -> None:  # between two empty answers of the coordinator: a failed worker fails the wait
        self.check()

    def check(self) -> None:
        """Raise :class:`EngineError` when a worker failed or died for good."""
        if not self.serving:
            return
        ready, _ = ray.wait(list(self.serving), num_returns=len(self.serving), timeout=0)
        for ref in ready:
            wid = self.serving.pop(ref)
            try:
                self.worker_results[wid] = ray.get(ref)
            except RayActorError as e:
                raise EngineError(f"scoring worker {wid} died and was not restarted: {error_message(e)}") from None
            except RayTaskError as e:
                raise engine_error(e) from None

    # --- the trainer's workers, given weights ----------------------------------------------------
    def for_workers(self) -> EngineClient:
        """The handle trainer workers use to reach this engine (its coordinator)."""
        return EngineClient(self.coordinator, self.engine_dir)

    def publish_weights(self, kind: str, version: int, weights: Weights) -> None:
        """Put given weights (e.g. a checkpoint) in the object store once and register them."""
        ref = ray.put(weights)
        self._fixed.append(ref)
        self._get(self.coordinator.publish_weights.remote(kind, int(version), [ref]))

    # --- batch API -----------------------------------------------------------------------------
    def run(self, *, progress: bool = True, desc: str = "curate") -> None:
        """Block until every unit is done (batch curation), with a progress bar.

        Raises:
            StopRequested: a stop signal came (inside a :class:`curation.io.stop.GracefulStop`); polled about once a
                second. Leaving the engine's ``with`` block then lets the workers finish their units (:meth:`close`).
        """
        total = self.progress().units_total
        with progress_bar(total, desc=desc, unit="part", enabled=progress) as bar:
            def show() -> None:
                p = self.progress()
                bar.n = p.units_done
                bar.set_postfix(tokens=p.tokens, kept=p.kept_tokens, redone=p.redone)
                bar.refresh()
                check_stop(f"with {p.units_done} of {p.units_total} work units done")

            self._poll(lambda: self.coordinator.wait_finished.remote(1.0), each=show)

    def finish_units(self) -> None:
        """After the trainer: wait for the units still to do (parts redone after damage was found on opening).

        Raises:
            EngineError: a unit can no longer be done (its weights are gone), naming its part.
        """
        self._get(self.coordinator.check_finishable.remote())
        p = self.progress()
        if p.units_done < p.units_total:
            self.run(progress=False, desc="redo")

    # --- reporting / shutdown ------------------------------------------------------------------
    def report(self, *, job_seconds: float | None = None) -> EngineReport:
        """The engine's account of the run (the coordinator's, with this driver's settings); ``job_seconds``: the
        whole job's time this run, as the caller measured it."""
        rep: EngineReport = self._get(self.coordinator.report.remote()).here()  # (at this process's cache paths)
        return dataclasses.replace(rep, workers=self.count, threads_per_worker=self.threads, job_seconds=job_seconds)

    def finish(self, extra: Mapping[str, object] | None = None) -> int:
        """Every unit is done: mark the output directory's manifest complete (``extra``: more manifest fields);
        returns the objects the coordinator uploaded (the scoring workers' are in :attr:`worker_results` once they
        returned, after :meth:`close` at the latest)."""
        return self._get(self.coordinator.finish.remote(extra))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (they finish their unit), then end every actor."""
        try:
            self.coordinator.stop.remote()
            if self.serving:
                ready, _ = ray.wait(list(self.serving), num_returns=len(self.serving), timeout=timeout_s)
                for ref in ready:
                    wid = self.serving.pop(ref)
                    try:
                        self.worker_results[wid] = ray.get(ref)
                    except Exception:  # noqa: BLE001 - already reported by check()
                        pass
        finally:
            for actor in [*self.workers, self.coordinator, self.refresh]:
                if actor is not None:
                    ray.kill(actor, no_restart=True)
