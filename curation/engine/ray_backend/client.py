"""A trainer's handle on the engine on Ray: :class:`EngineClient`, the engine's trainer calls on the coordinator's
actor handle (:class:`curation.engine.handle.EngineHandle`). The driver's
:class:`~curation.engine.ray_backend.RayEngine` is one (it also owns the actors and makes the driver's calls,
:class:`curation.engine.handle.EngineDriver`); a data-parallel trainer worker holds a plain one (picklable: the
coordinator's handle travels in the worker group's feed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from torch import nn

from curation.core.refresh_data import RecentMasks
from curation.engine.plan import REFERENCE, EngineError
from curation.engine.report import EngineProgress, PartInfo
from curation.engine.state import save_snapshot
from curation.engine.weights import Weights
from curation.io.bad_shards import blame, blamed

__all__ = ["EngineClient", "engine_error", "error_message", "RERUN"]

#: What to do after the engine stopped because one of its processes died (killed, out of memory, its node lost).
RERUN = "finished work is kept: rerun the same command to resume"


def error_message(err: BaseException) -> str:
    """The original error's message out of Ray's wrappers; an actor that died (not one whose start failed: its
    error is the message) in one line saying which and what to do."""
    cause = getattr(err, "cause", None)
    if isinstance(err, RayTaskError) and cause is not None:
        return error_message(cause)
    if isinstance(err, RayActorError) and not getattr(err, "actor_init_failed", False):
        return _actor_death(str(err))
    return str(err)


def engine_error(err: BaseException) -> EngineError:
    """An error of the engine's actors as the :class:`EngineError` its callers raise: the original message
    (:func:`error_message`), blaming the input shard files the original blames (:mod:`curation.io.bad_shards`)."""
    return blame(EngineError(error_message(err)), *blamed(err))


def _actor_death(text: str) -> str:
    """Ray's multi-line report of a dead actor ("The actor died unexpectedly ...", tab-indented fields, then why) as
    one line: which actor, its pid, why, and :data:`RERUN`."""
    lines = [line for line in text.splitlines() if line.strip()]
    fields = dict(line.strip().split(": ", 1) for line in lines if line.startswith("\t") and ": " in line)
    why = " ".join(line.strip() for line in lines[1:] if not line.startswith("\t")) or (lines[0] if lines else "")
    name = fields.get("class_name", "actor").strip("_").removesuffix("Actor") or "actor"  # _CoordinatorActor: Coordinator
    who = f"the engine's {name}" + (f" (pid {fields['pid']})" if "pid" in fields else "")
    why = why if len(why) <= 300 else why[:300] + "..."
    return f"{who} died: {why}; {RERUN}"


class EngineClient:
    """The trainer's calls on a running engine's coordinator: ``wait_part`` (every rank of a data-parallel trainer:
    each needs the scores of its rows), ``trainer_at`` and ``publish_proxy`` (rank 0 only: the weights are identical
    on every rank), ``reference``, ``progress``. The driver checks the scoring workers and ends the engine
    (:class:`~curation.engine.ray_backend.RayEngine`, which checks them between two empty answers too).

    Args:
        coordinator: the coordinator actor's handle.
        engine_dir: where the engine keeps weights versions (proxy snapshots are saved there before publishing).
    """

    def __init__(self, coordinator: ActorHandle, engine_dir: str) -> None:
        self.coordinator = coordinator
        self.engine_dir = engine_dir
        self.wait_seconds = 0.0
        self.waits: list[tuple[int, float]] = []  # (step, seconds) of the trainer's waits ≥ 50 ms

    def _get(self, ref: ObjectRef | list[ObjectRef], timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except RayTaskError as e:
            raise engine_error(e) from None
        except RayActorError as e:  # killed (one line, with the rerun), or failed to start (its error is the message)
            raise engine_error(e) from None

    def _idle(self) -> None:
        """After an empty answer: nothing in a trainer worker (the driver checks the engine; RayEngine does here)."""

    def _poll(self, ask: Callable[[], ObjectRef], *, timeout_s: float = math.inf,
              each: Callable[[], None] | None = None) -> Any:
        """Ask the coordinator (``ask()`` starts a call that waits a little itself) until it answers, running
        ``each`` after every answer and :meth:`_idle` after every empty one; ``None`` after ``timeout_s``."""
        start = time.monotonic()
        while True:
            answer = self._get(ask())
            if each is not None:
                each()
            if answer:
                return answer
            self._idle()
            if time.monotonic() - start > timeout_s:
                return None

    def wait_part(self, step: int, *, timeout_s: float = 1800.0) -> PartInfo:
        """Block until the part holding ``step`` is recorded."""
        start = time.monotonic()
        info = self._poll(lambda: self.coordinator.wait_part.remote(step, 2.0), timeout_s=timeout_s)
        if info is None:
            raise EngineError(f"no scores for step {step} after {timeout_s:.0f}s ({self.progress()})")
        waited = time.monotonic() - start
        self.wait_seconds += waited
        if waited >= 0.05:
            self.waits.append((int(step), round(waited, 3)))
        return info

    def trainer_at(self, step: int) -> None:
        self.coordinator.trainer_at.remote(int(step))

    def publish_proxy(self, step: int, model: nn.Module, recent: RecentMasks | None = None) -> None:
        """Save ``u^(step)`` (and the recent masks) under ``engine_dir``, put it in the object store once, register it."""
        weights = Weights.from_state_dict(model)
        save_snapshot(self.engine_dir, step, weights, recent)
        self._get(self.coordinator.publish_proxy.remote(int(step), [ray.put(weights)], recent))

    def reference(self, version: int, *, timeout_s: float = 1800.0) -> Weights:
        ref = self._get(self.coordinator.weights.remote(REFERENCE, int(version), timeout_s))
        if ref is None:
            raise EngineError(f"reference {version} not available after {timeout_s:.0f}s")
        return self._get(ref[0])

    def progress(self) -> EngineProgress:
        return self._get(self.coordinator.progress.remote())
