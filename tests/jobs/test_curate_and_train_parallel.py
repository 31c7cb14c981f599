"""The main job with the trainer as 2 Ray Train workers next to the engine (exact mode) against the single-process
trainer on the same tiny demo: the workers read the engine's scores of their rows, rank 0 publishes u."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from curation.core.selection import num_selected
from curation.io.shards import read_column
from schemas.manifest import Manifest
from tests.conftest import load_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_two_trainer_workers_next_to_the_engine_select_like_one_process(tmp_path, tiny_train, single_run, ray_local,
                                                                       capfd):
    """The job's ``main`` in this test process, on its Ray instance (4 CPUs: 2 scoring workers, 2 trainer workers)."""
    out = str(tmp_path / "par")
    cfg = tmp_path / "cfg.yaml"
    # ‖u − w‖ every throughput.log_interval steps (distance_interval's default): 2 here
    cfg.write_text(yaml.safe_dump({"train": tiny_train(out, throughput={"log_interval": 2}),
                                   "workers": {"count": 2, "range_steps": 2, "device": "cpu"},
                                   "engine": {"lookahead": 4, "refresh_device": "cpu"}}), encoding="utf-8")
    capfd.readouterr()
    rc = load_job("curate_and_train", "_parallel").main(["--config", str(cfg), "--set", "train.parallel.workers=2"])
    stdout, stderr = capfd.readouterr()
    assert rc == 0, stdout[-3000:] + stderr[-5000:]
    assert "trainer: 2 Ray Train workers" in stdout

    single = single_run  # tiny_train's config in one process
    steps, b, w = 14, 8, 2
    a = {c: read_column(single["selected"], c) for c in ("step", "tokens", "loss_mask")}
    p = {c: read_column(os.path.join(out, "selected"), c) for c in ("step", "tokens", "loss_mask")}
    assert p["step"] == [t for t in range(steps) for _ in range(b)]  # each step once: no duplicate rows
    assert all(np.array_equal(x, y) for x, y in zip(a["tokens"], p["tokens"], strict=True))
    ma, mp = np.stack(a["loss_mask"]).astype(bool), np.stack(p["loss_mask"]).astype(bool)
    assert np.array_equal(ma[w * b:(w + 1) * b], mp[w * b:(w + 1) * b])  # first selecting step: exact
    assert (ma == mp).mean() >= 0.99
    valid = b * (mp.shape[-1] - 1)
    assert [int(m.sum()) for m in mp.reshape(steps, b, -1)[w:]] == [num_selected(0.6, valid)] * (steps - w)
    assert Manifest.load(os.path.join(out, "selected")).extra["world_size"] == 2

    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        s = json.load(f)
    with open(single["summary"], encoding="utf-8") as f:
        s1 = json.load(f)
    assert s["world_size"] == 2 and [r["version"] for r in s["refreshes"]] == [0, 1, 2]
    assert "trainer_workers" not in s["engine"] and s["engine"]["trainer_wait_seconds"] >= 0  # rank 0's waits
    assert abs(s["validation"][-1]["loss"] - s1["validation"][-1]["loss"]) < 1e-3
    assert [d["step"] for d in s["param_distance"]] == list(range(2, 14, 2))  # rank 0 measured ‖u − w‖
    tp = s["throughput"]  # rank 0's, for the whole group; the reference's work is the engine's, not the trainer's
    assert (tp["steps"], tp["tokens"]) == (steps, steps * b * 128) and "world_size" not in tp
    assert tp["reference_flops_per_device"] == 0.0 and tp["kept_tokens"] == s["tokens"]["kept"]
    assert os.path.exists(os.path.join(out, "final", "model.safetensors"))
    assert os.path.exists(os.path.join(out, "final", "reference.safetensors"))
