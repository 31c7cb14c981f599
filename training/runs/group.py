"""The data-parallel trainer's Ray Train plumbing: ``parallel.workers = N > 1`` Composer trainers in a worker group.

Every worker (rank ``r`` of ``N``) runs :func:`train_worker`, which runs :func:`training.runs.rank.run_rank` for its
rank: the same body as a single process (rank 0 of 1), which differs only where the rank shows (DESIGN.md §2,
docs/dev/ray-train-composer.md):

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
  ``world_size`` in the manifest), the metrics log and the experiment loggers' files; Composer writes the
  checkpoints from rank 0 only. Rank 0's :class:`~training.runs.rank.RankResult` (statistics, throughput, the final
  weights gathered on the host) is the return value of its worker function: Ray Train hands it to the driver, which
  finishes the run (:func:`training.runs.finish.finish`): no file on a shared filesystem carries it.
* **Preemption**: a SIGTERM / SIGINT caught by the driver (:class:`curation.io.stop.GracefulStop`) is set on the
  group's channel (:class:`~curation.engine.ray_backend.train_group.GroupChannel`, a Ray actor on the driver's
  node); every rank reads it at the end of every step and the ranks agree with one ``all_reduce``
  (MAX) of their flags (:class:`GroupStop`), so all stop after the same step, where rank 0's checkpoint is written
  (:class:`training.blocks.preemption.StopAtStepEnd`). Rank 0's result says where, and the driver raises
  :class:`~curation.io.stop.StopRequested` naming the step and the checkpoint.
* **Failures**: the worker group runs under Ray Train's failure config. A killed worker makes Ray Train
  restart the group, and every worker resumes from ``checkpoints/latest-rank0.pt`` (the run's usual
  resume), so the outputs equal an uninterrupted run. Ray Train retries *every* worker error; data errors
  (bad shards, diverged loss, bad settings) are recorded on the channel by the failing worker (with the input
  shard files a data error blames, by URL for an object-store input: :mod:`curation.io.bad_shards`), the retried
  group returns at once, and the driver raises the recorded message (and keeps it in ``parallel/fatal.json``).

* **Nodes**: the driver and the ranks share nothing but Ray and, for an ``s3://`` ``output_dir``, the bucket. The
  job travels :func:`~curation.io.carried.carry` ied (each rank's paths at its own node's cache, its files brought
  there: :func:`~curation.io.outputs.relocalize`); on a node other than the driver's, each rank pulls the folders
  ranks write (:data:`RANK_WRITES`) from the bucket (one at a time) before the group starts (the checkpoints every
  rank resumes from), rank 0 uploads
  checkpoints as Composer writes them (:class:`~training.blocks.trainer.CheckpointUpload`) and its selected parts
  as it flushes them, and pushes the rest of those folders when it ends; the driver then pulls them. Ray Train's state is in
  the bucket too. A setting given as a local path is probed on every node that could host a rank before the group
  starts (:func:`~curation.engine.ray_backend.train_group.check_group_nodes`) and refused naming it.

Ray itself is only imported by :mod:`curation.engine.ray_backend` (:func:`run_trainer_group`); this module
uses plain ``torch.distributed`` for the rank.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from curation.core.distributed import Ranks, current_ranks
from curation.engine.handle import EngineDriver, EngineFeed
from curation.engine.plan import EngineError, WorkerGroupFailed
from curation.engine.ray_backend import GroupChannel, run_trainer_group
from curation.io import storage
from curation.io.atomic import atomic_write_text
from curation.io.bad_shards import blamed
from curation.io.carried import Carried, carry
from curation.io.outputs import local_paths, relocalize
from curation.io.stop import stop_signal
from schemas.shards import ShardSchemaError
from schemas.train_config import TrainConfig
from training.blocks.callbacks import StepTimes
from training.blocks.preemption import StopAtStepEnd
from training.runs.rank import RankResult, run_rank

__all__ = ["GroupJob", "train_worker", "run_group", "trainer_cpus", "GroupStop", "FATAL_FILE", "ATTEMPTS_FILE"]

#: The driver's record of an error that retrying cannot fix (relative to output_dir).
FATAL_FILE = os.path.join("parallel", "fatal.json")
#: One line per worker start: rank, pid, node, attempt time, checkpoint resumed from (relative to output_dir; the
#: driver writes what the ranks told its channel).
ATTEMPTS_FILE = os.path.join("parallel", "attempts.jsonl")
#: The folders of output_dir a rank writes (rank 0: Composer's checkpoints, the selected-token shards, the metrics
#: log and the experiment loggers' files): what a rank on another node than the driver's pulls before it starts and
#: rank 0 there pushes when it ends, and the driver then pulls. Nothing else: the engine's folders (``scored/``,
#: ``engine/``: its actors upload what they write, read by the ranks part by part) and the driver's ``parallel/``
#: and records are not copied to every node, nor a stale copy of them uploaded from one.
RANK_WRITES = ("checkpoints", "selected", "logs")
#: Errors that a restart of the worker group cannot fix.
FATAL_ERRORS = (ValueError, ShardSchemaError, FileNotFoundError, EngineError)


# ------------------------------------------------------------------------------------------------
# the train-loop function of a Ray Train worker, and the driver
# ------------------------------------------------------------------------------------------------
class GroupStop:
    """A rank's stop request, polled at the end of every step: the signal the driver set on the group's channel,
    agreed on by every rank with one ``all_reduce`` (MAX) of the signal numbers, so that all ranks stop after the
    same step."""

    def __init__(self, channel: GroupChannel) -> None:
        self.channel = channel

    def __call__(self) -> int | None:
        local = self.channel.stop_signal()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            cuda = dist.get_backend() == "nccl"
            flag = torch.tensor([local], dtype=torch.int64,
                                device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag.item())
        return local or None


@dataclass(frozen=True)
class GroupJob:
    """What every worker of the group is handed (pickled once into the worker group's config, :func:`carry` ied:
    a rank on another node reads and writes the same URLs through its own cache).

    Attributes:
        cfg: the resolved training config.
        channel: the group's line to the driver (stop request, fatal error, attempts).
        feed: the running engine as the workers see it (their own handle), or ``None``.
        step_times: every rank records its step times (:class:`~training.blocks.callbacks.StepTimes`).
        cwd: the driver's working directory (relative paths of the config mean what they mean to the driver; a
            rank on the driver's node works there).
    """

    cfg: TrainConfig
    channel: GroupChannel
    feed: EngineFeed | None = None
    step_times: bool = False
    cwd: str = ""


def _sync_node_cache(out: str, ranks: Ranks, *, pull: bool) -> None:
    """An object-store output directory: on a node other than the driver's (``pull``), the rank makes its node's
    cache of the folders ranks write (:data:`RANK_WRITES`) equal to the bucket (the checkpoints every rank resumes
    from, rank 0's selected shards and logs to continue), one rank of the node at a time (a lock file in that cache:
    the second finds nothing left to fetch; not Ray Train's local rank, which counts ranks by IP address and so takes
    two nodes of one address for one); then every rank of the group waits for the others (one barrier, on every
    node): a new machine with an empty cache resumes where the run is. The driver's node holds the driver's cache,
    pulled when it opened the directory."""
    if pull:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".tmp-pull.lock"), "a+b") as lock:  # (.tmp-*: never synced, never deleted)
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                for sub in RANK_WRITES:
                    storage.pull(os.path.join(out, sub))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    if ranks.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()


def train_worker(config: Mapping[str, Carried[GroupJob]]) -> Carried[tuple[RankResult, bool]] | None:
    """The train-loop function every Ray Train worker runs (``config["job"]``): :func:`~training.runs.rank.run_rank`
    for its rank. Rank 0's result is the group's (Ray Train hands it to the driver, carried: its paths as URLs), with
    whether it ran on another node than the driver's (its outputs then reached the driver through the bucket).

    Re-run from the start on every group restart: the run resumes from its newest checkpoint.
    """
    job = config["job"].here()
    channel = job.channel
    on_driver_node = channel.on_driver_node()
    if on_driver_node and os.path.isdir(job.cwd):
        os.chdir(job.cwd)
    cfg = relocalize(job.cfg)  # (its files, e.g. the tokenizer, brought into this node's cache)
    out = cfg.output_dir
    if channel.fatal() is not None:
        return None  # an earlier attempt hit an error that a restart cannot fix; the driver reports it
    ranks = current_ranks()
    remote = storage.url_of(out) is not None and not on_driver_node  # (this node's own cache of the bucket)
    try:
        if storage.url_of(out) is not None:
            _sync_node_cache(out, ranks, pull=remote)
        if ranks.rank > 0:  # one progress bar
            cfg = cfg.model_copy(update={"progress_bar": False})
        if cfg.threads is None:  # one trainer per reserved CPU, not torch's default of every core
            torch.set_num_threads(max(1, int(cfg.parallel.cpus_per_worker)))
        result = run_rank(cfg, ranks, job.feed, callbacks=[StepTimes(out, ranks.rank)] if job.step_times else [],
                          stopper=StopAtStepEnd(GroupStop(channel)),
                          ready=lambda run: channel.record_attempt({
                              "rank": ranks.rank, "world_size": ranks.world_size, "pid": os.getpid(),
                              "node": channel.node_here(), "time": time.time(),
                              "resumed_from": storage.url_of(run.resumed_from or "") or run.resumed_from}))
    except FATAL_ERRORS as e:
        channel.record_fatal({"rank": ranks.rank, "error": type(e).__name__, "message": str(e),
                              "shards": [storage.url_of(s) or s for s in blamed(e)]})  # (URLs: the driver's cache)
        raise
    if remote and ranks.rank == 0:  # its selected shards, logs and checkpoints: in the bucket for the driver
        for sub in RANK_WRITES:
            storage.push(out, sub)
    return carry((result, remote))


def trainer_cpus(cfg: TrainConfig) -> int:
    """Ray CPUs the worker group reserves (a local Ray instance must have at least these, plus the engine's)."""
    return int(np.ceil(cfg.parallel.workers * cfg.parallel.cpus_per_worker))


def run_group(cfg: TrainConfig, *, feed: EngineFeed | None = None, engine: EngineDriver | None = None,
              step_times: bool = False) -> RankResult:
    """Run the worker group of ``cfg`` on the Ray cluster this process joined (the caller holds ``output_dir``'s
    lock) and return rank 0's :class:`~training.runs.rank.RankResult`.

    ``feed``: the running engine of ``jobs/curate_and_train.py`` (exact mode) as its trainer sees it, with ``engine``,
    its driver: the workers read its scores through their own handle (:meth:`EngineDriver.for_workers`), rank 0
    publishes proxy snapshots to it; the driver checks the engine while the group runs and closes it (which stops
    the group) when it fails.

    Inside a :class:`curation.io.stop.GracefulStop`, a stop signal is handed to the ranks (the group's channel,
    within 0.5 s) and the group stops after a step they agree on (:class:`GroupStop`); rank 0's result then says
    where (:meth:`RankResult.raise_if_stopped`).

    Raises:
        ValueError: bad settings or data (the failing worker's message), a local path a rank's node cannot reach,
            or a group that cannot be placed.
        WorkerGroupFailed: the group failed more than ``parallel.max_failures`` times.
    """
    if (feed is None) != (engine is None):
        raise ValueError("a worker group next to an engine needs both its feed and its driver")
    out = cfg.output_dir
    url = storage.url_of(out)
    storage.remove(os.path.join(out, FATAL_FILE))  # a rerun (after fixing the cause of an error) starts clean
    theirs = dataclasses.replace(feed, handle=engine.for_workers()) if feed is not None and engine else None
    channel = GroupChannel.open()
    job = GroupJob(cfg, channel, feed=theirs, step_times=step_times, cwd=os.getcwd())
    attempts = os.path.join(out, ATTEMPTS_FILE)

    def take_attempts() -> None:
        new = channel.new_attempts()
        if new:
            os.makedirs(os.path.dirname(attempts), exist_ok=True)
            with open(attempts, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(a) + "\n" for a in new)
            storage.publish(attempts)

    def monitor() -> None:  # every 0.5 s in the driver's main thread (where the signal handler runs)
        signum = stop_signal()
        if signum is not None:
            channel.request_stop(signum)
        take_attempts()
        if engine is not None:
            engine.check()

    try:
        carried = run_trainer_group(
            train_worker, {"job": carry(job)}, cfg.parallel, name="train", channel=channel, monitor=monitor,
            storage_path=f"{url}/parallel/ray_train" if url else os.path.join(os.path.abspath(out), "parallel",
                                                                               "ray_train"),
            on_monitor_error=engine.close if engine is not None else None, local_paths=local_paths(cfg),
        )
    except ValueError:
        take_attempts()
        if (record := channel.fatal()) is not None:  # the run's record of what it failed on
            atomic_write_text(os.path.join(out, FATAL_FILE), json.dumps(record))
            storage.publish(os.path.join(out, FATAL_FILE))
        raise
    finally:
        try:
            take_attempts()
        finally:
            channel.close()
    result, elsewhere = carried.here() if isinstance(carried, Carried) else (carried, False)
    if not isinstance(result, RankResult):
        raise WorkerGroupFailed(f"the trainer worker group ended without rank 0's result (it returned {result!r})")
    if elsewhere:  # what rank 0 wrote on another node (selected shards, logs, checkpoints): into this machine's cache
        for sub in RANK_WRITES:
            storage.pull(os.path.join(out, sub))
    return result
