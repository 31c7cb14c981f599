"""One GPU check (``jobs/bench_gpu.py``): the ``gpu`` tests, the benchmarks and the demo main job, then one JSON
object of headline ratios.

Every step is a subprocess of this checkout's benchmark or job with ``--json`` (so a step that crashes or runs out
of its time is reported, and the others still run), the timed ones one at a time, then the four whose figures
are not wall-clock times side by side (:data:`TOGETHER`); the report holds each step's seconds, exit status, its JSON
(or the end of its output when it failed) and, under ``headline``, the figures issue 31 asks for:

* ``scoring``: in-process scoring worker ÷ bare forward at b = 8 and b = 32 (L = 1024, hidden 768, 12 layers,
  90 steps; goal ≥ 0.90); the per-token loss on the logits ÷ forward at b = 32 (timed directly; goal ≤ 0.05;
  the compiled one-pass loss on CUDA); the worker's host cost (``--pipeline-only``: µs per token, goal ≥ 5M
  tokens/s); under Ray, 1 worker ÷ in-process (goal ≥ 0.90) and the 1 → 2 workers scaling;
* ``training``: BLADE ÷ plain step over the pass-count prediction at b = 8 and b = 32 (goal ≤ 1.05), plain step
  ÷ the bare PyTorch loop of the same model (goal ≤ 1.05), host peak RSS and GPU peak BLADE ÷ plain (goal
  ≤ 1.10), with GPU-shaped models (``--heads 12``: head_dim 64);
* ``selection``: Δ + top-γ ÷ forward (goal < 0.02);
* ``host_reads``: host reads per steady step of the trainer (every policy, engine-fed) and of a scoring worker, per
  episode start and per weight load (``jobs/bench_host_reads.py``: counted on the CPU, the GPU run's branches
  taken; the ``gpu`` test ``tests/bench/test_host_reads_gpu.py`` checks the same steps under CUDA's sync detector);
* ``gpu_tests``: passed / failed / skipped; ``main_job``: exit status and seconds.

Needs only what the offline kit of ``../shared/gpu/`` installs (torch, numpy, composer, ray, transformers, pydantic,
pytest): this module imports nothing outside the standard library (each step imports what it needs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["STEPS", "TOGETHER", "commands", "stages", "run_step", "headline", "run"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The headline figures first, so that a run cut short by its budget still has them (on the H200 on 2026-11-26
# the first whole run spent its 470 s before the end and printed nothing: each step is now reported as it ends).
# "prepare" first: the demo corpora the training benches and the main job read (on a fresh machine, preparing them
# inside the first training step made it run out of its time on the H200 on 2026-11-27).
# b = 8 and 32 of the training bench in one invocation (each policy's process runs both: 3 process starts, not 6;
# on the H200 the two invocations took 89 + 102 s, most of it start-up, for 43 steps per policy and size).
STEPS = ("prepare", "scoring_b8", "scoring_b32", "training", "selection", "scoring_ray", "host_reads", "pipeline_only",
         "gpu_tests", "main_job")
# Run side by side at the end, none of them a wall-clock figure: the host cost per token is CPU time of one
# process, the tests and the main job report pass/fail (and seconds, for information). One after the other they
# took 16 + 46 + 50 s of the H200's 6 minutes on 2026-11-27, which the whole check overran.
# The host-read counts (jobs/bench_host_reads.py: on the CPU, the GPU run's branches taken) are counts, not times.
TOGETHER = ("host_reads", "pipeline_only", "gpu_tests", "main_job")

# The GPU shapes of issue 31 (bench_scoring's Llama of 134M parameters; bench_training's of 86.7M with head_dim 64).
_MODEL = ["--seq-len", "1024", "--hidden", "768", "--layers", "12", "--heads", "12"]
_TINY_SCORING = ["--device", "cpu", "--vocab", "512", "--hidden", "32", "--intermediate", "64", "--layers", "1",
                 "--heads", "2", "--seq-len", "32", "--range-steps", "2"]
_TINY_TRAINING = ["--device", "cpu", "--seq-len", "32", "--hidden", "32", "--layers", "1", "--heads", "2", "--tau", "4",
                  "--refresh-steps", "2", "--episodes", "1", "--repeats", "1", "--warmup", "2"]


def commands(tiny: bool, data: str) -> dict[str, list[str]]:
    """Each step's command line (after ``python``), at the GPU sizes or, with ``tiny``, at CPU test sizes."""
    py = [sys.executable]
    job = lambda name: [*py, os.path.join(REPO, "jobs", f"{name}.py")]  # noqa: E731
    # 4 processes, a file each at a time (the two training files hold the longest tests); short tracebacks, which
    # the step's result keeps
    gpu_tests = [*py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "4", "--tb=short",
                 *_gpu_test_files()]
    prepare = [*py, "-c", "import sys; from bench.training import ensure_data\n"
               "for path, seq_len in zip(sys.argv[1::2], sys.argv[2::2]): ensure_data(path, int(seq_len))"]
    if tiny:
        scoring = [*job("bench_scoring"), *_TINY_SCORING, "--json"]
        training = [*job("bench_training"), *_TINY_TRAINING, "--data", data, "--json"]
        return {
            "prepare": [*prepare, data, "32"],
            "gpu_tests": gpu_tests,
            "scoring_b8": [*scoring, "--no-ray", "--batch", "2", "--steps", "2"],
            "scoring_b32": [*scoring, "--no-ray", "--batch", "4", "--steps", "2"],
            "pipeline_only": [*scoring, "--pipeline-only", "--batch", "2", "--steps", "4"],
            "scoring_ray": [*scoring, "--batch", "2", "--steps", "2", "--ray-steps", "4"],
            "training": [*training, "--batch-size", "4", "8"],
            "selection": [*job("bench_selection"), "--device", "cpu", "--batch", "2", "--seq-len", "32", "--vocab", "512",
                          "--hidden", "32", "--intermediate", "64", "--layers", "1", "--heads", "2", "--repeats", "2",
                          "--select-repeats", "3", "--json"],
            "main_job": [*job("curate_and_train"), "--set", f"train.output_dir={data}/main-job",
                         "--set", "train.max_steps=6"],
            "host_reads": [*job("bench_host_reads"), "--only", "trainer_full", "weight_load", "--json"],
        }
    scoring = [*job("bench_scoring"), "--device", "cuda", *_MODEL, "--range-steps", "9", "--json"]
    training = [*job("bench_training"), "--device", "cuda", "--clock", "wall", "--precision", "amp_bf16", *_MODEL,
                "--repeats", "1", "--episodes", "1", "--json"]  # 2 episodes of τ = 20 steps per policy
    return {  # the training benches' corpus (L = 1024) and the main job's (the demo's, L = 128)
        "prepare": [*prepare, os.path.join("runs", "demo", "data-L1024"), "1024", os.path.join("runs", "demo", "data"),
                    "128"],
        "gpu_tests": gpu_tests,
        "scoring_b8": [*scoring, "--no-ray", "--batch", "8", "--steps", "90"],
        "scoring_b32": [*scoring, "--no-ray", "--batch", "32", "--steps", "90"],
        "pipeline_only": [*scoring, "--pipeline-only"],  # b = 8 and 32, 90 steps, median of 3 rounds
        "scoring_ray": [*scoring, "--batch", "8", "--steps", "45", "--ray-steps", "90"],  # in-process: 5 units
        "training": [*training, "--batch-size", "8", "32"],
        "selection": [*job("bench_selection"), "--device", "cuda", "--dtype", "bfloat16", "--seq-len", "1024",
                      "--hidden", "768", "--intermediate", "2048", "--layers", "12", "--heads", "12", "--json"],
        "main_job": [*job("curate_and_train"), "--set", f"train.output_dir={data}/main-job"],
        "host_reads": [*job("bench_host_reads"), "--json"],  # every scenario (on the CPU: counts, not times)
    }


