"""The coordinator's decisions beyond unit assignment (docs/DESIGN.md §3), Ray-free.

:class:`EngineState` is everything the Ray coordinator actor decides; the actor only forwards calls to
it, awaits, and launches refresh tasks. It runs in-process in tests.

* **Weights registry**: which ``(kind, version)`` are published (the :class:`~curation.engine.coordinator.Coordinator`
  knows) and a *handle* for each (an ``ObjectRef`` on Ray, anything in-process), loaded from
  ``engine_dir`` when asked for and not held.
* **Resume from disk**: the references (``reference-0003.safetensors``) and proxy snapshots
  (``proxy-000000010.safetensors``) a killed run left are published again; a refresh whose source snapshot
  is on disk but whose reference is not, or whose reference's log (``reference-0003.json``, written after the
  weights) is not, was interrupted, and :meth:`EngineState.start` runs it again with the recent masks saved
  next to the snapshot.
* **Refresh triggering**, from the policy's :class:`~curation.core.policies.RefreshMode`: ``STATIC`` starts
  the static reference (version 0) once; ``SYNC`` and ``CONTINUE`` start refresh ``e`` when its source
  snapshot ``u^(W + eτ − δ)`` is published (``CONTINUE`` also hands over reference ``e − 1``); ``NONE``
  (given weights) never starts one.
* **Snapshot retention** (:meth:`EngineState.prune`): a proxy snapshot is dropped (registry and disk) once
  no unit left to do, no running refresh and no refresh still to start needs it; references stay on disk.
* **Run statistics** (:class:`~curation.engine.report.RunStats`), the output ledger, progress and report (typed:
  :mod:`curation.engine.report`).

The coordinator's unit assignment (:class:`~curation.engine.coordinator.Coordinator`) is reached through this class
only: the actor calls :meth:`EngineState.next_unit`, :meth:`EngineState.worker_started`, ... here.
"""

from __future__ import annotations

import copy
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from curation.core.policies import RefreshMode
from curation.core.refresh_data import RecentMasks
from curation.engine.coordinator import Coordinator
from curation.engine.ledger import PartLedger, PartResult
from curation.engine.plan import PROXY, REFERENCE, EngineError, TrainingPlan, WorkUnit
from curation.engine.refresh_runner import proxy_path, reference_log_path, reference_path, refresh_logs
from curation.engine.report import EngineProgress, EngineReport, PartInfo, RunStats
from curation.engine.weights import Weights
from curation.io import storage
from curation.io.paths import safe_join
from curation.io.recent import load_recent, save_recent

__all__ = ["EngineState", "RefreshTask", "gpu_shares", "recent_path", "save_snapshot", "weights_on_disk"]

#: A handle of published weights: an ``ObjectRef`` on Ray; whatever the caller's ``load`` and ``launch`` give in-process.
H = TypeVar("H")

#: The refresh modes whose reference is refreshed every τ steps from a published proxy snapshot.
_REFRESHED = (RefreshMode.SYNC, RefreshMode.CONTINUE)
#: Weights files of ``engine_dir`` (the names :func:`proxy_path` / :func:`reference_path` write); the
#: ``proxy-*.recent.safetensors`` masks and ``reference-*.json`` logs do not match.
_FILE = {REFERENCE: re.compile(r"reference-(\d+)\.safetensors"), PROXY: re.compile(r"proxy-(\d+)\.safetensors")}


def recent_path(engine_dir: str, step: int) -> str:
    """The recent masks saved next to the proxy snapshot ``u^(step)`` (inputs of the refresh it starts)."""
    return proxy_path(engine_dir, step).replace(".safetensors", ".recent.safetensors")


def save_snapshot(engine_dir: str, step: int, weights: Weights, recent: RecentMasks | None = None) -> None:
    """Save ``u^(step)`` (and the recent masks, if any) before it is published, so a resumed run finds them."""
    weights.save(proxy_path(engine_dir, step))
    if recent is not None and recent.steps:
        save_recent(recent, recent_path(engine_dir, step))
        storage.publish(recent_path(engine_dir, step))  # (a coordinator elsewhere resumes an interrupted refresh)
    storage.publish(proxy_path(engine_dir, step))  # an object-store output directory: before it is published


def weights_on_disk(engine_dir: str, kind: str) -> dict[int, str]:
    """version → path of the ``kind`` weights saved under ``engine_dir``, in version order."""
    found = {}
    for name in os.listdir(engine_dir):
        if m := _FILE[kind].fullmatch(name):  # a name this code writes; resolved, it must stay in engine_dir
            found[int(m.group(1))] = safe_join(engine_dir, name, what=f"{kind} weights", source_file=engine_dir)
    return dict(sorted(found.items()))


