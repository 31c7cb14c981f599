"""Preemption of a trainer: on a stop request, training ends after the current step, with a checkpoint there.

:class:`StopAtStepEnd` is a Composer callback polled at ``BATCH_END`` of every step. When a stop was requested
(SIGTERM / SIGINT inside a :class:`curation.io.stop.GracefulStop`; a data-parallel rank asks its group instead, so
that all ranks agree on the step), it calls Composer's ``state.stop_training()``, which lowers ``max_duration`` to
the step just finished: the checkpoint interval of :func:`training.blocks.trainer.make_trainer` is due at
``max_duration``, so ``BATCH_CHECKPOINT`` writes this step's checkpoint, the loop ends, and ``FIT_END`` runs
(the selected-shard writer flushes its rows and records the run as incomplete). ``max_duration`` is not part of
a checkpoint, so a rerun trains on to ``max_steps`` from the step after the last one trained.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from composer.core import Callback, State
from composer.loggers import Logger

from curation.io import storage
from curation.io.stop import StopRequested, stop_signal

__all__ = ["StopAtStepEnd", "stopped_at_step"]


class StopAtStepEnd(Callback):
    """End training after the step in progress when ``requested()`` returns a signal number.

    Args:
        requested: polled once per step (every rank of a group polls it at the same step); returns the stop
            signal's number, or None to go on. Default: the signal of the active :class:`curation.io.stop.GracefulStop`.

    Attributes:
        stopped_at: the number of steps trained when training stopped (None: it did not stop early).
        signum: the signal that stopped it.
    """

    def __init__(self, requested: Callable[[], int | None] = stop_signal) -> None:
        self.requested = requested
        self.stopped_at: int | None = None
        self.signum: int | None = None

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.stopped_at is not None or state.max_duration is None:
            return
        signum = self.requested()
        if signum and state.timestamp < state.max_duration:  # (at the last step the run just finishes)
            self.signum, self.stopped_at = int(signum), int(state.timestamp.batch)
            state.stop_training()

    def stop(self, output_dir: str, max_steps: int) -> StopRequested:
        """The :class:`~curation.io.stop.StopRequested` to raise after the fit (:func:`stopped_at_step`)."""
        assert self.stopped_at is not None and self.signum is not None
        return stopped_at_step(self.signum, self.stopped_at, output_dir, max_steps)


def stopped_at_step(signum: int, step: int, output_dir: str, max_steps: int) -> StopRequested:
    """The :class:`~curation.io.stop.StopRequested` of a run in ``output_dir`` stopped after ``step`` steps: names the
    step and the checkpoint a rerun resumes from."""
    latest = os.path.join(output_dir, "checkpoints", "latest-rank0.pt")
    ckpt = storage.display(os.path.join(os.path.dirname(latest), os.path.basename(os.path.realpath(latest))))
    return StopRequested(signal.Signals(signum), (
        f"after step {step} of {max_steps} (checkpoint {ckpt}); rerun the same command to resume from it at step "
        f"{step + 1}"))
