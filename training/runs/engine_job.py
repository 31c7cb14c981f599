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
``train.parallel.workers > 1``); every way finishes through :func:`training.runs.wiring.finish_run`, with the
engine's last reference as ``final/reference.safetensors``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from curation.engine.ray_backend import RayEngine, ray_session
from curation.engine.refresh_runner import reference_path
from curation.engine.training_curation import TrainingCuration
from curation.ingest.prepare import prepare
from curation.io import storage
from curation.io.outputs import localize, open_output
from curation.io.stop import GracefulStop
from schemas.engine_config import CurateAndTrainConfig
from training.blocks.loggers import check_installed
from training.runs.engine_feed import EngineMaskedBatches, EngineSync, build_pipelined_training
from training.runs.group import run_worker_group, trainer_cpus
from training.runs.wiring import RunOutputs, build_training, finish_run
from training.selection.shard_scores import EngineScores

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


def curate_and_train(cfg: CurateAndTrainConfig) -> dict[str, Any]:
    """Run (or resume) the job; returns the output paths and the engine report.

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
        return _run(cfg, e, start)


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


def _run(cfg: CurateAndTrainConfig, e: TrainingCuration, start: float) -> dict[str, Any]:
    t, eng, wk = cfg.train, cfg.engine, cfg.workers
    pipelined, parallel = eng.mode == "pipelined", t.parallel.workers > 1
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
        if parallel:  # the trainer as a Ray Train worker group (exact mode); its rank 0 wrote final/model
            print(f"engine: {wk.count} workers ({wk.threads} thread(s) each), exact mode, {eng.refresh} refresh; "
                  f"trainer: {t.parallel.workers} Ray Train workers", flush=True)
            res = run_worker_group(t, engine=feed)
            outputs = RunOutputs(stats=res["stats"], extra={"resumed_from": res["resumed_from"],
                                                            "throughput": res["throughput"]})
        else:
            if pipelined:
                run = build_pipelined_training(t, batches=lambda vocab: EngineMaskedBatches(
                    feed, t.max_steps, model_vocab=vocab))
            else:
                run = build_training(t, scored=EngineScores(feed), schedule=e.plan.schedule)
            sync = EngineSync(feed.handle, feed.plan, algorithm=run.algorithm, distance_interval=t.effective_distance_interval)
            run.trainer.state.callbacks.insert(0, sync)  # before the statistics: the distance is on the record
            print(f"engine: {wk.count} workers ({wk.threads} thread(s) each, GPUs/worker {engine.gpus['per_worker']}), "
                  f"{eng.mode} mode, {eng.refresh} refresh, "
                  + (f"resuming from {storage.display(run.resumed_from)}" if run.resumed_from else "starting a new run"), flush=True)
            run.fit()  # a rerun of a finished run only reports
            run.raise_if_stopped(t.max_steps)  # a stop signal: nothing is finished, the engine closes (above)
            outputs = run.outputs(reference=False)
            res = {"publish_seconds": sync.publish_seconds, "trainer_wait_seconds": engine.wait_seconds}
        engine.finish_units()  # parts found damaged on opening and not needed by the trainer again
        engine.finish({"finished_at_step": t.max_steps})
        report = engine.report()

    refs = report["refreshes"]
    outputs.reference = reference_path(e.work.engine_dir, max(r["version"] for r in refs)) if refs else None
    engine_summary = {
        "mode": eng.mode, "refresh": eng.refresh, "workers": wk.count, "threads_per_worker": wk.threads,
        "snapshot_period": e.plan.snapshot_period if pipelined else None,
        "staleness_delta": {str(r["version"]): r.get("staleness", 0) for r in refs},
        "trainer_wait_seconds": res["trainer_wait_seconds"], "trainer_waits": report["trainer_waits"],
        "publish_seconds": res["publish_seconds"], "trainer_workers": t.parallel.workers,
        "units_redone_after_restart": report["progress"]["redone"], "scored": report["stats"],
        "engine_seconds_this_run": report["seconds"], "job_seconds_this_run": time.perf_counter() - start,
        "output_dir": e.out_dir,
    }
    selected = os.path.join(t.output_dir, "selected")
    outputs.extra = {"refreshes": refs, "engine": engine_summary, "resumed_from": outputs.extra.get("resumed_from"),
                     "stream": e.stream.to_dict(), "selected_dir": selected, "throughput": outputs.extra.get("throughput")}
    paths = finish_run(t.output_dir, outputs, plots=t.plots)
    return {**paths, "engine": engine_summary, "selected": selected, "scored": None if pipelined else e.out_dir}
