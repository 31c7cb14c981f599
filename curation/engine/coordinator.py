"""The coordinator's state (docs/DESIGN.md §3): which unit a worker does next, completion, failures, redo.

Pure Python: no ray. The Ray coordinator actor wraps one :class:`Coordinator`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from curation.engine.plan import EngineError, WorkUnit
from curation.io.bad_shards import blame


# ------------------------------------------------------------------------------------------------
# coordinator state
# ------------------------------------------------------------------------------------------------
class Coordinator:
    """Assignment of work units to workers (pure state; the Ray coordinator actor wraps it).

    A unit is *ready* when the weights it needs are published and, with a trainer, when it ends no more
    than ``lookahead`` steps after the step the trainer is about to take (back-pressure). Units are
    handed out in step order, one per request.

    A worker asks for its next unit *ahead*, while it still scores the one it holds, so the answer is there when
    that one is written: a worker holds the units handed to it until their reports (:meth:`complete`) arrive,
    the one it scores and the one asked ahead (and, for a moment, one whose report is on its way). A worker that
    (re)starts says so (:meth:`worker_started`): every unit it held goes back to pending, since its report may
    have died with the old process, and a report that still comes for one is ignored. The units it had begun are
    counted in :attr:`redone`: a worker asks ahead as it begins a unit, so a request marks the units the worker
    holds as begun, and the one handed out by the request as not yet.

    Args:
        units: all units of the run (any order).
        done: names of units already finished (resume).
        lookahead: the back-pressure bound, or ``None`` (no trainer: batch curation).
    """

    def __init__(self, units: Iterable[WorkUnit], *, done: Iterable[str] = (), lookahead: int | None = None) -> None:
        self.units = sorted(units, key=lambda u: u.first)
        self._firsts = [u.first for u in self.units]
        self.by_name = {u.name: u for u in self.units}
        if len(self.by_name) != len(self.units):
            raise ValueError("work units overlap")
        unknown = set(done) - set(self.by_name)
        if unknown:
            raise ValueError(f"finished parts {sorted(unknown)[:3]} are not units of this plan")
        self.done: set[str] = set(done)
        self.held: dict[int, list[str]] = {}  # worker → the units handed to it and not reported, in hand-out order
        self.begun: set[str] = set()  # held units their worker has begun (see the class)
        self.published: set[tuple[str, int]] = set()
        self.lookahead = lookahead
        self.trainer_step = 0
        self.failed: str | None = None
        self.failed_shards: tuple[str, ...] = ()  # the input shard files the failure blames (bad data)
        self.stopped = False
        self.redone = 0
        self.handed_out = 0

    # --- inputs ------------------------------------------------------------------------------
    def publish(self, kind: str, version: int) -> None:
        self.published.add((kind, int(version)))

    def retract(self, kind: str, version: int) -> None:
        self.published.discard((kind, int(version)))

    def trainer_at(self, step: int) -> None:
        """The trainer is about to take ``step`` (monotone)."""
        self.trainer_step = max(self.trainer_step, int(step))

    def fail(self, message: str, shards: Iterable[str] = ()) -> None:
        """The engine fails with ``message`` (the first failure wins); ``shards``: the input shard files whose data
        it blames (:mod:`curation.io.bad_shards`)."""
        if self.failed is None:
            self.failed = message
            self.failed_shards = tuple(shards)

    def error(self) -> EngineError:
        """The failure as the error every caller of the engine raises (blaming its shard files)."""
        return blame(EngineError(self.failed or "the engine failed"), *self.failed_shards)

    def stop(self) -> None:
        self.stopped = True

    # --- queries -----------------------------------------------------------------------------
    def ready(self, unit: WorkUnit) -> bool:
        if any(k not in self.published for k in unit.needs()):
            return False
        return self.lookahead is None or unit.stop <= self.trainer_step + self.lookahead

    def pending(self) -> list[WorkUnit]:
        """Units neither finished nor held by a worker, in step order."""
        held = {name for names in self.held.values() for name in names}
        return [u for u in self.units if u.name not in self.done and u.name not in held]

    def next_unit(self, worker: int) -> tuple[str, WorkUnit | None]:
        """``("work", unit)``: a unit more for ``worker`` to hold; ``("wait", None)`` (nothing ready yet) or
        ``("stop", None)``. The units ``worker`` holds are begun from now on."""
        self.begun.update(self.held.get(worker, ()))
        if self.failed is not None or self.stopped:
            return "stop", None
        pending = self.pending()
        if not pending:
            return "stop", None
        for unit in pending:
            if self.ready(unit):
                self.held.setdefault(worker, []).append(unit.name)
                self.handed_out += 1
                return "work", unit
            if self.lookahead is not None and unit.stop > self.trainer_step + self.lookahead:
                break  # later units are further ahead still
        return "wait", None

    def worker_started(self, worker: int) -> None:
        """``worker`` (re)started: the units it held go back to pending, their reports taken as lost; those it had
        begun count as redone."""
        names = self.held.pop(worker, [])
        self.redone += sum(name in self.begun for name in names)
        self.begun.difference_update(names)

    def complete(self, worker: int, name: str) -> WorkUnit | None:
        """Record that ``worker`` wrote unit ``name``; the unit, or ``None`` for the late report of a unit given back
        to pending when its worker restarted (ignored: the unit is redone).

        Raises:
            ValueError: the unit is finished, or held by another worker."""
        mine = self.held.get(worker, [])
        if name in mine:
            mine.remove(name)
            self.begun.discard(name)
            if not mine:
                del self.held[worker]
        elif any(u.name == name for u in self.pending()):
            return None
        else:
            raise ValueError(f"worker {worker} reports {name} finished but holds {mine or None}")
        self.done.add(name)
        return self.by_name[name]

    def unit_for(self, step: int) -> WorkUnit | None:
        i = bisect.bisect_right(self._firsts, step) - 1
        if i >= 0 and step < self.units[i].stop:
            return self.units[i]
        return None

    def finished(self) -> bool:
        return len(self.done) == len(self.units)

    def needed(self) -> set[tuple[str, int]]:
        """Weights still needed by units not finished."""
        return {k for u in self.units if u.name not in self.done for k in u.needs()}
