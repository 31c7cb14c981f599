"""jobs/bench_gpu.py (bench/gpu.py): the GPU check's commands and, at tiny sizes on a CPU, a run of some of its steps."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from bench import gpu
from tests import timing
from tests.conftest import REPO, load_job


def test_the_gpu_commands_run_the_sizes_of_issue_31(tmp_path):
    bench = load_job("bench_gpu")
    cmds = gpu.commands(False, str(tmp_path))
    assert set(cmds) == set(gpu.STEPS)

    def opt(cmd, name):
        return cmd[cmd.index(name) + 1]

    for name in ("scoring_b8", "scoring_b32", "pipeline_only", "scoring_ray", "training"):
        cmd = cmds[name]
        assert opt(cmd, "--device") == "cuda" and "--json" in cmd, name
        assert (opt(cmd, "--seq-len"), opt(cmd, "--hidden"), opt(cmd, "--layers"), opt(cmd, "--heads")) == \
            ("1024", "768", "12", "12"), name  # head_dim 64
    assert [opt(cmds[n], "--batch") for n in ("scoring_b8", "scoring_b32")] == ["8", "32"]
    assert all(int(opt(cmds[n], "--steps")) >= 90 for n in ("scoring_b8", "scoring_b32"))
    assert "--no-ray" not in cmds["scoring_ray"] and int(opt(cmds["scoring_ray"], "--ray-steps")) >= 90
    b = cmds["training"].index("--batch-size")
    assert cmds["training"][b + 1:b + 3] == ["8", "32"]  # both sizes in one invocation (3 process starts, not 6)
    assert gpu.STEPS[0] == "prepare" and cmds["prepare"][-4:] == [os.path.join("runs", "demo", "data-L1024"), "1024",
                                                                    os.path.join("runs", "demo", "data"), "128"]
    assert opt(cmds["training"], "--precision") == "amp_bf16" and "--no-bare" not in cmds["training"]
    gpu_files = [a for a in cmds["gpu_tests"] if a.startswith("tests/")]
    assert "tests/curation/engine/test_workers.py" in gpu_files and "tests/jobs/test_bench_gpu.py" not in gpu_files
    with pytest.raises(SystemExit):
        bench.main(["--skip", "scoring,main_job"])


@pytest.mark.slow
def test_tiny_mode_runs_its_steps_on_a_cpu_and_reports_their_headline(tmp_path):
    """Two quick steps at tiny sizes (the others are left out here: the full --tiny run takes minutes)."""
    skip = ",".join(s for s in gpu.STEPS if s not in ("scoring_b8", "selection"))
    proc = timing.run([sys.executable, os.path.join(REPO, "jobs", "bench_gpu.py"), "--tiny", "--skip", skip,
                           "--data", str(tmp_path), "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["tiny"] is True and set(report["steps"]) == {"scoring_b8", "selection"}
    assert all(s["rc"] == 0 and "tail" not in s for s in report["steps"].values())
    scoring, head = report["steps"]["scoring_b8"]["result"], report["headline"]
    assert scoring["batch"] == 2 and scoring["device"] == "cpu"
    assert head["scoring"]["worker_over_forward_b8"] == scoring["worker_over_forward"]
    assert head["selection_over_forward"] == report["steps"]["selection"]["result"]["delta_select_over_forward"]
    assert head["selection_queued_over_forward"] is None  # device time of queued calls: on a GPU only
    assert head["scoring"]["worker_over_forward_b32"] is None and head["main_job_ok"] is None
    with open(tmp_path / "steps.jsonl", encoding="utf-8") as f:  # each step written as it ended
        partial = [json.loads(line) for line in f]
    assert [p.pop("step") for p in partial] == ["scoring_b8", "selection"]
    assert partial == [report["steps"]["scoring_b8"], report["steps"]["selection"]]


def test_the_gpu_tests_step_names_its_failing_tests(tmp_path):
    """A failing test is named in the step's result (on an H200 the output's tail held only warnings)."""
    test = tmp_path / "test_two.py"
    test.write_text("def test_passes():\n    pass\n\n\ndef test_fails():\n    assert 1 == 2\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
           "-c", os.devnull, str(test)]
    step = gpu.run_step("gpu_tests", cmd, 120)
    assert step["rc"] == 1
    assert step["result"]["passed"] == 1 and step["result"]["failed"] == 1
    [failure] = step["result"]["failures"]
    assert failure.startswith("FAILED ") and failure.split()[1].endswith("test_two.py::test_fails")
    assert failure.endswith("assert 1 == 2")  # the message too (COLUMNS: not cut at 80 columns)
    assert "= FAILURES =" in step["result"]["tracebacks"] and "def test_fails" in step["result"]["tracebacks"]


def test_a_spent_budget_skips_the_remaining_steps_and_fails_the_check(tmp_path, capsys):
    bench = load_job("bench_gpu", "_budget")
    args = ["--tiny", "--budget", "10", "--data", str(tmp_path), "--json"]
    assert bench.main(args) == 1
    capsys.readouterr()
    assert bench.main(args) == 1  # a reused --data: steps.jsonl holds this run's steps only
    report = json.loads(capsys.readouterr().out)
    assert list(report["steps"]) == list(gpu.STEPS)
    assert all(s["rc"] == "skipped" and s["why"].startswith("budget: ") for s in report["steps"].values())
    assert report["headline"]["scoring"]["worker_over_forward_b8"] is None
    with open(tmp_path / "steps.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f] == list(gpu.STEPS)


def test_the_headline_reads_both_batch_sizes_of_the_one_training_step():
    by = {b: {"blade_over_plain": r, "predicted": 1.5, "plain_over_bare": 1.1, "peak_rss_ratio": m, "peak_gpu_mem_ratio": 1.0,
              "refresh_ms": [float(b), 2.0]} for b, r, m in (("8", 1.65, 1.2), ("32", 1.53, 1.08))}
    head = gpu.headline({"training": {"rc": 0, "result": {"batch_sizes": [8, 32], "by_batch": by}}})["training"]
    assert head["blade_over_predicted_b8"] == pytest.approx(1.1) and head["blade_over_predicted_b32"] == pytest.approx(1.02)
    assert (head["blade_over_plain_b8"], head["peak_rss_ratio_b32"]) == (1.65, 1.08)
    assert (head["refresh_ms_b8"], head["refresh_ms_b32"]) == ([8.0, 2.0], [32.0, 2.0])
    assert gpu.headline({"training": {"rc": 1, "result": None}})["training"]["blade_over_predicted_b8"] is None


def test_the_untimed_steps_run_side_by_side_at_the_end(tmp_path, monkeypatch, capsys):
    """pipeline_only (CPU time), the gpu tests and the main job (pass/fail) start together, after every wall-clock
    step; the report keeps STEPS' order whichever ends first."""
    bench = load_job("bench_gpu", "_together")
    assert gpu.stages() == [(n,) for n in gpu.STEPS[:-4]] + [("host_reads", "pipeline_only", "gpu_tests", "main_job")]
    assert gpu.stages({"gpu_tests", "training"})[-2:] == [("scoring_ray",), ("host_reads", "pipeline_only", "main_job")]
    started, barrier = [], threading.Barrier(3, timeout=30)

    def fake(name, cmd, timeout):
        started.append(name)
        barrier.wait()  # returns only once all three have started: run one after the other, it would time out
        return {"seconds": 0.0, "rc": 0, "command": name, "result": {"ok": name}}

    monkeypatch.setattr(gpu, "run_step", fake)
    alone = ",".join(n for n in gpu.STEPS if n not in gpu.TOGETHER or n == "host_reads")
    assert bench.main(["--tiny", "--skip", alone, "--data", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["steps"]) == ["pipeline_only", "gpu_tests", "main_job"] and set(started) == set(report["steps"])
