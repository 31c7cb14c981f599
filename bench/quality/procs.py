"""Processes of the quality benchmark's own: a pool whose workers are spawned (nothing of the parent's torch state
is shared; each sets its own threads) and end with the benchmark (``PR_SET_PDEATHSIG`` on Linux), so that a
killed benchmark leaves no run training into, or scores written for, a directory the next invocation resumes.

Inside :func:`shared_workers` (the whole of ``bench.quality.analysis.run_benchmark``) every stage's training runs
and every prefetch of scores use one pool, started once: a spawned worker imports torch, Composer and
transformers before its first job (≈ 8 s of CPU), which the quick preset paid 22 times with a pool per stage and
per prefetch (11 pools of two workers). A worker runs its jobs one after another either way (a run sets its
threads, seeds and data order from its config, a scoring its threads), so the numbers do not depend on which
worker, or which pool, runs a job.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any

__all__ = ["process_pool", "shared_workers"]

#: the pool of the open :func:`shared_workers` block (None: none open) and its number of workers
_SHARED: list[Any] = [None, 0]


def _end_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no prctl: a worker outlives a killed parent
            pass


def _spawned(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_end_with_parent)


class _Borrowed:
    """The shared pool lent to one ``with process_pool(n)`` block: what the block submitted is waited for when it
    ends (as a pool of its own would be, shut down), the pool itself stays up for the next block."""

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self.pool, self.futures = pool, []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        fut = self.pool.submit(fn, *args, **kwargs)
        self.futures.append(fut)
        return fut

    def __enter__(self) -> _Borrowed:
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        wait(self.futures)  # (cancelled ones are done)
        if isinstance(error, BrokenProcessPool) and _SHARED[0] is self.pool:  # a worker died: a fresh pool next time
            self.pool.shutdown(wait=False, cancel_futures=True)
            _SHARED[0] = None


def process_pool(workers: int) -> ProcessPoolExecutor | _Borrowed:
    """A pool of ``workers`` spawned processes, as a ``with`` block: inside :func:`shared_workers` with at least
    that many workers, the shared pool (left running when the block ends); else a pool of its own (shut down)."""
    if _SHARED[1] >= workers:
        if _SHARED[0] is None:
            _SHARED[0] = _spawned(_SHARED[1])
        return _Borrowed(_SHARED[0])
    return _spawned(workers)


@contextmanager
def shared_workers(workers: int) -> Iterator[None]:
    """Within the block, :func:`process_pool` lends one pool of ``workers`` processes (started at its first use)
    to every caller asking for at most that many; it is shut down when the block ends."""
    if _SHARED[1]:
        raise RuntimeError("shared_workers blocks do not nest")
    _SHARED[1] = workers
    try:
        yield
    finally:
        pool, _SHARED[0], _SHARED[1] = _SHARED[0], None, 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
