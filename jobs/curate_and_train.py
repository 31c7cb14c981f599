"""The main job: online BLADE curation on Ray (coordinator, scoring workers, refresh) + Composer training.

    python jobs/curate_and_train.py                          # embedded demo: prepare if missing, local Ray, ~3 min on 2 CPUs
    python jobs/curate_and_train.py --set engine.mode=pipelined --set engine.snapshot_period=4
    python jobs/curate_and_train.py --set engine.refresh=overlapped --set engine.overlap_steps=5
    python jobs/curate_and_train.py --set train.parallel.workers=2   # the trainer as 2 Ray Train workers (exact mode)
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/curate_and_train.py --config my.yaml

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
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from curation.core.distributed import WorkerGroupFailed
from curation.core.policies import get_policy
from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream
from curation.engine.plan import EngineError, TrainingPlan
from curation.engine.ray_backend import RayEngine, ray_session
from curation.engine.refresh_runner import RefreshSpec, reference_path
from curation.engine.workers import BatchOrder, WorkerSpec
from curation.io.shards import check_tokenizer, shard_dir_info
from schemas.config import parse_job_config
from schemas.engine_config import CurateAndTrainConfig
from schemas.outdir import OutputDirLock, open_output_dir, report_job_errors


def _ensure_data(cfg: CurateAndTrainConfig) -> None:
    cand = cfg.train.data.candidates
    if os.path.exists(os.path.join(cand, "index.json")):
        return
    if cfg.prepare is None:
        raise ValueError(f"{cand} holds no candidate shards: run jobs/prepare.py first (or set `prepare`)")
    from curation.ingest.prepare import prepare

    print(f"preparing the corpus into {cfg.prepare.output_dir} ...", flush=True)
    prepare(cfg.prepare)


def curate_and_train(cfg: CurateAndTrainConfig) -> dict:
    """Run (or resume) the job; returns the output paths and the engine report.

    Holds ``train.output_dir``'s lock; a rerun resumes only with the configs recorded there
    (``engine_config.yaml``, ``config.yaml``), else it is refused naming the differing keys.
    """
    records = {"engine_config.yaml": cfg, "config.yaml": cfg.train}
    with open_output_dir(cfg.train.output_dir, "curate_and_train", records) as lock:
        return _curate_and_train(cfg, lock)


def _curate_and_train(cfg: CurateAndTrainConfig, lock: OutputDirLock) -> dict:
    start = time.perf_counter()
    t, eng, wk = cfg.train, cfg.engine, cfg.workers
    _ensure_data(cfg)

    cand = shard_dir_info(t.data.candidates, "candidate")
    val = shard_dir_info(t.data.validation, "candidate")
    fingerprint = check_tokenizer([cand, val], t.data.tokenizer)
    policy = get_policy(t.selection.policy)
    schedule = Schedule(t.selection.warmup_steps, t.selection.tau, t.max_steps)
    pipelined = eng.mode == "pipelined"
    plan = TrainingPlan(schedule, eng.mode, policy.refreshes, eng.snapshot_period if pipelined else 1,
                        eng.overlap_steps if eng.refresh == "overlapped" else 0)
    num = cand.manifest.totals().sequences
    stream = CandidateStream(num, t.batch_size, t.seed)
    out = os.path.join(t.output_dir, "selected" if pipelined else "scored")
    engine_dir = os.path.join(t.output_dir, "engine")
    model = t.model.model_dump(mode="json")
    run_key = {
        "stream": stream.to_dict(), "plan": plan.to_dict(), "policy": policy.name, "model": model,
        "selection": t.selection.model_dump(mode="json"), "optim": t.optim.model_dump(mode="json"),
        "candidates": os.path.abspath(t.data.candidates), "validation": os.path.abspath(t.data.validation),
        "range_steps": wk.range_steps,
    }
    ledger = dict(out_dir=out, kind="selected" if pipelined else "scored", job="curate_and_train", run_key=run_key,
                  config=cfg.model_dump(mode="json"), vocab_size=cand.vocab_size, seq_len=cand.seq_len,
                  tokenizer_fingerprint=fingerprint, extra={"stream": stream.to_dict(), "policy": policy.name})
    worker_spec = WorkerSpec(
        candidates=t.data.candidates, out_dir=out, model=model,
        order=BatchOrder("stream", num, t.batch_size, t.seed).to_dict(), vocab_size=cand.vocab_size,
        policy=policy.name, gamma=t.selection.gamma, schedule=schedule.to_dict(), device=wk.device,
        threads=wk.threads, score_batch_size=wk.score_batch_size, needs_proxy=pipelined, precision=t.precision,
    )
    refresh_spec = RefreshSpec(
        model=model, validation=t.data.validation, candidates=t.data.candidates, stream=stream.to_dict(),
        selection=t.selection.model_dump(mode="json"), ref_lr=t.selection.ref_lr or t.optim.lr,
        refresh_batch_size=t.refresh_batch_size, engine_dir=engine_dir, device=eng.refresh_device,
        threads=eng.refresh_threads or wk.threads, precision=t.precision, schedule=schedule.to_dict(),
    )
    lock.write_records()
    parallel = t.parallel.workers > 1  # the trainer as a Ray Train worker group (training/parallel.py)
    if parallel:
        from training.parallel import run_worker_group, trainer_cpus
    run = None
    with ray_session(cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.include_dashboard,
                     need_cpus=wk.count * wk.threads + (trainer_cpus(t) if parallel else 0)), RayEngine(
            units=plan.units(wk.range_steps), worker_spec=worker_spec, workers=wk.count, threads=wk.threads,
            ledger=ledger, engine_dir=engine_dir, lookahead=eng.lookahead, plan=plan,
            refresh_mode=policy.refresh_mode, refresh_spec=refresh_spec, max_restarts=wk.max_restarts,
            device=wk.device, gpus=wk.gpus,
            reserved_gpus=t.parallel.workers * t.parallel.gpus_per_worker if parallel else 0.0,
    ) as engine:
        # Composer takes seconds to import: done while the actors start and load their models.
        from training.engine_hooks import (
            EngineMaskedBatches,
            EngineScores,
            EngineSync,
            build_pipelined_training,
        )
        from training.run import build_training

        if parallel:
            print(f"engine: {wk.count} workers ({wk.threads} thread(s) each), exact mode, {eng.refresh} refresh; "
                  f"trainer: {t.parallel.workers} Ray Train workers", flush=True)
            res = run_worker_group(t, engine={"engine": engine, "scored_dir": out, "stream": stream, "plan": plan,
                                              "timeout_s": eng.wait_timeout_s})
        elif pipelined:
            run = build_pipelined_training(t, batches=lambda vocab: EngineMaskedBatches(
                engine, out, stream, t.max_steps, model_vocab=vocab, timeout_s=eng.wait_timeout_s))
        else:
            run = build_training(t, scored=EngineScores(engine, out, stream, timeout_s=eng.wait_timeout_s),
                                 schedule=schedule)
        if run is not None:
            sync = EngineSync(engine, plan, algorithm=run.algorithm, distance_interval=t.distance_interval)
            run.trainer.state.callbacks.insert(0, sync)  # before the statistics: the distance is on the record
            print(f"engine: {wk.count} workers ({wk.threads} thread(s) each, GPUs/worker {engine.gpus['per_worker']}), "
                  f"{eng.mode} mode, {eng.refresh} refresh, "
                  + (f"resuming from {run.resumed_from}" if run.resumed_from else "starting a new run"), flush=True)
            run.fit()  # a rerun of a finished run only reports
            res = {"stats": run.stats.summary_data(), "resumed_from": run.resumed_from,
                   "publish_seconds": sync.publish_seconds, "trainer_wait_seconds": engine.wait_seconds}
        engine.finish_units()  # parts found damaged on opening and not needed by the trainer again
        engine.finish({"finished_at_step": t.max_steps})
        report = engine.report()

    refs = report["refreshes"]
    last_reference = reference_path(engine_dir, max(r["version"] for r in refs)) if refs else None
    if run is not None:
        final = run.write_final(last_reference)
    else:  # rank 0 of the worker group wrote final/model.safetensors
        final = res["final"]
        if last_reference is not None:
            shutil.copyfile(last_reference, os.path.join(final, "reference.safetensors.tmp"))
            os.replace(os.path.join(final, "reference.safetensors.tmp"), os.path.join(final, "reference.safetensors"))
    engine_summary = {
        "mode": eng.mode, "refresh": eng.refresh, "workers": wk.count, "threads_per_worker": wk.threads,
        "snapshot_period": plan.snapshot_period if pipelined else None,
        "staleness_delta": {str(r["version"]): r.get("staleness", 0) for r in refs},
        "trainer_wait_seconds": res["trainer_wait_seconds"], "trainer_waits": report["trainer_waits"],
        "publish_seconds": res["publish_seconds"], "trainer_workers": t.parallel.workers,
        "units_redone_after_restart": report["progress"]["redone"], "scored": report["stats"],
        "engine_seconds_this_run": report["seconds"], "job_seconds_this_run": time.perf_counter() - start,
        "output_dir": out,
    }
    extra = {"refreshes": refs, "engine": engine_summary, "resumed_from": res["resumed_from"],
             "stream": stream.to_dict(), "selected_dir": os.path.join(t.output_dir, "selected")}
    from training.summary import write_summary

    summary, pngs = write_summary(t.output_dir, res["stats"], extra=extra, plots=t.plots)
    return {"summary": summary, "plots": pngs, "final": final, "engine": engine_summary,
            "selected": extra["selected_dir"], "scored": None if pipelined else out}


def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_job_config(CurateAndTrainConfig, description=__doc__.splitlines()[0],
                              default=CurateAndTrainConfig.demo_default, argv=argv,
                              set_example="engine.mode=pipelined --set train.output_dir=runs/demo/pipelined")
    out = report_job_errors(lambda: curate_and_train(cfg), f"curate_and_train into {cfg.train.output_dir} failed",
                            expected=(EngineError, WorkerGroupFailed))
    if out is None:
        return 1
    with open(out["summary"], encoding="utf-8") as f:
        s = json.load(f)
    e = out["engine"]
    print(f"trained {s['steps']} steps; kept {s['tokens']['kept']} of {s['tokens']['valid']} tokens")
    for name, c in s["tokens"]["per_source"].items():
        print(f"  {name}: kept {c['kept_fraction']:.1%} of {c['valid_tokens']} tokens")
    if s["validation"]:
        print(f"validation loss {s['validation'][0]['loss']:.3f} → {s['validation'][-1]['loss']:.3f}")
    print(f"engine: {e['mode']}, {e['workers']} workers, trainer waited {e['trainer_wait_seconds']:.1f}s, "
          f"{e['units_redone_after_restart']} units redone, {e['job_seconds_this_run']:.0f}s in all")
    print(f"summary: {out['summary']}; selected-token shards: {out['selected']}; final weights: {out['final']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
