"""jobs/bench_training.py at tiny sizes on a CPU: several batch sizes in one invocation, one report each; the
refresh's joint forward (selection.refresh_joint_forward) through the trainer."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import timing
from tests.conftest import REPO


@pytest.mark.slow
def test_two_batch_sizes_run_in_each_policys_process_and_report_each(tmp_path):
    data = tmp_path / "data"
    cmd = [sys.executable, os.path.join(REPO, "jobs", "bench_training.py"), "--device", "cpu", "--seq-len", "32",
           "--hidden", "32", "--layers", "1", "--heads", "2", "--tau", "4", "--refresh-steps", "2", "--episodes", "1",
           "--repeats", "1", "--warmup", "2", "--data", str(data), "--batch-size", "8", "4", "--json",
           "--profile-refresh", str(tmp_path / "prof"), "--refresh-joint-forward", "on"]
    proc = timing.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batch_sizes"] == [4, 8] and set(out["by_batch"]) == {"4", "8"}
    for b, r in out["by_batch"].items():
        assert r["batch_size"] == int(b) and r["refresh_batch_size"] == int(b) // 4
        # the pass-count prediction at this b: 1 + 1/3 + (K/τ)·(2·rb/b)
        assert r["predicted"] == pytest.approx(1 + 1 / 3 + (2 / 4) * (2 * (int(b) // 4) / int(b)))
        assert r["blade_over_plain"] == pytest.approx(r["blade_step_ms"] / r["plain_step_ms"])
        assert r["plain_over_bare"] == pytest.approx(r["plain_step_ms"] / r["bare_step_ms"])
        # 10 steps (2 warm-up + 2 episodes of τ = 4): refreshes at steps 2 and 6, each timed; the second profiled
        assert len(r["refresh_ms"]) == 2 and min(r["refresh_ms"]) > 0
        table = (tmp_path / "prof" / f"refresh-b{b}.txt").read_text()
        assert table.startswith(f"refresh 2 at b = {b}: {r['refresh_ms'][1]:.1f} ms wall (profiled); ")
        assert "--- by self_cpu_time_total" in table and "aten::mm" in table  # the refresh's matrix products
        # the joint forward (on by request, on a CPU): each of the K = 2 steps one forward over the validation and
        # candidate rows stacked, so the 1-layer model's attention ran twice, not four times
        assert r["refresh_joint_forward"] is True
        assert "aten::scaled_dot_product_attention × 2 (one per layer and forward)" in table.splitlines()[0]
    # one process per policy ran both sizes, smaller first: its peak RSS so far can only grow
    rss = out["by_batch"]
    assert all(rss["4"]["peak_rss_mb"][p] <= rss["8"]["peak_rss_mb"][p] for p in ("plain", "blade", "bare"))
    assert proc.stdout.count("BLADE training benchmark:") == 2 and "b = 4," in proc.stdout and "b = 8," in proc.stdout
