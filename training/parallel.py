"""The data-parallel trainer: ``parallel.workers = N > 1`` Composer trainers in a Ray Train worker group.

Every worker (rank ``r`` of ``N``) runs :func:`train_worker`: the single-process run of
:func:`training.run.build_training` with these differences (DESIGN.md §2, docs/dev/ray-train-composer.md):

* **Data**: the worker trains on rows ``[r·b/N, (r+1)·b/N)`` of each candidate batch
  (:class:`RankBatches`, one microbatch per worker); Composer wraps the model in DDP itself, on the
  process group Ray Train set up (gloo on CPUs, nccl on GPUs).
* **Selection**: Δ and validity are gathered from every rank and the same top-γ is taken on every rank
  (:func:`curation.core.distributed.select_across_ranks`: the single-process mask, or per-rank blocks with
  ``selection.scope: rank``); each worker keeps its slice. ``random`` draws the scores of the whole batch
  from the generator of ``(seed, step)``, so it also equals the single-process run.
* **Loss**: normalised by the *global* kept count with the *global* rows (``kept_total``, ``rows_total``),
  so DDP's averaged gradient is the single-process gradient of the whole batch.
* **Reference**: every rank scores its own rows with the same reference; refreshes run identically on
  every rank (the proxy weights are identical under DDP and the refresh batches are deterministic).
* **Outputs, once**: rank 0 writes the selected-token shards (full batches, in single-process row order,
  ``world_size`` in the manifest), the metrics log, the final weights and the summary; Composer writes the
  checkpoints from rank 0 only.
* **Failures**: the worker group runs under Ray Train's failure config. A killed worker makes Ray Train
  restart the group, and every worker resumes from ``checkpoints/latest-rank0.pt`` (the run's usual
  resume), so the outputs equal an uninterrupted run. Ray Train retries *every* worker error; data errors
  (bad shards, diverged loss, bad settings) are recorded in ``parallel/fatal.json`` by the failing worker,
  the retried group returns at once, and the driver raises the recorded message.

Ray itself is only imported by :mod:`curation.engine.ray_backend` (:func:`run_trainer_group`); this module
uses plain ``torch.distributed`` for the rank.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from composer.core import Callback
from torch.utils.data import DataLoader, DistributedSampler

from curation.core.distributed import GlobalSelection, Ranks, current_ranks, expected_kept, global_rows
from curation.core.distributed import select_across_ranks as _select_across_ranks
from curation.core.selection import random_scores
from curation.engine.plan import EngineError
from schemas.manifest import atomic_write_text
from schemas.shards import ShardSchemaError
from schemas.train_config import TrainConfig
from training.callbacks import JSONLinesLogger, SelectedShardWriter
from training.data import StepBatches, StreamBatches
from training.sharding import is_sharded

__all__ = ["RankBatches", "RankZeroShardWriter", "ParallelSelection", "DataParallelParts", "data_parallel_parts",
           "rank_eval_loader", "StepTimes",           "train_worker", "train_parallel", "run_worker_group", "trainer_cpus", "FATAL_FILE"]

#: Where a worker records an error that retrying cannot fix (relative to output_dir).
FATAL_FILE = os.path.join("parallel", "fatal.json")
#: One line per worker start: rank, pid, attempt time, checkpoint resumed from (relative to output_dir).
ATTEMPTS_FILE = os.path.join("parallel", "attempts.jsonl")
#: Errors that a restart of the worker group cannot fix.
FATAL_ERRORS = (ValueError, ShardSchemaError, FileNotFoundError, EngineError)


class RankBatches(StepBatches):
    """This rank's rows of each step's candidate batch (resumes by step like every :class:`StepBatches`:
    Composer counts the samples of every rank, so the saved position is the global step and resuming works
    with any number of workers)."""

    def __init__(self, stream: StreamBatches, ranks: Ranks) -> None:
        super().__init__(stream.stream, stream.stop_step, model_vocab=stream.model_vocab)
        self.full = stream
        self.ranks = ranks

    def batch(self, step: int) -> dict[str, Any]:
        return rank_slice(self.full.batch(step), self.ranks)


def rank_slice(batch: dict[str, Any], ranks: Ranks) -> dict[str, Any]:
    """The rows of ``ranks`` of a collated batch dict (tensors and lists by row, other values copied)."""
    rows = ranks.rows(int(batch["tokens"].shape[0]))
    return {k: v[rows] if isinstance(v, torch.Tensor | list | tuple) else v for k, v in batch.items()}


class ParallelSelection:
    """What :class:`training.algorithm.BladeAlgorithm` does differently on rank ``r`` of ``N > 1``.

    Args:
        ranks: this worker's place in the group.
        scope: ``global`` or ``rank`` (``selection.scope``).
        stream: the full candidate stream (the full batch of a step is re-read for the record).
    """

    def __init__(self, ranks: Ranks, scope: str, stream: StreamBatches) -> None:
        self.ranks = ranks
        self.scope = scope
        self.stream = stream

    def rows(self, batch_rows: int) -> slice:
        """This rank's rows of a full batch of ``batch_rows`` rows."""
        return self.ranks.rows(batch_rows)

    def before_step(self, batch: dict[str, Any], gamma: float, valid_of: Any) -> tuple[list[int], dict[str, Any]]:
        """Global kept count and rows on the rank's batch; returns the expected kept counts and the full batch.

        ``valid_of(batch)`` is the algorithm's validity of a batch's loss positions.
        """
        full = self.stream.batch(int(batch["step"]))
        expected = expected_kept(valid_of(full), gamma, blocks=1 if self.scope == "global" else self.ranks.world_size)
        batch["kept_total"] = int(sum(expected))
        batch["rows_total"] = global_rows(int(batch["tokens"].shape[0]), self.ranks)
        return expected, full

    def scores(self, policy: Any, proxy_losses: torch.Tensor, ref_losses: torch.Tensor | None, *, seed: int,
               step: int) -> torch.Tensor:
        """This rank's rows of the scores of the whole batch (``random``: drawn for the whole batch under global
        scope, as one process would; per rank block, seeded by its first row, under rank scope)."""
        if not policy.needs_generator:
            return policy.scores(proxy_losses, ref_losses)
        rows, length = proxy_losses.shape
        offset = 0 if self.scope == "global" else self.ranks.rank * rows
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step, offset]).generate_state(1)[0]))
        if self.scope == "global":
            drawn = random_scores((rows * self.ranks.world_size, length), gen)[self.ranks.rows(rows * self.ranks.world_size)]
        else:
            drawn = random_scores((rows, length), gen)
        return drawn.to(proxy_losses.device)

    def select(self, scores: torch.Tensor, valid: torch.Tensor, gamma: float, *, selecting: bool) -> GlobalSelection:
        """The whole batch's selection (a collective: every rank calls it at every step)."""
        return _select_across_ranks(scores, valid, gamma, self.ranks, scope=self.scope, select=selecting)

    def step(self, policy: Any, gamma: float, *, seed: int, step: int, selecting: bool, full: dict[str, Any],
             proxy_losses: torch.Tensor, ref_losses: torch.Tensor | None,
             valid: torch.Tensor) -> tuple[GlobalSelection, dict[str, Any]]:
        """One step's selection: Δ of this rank's rows (NaN scores in warm-up), the selection of the whole batch,
        and the record of the whole step for the selected-token shards (``full``: the step's full batch)."""
        if selecting:
            scores = self.scores(policy, proxy_losses, ref_losses, seed=seed, step=step)
        else:
            scores = torch.full(valid.shape, math.nan, dtype=torch.float32, device=valid.device)
        sel = self.select(scores, valid, gamma, selecting=selecting)
        part = {
            "tokens": full["tokens"].numpy(), "mask": sel.mask.cpu().numpy(), "valid": sel.valid.cpu().numpy(),
            "scores": sel.scores.cpu().numpy(), "sources": list(full["source"]),
            "sample_ids": full["sample_id"].numpy(),
        }
        return sel, part


