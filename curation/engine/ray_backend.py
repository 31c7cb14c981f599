"""The engine on Ray (docs/DESIGN.md §3): coordinator, scoring workers and refresh as actors.

This is the only module of the project that imports ray. The actors wrap the plain classes of
:mod:`curation.engine` and :mod:`curation.engine.workers`; the driver (a job, or the trainer's process) holds a
:class:`RayEngine`.

* **Coordinator** (async actor, no CPU reserved): owns the plan and the :class:`~curation.engine.coordinator.Coordinator`
  state; keeps the versioned weights registry (``("proxy", step)`` and ``("reference", episode)`` → one
  object in the object store each); starts refreshes on the refresh actor when their proxy snapshot is
  published; is the single writer of the output manifest (:class:`~curation.engine.ledger.PartLedger`).
* **Scoring workers** (``num_gpus=1`` when the cluster has GPUs, else CPU with ``threads`` each): a loop
  ``serve()`` asks the coordinator for the next unit, fetches the weights of a version only when it
  changes (``ray.get`` of the registry's reference, never weights inside a call), runs the plain
  :class:`~curation.engine.workers.ScoringWorker`, and reports the written part. A worker killed mid-unit is
  restarted by Ray (``max_restarts``) and its ``serve()`` call retried (``max_task_retries``); the
  coordinator hands the restarted worker the unit it held, so the unit is redone exactly once and its
  leftover ``.tmp`` replaced. Bad data is reported with shard and record; the coordinator then stops
  every worker and the driver raises :class:`~curation.engine.plan.EngineError` with that message.
* **Refresh actor** (a GPU when one is left): :class:`~curation.engine.refresh_runner.RefreshRunner`; a new reference is
  the return value of its task, so it lands in the object store once and is registered by reference.

Every published weights version is also on disk under ``engine_dir`` (``proxy-*.safetensors`` written by
the trainer before publishing, ``reference-*.safetensors`` by the refresh), so a killed job resumes with
the same references; proxy snapshots are deleted once nothing needs them.
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import time
import warnings
from collections.abc import Sequence
from typing import Any

try:
    import ray
    from ray.exceptions import RayActorError, RayTaskError
except ImportError as e:  # pragma: no cover - ray is a hard dependency of the project
    raise ImportError("the Ray engine needs ray: pip install 'ray[default]>=2.60,<2.61'") from e

from torch import nn

from curation.core.schedule import Schedule
from curation.engine.coordinator import Coordinator
from curation.engine.ledger import PartLedger, PartResult
from curation.engine.plan import PROXY, REFERENCE, EngineError, ScoringDataError, TrainingPlan, WorkUnit
from curation.engine.refresh_runner import (
    RecentMasks,
    RefreshRunner,
    RefreshSpec,
    proxy_path,
    reference_path,
    refresh_logs,
)
from curation.engine.weights import Weights
from curation.engine.workers import ScoringWorker, WorkerSpec

__all__ = ["init_ray", "gpu_shares", "RayEngine"]


def init_ray(address: str | None = None, *, num_cpus: int | None = None, include_dashboard: bool = False,
             need_cpus: int = 1) -> bool:
    """Connect to (or start) Ray; returns whether a new local instance was started.

    ``address=None`` joins the cluster a ``ray job submit`` runs in (``RAY_ADDRESS``; the job's
    ``--working-dir`` carries the code) and otherwise starts a local instance with
    ``max(os.cpu_count(), need_cpus)`` CPUs (or ``num_cpus``) whose workers import this checkout;
    ``"local"`` always starts one; anything else is a cluster address (its nodes need the packages).
    """
    if ray.is_initialized():
        return False
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = "auto"
    if address in (None, "local"):
        # The actors import this checkout's packages, whatever else is installed (like the jobs do).
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", num_cpus=num_cpus or max(os.cpu_count() or 1, need_cpus),
                 include_dashboard=include_dashboard, log_to_driver=True, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        return True
    ray.init(address=address, log_to_driver=True, configure_logging=False)
    return False


def gpu_shares(workers: int, *, refresh: bool, per_worker: float | None = None, device: str = "auto") -> tuple[float, float]:
    """GPUs requested per worker and by the refresh actor.

    One GPU each when the cluster has enough, else an equal fractional share (e.g. one GPU shared by two
    workers and the refresh: 1/3 each), none without GPUs or with ``device=cpu``.
    """
    if device == "cpu":
        return 0.0, 0.0
    total = float(ray.cluster_resources().get("GPU", 0.0))
    if device == "cuda" and total == 0:
        raise ValueError("workers.device=cuda but the Ray cluster has no GPU")
    slots = workers + int(refresh)
    if per_worker is not None:
        left = max(0.0, total - per_worker * workers)
        return per_worker, (min(1.0, left) if refresh else 0.0)
    if total == 0:
        return 0.0, 0.0
    share = 1.0 if total >= slots else total / slots
    return share, (share if refresh else 0.0)


def _message(err: BaseException) -> str:
    """The original error's message out of Ray's wrappers."""
    cause = getattr(err, "cause", None)
    if isinstance(err, RayTaskError) and cause is not None:
        return _message(cause)
    return str(err)


@ray.remote(num_cpus=0)
def _load_weights(path: str) -> Weights:
    return Weights.load(path)


# ------------------------------------------------------------------------------------------------
# actors
# ------------------------------------------------------------------------------------------------
class _CoordinatorActor:
    """See the module docstring. Async: waiting calls (``next_unit``, ``wait_part``) do not block others."""

    def __init__(self, *, units: list[dict[str, Any]], lookahead: int | None, ledger: dict[str, Any],
                 engine_dir: str, plan: dict[str, Any] | None, policy_mode: str, refresh: Any = None) -> None:
        self.ledger = PartLedger(**ledger)
        unit_objs = [WorkUnit.from_dict(u) for u in units]
        done = set(self.ledger.done_units())
        self.core = Coordinator(unit_objs, done=done, lookahead=lookahead)
        self.engine_dir = engine_dir
        os.makedirs(engine_dir, exist_ok=True)
        self.plan = None
        if plan is not None:
            self.plan = TrainingPlan(Schedule.from_dict(plan["schedule"]), plan["mode"], plan["refreshes"],
                                     plan["snapshot_period"], plan["overlap_steps"])
        self.policy_mode = policy_mode  # "sync" | "continue" | "static" | "fixed"
        self.refresh_actor = refresh
        self.refs: dict[tuple[str, int], Any] = {}
        self.refreshing: dict[int, int] = {}  # version → source step
        self.refresh_log: list[dict[str, Any]] = []
        self.stats = {"tokens": 0, "kept_tokens": 0, "parts": 0, "seconds": 0.0, "sources": {}}
        self.started = time.time()
        self._event: asyncio.Event | None = None
        self._tasks: set[Any] = set()
        self._interrupted: list[int] = []
        self._resume_from_disk()

    # --- registry ------------------------------------------------------------------------------
    def _resume_from_disk(self) -> None:
        for path in sorted(glob.glob(os.path.join(self.engine_dir, "reference-*.safetensors"))):
            if m := re.search(r"reference-(\d+)\.safetensors$", path):
                self.core.publish(REFERENCE, int(m.group(1)))
        if self.plan is None:
            return
        sources = self.plan.refresh_sources()
        for path in sorted(glob.glob(os.path.join(self.engine_dir, "proxy-*.safetensors"))):
            if m := re.search(r"proxy-(\d+)\.safetensors$", path):  # not the .recent.safetensors files
                step = int(m.group(1))
                self.core.publish(PROXY, step)
                self.refs[(PROXY, step)] = _load_weights.remote(path)
        # A refresh whose source snapshot is on disk but whose reference is not was interrupted: `start`
        # runs it again.
        self._interrupted = [v for s, v in sorted(sources.items())
                             if (REFERENCE, v) not in self.core.published and (PROXY, s) in self.core.published]

    def _recent_path(self, step: int) -> str:
        return proxy_path(self.engine_dir, step).replace(".safetensors", ".recent.safetensors")

    def _ref(self, key: tuple[str, int]) -> Any:
        ref = self.refs.get(key)
        if ref is None:
            kind, version = key
            path = reference_path(self.engine_dir, version) if kind == REFERENCE else proxy_path(self.engine_dir, version)
            if not os.path.exists(path):
                raise EngineError(f"weights {kind} {version} are registered but {path} is missing")
            ref = self.refs[key] = _load_weights.remote(path)
        return ref

    def _start_refresh(self, version: int, recent: RecentMasks) -> None:
        assert self.plan is not None and self.refresh_actor is not None
        source = self.plan.refresh_source(version)
        previous = None
        if self.policy_mode == "continue" and version > 0:
            if (REFERENCE, version - 1) not in self.core.published:
                raise EngineError(f"refresh {version} (blade-nosync) needs reference {version - 1}, which is missing")
            previous = self._ref((REFERENCE, version - 1))
        weights, log = self.refresh_actor.refresh.options(num_returns=2).remote(
            version, self._ref((PROXY, source)), recent, source_step=source, previous=previous)
        self.refs[(REFERENCE, version)] = weights
        self.refreshing[version] = source
        self.core.publish(REFERENCE, version)
        self._spawn(self._await_refresh(version, log))

    def _start_static(self) -> None:
        weights, log = self.refresh_actor.static.options(num_returns=2).remote()
        self.refs[(REFERENCE, 0)] = weights
        self.refreshing[0] = 0
        self.core.publish(REFERENCE, 0)
        self._spawn(self._await_refresh(0, log))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_event_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await_refresh(self, version: int, log_ref: Any) -> None:
        try:
            log = await log_ref
            self.refresh_log.append(log)
        except Exception as e:  # the refresh raised: stop everything with its message
            self.core.fail(f"refresh of reference {version} failed: {_message(e)}")
        self.refreshing.pop(version, None)
        self._gc()
        self._notify()

    def _gc(self) -> None:
        """Drop proxy snapshots nothing needs any more (registry and disk); references stay on disk."""
        needed = self.core.needed() | {(PROXY, s) for s in self.refreshing.values()}
        if self.plan is not None:  # refreshes not started yet need their source snapshot
            for step, version in self.plan.refresh_sources().items():
                if (REFERENCE, version) not in self.core.published:
                    needed.add((PROXY, step))
        latest_ref = max((v for k, v in self.core.published if k == REFERENCE), default=None)
        for key in list(self.refs):
            kind, version = key
            if key in needed or (kind == REFERENCE and version == latest_ref):
                continue
            del self.refs[key]
            if kind == PROXY:
                self.core.retract(PROXY, version)
                for path in (proxy_path(self.engine_dir, version), self._recent_path(version)):
                    if os.path.exists(path):
                        os.remove(path)

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

    # --- workers ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start what needs no trainer: RHO-1's static reference, refreshes interrupted by a kill."""
        if self.policy_mode == "static" and (REFERENCE, 0) not in self.core.published:
            self._start_static()
        assert self.plan is not None or not self._interrupted
        for version in self._interrupted:
            path = self._recent_path(self.plan.refresh_source(version))
            self._start_refresh(version, RecentMasks.load(path) if os.path.exists(path) else RecentMasks())
        self._interrupted = []
        self._gc()
        self._notify()

    async def next_unit(self, worker: int) -> dict[str, Any] | None:
        while True:
            status, unit = self.core.next_unit(worker)
            if status == "stop":
                return None
            if status == "work":
                assert unit is not None
                return {"unit": unit.to_dict(), "weights": {f"{k}:{v}": [self._ref((k, v))] for k, v in unit.needs()}}
            await self._wait_change(5.0)

    def complete(self, worker: int, result: PartResult) -> None:
        self.core.complete(worker, result.unit)
        self.ledger.record(result)
        self.stats["tokens"] += result.tokens
        self.stats["kept_tokens"] += result.kept_tokens
        self.stats["parts"] += 1
        self.stats["seconds"] += result.seconds
        for src, c in result.sources.items():
            s = self.stats["sources"].setdefault(src, {"sequences": 0, "tokens": 0, "kept_tokens": 0})
            for k, v in c.items():
                s[k] += v
        self._gc()
        self._notify()

    def fail(self, worker: int, unit: str, message: str) -> None:
        self.core.fail(message)
        self._notify()

    # --- trainer ---------------------------------------------------------------------------------
    def trainer_at(self, step: int) -> None:
        self.core.trainer_at(step)
        self._notify()

    def publish_proxy(self, step: int, ref: list[Any], recent: RecentMasks | None = None) -> bool:
        """Register ``u^(step)`` (``ref`` is ``[ObjectRef]``); start the refresh it is the source of."""
        key = (PROXY, int(step))
        if key in self.core.published:
            return False
        self.refs[key] = ref[0]
        self.core.publish(PROXY, step)
        if self.plan is not None:
            version = self.plan.refresh_sources().get(int(step))
            if version is not None and (REFERENCE, version) not in self.core.published:
                self._start_refresh(version, recent or RecentMasks())
        self._gc()
        self._notify()
        return True

    def publish_weights(self, kind: str, version: int, ref: list[Any]) -> None:
        """Register given weights (batch curation: the checkpoints); ``ref`` is ``[ObjectRef]``."""
        self.refs[(kind, int(version))] = ref[0]
        self.core.publish(kind, version)
        self._notify()

    async def wait_part(self, step: int, timeout: float) -> dict[str, Any] | None:
        """The finished part holding ``step`` (``None`` after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.core.failed is not None:
                raise EngineError(self.core.failed)
            unit = self.core.unit_for(step)
            if unit is None:
                raise EngineError(f"no work unit covers step {step}")
            if unit.name in self.core.done:
                rec = self.ledger.done_units()[unit.name]
                return {"part": rec.name, "first": unit.first, "stop": unit.stop, "ref_version": unit.ref_version}
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self._wait_change(left)

    def unfinishable(self) -> list[str]:
        """Units left to do whose weights are not published and not being refreshed: once the trainer is done,
        nothing will publish them (a damaged part whose proxy snapshot was already dropped)."""
        coming = {(REFERENCE, v) for v in self.refreshing}
        return [u.name for u in self.core.pending()
                if any(k not in self.core.published and k not in coming for k in u.needs())]

    async def wait_finished(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.core.finished():
            if self.core.failed is not None:
                raise EngineError(self.core.failed)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self._wait_change(left)
        return True

    async def weights(self, kind: str, version: int, timeout: float) -> list[Any] | None:
        deadline = time.monotonic() + timeout
        while (kind, version) not in self.core.published:
            if self.core.failed is not None:
                raise EngineError(self.core.failed)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self._wait_change(left)
        return [self._ref((kind, version))]

    # --- reporting -------------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        return {**self.core.progress(), "tokens": self.stats["tokens"], "kept_tokens": self.stats["kept_tokens"],
                "refreshing": sorted(self.refreshing), "references": sorted(v for k, v in self.core.published
                                                                             if k == REFERENCE)}

    def report(self) -> dict[str, Any]:
        return {"progress": self.progress(), "stats": self.stats, "refreshes": refresh_logs(self.engine_dir),
                "seconds": time.time() - self.started}

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        if not self.core.finished():
            raise EngineError(f"finish() with {len(self.core.units) - len(self.core.done)} units not done")
        self.ledger.finish(extra)

    def stop(self) -> None:
        self.core.stop()
        self._notify()


class _WorkerActor:
    """A :class:`~curation.engine.workers.ScoringWorker` serving units from the coordinator."""

    def __init__(self, spec: WorkerSpec, worker_id: int) -> None:
        self.worker = ScoringWorker(spec, worker_id)
        with warnings.catch_warnings():  # the property reads a deprecated attribute internally
            warnings.simplefilter("ignore")
            self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)

    def pid(self) -> int:
        return os.getpid()

    def serve(self, coordinator: Any) -> dict[str, Any]:
        wid = self.worker.worker_id
        while True:
            job = ray.get(coordinator.next_unit.remote(wid))
            if job is None:
                return {**self.worker.stats, "restarted": self.restarted}
            unit = WorkUnit.from_dict(job["unit"])
            refs = job["weights"]
            try:
                result = self.worker.run(unit, lambda kind, version, refs=refs: ray.get(refs[f"{kind}:{version}"][0]))
            except Exception as e:
                message = str(e) if isinstance(e, ScoringDataError) else f"{type(e).__name__}: {_message(e)}"
                ray.get(coordinator.fail.remote(wid, unit.name, f"worker {wid}, unit {unit.name}: {message}"))
                raise
            ray.get(coordinator.complete.remote(wid, result))


class _RefreshActor:
    """A :class:`~curation.engine.refresh_runner.RefreshRunner`; each result is returned into the object store."""

    def __init__(self, spec: RefreshSpec) -> None:
        self.runner = RefreshRunner(spec)

    def refresh(self, version: int, proxy: Weights, recent: RecentMasks, *, source_step: int,
                previous: Weights | None = None) -> tuple[Weights, dict[str, Any]]:
        return self.runner.refresh(version, proxy, recent, source_step=source_step, previous=previous)

    def static(self) -> tuple[Weights, dict[str, Any]]:
        return self.runner.static()


# ------------------------------------------------------------------------------------------------
# driver side
# ------------------------------------------------------------------------------------------------
class RayEngine:
    """Driver handle: starts the actors, waits for parts, publishes proxy snapshots, reports.

    Args:
        units: the work units.
        worker_spec: settings of every scoring worker.
        workers: number of workers.
        threads: torch threads (and Ray CPUs) per worker.
        ledger: keyword arguments of the output directory's :class:`~curation.engine.ledger.PartLedger`.
        engine_dir: where weights versions are kept.
        lookahead: back-pressure bound (``None``: no trainer).
        plan: the training plan (refresh sources, snapshot steps); ``None`` for batch curation.
        policy_mode: ``sync`` (blade), ``continue`` (blade-nosync), ``static`` (rho1) or ``fixed`` (given weights).
        refresh_spec: settings of the refresh actor (``None``: no refresh).
        max_restarts: restarts of a crashed worker (and retries of its ``serve`` call).
        device: workers' device setting (``cpu`` requests no GPU).
        gpus: GPUs per worker (``None``: :func:`gpu_shares`).
        refresh_threads: torch threads of the refresh actor.
        fixed_weights: ``{(kind, version): Weights}`` put in the object store once (batch curation).
    """

    def __init__(
        self, *, units: Sequence[WorkUnit], worker_spec: WorkerSpec, workers: int, threads: int,
        ledger: dict[str, Any], engine_dir: str, lookahead: int | None = None, plan: TrainingPlan | None = None,
        policy_mode: str = "fixed", refresh_spec: RefreshSpec | None = None, max_restarts: int = 3,
        device: str = "auto", gpus: float | None = None, fixed_weights: dict[tuple[str, int], Weights] | None = None,
    ) -> None:
        self.engine_dir = engine_dir
        self.out_dir = ledger["out_dir"]
        self.plan = plan
        self.wait_seconds = 0.0
        self.waits: list[tuple[int, float]] = []  # (step, seconds) of the trainer's waits ≥ 50 ms
        gpu_w, gpu_r = gpu_shares(workers, refresh=refresh_spec is not None, per_worker=gpus, device=device)
        self.gpus = {"per_worker": gpu_w, "refresh": gpu_r}
        refresh = None
        if refresh_spec is not None:
            refresh = ray.remote(_RefreshActor).options(
                num_cpus=0, num_gpus=gpu_r, max_restarts=max_restarts, max_task_retries=max_restarts,
            ).remote(refresh_spec)
        self.refresh = refresh
        self.coordinator = ray.remote(_CoordinatorActor).options(num_cpus=0, max_concurrency=1000).remote(
            units=[u.to_dict() for u in units], lookahead=lookahead, ledger=ledger, engine_dir=engine_dir,
            plan=plan.to_dict() if plan is not None else None, policy_mode=policy_mode, refresh=refresh,
        )
        # Every actor is created before waiting on any: they start (import torch, load models) in parallel.
        self.workers = [
            ray.remote(_WorkerActor).options(
                num_cpus=threads, num_gpus=gpu_w, max_restarts=max_restarts, max_task_retries=max_restarts,
            ).remote(worker_spec, i)
            for i in range(workers)
        ]
        self._pid_refs = [w.pid.remote() for w in self.workers]  # answered once each actor is up
        self.serving = {w.serve.remote(self.coordinator): i for i, w in enumerate(self.workers)}
        self.worker_results: dict[int, dict[str, Any]] = {}
        self._get(self.coordinator.start.remote())
        self._fixed: list[Any] = []
        for (kind, version), w in (fixed_weights or {}).items():
            self.publish_weights(kind, version, w)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers as first started (waits until they are up)."""
        return self._get(self._pid_refs)

    # --- errors --------------------------------------------------------------------------------
    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except RayTaskError as e:
            raise EngineError(_message(e)) from None
        except RayActorError as e:  # e.g. the coordinator failed to start: its error is in the message
            raise EngineError(str(e)) from None

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
                raise EngineError(f"scoring worker {wid} died and was not restarted: {_message(e)}") from None
            except RayTaskError as e:
                raise EngineError(_message(e)) from None

    # --- trainer API ---------------------------------------------------------------------------
    def wait_part(self, step: int, *, timeout_s: float = 1800.0) -> dict[str, Any]:
        """Block until the part holding ``step`` is recorded; returns ``{part, first, stop, ref_version}``."""
        start = time.monotonic()
        while True:
            info = self._get(self.coordinator.wait_part.remote(step, 2.0))
            if info is not None:
                waited = time.monotonic() - start
                self.wait_seconds += waited
                if waited >= 0.05:
                    self.waits.append((int(step), round(waited, 3)))
                return info
            self.check()
            if time.monotonic() - start > timeout_s:
                raise EngineError(f"no scores for step {step} after {timeout_s:.0f}s: {self.progress()}")

    def publish_weights(self, kind: str, version: int, weights: Weights) -> None:
        """Put given weights (e.g. a checkpoint) in the object store once and register them."""
        ref = ray.put(weights)
        self._fixed.append(ref)
        self._get(self.coordinator.publish_weights.remote(kind, int(version), [ref]))

    def trainer_at(self, step: int) -> None:
        self.coordinator.trainer_at.remote(int(step))

    def publish_proxy(self, step: int, model: nn.Module, recent: RecentMasks | None = None) -> None:
        """Save ``u^(step)`` (and the recent masks) under ``engine_dir``, put it in the object store once, register it."""
        weights = Weights.from_state_dict(model)
        path = proxy_path(self.engine_dir, step)
        weights.save(path)
        if recent is not None and recent.steps:
            recent.save(path.replace(".safetensors", ".recent.safetensors"))
        self._get(self.coordinator.publish_proxy.remote(int(step), [ray.put(weights)], recent))

    def reference(self, version: int, *, timeout_s: float = 1800.0) -> Weights:
        ref = self._get(self.coordinator.weights.remote(REFERENCE, int(version), timeout_s))
        if ref is None:
            raise EngineError(f"reference {version} not available after {timeout_s:.0f}s")
        return self._get(ref[0])

    # --- batch API -----------------------------------------------------------------------------
    def run(self, *, progress: bool = True, desc: str = "curate") -> None:
        """Block until every unit is done (batch curation), with a progress bar."""
        from tqdm import tqdm

        total = self.progress()["units_total"]
        with tqdm(total=total, desc=desc, unit="part", disable=not progress) as bar:
            while True:
                finished = self._get(self.coordinator.wait_finished.remote(1.0))
                p = self.progress()
                bar.n = p["units_done"]
                bar.set_postfix(tokens=p["tokens"], kept=p["kept_tokens"], redone=p["redone"])
                bar.refresh()
                if finished:
                    return
                self.check()

    def finish_units(self) -> None:
        """After the trainer: wait for the units still to do (parts redone after damage was found on opening).

        Raises:
            EngineError: a unit can no longer be done (its weights are gone), naming its part.
        """
        stuck = self._get(self.coordinator.unfinishable.remote())
        if stuck:
            raise EngineError(
                f"parts {', '.join(stuck[:3])} of {self.out_dir} were damaged and cannot be redone: the proxy "
                "snapshots they were scored with are gone (the trainer is past them); use a new output directory"
            )
        p = self.progress()
        if p["units_done"] < p["units_total"]:
            self.run(progress=False, desc="redo")

    # --- reporting / shutdown ------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        return self._get(self.coordinator.progress.remote())

    def report(self) -> dict[str, Any]:
        rep = self._get(self.coordinator.report.remote())
        rep["trainer_wait_seconds"] = self.wait_seconds
        rep["trainer_waits"] = [{"step": t, "seconds": w} for t, w in self.waits]
        rep["gpus"] = self.gpus
        rep["workers"] = self.worker_results
        return rep

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        self._get(self.coordinator.finish.remote(extra))

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