def stages(skip: set[str] = frozenset()) -> list[tuple[str, ...]]:
    """The steps not in ``skip``, in the order they run: one at a time, then :data:`TOGETHER` side by side."""
    alone = [(n,) for n in STEPS if n not in TOGETHER and n not in skip]
    together = tuple(n for n in TOGETHER if n not in skip)
    return alone + ([together] if together else [])


def _gpu_test_files() -> list[str]:
    """The test files holding ``gpu``-marked tests (collecting only them keeps the start short)."""
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "tests")):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    if "pytest.mark.gpu" in f.read():
                        found.append(os.path.relpath(path, REPO))
    return sorted(found)


def _last_json(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (the benches print their report before it)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def run_step(name: str, cmd: list[str], timeout: float) -> dict:
    # COLUMNS: pytest's summary lines keep each failure's message instead of cutting it at 80 columns
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "240"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", _text(e.stdout), _text(e.stderr)
    step = {"seconds": round(time.perf_counter() - start, 1), "rc": rc, "command": " ".join(cmd[1:])}
    if name == "gpu_tests":  # the failing tests by name, and their tracebacks (the output's tail is mostly warnings)
        at = out.find("= FAILURES =")
        step["result"] = {**_pytest_counts(out),
                          "failures": [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))],
                          "tracebacks": out[max(at - 30, 0):][:6000] if at >= 0 else ""}
    elif name not in ("main_job", "prepare"):
        step["result"] = _last_json(out)
    if rc != 0:
        step["tail"] = (out + err)[-1500:]
    return step


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _pytest_counts(out: str) -> dict[str, int]:
    """``{"passed": n, "failed": n, ...}`` from pytest's summary line."""
    lines = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|error)", ln)]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", lines[-1])} \
        if lines else {}


