"""The quality benchmark's runs of one stage, several at a time.

A training run of the CPU preset's tiny models does ≈ 14 ms of single-threaded host work per step (Python: the
trainer's events, selection bookkeeping, data, logging) beside its torch kernels. More torch threads shrink only
the kernels, so on 2 cores two 1-thread runs side by side do more work than one 2-thread run: process CPU per
step at 1 thread, 110 ms (the proxy) and 322 ms (the target), against 87 and 220 ms of wall time at 2 threads,
i.e. ≈ 1.6× and 1.4× the steps per second (the CPU preset's ``full`` runs: ``jobs/train.py`` on a run's recorded
config at 100 and 300 steps, the difference; two 1-thread runs side by side do not slow each other down on
this machine's 2 cores).

:func:`run_jobs` runs a stage's independent runs ``parallel_runs`` at a time in worker processes
(``bench.quality.procs``: within a benchmark, one pool for every stage), each with the threads its config names, and
returns their results in the order given; finished runs are taken from their records without starting a process. A run's result does not depend on what
runs beside it (its config fixes its threads, data order and seeds), so one run at a time gives the same numbers
bit for bit (``tests/jobs/test_bench_quality.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from bench.quality.procs import process_pool
from bench.quality.runs import lookup, run_replay, run_training
from schemas.train_config import ReplayConfig, TrainConfig

__all__ = ["Job", "run_jobs"]


@dataclass(frozen=True)
class Job:
    """One training (TrainConfig) or replay (ReplayConfig) run and where its result is recorded."""

    name: str
    cfg: TrainConfig | ReplayConfig
    result_path: str
    snapshots: tuple[int, ...] = ()
    cost: float = 1.0  # relative work, to start the longest runs first (the order changes no result)


def _run(job: Job) -> dict[str, Any]:
    fn = run_replay if isinstance(job.cfg, ReplayConfig) else run_training
    return fn(job.cfg, job.result_path, snapshots=job.snapshots)


def _in_worker(kind: str, cfg: dict[str, Any], result_path: str, snapshots: tuple[int, ...]) -> dict[str, Any]:
    schema = ReplayConfig if kind == "replay" else TrainConfig
    return _run(Job("", schema.model_validate(cfg), result_path, snapshots))


def run_jobs(jobs: list[Job], parallel_runs: int, report: Callable[[Job, dict[str, Any], float], None]) -> list[dict[str, Any]]:
    """Each job's result, in the order of ``jobs``: recorded ones as they are, the others trained
    ``parallel_runs`` at a time (in this process when at most one is left to train). ``report(job, result,
    seconds)`` is called as each finishes (seconds 0 for a recorded one). The first failure cancels the runs not
    started, waits for the ones training (each resumes from its checkpoint next time) and is raised."""
    results: dict[int, dict[str, Any]] = {}
    todo = []
    for i, job in enumerate(jobs):
        found = lookup(job.cfg, job.result_path, snapshots=job.snapshots)
        if found is None:
            todo.append(i)
        else:
            results[i] = found
            report(job, found, 0.0)
    todo.sort(key=lambda i: -jobs[i].cost)
    slots = min(parallel_runs, len(todo))
    if slots <= 1:
        threads = torch.get_num_threads()
        try:
            for i in todo:
                t0 = time.perf_counter()
                results[i] = _run(jobs[i])
                report(jobs[i], results[i], time.perf_counter() - t0)
        finally:
            torch.set_num_threads(threads)  # a run sets its own; the stage's evaluation uses the parent's
        return [results[i] for i in range(len(jobs))]
    with process_pool(slots) as pool:
        started: dict[Future, tuple[int, float]] = {}
        for i in todo:
            job = jobs[i]
            kind = "replay" if isinstance(job.cfg, ReplayConfig) else "train"
            fut = pool.submit(_in_worker, kind, job.cfg.model_dump(mode="json"), job.result_path, job.snapshots)
            started[fut] = (i, time.perf_counter())
        pending = set(started)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in done:
                    i, _ = started[fut]
                    results[i] = fut.result()  # raises the run's error
                    report(jobs[i], results[i], _seconds(results[i]))
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return [results[i] for i in range(len(jobs))]


def _seconds(res: dict[str, Any]) -> float:
    return float(res.get("run_seconds", {}).get("wall", 0.0))
