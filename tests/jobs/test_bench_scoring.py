"""jobs/bench_scoring.py (bench/scoring.py) at tiny sizes on a CPU: every part runs and reports its keys (the figures
are the bench's)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from tests import timing
from tests.conftest import REPO, load_job

TINY = ["--device", "cpu", "--vocab", "512", "--hidden", "32", "--intermediate", "64", "--layers", "1", "--heads", "2",
        "--seq-len", "32", "--batch", "2", "--range-steps", "2", "--json"]


def test_pipeline_only_reports_the_host_cost_per_token(capsys):
    bench = load_job("bench_scoring", "_pipeline")
    assert bench.main([*TINY, "--pipeline-only", "--steps", "4", "--rounds", "3", "--parts", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "pipeline-only" and len(out["shapes"]) == 1 and (out["order"], out["parts"]) == ("stream", 3)
    shape = out["shapes"][0]
    assert (shape["batch"], shape["seq_len"], shape["tokens"]) == (2, 32, 4 * 2 * 32)
    assert len(shape["host_us_per_token_rounds"]) == 3 and min(shape["host_us_per_token_rounds"]) > 0
    assert shape["host_us_per_token"] == sorted(shape["host_us_per_token_rounds"])[1]  # the median round
    assert shape["tokens_per_s_one_core"] == pytest.approx(1e6 / shape["host_us_per_token"])
    assert out["tokens_per_s_one_core"] == shape["tokens_per_s_one_core"]
    assert shape["ok"] == out["ok"] == (shape["tokens_per_s_one_core"] >= 5e6)
    assert shape["host_waits_per_step"] == 0  # a CPU has no device to wait for


def test_pipeline_only_runs_the_gpu_shapes_by_default_and_judges_the_worst(monkeypatch):
    from bench import scoring as bench

    measured = []

    def fake(args, batch, seq_len, steps):
        measured.append((batch, seq_len, steps))
        us = {8: 0.1, 32: 0.3}[batch]
        return {"batch": batch, "host_us_per_token": us, "tokens_per_s_one_core": 1e6 / us, "ok": 1e6 / us >= 5e6}

    monkeypatch.setattr(bench, "_pipeline_shape", fake)
    args = argparse.Namespace(batch=None, seq_len=None, steps=None, rounds=3, device="cpu", range_steps=3, parts=16)
    out = bench.pipeline_only(args)
    assert measured == [(8, 1024, 90), (32, 1024, 90)]
    assert out["host_us_per_token"] == 0.3 and out["ok"] is False  # b = 32 misses 5M tokens/s: the check fails
    measured.clear()
    bench.pipeline_only(argparse.Namespace(**{**vars(args), "batch": 32, "seq_len": 512}))
    assert measured == [(32, 512, 90)]


def test_in_process_part_times_the_loss_directly(capsys):
    bench = load_job("bench_scoring", "_inproc")
    assert bench.main([*TINY, "--no-ray", "--steps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 2 * 2 * 32 and out["worker_over_forward"] > 0
    lo = out["loss_over_forward"]
    assert lo["full_logits"] > 0 and lo["hidden_chunks"] > 0  # direct timings: never negative
    assert "ray" not in out
    assert out["precision"] == "fp32" and out["loss_path"] == "cross_entropy" and out["loss_path_error"] is None


def test_the_worker_runs_at_the_bare_forwards_precision():
    """bf16 autocast on CUDA for both sides of the ratio (the worker once ran fp32 against a bf16 forward)."""
    import torch

    from bench.scoring import worker_precision

    assert worker_precision(torch.device("cuda")) == "amp_bf16"
    assert worker_precision(torch.device("cpu")) == "fp32"


@pytest.mark.ray
@pytest.mark.slow
def test_ray_part_runs_one_then_two_workers():
    """The 1 vs 2 workers part (it once crashed on its second iteration: no test ran it)."""
    proc = timing.run([sys.executable, os.path.join(REPO, "jobs", "bench_scoring.py"), *TINY, "--steps", "2",
                           "--ray-steps", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ray = out["ray"]
    assert set(ray["runs"]) == {"1", "2"}
    for run in ray["runs"].values():
        assert run["steady_tokens_per_s"] > 0 and run["startup_s"] >= 0
        assert set(run) == {"startup_s", "whole_run_tokens_per_s", "steady_tokens_per_s", "steady_tokens", "workers"}
    for n, run in ray["runs"].items():  # where each worker's time went, per unit
        assert len(run["workers"]) == int(n) and sum(w["units"] for w in run["workers"].values()) >= 3
        for w in run["workers"].values():
            assert set(w) == {"units", "niceness", "wait_ms_per_unit", "run_ms_per_unit", "report_ms_per_unit",
                              "run_ms_first_unit", "run_ms_median_after_first"}
            assert w["niceness"] == os.nice(0)  # the local instance runs its workers at the driver's priority
            assert min(w["wait_ms_per_unit"], w["run_ms_per_unit"], w["report_ms_per_unit"]) >= 0
            if w["units"] > 1:  # the units' own times are parts of the total: the first, and the others' median
                rest = w["run_ms_per_unit"] * w["units"] - w["run_ms_first_unit"]
                assert 0 < w["run_ms_median_after_first"] <= rest + 1e-6 and w["run_ms_first_unit"] > 0
    assert ray["runs"]["1"]["workers"]["0"]["units"] > 1 and out["worker_ms_per_unit"] > 0
    assert ray["speedup"] == pytest.approx(ray["tokens_per_s_2_workers"] / ray["tokens_per_s_1_worker"])
    assert ray["scaling_efficiency"] == pytest.approx(ray["speedup"] / 2)
    assert ray["ray_over_in_process"] > 0
    # the text report shows the same per-unit times (one line per worker of each run)
    from bench.scoring import ray_text

    lines = ray_text(out)
    one = ray["runs"]["1"]["workers"]["0"]
    assert f"  1 worker(s), worker 0: {one['units']} units, ms per unit: wait {one['wait_ms_per_unit']:.1f}, " \
           f"run {one['run_ms_per_unit']:.1f}, report {one['report_ms_per_unit']:.1f} (niceness {os.nice(0)}); run of a " \
           f"unit after the first: median {one['run_ms_median_after_first']:.1f} (in-process " \
           f"{out['worker_ms_per_unit']:.1f})" in lines
    assert len([x for x in lines if " worker(s), worker " in x]) == 3
