"""Processes of the quality benchmark's own: a pool whose workers are spawned (nothing of the parent's torch state
is shared; each sets its own threads) and end with the benchmark (``PR_SET_PDEATHSIG`` on Linux), so that a
killed benchmark leaves no run training into, or scores written for, a directory the next invocation resumes."""

from __future__ import annotations

import ctypes
import multiprocessing
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

__all__ = ["process_pool"]


def _end_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no prctl: a worker outlives a killed parent
            pass


def process_pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_end_with_parent)
