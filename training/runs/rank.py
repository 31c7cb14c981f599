"""The one body of every trainer process: :func:`run_rank` → :class:`RankResult`.

A single process (``jobs/train.py``), each rank of the data-parallel Ray Train group (:mod:`training.runs.group`) and
the trainer fed by the Ray engine (``jobs/curate_and_train.py``, one process or a group) all run :func:`run_rank`:
it wires the trainer of the config for its rank (exact BLADE or another policy on the candidate stream, the
engine's scores in its place when there is a feed; the engine's masks, pipelined), puts the engine's sync first
among the callbacks on rank 0 when there is a feed (:class:`~training.runs.engine_feed.EngineSync`: proxy
publication, back-pressure, ``‖u − w‖``), fits, and returns a frozen :class:`RankResult`: what the rank trained,
its statistics and throughput, its time publishing and waiting for the engine, and the weights that
:func:`training.runs.finish.finish` writes to ``final/``. A result is plain data: a group's rank 0 returns it from
its Ray Train worker function and it reaches the driver serialised once (no file on a shared filesystem).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from composer.core import Callback
from torch import Tensor

from curation.core.distributed import Ranks
from curation.core.stream import CandidateStream
from curation.engine.handle import EngineFeed
from curation.io.hf_export import TokenizerFiles
from schemas.train_config import TrainConfig
from training.blocks.preemption import StopAtStepEnd, stopped_at_step
from training.blocks.sharding import full_state_dict, is_sharded
from training.blocks.summary import Section
from training.runs.engine_feed import EngineMaskedBatches, EngineSync, build_pipelined_training
from training.runs.wiring import TrainRun, build_training
from training.selection.algorithm import BladeAlgorithm
from training.selection.shard_scores import EngineScores

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["FinalWeights", "RankResult", "run_rank", "rank_result"]


@dataclass(frozen=True)
class FinalWeights:
    """The weights a finished run leaves for ``final/``: the trained model's full state dict (on the host when it
    travels from a worker group), its HF config, the in-process reference ``w̃``'s (``None``: no reference, or the
    engine's, which :class:`~curation.engine.report.EngineReport` names), and the shards' tokenizer (copied beside
    them, so that ``AutoTokenizer`` loads ``final/`` too; ``None``: unknown)."""

    model: Mapping[str, Tensor]
    config: PretrainedConfig
    reference: Mapping[str, Tensor] | None = None
    tokenizer: TokenizerFiles | None = None


@dataclass(frozen=True)
class RankResult:
    """What one trainer process did (rank 0's is the run's: the statistics, the weights).

    Attributes:
        rank, world_size: which rank of how many trainer processes.
        steps: the steps trained (all of them, a resumed run's included).
        stopped_at: the steps trained when a stop request ended the fit early (``None``: it ran to the end).
        signum: the stop signal's number.
        resumed_from: the checkpoint this run resumed from.
        stats: the selection statistics (:meth:`~training.blocks.callbacks.SelectionStats.summary_data`; ``None``:
            a trainer without selection, replay).
        validation: ``{step, loss, perplexity}`` after each evaluation.
        throughput: :meth:`~training.blocks.throughput.Throughput.summary`.
        memory: the trainer's peak host and device memory (:meth:`~training.blocks.throughput.Throughput.memory`).
        publish_seconds: time spent publishing proxy snapshots to the engine.
        wait_seconds: time spent waiting for the engine's parts; ``waits``: ``(step, seconds)`` of each ≥ 50 ms.
        stream: the candidate stream it trained on (``None``: replay).
        selected_dir: where the selected-token shards of the run are (``None``: none written).
        weights: what ``final/`` receives (``None``: a stopped run, or a rank other than 0).
    """

    rank: int = 0
    world_size: int = 1
    steps: int = 0
    stopped_at: int | None = None
    signum: int | None = None
    resumed_from: str | None = None
    stats: Section | None = None
    validation: tuple[Section, ...] = ()
    throughput: Section | None = None
    memory: Section | None = None
    publish_seconds: float = 0.0
    wait_seconds: float = 0.0
    waits: tuple[tuple[int, float], ...] = ()
    stream: CandidateStream | None = None
    selected_dir: str | None = None
    weights: FinalWeights | None = None

    def raise_if_stopped(self, output_dir: str, max_steps: int) -> None:
        """Raise :class:`~curation.io.stop.StopRequested` naming the step and the checkpoint a rerun resumes from,
        when a stop request ended the fit early (``final/`` and the summary are then not written)."""
        if self.stopped_at is not None:
            assert self.signum is not None
            raise stopped_at_step(self.signum, self.stopped_at, output_dir, max_steps)


def run_rank(cfg: TrainConfig, ranks: Ranks, feed: EngineFeed | None, *, callbacks: Sequence[Callback] = (),
             stopper: StopAtStepEnd | None = None, ready: Callable[[TrainRun], None] | None = None) -> RankResult:
    """Wire, fit and account for the trainer of ``cfg``'s rank ``ranks`` (module docstring).

    Args:
        cfg: the training config (``parallel.workers`` is ``ranks.world_size``).
        ranks: this process's rank (a single process: rank 0 of 1).
        feed: the running engine as the trainer sees it (``None``: no engine; the in-process reference scores, or
            ``data.scored``).
        callbacks: more Composer callbacks.
        stopper: ends the fit at a step end on a stop request (default: a signal caught by the active
            :class:`curation.io.stop.GracefulStop`; a group's rank passes its group's).
        ready: called with the wired run before it is fitted (the output directory's records, a group's attempt log).

    Raises:
        ShardSchemaError, ValueError: bad data or settings (naming the file or setting).
        EngineError: the engine failed.
    """
    run = _wire(cfg, ranks, feed, callbacks=callbacks, stopper=stopper)
    sync = None
    if feed is not None and ranks.rank == 0:  # rank 0 publishes u and reports the trainer's step
        assert run.algorithm is not None
        sync = EngineSync(feed.handle, feed.plan, algorithm=run.algorithm,
                          distance_interval=cfg.effective_distance_interval)
        run.trainer.state.callbacks.insert(0, sync)  # before the statistics: the distance is on the record
    if ready is not None:
        ready(run)
    run.fit()  # a rerun of a finished run only reports
    selected = feed.out_dir if feed is not None and feed.plan.mode == "pipelined" else (
        os.path.join(cfg.output_dir, "selected") if cfg.write_selected else None)
    return rank_result(run, ranks, reference=feed is None, selected_dir=selected,
                       publish_seconds=sync.publish_seconds if sync is not None else 0.0,
                       wait_seconds=feed.handle.wait_seconds if feed is not None else 0.0,
                       waits=tuple(feed.handle.waits) if feed is not None else ())


def _wire(cfg: TrainConfig, ranks: Ranks, feed: EngineFeed | None, *, callbacks: Sequence[Callback],
          stopper: StopAtStepEnd | None) -> TrainRun:
    if feed is None:
        return build_training(cfg, ranks=ranks, callbacks=callbacks, stopper=stopper)
    if feed.plan.mode == "pipelined":  # the engine's masks: a plain masked-loss trainer, one process
        if ranks.world_size > 1:
            raise ValueError("engine.mode=pipelined trains in one process: set train.parallel.workers=1")
        return build_pipelined_training(cfg, batches=lambda vocab: EngineMaskedBatches(feed, cfg.max_steps,
                                                                                       model_vocab=vocab),
                                        callbacks=callbacks, stopper=stopper)
    # exact mode: every rank reads the engine's scores of its rows; the schedule is the engine's plan's
    return build_training(cfg, ranks=ranks, scored=EngineScores(feed), schedule=feed.plan.schedule,
                          callbacks=callbacks, stopper=stopper)


def rank_result(run: TrainRun, ranks: Ranks, *, reference: bool = True, selected_dir: str | None = None,
                publish_seconds: float = 0.0, wait_seconds: float = 0.0,
                waits: tuple[tuple[int, float], ...] = ()) -> RankResult:
    """The :class:`RankResult` of a fitted ``run`` (``reference``: the in-process reference's weights go to
    ``final/``). Gathering a sharded model's weights is a collective: every rank calls this; only rank 0's result
    holds the weights and the statistics."""
    state = run.trainer.state
    steps = int(state.timestamp.batch)
    base = RankResult(rank=ranks.rank, world_size=ranks.world_size, steps=steps, resumed_from=run.resumed_from,
                      publish_seconds=publish_seconds, wait_seconds=wait_seconds, waits=waits, stream=run.stream,
                      selected_dir=selected_dir)
    if run.stopped_at is not None:  # every rank of a group stopped after the same step
        assert run.stopper is not None
        return dataclasses.replace(base, stopped_at=run.stopped_at, signum=run.stopper.signum)
    hf = run.model.model
    ref = None  # sharded, both gathers are collectives: every rank makes them, in the same order
    if reference and isinstance(run.algorithm, BladeAlgorithm):
        ref = run.algorithm.reference_state_dict(copy=False)  # (written by finish right away)
    model = full_state_dict(hf) if is_sharded(hf) else hf.state_dict()
    if ranks.rank > 0:
        return base
    if ranks.world_size > 1:  # it travels to the driver: host tensors
        model = {k: v.detach().to("cpu") for k, v in model.items()}
    stats = run.stats
    meter = run.throughput
    return dataclasses.replace(base, stats=stats.summary_data() if stats is not None else None,
                    validation=tuple(stats.val) if stats is not None else (),
                    throughput=meter.summary(state) if meter is not None else None,
                    memory=meter.memory() if meter is not None else None,
                    weights=FinalWeights(model, hf.config, ref, run.tokenizer))
