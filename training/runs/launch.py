"""The one launcher of trainer processes: :func:`launch` runs :func:`training.runs.rank.run_rank` in this process for
one worker, or as a Ray Train worker group for ``parallel.workers = N > 1`` (:func:`training.runs.group.run_group`),
and returns rank 0's :class:`~training.runs.rank.RankResult` either way; a stopped run raises there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from composer.core import Callback

from curation.core.distributed import Ranks
from curation.engine.handle import EngineDriver, EngineFeed
from schemas.train_config import TrainConfig
from training.blocks.callbacks import StepTimes
from training.runs.group import run_group
from training.runs.rank import RankResult, run_rank
from training.runs.wiring import TrainRun

__all__ = ["launch"]


def launch(cfg: TrainConfig, *, feed: EngineFeed | None = None, engine: EngineDriver | None = None,
           callbacks: Sequence[Callback] = (), step_times: bool = False,
           ready: Callable[[TrainRun], None] | None = None) -> RankResult:
    """Train ``cfg`` (its caller holds ``output_dir``'s lock; a group needs the Ray cluster this process joined) and
    return rank 0's result.

    Args:
        cfg: the training config; ``parallel.workers`` trainer processes.
        feed: the running engine as the trainer sees it, and ``engine`` its driver (the main job), or neither.
        callbacks: more Composer callbacks (one worker only: they live in this process).
        step_times: every rank records its step times (``jobs/bench_scaling.py``).
        ready: called with the wired run before it is fitted (one worker: in this process).

    Raises:
        StopRequested: a stop signal ended the run after a step, with a checkpoint there (names both).
        ValueError: bad settings or data; callbacks given to a worker group.
    """
    if cfg.parallel.workers == 1:
        extra = [StepTimes(cfg.output_dir)] if step_times else []
        result = run_rank(cfg, Ranks(), feed, callbacks=[*callbacks, *extra], ready=ready)
    else:
        if callbacks or ready is not None:
            raise ValueError("callbacks and a ready hook run in this process: a worker group's ranks run elsewhere")
        result = run_group(cfg, feed=feed, engine=engine, step_times=step_times)
    result.raise_if_stopped(cfg.output_dir, cfg.max_steps)
    return result
