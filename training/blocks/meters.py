"""What a run's selection work measures: seconds per phase (``select``, ``score``, ``refresh``, ``distance``) and
counts (``score_steps``, ``refreshes``, ``selected_steps``), reported in the summary, kept in checkpoints, and read
by ``jobs/bench_training.py``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["Meters", "PHASES", "COUNTS"]

#: The timed phases of a BLADE run.
PHASES = ("select", "score", "refresh", "distance")
#: The counters of a BLADE run.
COUNTS = ("score_steps", "refreshes", "selected_steps")


class Meters:
    """Seconds per phase and counts (plain dicts, as checkpoints and summaries hold them).

    Args:
        clock: ``time.perf_counter``; benchmarks on a shared CPU use ``time.process_time``.
        sync_cuda: synchronise CUDA around each timed phase (a no-op without CUDA work; two device-wide waits per
            phase: not for a run whose speed is measured).
        events: on CUDA, also time each phase on the device with a pair of CUDA events (no wait), summed by
            :meth:`resolve` (one wait, at the end: ``jobs/bench_training.py --phase-pass``).
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, sync_cuda: bool = False,
                 events: bool = False) -> None:
        self.timers: dict[str, float] = {p: 0.0 for p in PHASES}
        self.counts: dict[str, int] = {c: 0 for c in COUNTS}
        self.clock = clock
        self.sync_cuda = sync_cuda
        self.events = events
        self._events: list[tuple[str, Any, Any]] = []

    @contextmanager
    def timed(self, phase: str, device: torch.device | None = None) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``phase`` (synchronising ``device`` when it is CUDA and
        ``sync_cuda`` is on)."""
        cuda = device is not None and device.type == "cuda"
        sync = self.sync_cuda and cuda
        if sync:
            torch.cuda.synchronize()
        marks = None
        if self.events and cuda:
            marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            marks[0].record()
        start = self.clock()
        try:
            yield
        finally:
            if marks is not None:
                marks[1].record()
                self._events.append((phase, *marks))
            if sync:
                torch.cuda.synchronize()
            self.timers[phase] += self.clock() - start

    def resolve(self) -> dict[str, float]:
        """Seconds per phase on the device from the events recorded so far (one wait for all of them)."""
        out = {p: 0.0 for p in PHASES}
        if self._events:
            self._events[-1][2].synchronize()
            for phase, a, b in self._events:
                out[phase] += a.elapsed_time(b) / 1000.0
            self._events.clear()
        return out
