"""The coordinator's state (docs/DESIGN.md §3): which unit a worker does next, completion, failures, redo.

Pure Python: no ray. The Ray coordinator actor wraps one :class:`Coordinator`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from curation.engine.plan import (
    WorkUnit,
)


# ------------------------------------------------------------------------------------------------
# coordinator state
# ------------------------------------------------------------------------------------------------
class Coordinator:
    """Assignment of work units to workers (pure state; the Ray coordinator actor wraps it).

    A unit is *ready* when the weights it needs are published and, with a trainer, when it ends no more
    than ``lookahead`` steps after the step the trainer is about to take (back-pressure). Units are
    handed out in step order. A worker asking again while it still holds a unit gets the same unit back:
    that is a worker restarted by Ray redoing the unit it crashed in (counted in :attr:`redone`).

    A worker does not wait for its report: it asks for its next unit *releasing* the one it has just written
    (``next_unit(worker, released=name)``) while the report (:meth:`complete`) is still on its way, so the
    coordinator's recording (index, manifest, an upload to a bucket) overlaps the next unit's scoring. A released
    unit is *reporting*: neither pending nor held, until its report arrives, in either order. A worker that
    (re)starts says so (:meth:`worker_started`): a report of its still missing then may have died with the old
    process, so those units go back to pending (redone), and a report that still comes for one is ignored.

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
        self.assigned: dict[int, str] = {}
        self.reporting: dict[str, int] = {}  # unit → the worker whose report of it is on its way
        self.published: set[tuple[str, int]] = set()
        self.lookahead = lookahead
        self.trainer_step = 0
        self.failed: str | None = None
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

    def fail(self, message: str) -> None:
        if self.failed is None:
            self.failed = message

    def stop(self) -> None:
        self.stopped = True

    # --- queries -----------------------------------------------------------------------------
    def ready(self, unit: WorkUnit) -> bool:
        if any(k not in self.published for k in unit.needs()):
            return False
        return self.lookahead is None or unit.stop <= self.trainer_step + self.lookahead

    def pending(self) -> list[WorkUnit]:
        """Units neither finished nor held by a worker nor reported, in step order."""
        held = set(self.assigned.values()) | set(self.reporting)
        return [u for u in self.units if u.name not in self.done and u.name not in held]

    def next_unit(self, worker: int, released: str | None = None) -> tuple[str, WorkUnit | None]:
        """``("work", unit)``, ``("wait", None)`` (nothing ready yet) or ``("stop", None)``.

        Args:
            worker: the asking worker.
            released: the unit the worker has just written, its report on the way (see the class)."""
        if released is not None and self.assigned.get(worker) == released:
            del self.assigned[worker]
            self.reporting[released] = worker
        if self.failed is not None or self.stopped:
            return "stop", None
        if worker in self.assigned:
            self.redone += 1
            return "work", self.by_name[self.assigned[worker]]
        pending = self.pending()
        if not pending:
            return "stop", None
        for unit in pending:
            if self.ready(unit):
                self.assigned[worker] = unit.name
                self.handed_out += 1
                return "work", unit
            if self.lookahead is not None and unit.stop > self.trainer_step + self.lookahead:
                break  # later units are further ahead still
        return "wait", None

    def worker_started(self, worker: int) -> None:
        """``worker`` (re)started: its reports still on their way are taken as lost (the units go back to pending)."""
        for name in [n for n, w in self.reporting.items() if w == worker]:
            del self.reporting[name]
            self.redone += 1

    def complete(self, worker: int, name: str) -> WorkUnit | None:
        """Record that ``worker`` wrote unit ``name``; the unit, or ``None`` for the late report of a unit given back
        to pending when its worker restarted (ignored: the unit is redone).

        Raises:
            ValueError: the unit is finished, or held or reported by another worker."""
        if self.reporting.get(name) == worker:
            del self.reporting[name]
        elif self.assigned.get(worker) == name:
            del self.assigned[worker]
        elif any(u.name == name for u in self.pending()):
            return None
        else:
            raise ValueError(f"worker {worker} reports {name} finished but holds {self.assigned.get(worker)}")
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

    def progress(self) -> dict[str, Any]:
        return {
            "units_done": len(self.done), "units_total": len(self.units), "working": dict(self.assigned),
            "reporting": len(self.reporting),
            "trainer_step": self.trainer_step, "redone": self.redone, "failed": self.failed,
        }
