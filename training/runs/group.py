"""The data-parallel trainer: ``parallel.workers = N > 1`` Composer trainers in a Ray Train worker group.

Every worker (rank ``r`` of ``N``) runs :func:`train_worker`: the trainer of
:func:`training.runs.wiring.build_training` for its rank, which differs from a single process (rank 0 of 1) only
where the rank shows (DESIGN.md §2, docs/dev/ray-train-composer.md):

* **Data**: the worker trains on rows ``[r·b/N, (r+1)·b/N)`` of each candidate batch
  (:class:`~training.blocks.data.RankBatches`, one microbatch per worker); Composer wraps the model in DDP itself,
  on the process group Ray Train set up (gloo on CPUs, nccl on GPUs).
* **Selection**: Δ and validity are gathered from every rank and the same top-γ is taken on every rank
  (:class:`curation.core.step.SelectionStep`: the single-process mask, or per-rank blocks with
  ``selection.scope: rank``); each worker keeps its slice. ``random`` draws the scores of the whole batch
  from the generator of ``(seed, step)``, so it also equals the single-process run.
* **Loss**: normalised by the *global* kept count with the *global* rows (``kept_total``, ``rows_total``),
  so DDP's averaged gradient is the single-process gradient of the whole batch.
* **Reference**: every rank scores its own rows with the same reference; refreshes run identically on
  every rank (the proxy weights are identical under DDP and the refresh batches are deterministic).
* **Outputs, once**: rank 0 writes the selected-token shards (full batches, in single-process row order,
  ``world_size`` in the manifest), the metrics log and the experiment loggers' files, the final weights and the
  summary; Composer writes the checkpoints from rank 0 only.
* **Preemption**: a SIGTERM / SIGINT caught by the driver (:class:`curation.io.stop.GracefulStop`) is written to
  ``parallel/stop.json``; every rank reads it at the end of every step and the ranks agree with one ``all_reduce``
  (MAX) of their flags (:class:`GroupStop`), so all stop after the same step, where rank 0's checkpoint is written
  (:class:`training.blocks.preemption.StopAtStepEnd`). Rank 0 records the step in ``parallel/stopped.json`` and
  the driver raises :class:`~curation.io.stop.StopRequested` naming it and the checkpoint.
* **Failures**: the worker group runs under Ray Train's failure config. A killed worker makes Ray Train
  restart the group, and every worker resumes from ``checkpoints/latest-rank0.pt`` (the run's usual
  resume), so the outputs equal an uninterrupted run. Ray Train retries *every* worker error; data errors
  (bad shards, diverged loss, bad settings) are recorded in ``parallel/fatal.json`` by the failing worker (with
  the input shard files a data error blames: :mod:`curation.io.bad_shards`), the retried group returns at once,
  and the driver raises the recorded message.

Ray itself is only imported by :mod:`curation.engine.ray_backend` (:func:`run_trainer_group`); this module
uses plain ``torch.distributed`` for the rank.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from curation.core.distributed import Ranks, current_ranks
from curation.engine.handle import EngineFeed
from curation.engine.plan import EngineError
from curation.engine.ray_backend import ray_session, run_trainer_group
from curation.io.atomic import atomic_write_text
from curation.io.bad_shards import blamed
from curation.io.outputs import localize, open_output
from curation.io.stop import GracefulStop, stop_signal
from schemas.shards import ShardSchemaError
from schemas.train_config import TrainConfig
from training.blocks.callbacks import StepTimes
from training.blocks.loggers import check_installed
from training.blocks.preemption import StopAtStepEnd, stopped_at_step
from training.blocks.sharding import is_sharded
from training.runs.engine_feed import EngineSync
from training.runs.wiring import build_training, finish_run
from training.selection.shard_scores import EngineScores

__all__ = ["train_worker", "train_parallel", "run_worker_group", "trainer_cpus", "GroupStop", "FATAL_FILE",
           "ATTEMPTS_FILE", "STOP_FILE", "STOPPED_FILE"]

#: Where a worker records an error that retrying cannot fix (relative to output_dir).
FATAL_FILE = os.path.join("parallel", "fatal.json")
#: One line per worker start: rank, pid, attempt time, checkpoint resumed from (relative to output_dir).
ATTEMPTS_FILE = os.path.join("parallel", "attempts.jsonl")
#: Written by the driver when a stop signal came (``{"signum": 15}``); the ranks poll it (relative to output_dir).
STOP_FILE = os.path.join("parallel", "stop.json")
#: Written by rank 0 when the group stopped early on it (``{"step": 7, "signum": 15}``).
STOPPED_FILE = os.path.join("parallel", "stopped.json")
#: Errors that a restart of the worker group cannot fix.
FATAL_ERRORS = (ValueError, ShardSchemaError, FileNotFoundError, EngineError)


# ------------------------------------------------------------------------------------------------
# the train-loop function of a Ray Train worker, and the driver
# ------------------------------------------------------------------------------------------------
def _fatal_path(output_dir: str) -> str:
    return os.path.join(output_dir, FATAL_FILE)


def _record_attempt(output_dir: str, ranks: Ranks, resumed_from: str | None) -> None:
    path = os.path.join(output_dir, ATTEMPTS_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:  # one short line per worker start (append is atomic enough)
        f.write(json.dumps({"rank": ranks.rank, "world_size": ranks.world_size, "pid": os.getpid(),
                            "time": time.time(), "resumed_from": resumed_from}) + "\n")


class GroupStop:
    """A rank's stop request, polled at the end of every step: the driver's ``parallel/stop.json``, agreed on by
    every rank with one ``all_reduce`` (MAX) of the signal numbers, so that all ranks stop after the same step."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, STOP_FILE)

    def __call__(self) -> int | None:
        local = 0
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                local = int(json.load(f)["signum"])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            cuda = dist.get_backend() == "nccl"
            flag = torch.tensor([local], dtype=torch.int64,
                                device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag.item())
        return local or None


