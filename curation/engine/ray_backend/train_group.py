"""The data-parallel trainer's worker group on Ray Train (``TorchTrainer`` hosting Composer), plumbing only.

The train-loop function lives on the training side (:mod:`training.runs.group`, which does not import ray);
here are the placement, the failure config, the monitoring of the engine while the group trains, and the
unwrapping of the workers' errors. With :mod:`curation.engine.ray_backend.actors`, the only code that
imports ray.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ray

from curation.engine.plan import WorkerGroupFailed
from curation.engine.ray_backend.client import error_message
from curation.io.bad_shards import blame
from schemas.train_config import ParallelConfig

__all__ = ["run_trainer_group", "recorded_fatal"]


def recorded_fatal(fatal_file: str) -> ValueError | None:
    """The error a worker recorded in ``fatal_file`` (``None``: none): its message, blaming the input shard files the
    record lists (:mod:`curation.io.bad_shards`: the job records what the run failed on)."""
    if not os.path.exists(fatal_file):
        return None
    with open(fatal_file, encoding="utf-8") as f:
        fatal = json.load(f)
    shards = fatal.get("shards") if isinstance(fatal.get("shards"), list) else []
    return blame(ValueError(fatal["message"]), *[s for s in shards if isinstance(s, str)])


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


def run_trainer_group(
    train_fn: Any, config: dict[str, Any], parallel: ParallelConfig, *, storage_path: str, name: str,
    fatal_file: str | None = None, monitor: Any = None, on_monitor_error: Any = None,
    monitor_every_s: float = 0.5,
) -> None:
    """Run ``train_fn(config)`` on ``parallel.workers`` Ray Train workers (``TorchTrainer``) and wait for it.

    Ray Train sets up the process group (``parallel.resolved_backend``: gloo or nccl, collectives time out after
    ``parallel.timeout_s``) before ``train_fn`` runs, places the workers (``cpus_per_worker``,
    ``gpus_per_worker``) on the cluster this process joined (next to the engine's actors), and restarts the whole
    group up to ``parallel.max_failures`` times after a worker failure (``train_fn`` is then run again from the
    start: it resumes from its own checkpoints). ``storage_path`` is Ray Train's run state: on a multi-node
    cluster a path every node can reach.

    ``fatal_file``: where a worker records an error that no restart can fix (JSON ``message``, and ``shards``: the
    input shard files it blames, :mod:`curation.io.bad_shards`); when it exists after the run, its message is raised
    as a ValueError blaming those.

    ``monitor()``: called every ``monitor_every_s`` seconds while the group runs (the engine's ``check``, the
    driver's stop signal); when it raises, ``on_monitor_error()`` is called (it must make the workers stop, e.g. by ending the engine they wait on),
    and the monitor's error is raised once the group has ended.

    Raises:
        ValueError: the group does not fit the cluster, or a worker recorded a fatal error.
        WorkerGroupFailed: the group failed more than ``max_failures`` times (the workers' errors by rank).
    """
    workers, cpus_per_worker, gpus_per_worker = parallel.workers, parallel.cpus_per_worker, parallel.gpus_per_worker
    max_failures = parallel.max_failures
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    _group_fits(workers, cpus_per_worker, gpus_per_worker)
    resources = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    trainer = TorchTrainer(
        train_fn, train_loop_config=config,
        torch_config=TorchConfig(backend=parallel.resolved_backend, timeout_s=parallel.timeout_s),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpus_per_worker > 0,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    failure: BaseException | None = None
    monitored: BaseException | None = None
    if monitor is None:
        try:
            trainer.fit()
        except TrainingFailedError as e:
            failure = e
    else:
        import threading

        box: dict[str, BaseException] = {}

        def fit() -> None:
            try:
                trainer.fit()
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                box["error"] = e

        thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(monitor_every_s)
            if monitored is None and thread.is_alive():
                try:
                    monitor()
                except Exception as e:  # noqa: BLE001 - raised below, after the group ended
                    monitored = e
                    if on_monitor_error is not None:
                        on_monitor_error()
        failure = box.get("error")
        if monitored is not None:
            raise monitored
        if failure is not None and not isinstance(failure, TrainingFailedError):
            raise failure
    fatal = recorded_fatal(fatal_file) if fatal_file is not None else None
    if fatal is not None:
        raise fatal from failure
    if failure is not None:
        per_rank = getattr(failure, "worker_failures", None) or {}
        detail = "; ".join(f"rank {r}: {error_message(err)}" for r, err in sorted(per_rank.items())) or error_message(failure)
        raise WorkerGroupFailed(f"the trainer worker group failed (parallel.max_failures={max_failures}): {detail}") \
            from failure