@dataclass
class DataParallelParts:
    """What :func:`training.run.build_training` wires differently on one worker of the group."""

    selection: ParallelSelection  # for BladeAlgorithm(parallel=...)
    batches: RankBatches  # the training dataset: this rank's rows
    writer: Callable[..., SelectedShardWriter]  # the shard writer class (rank 0 writes)
    microbatch_size: int  # b/N: one forward/backward per rank and step


def data_parallel_parts(cfg: TrainConfig, ranks: Ranks, stream: StreamBatches) -> DataParallelParts:
    """The data-parallel pieces of worker ``ranks`` for ``cfg`` (``ranks.world_size > 1``)."""
    if ranks.world_size != cfg.parallel.workers:
        raise ValueError(f"the worker group has {ranks.world_size} workers, parallel.workers is {cfg.parallel.workers}")
    return DataParallelParts(
        selection=ParallelSelection(ranks, cfg.selection.scope, stream),
        batches=RankBatches(stream, ranks),
        writer=functools.partial(RankZeroShardWriter, rank=ranks.rank),
        microbatch_size=cfg.batch_size // ranks.world_size,
    )


def rank_eval_loader(loader: DataLoader) -> DataLoader:
    """``loader``'s rows split over the ranks (``DistributedSampler``, no shuffling, no rows dropped).

    Composer drops the sampler's padding duplicates at the end and sums the metric states over the ranks,
    so the validation loss is the single-process one up to float summation order."""
    sampler = DistributedSampler(loader.dataset, shuffle=False, drop_last=False)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn,
                      num_workers=0)