def train_worker(config: dict[str, Any]) -> None:
    """The train-loop function every Ray Train worker runs (``config["train"]``: the resolved TrainConfig).

    Re-run from the start on every group restart: the run resumes from its newest checkpoint.
    """
    if os.path.isdir(config.get("cwd") or ""):  # relative paths of the config mean what they mean to the driver
        os.chdir(config["cwd"])
    cfg = TrainConfig.model_validate(config["train"])
    out = cfg.output_dir
    if os.path.exists(_fatal_path(out)):
        return  # an earlier attempt hit an error that a restart cannot fix; the driver reports it
    ranks = current_ranks()
    try:
        if ranks.rank > 0:  # one progress bar
            cfg = cfg.model_copy(update={"progress_bar": False})
        if cfg.threads is None:  # one trainer per reserved CPU, not torch's default of every core
            torch.set_num_threads(max(1, int(cfg.parallel.cpus_per_worker)))
        _run_worker(cfg, ranks, config)
    except FATAL_ERRORS as e:
        os.makedirs(os.path.dirname(_fatal_path(out)), exist_ok=True)
        atomic_write_text(_fatal_path(out), json.dumps({"rank": ranks.rank, "error": type(e).__name__,
                                                        "message": str(e), "shards": blamed(e)}))
        raise


def _run_worker(cfg: TrainConfig, ranks: Ranks, config: dict[str, Any]) -> None:
    callbacks = [StepTimes(cfg.output_dir, ranks.rank)] if config.get("step_times") else []
    engine: EngineFeed | None = config.get("engine")  # the driver's feed, with the workers' handle
    scored = schedule = None
    if engine is not None:  # exact mode next to the Ray engine: every rank reads the scores of its rows
        schedule = engine.plan.schedule  # the driver's: the engine's plan follows the same one
        scored = EngineScores(engine)
    run = build_training(cfg, ranks=ranks, callbacks=callbacks, scored=scored, schedule=schedule,
                         stopper=StopAtStepEnd(GroupStop(cfg.output_dir)))
    sync = None
    if engine is not None and ranks.rank == 0:  # rank 0 publishes u and reports the trainer's step
        sync = EngineSync(engine.handle, engine.plan, algorithm=run.algorithm, distance_interval=cfg.effective_distance_interval)
        run.trainer.state.callbacks.insert(0, sync)
    _record_attempt(cfg.output_dir, ranks, run.resumed_from)
    run.fit()
    if run.stopped_at is not None:  # every rank stopped after the same step (GroupStop); the driver reports it
        if ranks.rank == 0:
            atomic_write_text(os.path.join(cfg.output_dir, STOPPED_FILE),
                              json.dumps({"step": run.stopped_at, "signum": run.stopper.signum}))
        return
    # gathering a sharded model's final weights is a collective: every rank takes part, rank 0 writes
    outputs = run.outputs(reference=engine is None) if ranks.rank == 0 or is_sharded(run.model.model) else None
    if ranks.rank > 0:
        return
    selected = os.path.join(cfg.output_dir, "selected") if cfg.write_selected else None
    outputs.extra.update(world_size=ranks.world_size, selected_dir=selected)
    if engine is not None:  # the driver finishes: the engine's last reference and report go with the summary
        stats, outputs.stats = outputs.stats, None
        out = {**finish_run(cfg.output_dir, outputs, plots=cfg.plots), "stats": stats,
               "resumed_from": run.resumed_from, "throughput": outputs.extra.get("throughput"),
               "publish_seconds": sync.publish_seconds if sync else 0.0,
               "trainer_wait_seconds": engine.handle.wait_seconds}
    else:
        out = {**finish_run(cfg.output_dir, outputs, plots=cfg.plots), "selected": selected}
    atomic_write_text(os.path.join(cfg.output_dir, "parallel", "outputs.json"), json.dumps(out))


