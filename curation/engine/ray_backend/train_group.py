"""The data-parallel trainer's worker group on Ray Train (``TorchTrainer`` hosting Composer), plumbing only.

The train-loop function lives on the training side (:mod:`training.runs.group`, which does not import ray);
here are the placement, the failure config, the group's channel to its driver, the monitoring of the engine while
the group trains, and the unwrapping of the workers' errors. With :mod:`curation.engine.ray_backend.actors`, the
only code that imports ray.

**Nodes that share only an object store.** Nothing here needs a filesystem the driver and the ranks share:

* the driver and the ranks talk through a :class:`GroupChannel`, a small Ray actor pinned to the driver's node: the
  stop request (the driver sets it, every rank reads it at each step end), an error no restart can fix (the
  failing rank records it, the driver raises it), the ranks' starts (the driver writes them to
  ``parallel/attempts.jsonl``);
* Ray Train's own state (``storage_path``) is in the bucket when the run's output directory is
  (:func:`curation.io.objects.arrow_filesystem`: its ``.validate_storage_marker`` written by the controller is read
  back by every worker);
* what a group still needs on a path every node reaches is what its config names as a *local* path (an
  ``output_dir``, the data, a tokenizer): :func:`check_group_nodes` asks every node that could host a rank
  (:func:`~curation.engine.ray_backend.reach.check_shared`) before the group starts, and refuses naming the setting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from curation.engine.plan import WorkerGroupFailed
from curation.engine.ray_backend.client import error_message
from curation.engine.ray_backend.reach import check_shared
from curation.engine.ray_backend.session import started_without_dashboard
from curation.io import objects
from curation.io.bad_shards import blame
from schemas.train_config import ParallelConfig

__all__ = ["run_trainer_group", "recorded_fatal", "check_group_nodes", "GroupChannel"]


def recorded_fatal(record: Mapping[str, Any] | None) -> ValueError | None:
    """The error a worker recorded (``record``: its JSON-like record, ``message`` and ``shards``; ``None``: none): its
    message, blaming the input shard files the record lists (:mod:`curation.io.bad_shards`: the job records what the
    run failed on; a rank on another node lists them by URL)."""
    if record is None:
        return None
    shards = record.get("shards") if isinstance(record.get("shards"), list) else []
    return blame(ValueError(str(record["message"])), *[s for s in shards if isinstance(s, str)])


@ray.remote(num_cpus=0, max_restarts=0)
class _GroupSignals:
    """The state behind a :class:`GroupChannel` (one per group run, on the driver's node)."""

    def __init__(self) -> None:
        self.signum = 0
        self.fatal_record: dict | None = None
        self.attempts: list[dict] = []

    def request_stop(self, signum: int) -> None:
        self.signum = self.signum or int(signum)

    def stop_signal(self) -> int:
        return self.signum

    def record_fatal(self, record: dict) -> None:
        if self.fatal_record is None:  # (the first: later ones follow from it)
            self.fatal_record = record

    def fatal(self) -> dict | None:
        return self.fatal_record

    def record_attempt(self, record: dict) -> None:
        self.attempts.append(record)

    def attempts_from(self, first: int) -> list[dict]:
        return self.attempts[first:]


class GroupChannel:
    """The driver's and the ranks' one line to each other during a group run (module docstring): a Ray actor on the
    driver's node, with no CPU of its own. It travels to the ranks inside their config (pickled by Ray: the actor's
    handle); the driver :meth:`open` s it and :meth:`close` s it after the run.

    Ranks call :meth:`stop_signal`, :meth:`record_fatal`, :meth:`fatal`, :meth:`record_attempt` and
    :meth:`on_driver_node`; the driver :meth:`request_stop`, :meth:`fatal` and :meth:`new_attempts`.
    """

    def __init__(self, actor: Any, node_id: str) -> None:
        self._actor, self.node_id = actor, node_id
        self._seen = 0  # (the driver's count of the attempts it took)
        self._signal, self._asked = 0, None  # (a rank's last answer, and its question in flight)

    @classmethod
    def open(cls) -> GroupChannel:
        """A channel whose actor runs on this process's node (it lives as long as the driver's node does)."""
        node = ray.get_runtime_context().get_node_id()
        actor = _GroupSignals.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        return cls(actor, node)

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return (GroupChannel, (self._actor, self.node_id))

    # the ranks' side
    def stop_signal(self) -> int:
        """The signal the driver was asked to stop on (0: none), as last answered: the question is asked in the
        background and never waited for, so a step does not wait on the actor (the answer is at most a call late;
        the ranks agree on the step with their all-reduce)."""
        if self._signal:
            return self._signal
        if self._asked is None:
            self._asked = self._actor.stop_signal.remote()
        done, _ = ray.wait([self._asked], timeout=0)
        if done:
            self._signal, self._asked = int(ray.get(done[0])), None
        return self._signal

    def record_fatal(self, record: dict) -> None:
        """Record an error that no restart of the group can fix (the first one counts)."""
        ray.get(self._actor.record_fatal.remote(record))

    def fatal(self) -> dict | None:
        """The recorded error (``None``: none)."""
        return ray.get(self._actor.fatal.remote())

    def record_attempt(self, record: dict) -> None:
        ray.get(self._actor.record_attempt.remote(record))

    def node_here(self) -> str:
        """This process's Ray node id."""
        return ray.get_runtime_context().get_node_id()

    def on_driver_node(self) -> bool:
        """Whether this process runs on the driver's node (its machine: the same directories and cache)."""
        return ray.get_runtime_context().get_node_id() == self.node_id

    # the driver's side
    def request_stop(self, signum: int) -> None:
        ray.get(self._actor.request_stop.remote(signum))

    def new_attempts(self) -> list[dict]:
        """The ranks' starts recorded since the last call."""
        new = ray.get(self._actor.attempts_from.remote(self._seen))
        self._seen += len(new)
        return new

    def close(self) -> None:
        ray.kill(self._actor, no_restart=True)


T = TypeVar("T")
R = TypeVar("R")


def _group_fits(parallel: ParallelConfig) -> None:
    """Refuse a worker group the cluster can never place (Ray Train would retry its start forever)."""
    workers = parallel.workers
    need = {"CPU": parallel.cpus_per_worker, "GPU": parallel.gpus_per_worker, **parallel.resources}
    total = ray.cluster_resources()
    short = {k: v for k, v in need.items() if workers * v > float(total.get(k, 0.0))}
    if short:
        have = ", ".join(f"{k} {float(total.get(k, 0.0)):g}" for k in need)
        per = ", ".join(f"{k} {v:g}" for k, v in need.items())
        raise ValueError(
            f"parallel.workers={workers} trainer workers × ({per}) do not fit the Ray cluster ({have} in all): lower "
            "parallel.workers or the resources per worker (parallel.cpus_per_worker, gpus_per_worker, resources), "
            "or add nodes")


def _rank_nodes(parallel: ParallelConfig) -> list[dict]:
    """The alive nodes of the cluster that could host a rank of the group (its CPUs, GPUs and custom resources)."""
    need = {"CPU": parallel.cpus_per_worker, **({"GPU": parallel.gpus_per_worker} if parallel.gpus_per_worker else {}),
            **parallel.resources}
    return [n for n in ray.nodes() if n["Alive"] and all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]


def check_group_nodes(parallel: ParallelConfig, local_paths: Mapping[str, str]) -> None:
    """Refuse, before the group starts, a group whose ranks could run on a node that cannot reach a local path its
    config names (``local_paths``: ``{setting: path}``, the settings that are not object-store URLs). The ranks and
    the driver share nothing else (module docstring): an ``s3://`` output directory and data need no check, each
    node reads and writes the bucket through its own cache.

    Raises:
        ValueError: one line naming the setting, the path, the node, and what to do instead
            (:func:`~curation.engine.ray_backend.reach.check_shared`).
    """
    here = ray.get_runtime_context().get_node_id()
    if not local_paths or not any(n["NodeID"] != here for n in _rank_nodes(parallel)):
        return
    check_shared(local_paths, resources=parallel.resources, hint=" (parallel.workers > 1: a rank on that node "
                 "reads and writes it; an s3:// URL needs no shared filesystem)")


def _storage(storage_path: str) -> dict[str, Any]:
    """Ray Train's ``storage_path`` (and its filesystem, for an ``s3://`` URL: the project's endpoint)."""
    if objects.is_url(storage_path):
        fs, path = objects.arrow_filesystem(storage_path)
        return {"storage_path": path, "storage_filesystem": fs}
    return {"storage_path": storage_path}


def run_trainer_group(
    train_fn: Callable[[Mapping[str, T]], R], config: Mapping[str, T], parallel: ParallelConfig, *,
    storage_path: str, name: str, channel: GroupChannel | None = None, monitor: Callable[[], None] | None = None,
    on_monitor_error: Callable[[], None] | None = None, monitor_every_s: float = 0.5,
    local_paths: Mapping[str, str] | None = None,
) -> R | None:
    """Run ``train_fn(config)`` on ``parallel.workers`` Ray Train workers (``TorchTrainer``), wait for it, and return
    what rank 0's ``train_fn`` returned (Ray Train serialises it once, to this process).

    Ray Train sets up the process group (``parallel.resolved_backend``: gloo or nccl, collectives time out after
    ``parallel.timeout_s``) before ``train_fn`` runs, places the workers (``cpus_per_worker``,
    ``gpus_per_worker``, ``resources``) on the cluster this process joined (next to the engine's actors), and
    restarts the whole group up to ``parallel.max_failures`` times after a worker failure (``train_fn`` is then run
    again from the start: it resumes from its own checkpoints). ``storage_path`` is Ray Train's run state: an
    ``s3://`` URL (the bucket of the run) or a path every node can reach. ``local_paths``: the config's local paths
    (``{setting: path}``), checked first by :func:`check_group_nodes`.

    ``channel``: the group's :class:`GroupChannel`; an error a worker recorded there (``message``, and ``shards``:
    the input shard files it blames, :mod:`curation.io.bad_shards`) is raised as a ValueError blaming those.

    ``monitor()``: called every ``monitor_every_s`` seconds while the group runs (the engine's ``check``, the
    driver's stop signal); when it raises, ``on_monitor_error()`` is called (it must make the workers stop, e.g. by
    ending the engine they wait on), and the monitor's error is raised once the group has ended.

    Raises:
        ValueError: the group does not fit the cluster or its nodes cannot all reach a local path, or a worker
            recorded a fatal error.
        WorkerGroupFailed: the group failed more than ``max_failures`` times (the workers' errors by rank).
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig

    gpus = parallel.gpus_per_worker
    _group_fits(parallel)
    if local_paths:
        check_group_nodes(parallel, local_paths)
    trainer = _trainer_class()(
        train_fn, train_loop_config=dict(config),
        torch_config=TorchConfig(backend=parallel.resolved_backend, timeout_s=parallel.timeout_s),
        scaling_config=ScalingConfig(num_workers=parallel.workers, use_gpu=gpus > 0, resources_per_worker={
            "CPU": parallel.cpus_per_worker, **({"GPU": gpus} if gpus else {}), **parallel.resources}),
        run_config=RunConfig(name=name, **_storage(storage_path),
                             failure_config=FailureConfig(max_failures=parallel.max_failures)),
    )
    outcome = _fit(trainer.fit, monitor, on_monitor_error, monitor_every_s)
    failure = outcome.error
    if failure is not None and not isinstance(failure, TrainingFailedError):
        raise failure
    fatal = recorded_fatal(channel.fatal()) if channel is not None else None
    if fatal is not None:
        raise fatal from failure
    if failure is not None:
        per_rank = getattr(failure, "worker_failures", None) or {}
        detail = "; ".join(f"rank {r}: {error_message(err)}" for r, err in sorted(per_rank.items())) or error_message(failure)
        raise WorkerGroupFailed(f"the trainer worker group failed (parallel.max_failures={parallel.max_failures}): "
                                f"{detail}") from failure
    return getattr(outcome.result, "return_value", None)


def _trainer_class() -> type:
    """Ray Train's ``TorchTrainer`` without two of its default callbacks, where they cannot serve our groups (on a Ray
    whose internals differ, no such callback where it was, ``TorchTrainer`` itself):

    - its Ray Data plumbing, which a group handed no ``datasets`` (ours: the ranks read their shards themselves)
      never uses: Ray Train 2.60 starts a ``DatasetManager`` actor (a process of its own, importing Ray Data) at
      every start and restart of the worker group whatever the datasets, through its ``DatasetsCallback``;
    - on a local instance this process started without a dashboard (:func:`~.session.started_without_dashboard`:
      every job's own, the tests'), its placement-group cleaner. ``PlacementGroupCleanerCallback`` starts a
      detached actor per group run that asks Ray's state API (served by the dashboard) every second whether the
      controller still lives, to remove the group's placement group if it died. Without a dashboard each question
      hangs until it times out (40 s measured), and stopping the cleaner at the run's end waits out its 12-s stop
      timeout: every group run ended ≈ 12 s after its ranks had finished. Such an instance ends with the job,
      placement groups included, so there is nothing for a cleaner to do. A cluster's runs keep it.
    """
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:
        return TorchTrainer
    if not callable(getattr(TorchTrainer, "_create_default_callbacks", None)):
        return TorchTrainer

    class _Trainer(TorchTrainer):
        def _create_default_callbacks(self) -> list:
            unused = (() if self.datasets else (DatasetsCallback,)) + (
                (PlacementGroupCleanerCallback,) if started_without_dashboard() else ())
            return [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]

    return _Trainer


@dataclass
class _Outcome:
    result: object = None  # Ray Train's Result
    error: BaseException | None = None


def _fit(fit: Callable[[], object], monitor: Callable[[], None] | None, on_monitor_error: Callable[[], None] | None,
         every_s: float) -> _Outcome:
    """Run ``fit()`` (in a thread of its own while ``monitor`` is called every ``every_s`` seconds in this one);
    its result or error. A monitor's error is raised once ``fit`` has returned (``on_monitor_error`` was called
    first, to end it)."""
    outcome = _Outcome()

    def run() -> None:
        try:
            outcome.result = fit()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            outcome.error = e

    if monitor is None:
        run()
        return outcome
    thread = threading.Thread(target=run, name="ray-train-fit", daemon=True)
    thread.start()
    monitored: Exception | None = None
    while thread.is_alive():
        thread.join(every_s)
        if monitored is None and thread.is_alive():
            try:
                monitor()
            except Exception as e:  # noqa: BLE001 - raised below, after the group ended
                monitored = e
                if on_monitor_error is not None:
                    on_monitor_error()
    if monitored is not None:
        raise monitored
    return outcome
