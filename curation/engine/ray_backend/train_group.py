"""The data-parallel trainer's worker group on Ray Train (``TorchTrainer`` hosting Composer), plumbing only.

The train-loop function lives on the training side (:mod:`training.runs.group`, which does not import ray);
here are the placement, the failure config, the monitoring of the engine while the group trains, and the
unwrapping of the workers' errors. With :mod:`curation.engine.ray_backend.actors`, the only code that
imports ray.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import ray

from curation.engine.plan import WorkerGroupFailed
from curation.engine.ray_backend.client import error_message
from curation.engine.ray_backend.reach import check_shared
from curation.io.bad_shards import blame
from schemas.train_config import ParallelConfig

__all__ = ["run_trainer_group", "recorded_fatal", "check_group_nodes"]


def recorded_fatal(fatal_file: str) -> ValueError | None:
    """The error a worker recorded in ``fatal_file`` (``None``: none): its message, blaming the input shard files the
    record lists (:mod:`curation.io.bad_shards`: the job records what the run failed on)."""
    if not os.path.exists(fatal_file):
        return None
    with open(fatal_file, encoding="utf-8") as f:
        fatal = json.load(f)
    shards = fatal.get("shards") if isinstance(fatal.get("shards"), list) else []
    return blame(ValueError(fatal["message"]), *[s for s in shards if isinstance(s, str)])


T = TypeVar("T")
R = TypeVar("R")


def _group_fits(workers: int, cpus: float, gpus: float) -> None:
    """Refuse a worker group the cluster can never place (Ray Train would retry its start forever)."""
    total = ray.cluster_resources()
    have_cpu, have_gpu = float(total.get("CPU", 0.0)), float(total.get("GPU", 0.0))
    if workers * cpus > have_cpu or workers * gpus > have_gpu:
        raise ValueError(
            f"parallel.workers={workers} trainer workers × (CPU {cpus:g}, GPU {gpus:g}) do not fit the Ray cluster "
            f"(CPU {have_cpu:g}, GPU {have_gpu:g} in all): lower parallel.workers or the resources per worker, "
            "or add nodes"
        )


def _rank_nodes(parallel: ParallelConfig) -> list[dict]:
    """The alive nodes of the cluster that could host a rank of the group (its CPUs and GPUs per worker)."""
    need = {"CPU": parallel.cpus_per_worker, **({"GPU": parallel.gpus_per_worker} if parallel.gpus_per_worker else {})}
    return [n for n in ray.nodes() if n["Alive"] and all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]


def check_group_nodes(parallel: ParallelConfig, output_dir: str, url: str | None) -> None:
    """Refuse, before the group starts, a group whose ranks could run on a node that cannot reach its output
    directory: the ranks and the driver coordinate through files under ``output_dir/parallel/`` (the stop request, a
    fatal error, the attempts) and Ray Train keeps its state there. ``url``: the bucket URL when ``output_dir`` is its
    cache path (this machine's disk: no rank elsewhere sees it); else ``output_dir`` must be on a filesystem every
    node able to host a rank mounts (:func:`~curation.engine.ray_backend.reach.check_shared` asks them).

    Raises:
        ValueError: one line naming ``parallel.workers``, ``output_dir`` and the nodes, and what to do instead.
    """
    here = ray.get_runtime_context().get_node_id()
    elsewhere = [n for n in _rank_nodes(parallel) if n["NodeID"] != here]
    if not elsewhere:
        return
    if url is None:
        check_shared({"output_dir": output_dir}, hint=" (parallel.workers > 1: the trainer group's ranks coordinate "
                     "through output_dir/parallel/ and resume from output_dir/checkpoints/)")
        return
    where = ", ".join(f"{n['NodeManagerAddress']} (node {n['NodeID'][:12]})" for n in elsewhere[:4])
    raise ValueError(
        f"parallel.workers = {parallel.workers} with output_dir = {url}: a data-parallel trainer group keeps its "
        "coordination files (output_dir/parallel/) and Ray Train's state on the disk of this job's machine, and "
        f"{len(elsewhere)} other Ray node(s) could run its ranks: {where}. Across nodes, set output_dir to a path "
        "on a filesystem every node mounts, or run the group on a Ray cluster of one node (the data, the other jobs' "
        "outputs and single-process training may stay in the bucket)")


def run_trainer_group(
    train_fn: Callable[[Mapping[str, T]], R], config: Mapping[str, T], parallel: ParallelConfig, *,
    storage_path: str, name: str, fatal_file: str | None = None, monitor: Callable[[], None] | None = None,
    on_monitor_error: Callable[[], None] | None = None, monitor_every_s: float = 0.5,
    output_dir: str | None = None, output_url: str | None = None,
) -> R | None:
    """Run ``train_fn(config)`` on ``parallel.workers`` Ray Train workers (``TorchTrainer``), wait for it, and return
    what rank 0's ``train_fn`` returned (Ray Train serialises it once, to this process).

    Ray Train sets up the process group (``parallel.resolved_backend``: gloo or nccl, collectives time out after
    ``parallel.timeout_s``) before ``train_fn`` runs, places the workers (``cpus_per_worker``,
    ``gpus_per_worker``) on the cluster this process joined (next to the engine's actors), and restarts the whole
    group up to ``parallel.max_failures`` times after a worker failure (``train_fn`` is then run again from the
    start: it resumes from its own checkpoints). ``storage_path`` is Ray Train's run state: on a multi-node
    cluster a path every node can reach. ``output_dir`` (with ``output_url``, its bucket URL when it is a cache path):
    the run's directory, checked first by :func:`check_group_nodes`.

    ``fatal_file``: where a worker records an error that no restart can fix (JSON ``message``, and ``shards``: the
    input shard files it blames, :mod:`curation.io.bad_shards`); when it exists after the run, its message is raised
    as a ValueError blaming those.

    ``monitor()``: called every ``monitor_every_s`` seconds while the group runs (the engine's ``check``, the
    driver's stop signal); when it raises, ``on_monitor_error()`` is called (it must make the workers stop, e.g. by
    ending the engine they wait on), and the monitor's error is raised once the group has ended.

    Raises:
        ValueError: the group does not fit the cluster or its nodes cannot all reach ``output_dir``, or a worker
            recorded a fatal error.
        WorkerGroupFailed: the group failed more than ``max_failures`` times (the workers' errors by rank).
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    workers, cpus, gpus = parallel.workers, parallel.cpus_per_worker, parallel.gpus_per_worker
    _group_fits(workers, cpus, gpus)
    if output_dir is not None:
        check_group_nodes(parallel, output_dir, output_url)
    trainer = TorchTrainer(
        train_fn, train_loop_config=dict(config),
        torch_config=TorchConfig(backend=parallel.resolved_backend, timeout_s=parallel.timeout_s),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpus > 0,
                                     resources_per_worker={"CPU": cpus, **({"GPU": gpus} if gpus else {})}),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=parallel.max_failures)),
    )
    outcome = _fit(trainer.fit, monitor, on_monitor_error, monitor_every_s)
    failure = outcome.error
    if failure is not None and not isinstance(failure, TrainingFailedError):
        raise failure
    fatal = recorded_fatal(fatal_file) if fatal_file is not None else None
    if fatal is not None:
        raise fatal from failure
    if failure is not None:
        per_rank = getattr(failure, "worker_failures", None) or {}
        detail = "; ".join(f"rank {r}: {error_message(err)}" for r, err in sorted(per_rank.items())) or error_message(failure)
        raise WorkerGroupFailed(f"the trainer worker group failed (parallel.max_failures={parallel.max_failures}): "
                                f"{detail}") from failure
    return getattr(outcome.result, "return_value", None)


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