class RankZeroShardWriter(SelectedShardWriter):
    """The selected-token shard writer of a worker group: rank 0 writes every step's full batch once;
    the other ranks keep no rows (their writer state is never saved: Composer saves rank 0's)."""

    def __init__(self, *args: Any, rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank

    def fit_start(self, state: Any, logger: Any) -> None:
        if self.rank == 0:
            super().fit_start(state, logger)

    def batch_end(self, state: Any, logger: Any) -> None:
        if self.rank == 0:
            super().batch_end(state, logger)

    def fit_end(self, state: Any, logger: Any) -> None:
        if self.rank == 0:
            super().fit_end(state, logger)


class StepTimes(Callback):
    """Wall and process CPU time at the end of every step (``jobs/bench_scaling.py``); written by each rank to
    ``output_dir/parallel/step_times-rank<r>.json`` at the end of the fit."""

    def __init__(self, output_dir: str, rank: int = 0) -> None:
        self.path = os.path.join(output_dir, "parallel", f"step_times-rank{rank}.json")
        self.points: list[tuple[int, float, float]] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.points.append((int(state.timestamp.batch), time.perf_counter(), time.process_time()))

    def fit_end(self, state: Any, logger: Any) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.points))


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
                                                        "message": str(e)}))
        raise


def _run_worker(cfg: TrainConfig, ranks: Ranks, config: dict[str, Any]) -> None:
    from training.run import build_training, finish_training

    callbacks = [StepTimes(cfg.output_dir, ranks.rank)] if config.get("step_times") else []
    engine = config.get("engine")
    scored = None
    if engine is not None:  # exact mode next to the Ray engine: every rank reads the scores of its rows
        from training.engine_hooks import EngineScores

        scored = EngineScores(engine["client"], engine["scored_dir"], engine["stream"], timeout_s=engine["timeout_s"])
    run = build_training(cfg, ranks=ranks, callbacks=callbacks, scored=scored)
    sync = None
    if engine is not None and ranks.rank == 0:  # rank 0 publishes u and reports the trainer's step
        from training.engine_hooks import EngineSync

        sync = EngineSync(engine["client"], engine["plan"], algorithm=run.algorithm,
                          distance_interval=cfg.distance_interval)
        run.trainer.state.callbacks.insert(0, sync)
    _record_attempt(cfg.output_dir, ranks, run.resumed_from)
    if ranks.rank > 0:  # one metrics log: rank 0's
        dests = run.trainer.logger.destinations
        for d in dests:
            if isinstance(d, JSONLinesLogger):
                d._file.close()
        run.trainer.logger.destinations = tuple(d for d in dests if not isinstance(d, JSONLinesLogger))
    run.fit()
    sharded = is_sharded(run.model.model)  # then gathering the final weights is a collective
    state = run.final_state() if ranks.rank == 0 or sharded else None
    if ranks.rank == 0:
        extra = {"resumed_from": run.resumed_from, "world_size": ranks.world_size,
                 "stream": run.manifest_extra["stream"] if run.manifest_extra else None,
                 "selected_dir": os.path.join(cfg.output_dir, "selected") if cfg.write_selected else None}
        if engine is not None:  # the driver writes the summary, with the engine's report
            out = {"final": run.write_final(None, state[0]), "stats": run.stats.summary_data(), "resumed_from": run.resumed_from,
                   "publish_seconds": sync.publish_seconds if sync else 0.0,
                   "trainer_wait_seconds": engine["client"].wait_seconds}
        else:
            out = finish_training(run, cfg.plots, extra, state)
            out["selected"] = extra["selected_dir"]
        atomic_write_text(os.path.join(cfg.output_dir, "parallel", "outputs.json"), json.dumps(out))