def headline(steps: dict[str, dict]) -> dict:
    """The ratios issue 31 asks for, from the steps' JSON (``None`` where a step did not run or failed)."""
    r = {k: (v.get("result") or {}) for k, v in steps.items()}

    def get(step: str, *path: str):
        x = r.get(step, {})
        for p in path:
            x = x.get(p) if isinstance(x, dict) else None
        return x

    def training(i: int, key: str):  # the training step's report at its smaller (0: b = 8) or larger (1) batch size
        sizes = get("training", "batch_sizes") or []
        return get("training", "by_batch", str(sizes[i]), key) if len(sizes) == 2 else None

    def over_predicted(i: int):
        m, p = training(i, "blade_over_plain"), training(i, "predicted")
        return m / p if m is not None and p else None

    return {
        "scoring": {
            "worker_over_forward_b8": get("scoring_b8", "worker_over_forward"),
            "worker_over_forward_b32": get("scoring_b32", "worker_over_forward"),
            # the loss on the logits alone (goal ≤ 0.05); from the hidden states it also holds the head GEMM that
            # the forward runs too (about a fifth of this model's forward FLOPs): an upper bound, for information
            "loss_over_forward_b32": get("scoring_b32", "loss_over_forward", "full_logits"),
            "loss_with_head_over_forward_b32": get("scoring_b32", "loss_over_forward", "hidden_chunks"),
            "loss_path": get("scoring_b32", "loss_path"),
            "pipeline_host_us_per_token": get("pipeline_only", "host_us_per_token"),
            "pipeline_tokens_per_s_one_core": get("pipeline_only", "tokens_per_s_one_core"),
            "ray_over_in_process": get("scoring_ray", "ray", "ray_over_in_process"),
            "ray_scaling_efficiency": get("scoring_ray", "ray", "scaling_efficiency"),
            # one Ray worker's time per unit: asking for it, scoring it, waiting for the coordinator's record
            "ray_1_worker_ms_per_unit": get("scoring_ray", "ray", "runs", "1", "workers", "0"),
            "goals": {"worker_over_forward": 0.90, "loss_over_forward": 0.05, "pipeline_tokens_per_s": 5e6,
                      "ray_over_in_process": 0.90},
        },
        "training": {
            "blade_over_predicted_b8": over_predicted(0),
            "blade_over_predicted_b32": over_predicted(1),
            "blade_over_plain_b8": training(0, "blade_over_plain"),
            "blade_over_plain_b32": training(1, "blade_over_plain"),
            "plain_over_bare_b8": training(0, "plain_over_bare"),
            "plain_over_bare_b32": training(1, "plain_over_bare"),
            # each refresh's wall-clock ms (the first with one-off allocations) against K steps of 2·rb rows
            "refresh_ms_b8": training(0, "refresh_ms"),
            "refresh_ms_b32": training(1, "refresh_ms"),
            "peak_rss_ratio_b32": training(1, "peak_rss_ratio"),
            "peak_gpu_mem_ratio_b32": training(1, "peak_gpu_mem_ratio"),
            "goals": {"blade_over_predicted": 1.05, "plain_over_bare": 1.05, "peak_rss_ratio": 1.10,
                      "peak_gpu_mem_ratio": 1.10},
        },
        "selection_over_forward": get("selection", "delta_select_over_forward"),
        "selection_queued_over_forward": get("selection", "queued_delta_select_over_forward"),  # device time
        # host reads per steady step (trainer, every policy; engine-fed; workers), per episode start and weight load,
        # counted on the CPU with the GPU run's branches taken (issue 52: targets <= 1, 2)
        "host_reads": {**{k: v.get("per_step") for k, v in r.get("host_reads", {}).items()
                          if isinstance(v, dict) and "per_step" in v},
                       "met": get("host_reads", "met"), "sites": get("host_reads", "sites")} if r.get("host_reads")
        else None,
        "gpu_tests": r.get("gpu_tests") or None,
        "main_job_ok": steps["main_job"]["rc"] == 0 if "main_job" in steps else None,
        "main_job_seconds": steps["main_job"]["seconds"] if "main_job" in steps else None,
    }


