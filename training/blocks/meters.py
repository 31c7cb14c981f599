"""What a run's selection work measures: seconds per phase (``select``, ``score``, ``refresh``, ``distance``) and
counts (``score_steps``, ``refreshes``, ``selected_steps``), reported in the summary, kept in checkpoints, and read
by ``jobs/bench_training.py``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
        sync_cuda: synchronise CUDA around each timed phase (benchmarks; a no-op without CUDA work).
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, sync_cuda: bool = False) -> None:
        self.timers: dict[str, float] = {p: 0.0 for p in PHASES}
        self.counts: dict[str, int] = {c: 0 for c in COUNTS}
        self.clock = clock
        self.sync_cuda = sync_cuda

    @contextmanager
    def timed(self, phase: str, device: torch.device | None = None) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``phase`` (synchronising ``device`` when it is CUDA and
        ``sync_cuda`` is on)."""
        sync = self.sync_cuda and device is not None and device.type == "cuda"
        if sync:
            torch.cuda.synchronize()
        start = self.clock()
        try:
            yield
        finally:
            if sync:
                torch.cuda.synchronize()
            self.timers[phase] += self.clock() - start
