"""The main job as a library function: online BLADE curation on Ray (coordinator, scoring workers, refresh actor)
next to a Composer trainer (``jobs/curate_and_train.py`` parses the config and calls :func:`curate_and_train`).

``output_dir`` (``train.output_dir``)::

    config.yaml, engine_config.yaml   resolved configs (a rerun resumes only with the same ones)
    .lock                             held by the running job (pid, host, start time)
    scored/        (exact)            ℓ(w̃) per token, written by the workers (scored shards + manifest)
    selected/                         what each step trained on (selected-token shards + manifest); in
                                      pipelined mode written by the workers, in exact mode by the trainer
    engine/                           reference-NNNN.safetensors (+ .json refresh log), proxy snapshots in flight
    checkpoints/                      Composer checkpoints; a rerun with the same output_dir resumes
    summary.json, plots/*.png         run summary (tokens kept per source, validation loss, Δ per episode,
                                      ‖u − w‖, refreshes, engine: staleness δ, trainer wait, worker restarts)
    final/model.safetensors, final/reference.safetensors

The trainer is one process (exact or pipelined mode) or a data-parallel Ray Train worker group (exact mode,
``train.parallel.workers > 1``), launched the one way (:func:`training.runs.launch.launch`); the run finishes in
:func:`training.runs.finish.finish`, with the engine's report (its summary section, its last reference as
``final/reference.safetensors``).
"""

from __future__ import annotations

import dataclasses
import os
import time

from curation.engine.ray_backend import RayEngine, ray_session
from curation.engine.report import EngineReport
from curation.engine.training_curation import TrainingCuration
from curation.ingest.prepare import prepare
from curation.io import storage
from curation.io.outputs import localize, open_output
from curation.io.stop import GracefulStop
from schemas.engine_config import CurateAndTrainConfig
from training.blocks.loggers import check_installed
from training.runs.finish import Finished, finish
from training.runs.group import trainer_cpus
from training.runs.launch import launch
from training.runs.rank import RankResult
from training.runs.wiring import TrainRun

__all__ = ["curate_and_train"]


def _ensure_data(cfg: CurateAndTrainConfig) -> None:
    cand = cfg.train.data.candidates
    if storage.fetch(os.path.join(cand, "index.json")):  # (from the bucket for an s3:// directory)
        return
    if cfg.prepare is None:
        raise ValueError(f"{cand} holds no candidate shards: run jobs/prepare.py first (or set `prepare`)")
    writes = os.path.join(cfg.prepare.output_dir, "candidates")
    if os.path.abspath(writes) != os.path.abspath(cand):  # (e.g. the default's demo `prepare`, merged under a file)
        raise ValueError(f"train.data.candidates: {storage.display(cand)} holds no candidate shards, and `prepare` "
                         f"writes {storage.display(writes)}: set train.data.candidates (and validation) to its output, "
                         "or prepare.output_dir to the folder above it, or prepare: null")
    print(f"preparing the corpus into {storage.display(cfg.prepare.output_dir)} ...", flush=True)
    prepare(cfg.prepare)


def curate_and_train(cfg: CurateAndTrainConfig) -> Finished:
    """Run (or resume) the job; returns what it wrote, with the engine's report.

    Holds ``train.output_dir``'s lock; a rerun resumes only with the configs recorded there
    (``engine_config.yaml``, ``config.yaml``), else it is refused naming the differing keys.

    Raises:
        StopRequested: a SIGTERM / SIGINT came once the engine was up: the trainer stopped at the end of its step
            with a checkpoint there, the workers finished (or dropped) their units and Ray was shut down; the
            message names the step and the checkpoint a rerun resumes from.
    """
    check_installed(cfg.train.loggers)  # before Ray starts
    cfg = localize(cfg)  # s3:// directories: their local caches (curation.io.storage)
    with open_output(cfg.train.output_dir, "curate_and_train",
                     {"engine_config.yaml": cfg, "config.yaml": cfg.train}) as lock:
        start = time.perf_counter()
        _ensure_data(cfg)
        e = TrainingCuration.of(cfg)
        if "train.max_steps" in lock.extended:
            _check_extension(e, *lock.extended["train.max_steps"], cfg.workers.range_steps)
        lock.write_records()
        result, report = _run(cfg, e)
        report = dataclasses.replace(report, job_seconds=time.perf_counter() - start)
        return finish(cfg.train.output_dir, result, report, plots=cfg.train.plots)


def _check_extension(e: TrainingCuration, old: int, new: int, range_steps: int) -> None:
    """An extended run (``train.max_steps`` raised from ``old`` to ``new``): refused before anything is written when
    its continuation needs a proxy snapshot the shorter run never published (:meth:`TrainingPlan.extension_gaps`)."""
    gaps = e.plan.extension_gaps(old, range_steps)
    if gaps:
        raise ValueError(
            f"train.max_steps: {old} → {new} cannot extend this run exactly: it needs the proxy snapshot "
            f"{'; '.join(gaps)}, from before step {old}, where the shorter run ended (pipelined: extend from a "
            "max_steps of W plus a multiple of engine.snapshot_period; overlapped: not within engine.overlap_steps "
            "before an episode start), or use a new output_dir")
    print(f"extending the run: train.max_steps {old} → {new} (continuing from its checkpoint)", flush=True)


def _run(cfg: CurateAndTrainConfig, e: TrainingCuration) -> tuple[RankResult, EngineReport]:
    """The engine on Ray and the trainer (one process or a worker group) beside it; rank 0's result and the engine's
    report, once every unit is done."""
    t, eng, wk = cfg.train, cfg.engine, cfg.workers
    parallel = t.parallel.workers > 1
    # SIGTERM / SIGINT: the trainer stops at the end of its step with a checkpoint there (StopRequested), the
    # engine's workers finish their units (RayEngine.close), the local Ray instance is shut down (ray_session);
    # entered after ray.init, which sets its own SIGTERM handler (a second signal stops at once)
    with ray_session(cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.include_dashboard,
                     need_cpus=wk.count * wk.threads + (trainer_cpus(t) if parallel else 0)), GracefulStop(
            what="the training step in progress and its checkpoint"), RayEngine(
            e.work, wk, lookahead=eng.lookahead,
            reserved_gpus=t.parallel.workers * t.parallel.gpus_per_worker if parallel else 0.0,
    ) as engine:
        feed = e.feed(engine, timeout_s=eng.wait_timeout_s)  # what the trainer sees of the running engine

        def ready(run: TrainRun) -> None:  # the trainer in this process, wired
            print(f"engine: {wk.count} workers ({wk.threads} thread(s) each, GPUs/worker {engine.gpus['per_worker']}), "
                  f"{eng.mode} mode, {eng.refresh} refresh, "
                  + (f"resuming from {storage.display(run.resumed_from)}" if run.resumed_from else "starting a new run"),
                  flush=True)

        if parallel:
            print(f"engine: {wk.count} workers ({wk.threads} thread(s) each), exact mode, {eng.refresh} refresh; "
                  f"trainer: {t.parallel.workers} Ray Train workers", flush=True)
        result = launch(t, feed=feed, engine=engine, ready=None if parallel else ready)
        engine.finish_units()  # parts found damaged on opening and not needed by the trainer again
        engine.finish({"finished_at_step": t.max_steps})
        return result, engine.report()