def gpu_shares(total: float, workers: int, *, refresh: bool, per_worker: float | None = None,
               device: str = "auto", reserved: float = 0.0) -> tuple[float, float]:
    """GPUs requested per worker and by the refresh actor, on a cluster with ``total`` GPUs of which
    ``reserved`` are held for something else (the data-parallel trainer group's workers).

    One GPU each when the cluster has enough, else an equal fractional share of what is not reserved (e.g.
    one GPU shared by two workers and the refresh: 1/3 each), none without GPUs or with ``device=cpu``;
    ``per_worker`` given: that, and what is left (at most one) for the refresh.

    Raises:
        ValueError: ``device=cuda`` on a cluster without GPUs (or with all of them reserved); ``per_worker``
            GPUs that do not fit next to the reserved ones.
    """
    if device == "cpu":
        return 0.0, 0.0
    free = max(0.0, total - reserved)
    beside = f" beside the trainer's {reserved:g}" if reserved else ""
    if device == "cuda" and free == 0:
        raise ValueError("workers.device=cuda but the Ray cluster has no GPU" + (f" left{beside}" if beside else ""))
    if per_worker is not None:
        if per_worker * workers > free:
            raise ValueError(f"workers.gpus={per_worker:g} × {workers} scoring workers do not fit the Ray cluster's "
                             f"{total:g} GPUs{beside}: lower workers.gpus or workers.count, or add GPUs")
        left = free - per_worker * workers
        return per_worker, (min(1.0, left) if refresh else 0.0)
    if free == 0:
        return 0.0, 0.0
    slots = workers + int(refresh)
    share = 1.0 if free >= slots else free / slots
    return share, (share if refresh else 0.0)


@dataclass(frozen=True)
class RefreshTask(Generic[H]):
    """A reference version to compute: the static reference, or a refresh from the snapshot ``u^(source_step)``.

    Attributes:
        version: reference version (episode).
        source_step: step of the proxy snapshot it starts from (0 for the static reference).
        static: RHO-1's static reference (``proxy``, ``recent`` and ``previous`` unused).
        proxy: handle of the source snapshot.
        recent: the recent masks (``L_train`` of the refresh).
        previous: handle of reference ``version − 1`` (``CONTINUE`` only).
    """

    version: int
    source_step: int = 0
    static: bool = False
    proxy: H | None = None
    recent: RecentMasks | None = None
    previous: H | None = None