def train_parallel(cfg: TrainConfig, *, address: str | None = None, num_cpus: int | None = None,
                   step_times: bool = False) -> dict[str, Any]:
    """``jobs/train.py`` with ``parallel.workers > 1``: lock ``output_dir``, run the worker group on Ray
    (a local instance unless ``address`` or a ``ray job submit`` names a cluster), return the output paths.
    ``step_times``: every rank records its step times (:class:`StepTimes`).

    Raises:
        ValueError: bad settings or data (the failing worker's message), or a group that cannot be placed.
        OutputDirError: the directory is in use or was written with another config.
    """
    from curation.engine.ray_backend import ray_session
    from schemas.outdir import open_output_dir

    with open_output_dir(cfg.output_dir, "train", {"config.yaml": cfg}) as lock:
        lock.write_records()
        with ray_session(address, num_cpus=num_cpus, need_cpus=trainer_cpus(cfg)):
            return run_worker_group(cfg, step_times=step_times)


def trainer_cpus(cfg: TrainConfig) -> int:
    """Ray CPUs the worker group reserves (a local Ray instance must have at least these, plus the engine's)."""
    return int(np.ceil(cfg.parallel.workers * cfg.parallel.cpus_per_worker))


def run_worker_group(cfg: TrainConfig, *, engine: Any = None, step_times: bool = False) -> dict[str, Any]:
    """Run the worker group of ``cfg`` on the Ray cluster this process joined (the caller holds ``output_dir``'s
    lock) and return what rank 0 wrote to ``parallel/outputs.json``.

    ``engine``: the running :class:`~curation.engine.ray_backend.RayEngine` of ``jobs/curate_and_train.py``
    (exact mode) with ``scored_dir``, ``stream``, ``plan``, ``timeout_s``: the workers read its scores, rank 0
    publishes proxy snapshots to it; the driver checks the engine while the group runs and stops the group
    when the engine fails.
    """
    from curation.engine.ray_backend import engine_client, run_trainer_group

    p = cfg.parallel
    os.makedirs(os.path.join(cfg.output_dir, "parallel"), exist_ok=True)
    for stale in (_fatal_path(cfg.output_dir), os.path.join(cfg.output_dir, "parallel", "outputs.json")):
        if os.path.exists(stale):  # a rerun (after fixing the cause of an error) starts clean
            os.remove(stale)
    config: dict[str, Any] = {"train": cfg.model_dump(mode="json"), "step_times": step_times, "cwd": os.getcwd()}
    monitor = on_error = None
    if engine is not None:
        handle = engine.pop("engine")
        config["engine"] = {**engine, "client": engine_client(handle)}
        monitor, on_error = handle.check, handle.close
    run_trainer_group(
        train_worker, config, workers=p.workers, cpus_per_worker=p.cpus_per_worker,
        gpus_per_worker=p.gpus_per_worker, backend=p.resolved_backend, max_failures=p.max_failures,
        timeout_s=p.timeout_s, storage_path=os.path.join(os.path.abspath(cfg.output_dir), "parallel", "ray_train"),
        name="train", fatal_file=_fatal_path(cfg.output_dir), monitor=monitor, on_monitor_error=on_error,
    )
    with open(os.path.join(cfg.output_dir, "parallel", "outputs.json"), encoding="utf-8") as f:
        return json.load(f)
