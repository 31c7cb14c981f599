"""The trainer fed by the Ray engine (docs/DESIGN.md §3): Composer glue for the exact and pipelined modes.

The engine is reached through its declared handle (:class:`curation.engine.handle.EngineHandle`: ``wait_part``,
``trainer_at``, ``publish_proxy``, ``reference``, ``progress``), handed over in an
:class:`~curation.engine.handle.EngineFeed`, so nothing here imports ray.

* **exact**: :class:`~training.selection.shard_scores.EngineScores` stands in for scored shards in the BLADE
  algorithm: ``ℓ(w̃)`` of step ``t`` is read from the engine's scored part holding ``t``, waiting until a worker
  has written it. The trainer selects with its own ``ℓ(u)`` (:func:`training.runs.wiring.build_training`).
* **pipelined**: :class:`EngineMaskedBatches` yields each step's tokens with the finished ``loss_mask``
  from the engine's selected parts; the trainer is a plain masked-loss trainer
  (:func:`build_pipelined_training`); :class:`~training.selection.recorded.EngineSelection` only keeps the
  records the summary needs.
* both: :class:`EngineSync` publishes ``u^(s)`` at the plan's steps (refresh start points, pipelined
  snapshots), tells the engine which step the trainer is about to take (back-pressure), and measures
  ``‖u − w‖`` against the engine's reference on the device (read with the step's record: no read of its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from composer.core import Callback, State
from composer.loggers import Logger
from torch import Tensor, nn

from curation.core.host_sync import pinned
from curation.core.refresh_data import RecentMasks
from curation.core.stats import param_distance_tensor
from curation.engine.handle import EngineFeed, EngineHandle
from curation.engine.plan import TrainingPlan
from curation.io.models import check_token_range
from schemas.train_config import TrainConfig
from training.blocks.callbacks import StepSelections
from training.blocks.data import Batch, StepBatches
from training.blocks.preemption import StopAtStepEnd
from training.runs.wiring import TrainRun, training_inputs, wire
from training.selection.recorded import EngineSelection

__all__ = ["EngineSync", "EngineMaskedBatches", "build_pipelined_training"]


class EngineSync(Callback):
    """Publishes proxy snapshots, reports the trainer's step, measures ``‖u − w‖`` (on the device, into the step's
    record: :attr:`StepSelections.extra_values <training.blocks.callbacks.StepSelections>`).

    Args:
        engine: the running engine.
        plan: the training plan (which steps to publish).
        algorithm: what trained the step (its ``last`` record; its ``recent`` masks, for the refresh's ``L_train``).
        distance_interval: measure ``‖u − w‖`` every this many steps.
        log_every: log the engine's progress every this many steps.
    """

    def __init__(self, engine: EngineHandle, plan: TrainingPlan, *, algorithm: StepSelections, distance_interval: int = 1,
                 log_every: int = 10) -> None:
        self.engine = engine
        self.plan = plan
        self.algorithm = algorithm
        self.publish_steps = set(plan.publish_steps())
        self.refresh_sources = plan.refresh_sources()
        self.distance_interval = distance_interval
        self.log_every = log_every
        self.published: list[int] = []
        self.publish_seconds = 0.0
        self._ref: dict[str, Tensor] | None = None
        self._ref_version: int | None = None
        algorithm.extra_values.append(self._distance_values)

    @staticmethod
    def _proxy(state: State) -> nn.Module:
        return getattr(state.model, "module", state.model).model

    def _publish(self, state: State, step: int) -> None:
        if step not in self.publish_steps or step >= self.plan.stop_step:
            return
        start = time.perf_counter()
        recent = None
        if step in self.refresh_sources:
            self.algorithm.drain()  # the masks of every step before this one
            recent = RecentMasks.from_pairs(list(self.algorithm.recent))
        self.engine.publish_proxy(step, self._proxy(state), recent)
        self.published.append(step)
        self.publish_seconds += time.perf_counter() - start

    def fit_start(self, state: State, logger: Logger) -> None:
        step = int(state.timestamp.batch)
        self.engine.trainer_at(step)
        self._publish(state, step)

    def batch_end(self, state: State, logger: Logger) -> None:
        nxt = int(state.timestamp.batch)  # after the step: the step about to be taken
        self.engine.trainer_at(nxt)
        self._publish(state, nxt)
        if nxt % self.log_every == 0:
            p = self.engine.progress()
            logger.log_metrics({"engine/units_done": p.units_done, "engine/tokens_scored": p.tokens,
                                "engine/redone": p.redone, "engine/trainer_wait_s": self.engine.wait_seconds})

    def _distance_values(self, state: State, step: int, version: int) -> dict[str, Tensor]:
        """``{"distance": ‖u − w‖}`` of the step just taken (on the device) when it is measured."""
        if not self.algorithm.policy.needs_reference or version < 0 or step % self.distance_interval:
            return {}
        proxy = self._proxy(state)
        if self._ref_version != version:  # the reference's parameters in pinned host memory, once per version
            weights = self.engine.reference(version).state_dict()
            device = next(proxy.parameters()).device
            self._ref = {name: pinned(weights[name], device) for name, _ in proxy.named_parameters()}
            self._ref_version = version
        assert self._ref is not None
        return {"distance": param_distance_tensor(proxy, self._ref)}  # (each group copied without blocking)


class EngineMaskedBatches(StepBatches):
    """One batch per proxy step with the engine's finished mask (pipelined mode); waits for the part.

    Args:
        feed: the running engine, the selected-token shard directory it writes, the candidate stream (sample ids of
            each step), how long to wait for a step's mask before failing.
        stop_step: ``max_steps``.
        model_vocab: token ids are checked against it.
    """

    def __init__(self, feed: EngineFeed, stop_step: int, *, model_vocab: int | None = None) -> None:
        super().__init__(feed.stream, stop_step, model_vocab=model_vocab)
        self.feed = feed

    def batch(self, step: int) -> Batch:
        rows = self.feed.rows(step)
        if any(int(s) != step for s in rows.column("step")):
            raise ValueError(f"{rows.where}: rows of step {step} are labelled with another step")
        tokens = rows.column("tokens").astype(np.int64)
        if self.model_vocab is not None:
            check_token_range(tokens, self.model_vocab, f"{rows.where} (step {step})")
        return {
            "tokens": torch.from_numpy(tokens),
            "loss_mask": torch.from_numpy(rows.column("loss_mask").astype(bool)),
            "score": torch.from_numpy(rows.column("score").astype(np.float32)),
            "source": [str(s) for s in rows.column("source")],
            "sample_id": torch.from_numpy(self.stream.batch_ids(step)),
            "step": int(step),
            "episode": int(rows.column("episode")[0]),
            "ref_version": int(rows.ref_version),
        }


def build_pipelined_training(
    cfg: TrainConfig, *, batches: Callable[[int], EngineMaskedBatches], callbacks: Sequence[Callback] = (),
    stopper: StopAtStepEnd | None = None,
) -> TrainRun:
    """Wire a plain masked-loss Composer trainer on the engine's masks (pipelined mode).

    Same model, optimizer, evaluation, checkpoints and logs as :func:`training.runs.wiring.build_training`; only
    the data (finished masks, no proxy-side selection) and the bookkeeping algorithm differ.

    Args:
        cfg: the training config.
        batches: ``model_vocab → EngineMaskedBatches`` (built once the model's vocabulary is known).
        callbacks: extra callbacks.
        stopper: as in :func:`training.runs.wiring.wire`.

    Returns:
        A :class:`training.runs.wiring.TrainRun` whose ``algorithm`` is the :class:`EngineSelection`.
    """
    inputs = training_inputs(cfg)
    selection = EngineSelection(cfg.selection.policy, recent_batches=cfg.selection.refresh_candidate_batches)
    return wire(cfg, inputs, batches(inputs.vocab), selection, callbacks=callbacks, stopper=stopper)