class EngineState(Generic[H]):
    """The coordinator's state and decisions (see the module docstring).

    Args:
        units: all work units of the run.
        ledger: the output directory's ledger (its finished units are not redone).
        engine_dir: where weights versions are kept.
        lookahead: back-pressure bound (``None``: no trainer).
        plan: the training plan (``None``: batch curation with given weights).
        refresh_mode: the policy's refresh mode (``NONE``: given weights).
        load: ``path → handle`` of a weights file.
        launch: starts a :class:`RefreshTask`, returns the handle of the reference it will produce; the
            caller reports its end with :meth:`refresh_done`.
    """

    def __init__(self, units: Iterable[WorkUnit], *, ledger: PartLedger, engine_dir: str, lookahead: int | None = None,
                 plan: TrainingPlan | None = None, refresh_mode: RefreshMode = RefreshMode.NONE,
                 load: Callable[[str], H], launch: Callable[[RefreshTask[H]], H] | None = None) -> None:
        self.ledger = ledger
        units = list(units)
        ledger.keep_units({u.name for u in units})  # (an extended run: a part cut short by the old max_steps)
        self.core = Coordinator(units, done=set(ledger.done_units()), lookahead=lookahead)
        self.engine_dir = engine_dir
        os.makedirs(engine_dir, exist_ok=True)
        storage.pull(engine_dir)  # an object-store directory, on whatever node this runs: its cache = the bucket
        self.plan = plan
        self.refresh_mode = RefreshMode(refresh_mode)
        if plan is not None and plan.refreshes != (self.refresh_mode in _REFRESHED):
            raise ValueError(f"refresh mode {self.refresh_mode.value!r} does not match a plan with "
                             f"refreshes={plan.refreshes}")
        self._load = load
        self._launch = launch
        self.handles: dict[tuple[str, int], H] = {}
        self.refreshing: dict[int, int] = {}  # version → source step
        self.stats = RunStats()
        self.started = time.time()
        self._interrupted = self._resume_from_disk()

    # --- registry ------------------------------------------------------------------------------
    def _resume_from_disk(self) -> list[int]:
        """Publish the weights a killed run left on disk; returns the refreshes it interrupted (a reference whose
        log is missing among them: the run was killed between the two, and the summary would lack its refresh)."""
        for version in weights_on_disk(self.engine_dir, REFERENCE):
            if os.path.exists(reference_log_path(self.engine_dir, version)):
                self.core.publish(REFERENCE, version)
        if self.plan is None:
            return []
        for step, path in weights_on_disk(self.engine_dir, PROXY).items():
            self.core.publish(PROXY, step)
            self.handles[(PROXY, step)] = self._load(path)
        published = self.core.published
        return [v for s, v in sorted(self.plan.refresh_sources().items())
                if (REFERENCE, v) not in published and (PROXY, s) in published]

    def published(self, kind: str, version: int) -> bool:
        return (kind, int(version)) in self.core.published

    def handle(self, kind: str, version: int) -> H:
        """The handle of published weights, loaded from ``engine_dir`` when not held.

        Raises:
            EngineError: the file is missing.
        """
        key = (kind, int(version))
        h = self.handles.get(key)
        if h is None:
            path = reference_path(self.engine_dir, version) if kind == REFERENCE else proxy_path(self.engine_dir, version)
            if not storage.fetch(path):  # (an object-store run: written by a process of another node, maybe)
                raise EngineError(f"weights {kind} {version} are registered but {path} is missing")
            h = self.handles[key] = self._load(path)
        return h

    def publish_weights(self, kind: str, version: int, handle: H) -> None:
        """Register given weights (batch curation: the checkpoints)."""
        self.handles[(kind, int(version))] = handle
        self.core.publish(kind, version)

    def publish_proxy(self, step: int, handle: H, recent: RecentMasks | None = None) -> bool:
        """Register ``u^(step)`` and start the refresh it is the source of; ``False``: already registered."""
        key = (PROXY, int(step))
        if key in self.core.published:
            return False
        self.handles[key] = handle
        self.core.publish(PROXY, step)
        if self.plan is not None and self.refresh_mode in _REFRESHED:
            version = self.plan.refresh_sources().get(int(step))
            if version is not None and not self.published(REFERENCE, version):
                self._start_refresh(version, recent or RecentMasks())
        self.prune()
        return True

    # --- refreshes -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start what needs no trainer: the static reference (``STATIC``), refreshes interrupted by a kill."""
        if self.refresh_mode is RefreshMode.STATIC and not self.published(REFERENCE, 0):
            self._launch_task(RefreshTask(0, static=True))
        for version in self._interrupted:
            assert self.plan is not None
            recent = load_recent(recent_path(self.engine_dir, self.plan.refresh_source(version)), missing_ok=True)
            self._start_refresh(version, recent)
        self._interrupted = []
        self.prune()

    def _start_refresh(self, version: int, recent: RecentMasks) -> None:
        assert self.plan is not None
        source = self.plan.refresh_source(version)
        previous = None
        if self.refresh_mode is RefreshMode.CONTINUE and version > 0:
            if not self.published(REFERENCE, version - 1):
                raise EngineError(f"refresh {version} (blade-nosync) needs reference {version - 1}, which is missing")
            previous = self.handle(REFERENCE, version - 1)
        self._launch_task(RefreshTask(version, source, proxy=self.handle(PROXY, source), recent=recent,
                                      previous=previous))

    def _launch_task(self, task: RefreshTask[H]) -> None:
        assert self._launch is not None, "a refresh is due but the engine has no refresh actor"
        self.handles[(REFERENCE, task.version)] = self._launch(task)
        self.refreshing[task.version] = task.source_step
        self.core.publish(REFERENCE, task.version)

    def refresh_done(self, version: int, error: str | None = None, shards: Sequence[str] = ()) -> None:
        """A launched refresh ended (``error``: its message; the engine then fails with it, blaming ``shards``: the
        input shard files of bad data it met)."""
        if error is not None:
            self.core.fail(f"refresh of reference {version} failed: {error}", shards)
        self.refreshing.pop(version, None)
        self.prune()

    def prune(self) -> list[int]:
        """Drop the proxy snapshots nothing needs any more (registry and disk) and the handles of references
        other than the latest that no unit needs (their files stay); returns the dropped snapshot steps."""
        needed = self.core.needed() | {(PROXY, s) for s in self.refreshing.values()}
        if self.plan is not None:  # refreshes not started yet need their source snapshot
            for step, version in self.plan.refresh_sources().items():
                if not self.published(REFERENCE, version):
                    needed.add((PROXY, step))
        latest_ref = max((v for k, v in self.core.published if k == REFERENCE), default=None)
        dropped = []
        for key in list(self.handles):
            kind, version = key
            if key in needed or (kind == REFERENCE and version == latest_ref):
                continue
            del self.handles[key]
            if kind == PROXY:
                self.core.retract(PROXY, version)
                dropped.append(version)
                for path in (proxy_path(self.engine_dir, version), recent_path(self.engine_dir, version)):
                    storage.remove(path)  # (an object-store run: the bucket's too, written on whichever node)
        return dropped

    # --- workers and trainer -------------------------------------------------------------------
    def complete(self, worker: int, result: PartResult) -> None:
        """A worker wrote its unit's part: record it and count it (not the late report of a unit being redone)."""
        if self.core.complete(worker, result.unit) is None:
            return
        self.ledger.record(result)
        self.stats.add(result)
        self.prune()

    def part_info(self, step: int) -> PartInfo | None:
        """The finished part holding ``step``, ``None`` while not finished.

        Raises:
            EngineError: the engine failed, or no unit covers ``step``.
        """
        if self.core.failed is not None:
            raise self.core.error()
        unit = self.core.unit_for(step)
        if unit is None:
            raise EngineError(f"no work unit covers step {step}")
        if unit.name not in self.core.done:
            return None
        rec = self.ledger.done_units()[unit.name]
        return PartInfo(rec.name, unit.first, unit.stop, unit.ref_version)

    def unfinishable(self) -> list[str]:
        """Units left to do whose weights are not published and not being refreshed: once the trainer is done,
        nothing will publish them (a damaged part whose proxy snapshot was already dropped)."""
        coming = {(REFERENCE, v) for v in self.refreshing}
        return [u.name for u in self.core.pending()
                if any(k not in self.core.published and k not in coming for k in u.needs())]

    def check_finishable(self) -> None:
        """After the trainer: raise :class:`EngineError` naming the :meth:`unfinishable` parts, if any."""
        stuck = self.unfinishable()
        if stuck:
            raise EngineError(
                f"parts {', '.join(stuck[:3])} of {self.ledger.out_dir} were damaged and cannot be redone: the proxy "
                "snapshots they were scored with are gone (the trainer is past them); use a new output directory"
            )

    def finish(self, extra: Mapping[str, object] | None = None) -> None:
        """Every unit is done: the ledger's manifest is marked complete (``extra``: more manifest fields).

        Raises:
            EngineError: units are left.
        """
        if not self.core.finished():
            raise EngineError(f"finish() with {len(self.core.units) - len(self.core.done)} units not done")
        self.ledger.finish(extra)

    # --- the coordinator's unit assignment ---------------------------------------------------------
    @property
    def failed(self) -> str | None:
        """The engine's error (the first one), ``None`` while it runs."""
        return self.core.failed

    def next_unit(self, worker: int) -> tuple[str, WorkUnit | None]:
        """``("work", unit)``, ``("wait", None)`` or ``("stop", None)``: :meth:`Coordinator.next_unit`."""
        return self.core.next_unit(worker)

    def worker_started(self, worker: int) -> None:
        """``worker`` (re)started: the units it held go back to pending (:meth:`Coordinator.worker_started`)."""
        self.core.worker_started(worker)

    def trainer_at(self, step: int) -> None:
        """The trainer is about to take ``step`` (back-pressure)."""
        self.core.trainer_at(step)

    def fail(self, message: str, shards: Sequence[str] = ()) -> None:
        """The engine failed (a worker met bad data, a refresh failed): every worker stops, every wait raises;
        ``shards``: the input shard files whose data it blames (:mod:`curation.io.bad_shards`)."""
        self.core.fail(message, shards)

    def error(self) -> EngineError:
        """The failure as the error every caller of the engine raises (blaming its shard files)."""
        return self.core.error()

    def stop(self) -> None:
        """Hand out no more units (the driver ends the engine)."""
        self.core.stop()

    def finished(self) -> bool:
        """Every unit is done."""
        return self.core.finished()

    # --- reporting -----------------------------------------------------------------------------
    def progress(self) -> EngineProgress:
        c = self.core
        return EngineProgress(
            units_done=len(c.done), units_total=len(c.units), trainer_step=c.trainer_step, redone=c.redone,
            failed=c.failed, tokens=self.stats.tokens, kept_tokens=self.stats.kept_tokens,
            working={w: tuple(names) for w, names in c.held.items()}, refreshing=tuple(sorted(self.refreshing)),
            references=tuple(sorted(v for k, v in c.published if k == REFERENCE)))

    def report(self) -> EngineReport:
        """The engine's side of the report (the driver adds its settings: :meth:`RayEngine.report`); its statistics
        are a copy, which later parts do not change."""
        return EngineReport(progress=self.progress(), stats=copy.deepcopy(self.stats),
                            refreshes=tuple(refresh_logs(self.engine_dir)), seconds=time.time() - self.started,
                            engine_dir=self.engine_dir, out_dir=self.ledger.out_dir, plan=self.plan)
