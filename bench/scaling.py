"""Trainer tokens/s with 1 vs N data-parallel workers (Ray Train + Composer), and the efficiency:
``jobs/bench_scaling.py``.

Every run trains the same config (the demo corpus, a Llama of ``--hidden``/``--layers``, ``b`` sequences per
step) for ``--steps`` steps; 1 worker is the in-process trainer (``parallel.workers=1``), N > 1 a Ray Train worker
group. Each worker records the time at the end of every step; the first ``--skip`` steps (start-up, first
refresh) are not measured. Reported per run:

* tokens/s (wall): ``b · L`` candidate tokens per step ÷ rank 0's wall time per step;
* tokens/s per CPU-second: candidate tokens ÷ the CPU time of all workers together (process CPU time;
  robust to other load on a shared machine: it measures the work added by the gather, the all-reduce and
  the work every rank repeats, such as the reference refresh);
* efficiency = tokens/s(N) ÷ (N · tokens/s(1)), for both measures.

On a CPU the wall measure needs N free cores (the workers reserve ``--cpus`` Ray CPUs each); on a machine
shared with other work it is noisy, the CPU-time measure is not. Start-up (Ray, worker processes, imports,
about a minute on 2 cores) is not counted: it is paid once per job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile

from curation.engine.ray_backend import ray_session
from curation.ingest.prepare import prepare
from schemas.config import PrepareConfig
from schemas.train_config import TrainConfig, demo_model_config
from training.runs.train_job import train

__all__ = ["run"]


def _config(args: argparse.Namespace, workers: int, out: str) -> TrainConfig:
    root = os.path.dirname(os.path.abspath(args.data))
    cfg = TrainConfig.demo_default(root, policy=args.policy).model_dump(mode="json")
    cfg["data"].update(candidates=os.path.join(args.data, "candidates"),
                       validation=os.path.join(args.data, "validation"), tokenizer=None)
    cfg.update(
        model=demo_model_config(cfg["model"]["hf_config"]["vocab_size"], hidden=args.hidden,
                                layers=args.layers).model_dump(mode="json"),
        output_dir=out, batch_size=args.batch_size, max_steps=args.steps, threads=args.threads,
        device="cuda" if args.gpus else "cpu", progress_bar=False, plots=False, write_selected=False,
        parallel={"workers": workers, "cpus_per_worker": args.threads, "gpus_per_worker": 1 if args.gpus else 0,
                  "strategy": args.strategy if workers > 1 else "ddp"},
    )
    cfg["selection"].update(warmup_steps=min(5, args.skip), tau=10, refresh_steps=3)
    cfg["eval"].update(interval=10 ** 6, max_batches=1)
    cfg["checkpoint"].update(interval=10 ** 6)
    return TrainConfig.model_validate(cfg)


def _measure(out: str, workers: int, skip: int, tokens_per_step: int) -> dict:
    per_rank = []
    for r in range(workers):
        with open(os.path.join(out, "parallel", f"step_times-rank{r}.json"), encoding="utf-8") as f:
            per_rank.append(json.load(f))
    steps = [p for p in per_rank[0] if p[0] > skip]
    n = steps[-1][0] - steps[0][0]
    wall = steps[-1][1] - steps[0][1]
    cpu = 0.0
    for pts in per_rank:
        sel = [p for p in pts if p[0] > skip]
        cpu += sel[-1][2] - sel[0][2]
    return {"workers": workers, "steps_measured": n, "wall_s_per_step": wall / n,
            "tokens_per_s": tokens_per_step * n / wall, "tokens_per_cpu_s": tokens_per_step * n / cpu}


def run(args: argparse.Namespace) -> int:
    """Train each worker count's run, measure, print (``args.json``: also one JSON object); the exit status."""
    if not os.path.exists(os.path.join(args.data, "candidates", "index.json")):
        prepare(PrepareConfig.demo_default(os.path.dirname(os.path.normpath(args.data))))  # as jobs/prepare.py
    need = max(args.workers) * args.threads
    tmp = tempfile.mkdtemp(prefix="bench_scaling-")
    results = []
    with ray_session(None, need_cpus=need), contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, tmp, ignore_errors=True)
        for n in args.workers:
            out = os.path.join(tmp, f"w{n}")
            cfg = _config(args, n, out)
            train(cfg, step_times=True)
            seq_len = json.load(open(os.path.join(args.data, "candidates", "manifest.json"), encoding="utf-8"))["seq_len"]
            results.append(_measure(out, n, args.skip, args.batch_size * seq_len))
            shutil.rmtree(out, ignore_errors=True)
    base = results[0]
    print(f"trainer throughput, policy {args.policy}, {args.strategy} for N > 1, b={args.batch_size}, Llama {args.hidden}×{args.layers}, "
          f"{'GPU' if args.gpus else f'CPU, {args.threads} thread(s)'} per worker, steps {args.skip + 1}–{args.steps}:")
    for r in results:
        k = r["workers"] / base["workers"]
        r["efficiency_wall"] = r["tokens_per_s"] / (k * base["tokens_per_s"])
        r["efficiency_cpu"] = r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        r["speedup_wall"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"  {r['workers']} worker(s): {r['tokens_per_s']:8.0f} tokens/s wall ({r['wall_s_per_step'] * 1e3:.0f} ms/step, "
              f"speed-up {r['speedup_wall']:.2f}×, efficiency {r['efficiency_wall']:.0%}); "
              f"{r['tokens_per_cpu_s']:8.0f} tokens per CPU-second (efficiency {r['efficiency_cpu']:.0%})")
    if args.json:
        print(json.dumps({"policy": args.policy, "strategy": args.strategy, "batch_size": args.batch_size, "hidden": args.hidden,
                          "layers": args.layers, "threads": args.threads, "gpus": args.gpus, "runs": results}))
    return 0