def train_parallel(cfg: TrainConfig, *, address: str | None = None, num_cpus: int | None = None,
                   step_times: bool = False) -> dict[str, Any]:
    """``jobs/train.py`` with ``parallel.workers > 1``: lock ``output_dir``, run the worker group on Ray
    (a local instance unless ``address`` or a ``ray job submit`` names a cluster), return the output paths.
    ``step_times``: every rank records its step times (:class:`StepTimes`).

    Raises:
        ValueError: bad settings or data (the failing worker's message), or a group that cannot be placed.
        OutputDirError: the directory is in use or was written with another config.
        StopRequested: a SIGTERM / SIGINT stopped the group after a step, with a checkpoint there (the module's
            docstring); Ray is shut down, and the message names the step and the checkpoint.
    """
    check_installed(cfg.loggers)  # here, not in a worker after Ray started
    cfg = localize(cfg)  # s3:// directories: their local caches (curation.io.storage), shared by the ranks
    with open_output(cfg.output_dir, "train", {"config.yaml": cfg}) as lock:
        lock.write_records()
        # entered after ray.init, which sets its own SIGTERM handler (a second signal stops at once)
        with ray_session(address, num_cpus=num_cpus, need_cpus=trainer_cpus(cfg)), GracefulStop(
                what="the training step in progress and its checkpoint"):
            return run_worker_group(cfg, step_times=step_times)


def trainer_cpus(cfg: TrainConfig) -> int:
    """Ray CPUs the worker group reserves (a local Ray instance must have at least these, plus the engine's)."""
    return int(np.ceil(cfg.parallel.workers * cfg.parallel.cpus_per_worker))


def run_worker_group(cfg: TrainConfig, *, engine: EngineFeed | None = None, step_times: bool = False) -> dict[str, Any]:
    """Run the worker group of ``cfg`` on the Ray cluster this process joined (the caller holds ``output_dir``'s
    lock) and return what rank 0 wrote to ``parallel/outputs.json``.

    ``engine``: the running engine of ``jobs/curate_and_train.py`` (exact mode) as its trainer sees it (the
    scored-shard directory, the stream, the plan whose schedule is the run's, the wait timeout): the workers read its
    scores through :meth:`~curation.engine.handle.EngineFeed.for_workers`, rank 0 publishes proxy snapshots to it;
    the driver checks the engine while the group runs and closes it (which stops the group) when it fails.

    Inside a :class:`curation.io.stop.GracefulStop`, a stop signal is handed to the ranks (``parallel/stop.json``,
    within 0.5 s) and the group stops after a step they agree on (:class:`GroupStop`).

    Raises:
        StopRequested: the group stopped on a signal; names the step and the checkpoint a rerun resumes from.
    """
    out = cfg.output_dir
    os.makedirs(os.path.join(out, "parallel"), exist_ok=True)
    stop_file, stopped_file = os.path.join(out, STOP_FILE), os.path.join(out, STOPPED_FILE)
    for stale in (_fatal_path(out), os.path.join(out, "parallel", "outputs.json"), stop_file, stopped_file):
        if os.path.exists(stale):  # a rerun (after fixing the cause of an error, or after a stop) starts clean
            os.remove(stale)
    config: dict[str, Any] = {"train": cfg.model_dump(mode="json"), "step_times": step_times, "cwd": os.getcwd()}
    check = on_error = None
    if engine is not None:
        config["engine"] = engine.for_workers()
        check, on_error = engine.handle.check, engine.handle.close

    def monitor() -> None:  # every 0.5 s in the driver's main thread (where the signal handler runs)
        signum = stop_signal()
        if signum is not None and not os.path.exists(stop_file):
            atomic_write_text(stop_file, json.dumps({"signum": signum}))
        if check is not None:
            check()

    run_trainer_group(
        train_worker, config, cfg.parallel, storage_path=os.path.join(os.path.abspath(out), "parallel", "ray_train"),
        name="train", fatal_file=_fatal_path(out), monitor=monitor, on_monitor_error=on_error,
    )
    if os.path.exists(stopped_file):
        with open(stopped_file, encoding="utf-8") as f:
            stopped = json.load(f)
        raise stopped_at_step(stopped["signum"], stopped["step"], out, cfg.max_steps)
    with open(os.path.join(out, "parallel", "outputs.json"), encoding="utf-8") as f:
        return json.load(f)