def run(args: argparse.Namespace, skip: set[str]) -> int:
    """Run the steps not in ``skip`` (module docstring) and print the report (``args.json``: one JSON object); the
    exit status: 0 when every step passed."""
    data = os.path.abspath(args.data or tempfile.mkdtemp(prefix="bench_gpu-"))
    os.makedirs(data, exist_ok=True)
    cmds = commands(args.tiny, os.path.join(data, "training-data"))
    start = time.perf_counter()
    steps = {}
    partial = os.path.join(data, "steps.jsonl")  # each step's record as it ends: survives a kill of this process
    open(partial, "w", encoding="utf-8").close()  # this run's steps only, when --data is reused
    lock = threading.Lock()

    def record(name: str, step: dict) -> None:
        with lock:
            steps[name] = step
            line = json.dumps({"step": name, **step})
            with open(partial, "a", encoding="utf-8") as f:
                f.write(line + "\n")
            print(line if args.json else f"{name}: rc {step['rc']}, {step['seconds']} s", file=sys.stderr, flush=True)

    for stage in stages(skip):
        left = args.budget - (time.perf_counter() - start)
        if left < 15:
            for name in stage:
                record(name, {"seconds": 0.0, "rc": "skipped", "why": f"budget: {left:.0f} s of --budget left"})
            continue
        timeout = min(args.step_timeout, left)
        threads = [threading.Thread(target=lambda n, t: record(n, run_step(n, cmds[n], t)), args=(name, timeout))
                   for name in stage]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    steps = {name: steps[name] for name in STEPS if name in steps}  # in STEPS' order, whatever ended first
    report = {"tiny": args.tiny, "seconds": round(time.perf_counter() - start, 1), "headline": headline(steps),
              "steps": steps}
    print(json.dumps(report, indent=None if args.json else 1))
    return 0 if all(s["rc"] == 0 for s in steps.values()) else 1  # a step skipped for the budget fails the check

