"""The one host read of a trainer's steady step (docs/DESIGN.md §6, "Steps that never wait").

What the host needs to know of step ``t`` (its loss; the BLADE algorithm's selection record: mask, validity, scores,
a finiteness flag, ``‖u − w̃‖`` when measured) is computed on the device. At the end of step ``t`` those tensors are
copied without blocking into reused pinned host buffers and an event is recorded
(:class:`~curation.core.host_sync.HostCopies`); at the end of step ``t + 1``, once that step's work is queued, the host
waits for step ``t``'s event (the one read of the step) and *delivers* step ``t``: the loss is logged as
``loss/train/total`` (step ``t``) and set as ``state.total_loss_dict``, the subclass makes its record
(:meth:`StepReads.finish`), and every subscriber (the selected-shard writer, the statistics) receives it. On a CPU
the same happens without copies or events: the same values, delivered at the same points.

A step still pending is delivered by :meth:`StepReads.drain`: before a checkpoint's state is taken (every
subscriber's ``state_dict`` drains first), before a refresh reads the recent masks, before a proxy is published with
them, and at the end of the fit. A diverged step (non-finite loss) is therefore raised at the end of the next step or
before the checkpoint that would hold it, never written.

:class:`StepReads` itself is the plain trainer's (replay: the loss only); the BLADE algorithm
(:class:`training.selection.algorithm.BladeAlgorithm`) and the engine-fed pipelined trainer's record
(:class:`training.selection.recorded.EngineSelection`) extend it. :class:`~training.blocks.trainer.LeanTrainer` hands
it each step's loss on the device (``loss``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from torch import Tensor

from curation.core.host_sync import HostCopies, Ticket

__all__ = ["StepReads"]

Info = TypeVar("Info")  # what the host knows of a step before its device values are read
Record = TypeVar("Record")  # what a delivered step becomes


class StepReads(Algorithm, Generic[Info, Record]):
    """The deferred reads of a run's steps (module docstring). Subclasses override :meth:`step_values` (device
    tensors of the step), :meth:`step_info` (what the host knows of it: ``Info``) and :meth:`finish` (the
    ``Record`` delivered)."""

    def __init__(self) -> None:
        self.loss: Tensor | None = None  # this step's loss on the device (LeanTrainer, one process)
        self.copies: HostCopies | None = None
        self._pending: tuple[Ticket, int, Info | None, float | None] | None = None
        self._subscribers: list[Callable[[Record | None], None]] = []
        self._logger: Logger | None = None
        self._state: State | None = None
        self.reads = 0  # steps delivered after a wait on the device

    # --- what subclasses provide ---------------------------------------------------------------
    def step_values(self, state: State) -> dict[str, Tensor]:
        """Device tensors of the step just taken, read a step later."""
        return {}

    def step_info(self, state: State) -> Info | None:
        """What the host knows of the step just taken (kept until it is delivered)."""
        return None

    def finish(self, step: int, host: dict[str, Tensor], info: Info | None, loss: float | None) -> Record | None:
        """The record of step ``step`` from its host values (valid until the next delivery: copy what is kept)."""
        return None

    # --- subscribers ---------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[Record | None], None]) -> None:
        """``fn(record)`` on every step delivered, in step order."""
        self._subscribers.append(fn)

    # --- Composer hooks --------------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.BATCH_END, Event.FIT_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.FIT_START:
            self.start(state, logger)
        elif event == Event.BATCH_END:
            self.queue(state)
        elif event == Event.FIT_END:
            self.drain()

    def start(self, state: State, logger: Logger) -> None:
        self._state, self._logger = state, logger
        device = next(state.model.parameters()).device
        self.copies = HostCopies(device, slots=2)

    def queue(self, state: State) -> None:
        """The step just taken: its device values' copies queued; then the step before it delivered."""
        assert self.copies is not None, "StepReads.queue before FIT_START"
        values = dict(self.step_values(state))
        loss_host = None
        if self.loss is not None:
            values["loss"] = self.loss.detach().reshape(())
        else:  # (data-parallel ranks: Composer read and summed the loss already)
            loss = (state.total_loss_dict or {}).get("loss/train/total")
            loss_host = float(loss) if loss is not None and not isinstance(loss, Tensor) else None
        self.loss = None
        ticket = self.copies.put(values)
        step = int(state.timestamp.batch) - 1  # (Composer advanced the timestamp before BATCH_END)
        previous, self._pending = self._pending, (ticket, step, self.step_info(state), loss_host)
        if previous is not None:
            self._deliver(previous)

    def drain(self) -> None:
        """Deliver the step still pending (a host wait when there is one)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._deliver(pending)

    def _deliver(self, pending: tuple[Ticket, int, Info | None, float | None]) -> None:
        ticket, step, info, loss = pending
        assert self.copies is not None
        host = self.copies.get(ticket)
        self.reads += 1
        if "loss" in host:
            loss = float(host["loss"])
        if loss is not None and "loss" in host:  # (Composer logged a data-parallel run's loss itself)
            if self._state is not None:
                self._state.total_loss_dict = {"loss/train/total": loss}
            if self._logger is not None:
                self._logger.log_metrics({"loss/train/total": loss}, step=step)
        record = self.finish(step, host, info, loss)
        for fn in self._subscribers:
            fn(record)

    def state_dict(self) -> dict[str, Any]:
        self.drain()
        return {}
