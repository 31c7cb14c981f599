"""Batch curation (jobs/curate.py) on Ray workers: bad data fails naming shard and record and keeps the
finished parts; a rerun after the fix completes; a killed run resumes; outputs equal one in-process pass."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from curation.core.stream import CandidateStream
from curation.engine.plan import PROXY, REFERENCE, WorkUnit
from curation.engine.weights import Weights
from curation.engine.workers import BatchOrder, ScoringWorker, WorkerSpec
from curation.io.models import build_causal_lm
from curation.io.shards import ShardReader, merge_part_indexes, open_shards, write_part
from schemas.manifest import Manifest
from schemas.shards import CANDIDATE, validate_shard_dir
from schemas.train_config import demo_model_config
from tests import timing
from tests.conftest import load_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "jobs", "curate.py")
B = 8
MODEL = demo_model_config(512, hidden=32, layers=1)


@pytest.fixture(scope="module")
def setup(engine_demo, tmp_path_factory):
    d = tmp_path_factory.mktemp("curate")
    cand = str(d / "candidates")
    shutil.copytree(os.path.join(engine_demo, "data", "candidates"), cand)
    paths = {}
    for name, seed in (("reference", 1), ("proxy", 2)):
        paths[name] = Weights.from_state_dict(build_causal_lm(MODEL.model_copy(update={"init_seed": seed}))).save(
            str(d / f"{name}.safetensors"))
    n = len(open_shards(cand))
    order = BatchOrder("blocks", n, B, seed=0, shuffle=True)  # the job's default order
    spec = WorkerSpec(candidates=cand, out_dir="/nonexistent", model=MODEL, order=order, vocab_size=512, gamma=0.5)
    worker = ScoringWorker(spec, 0)
    fixed = {(REFERENCE, 0): Weights.load(paths["reference"]), (PROXY, 0): Weights.load(paths["proxy"])}
    expected = []
    for step in range(order.num_steps):  # one uninterrupted in-process pass
        unit = WorkUnit(step, step + 1, "selected", 0, 0)
        worker._ensure(unit, lambda k, v: fixed[(k, v)])
        expected.extend(row for block in worker.rows(unit, {}) for row in block)  # (one RowBlock per step)
    return {"dir": d, "cand": cand, "paths": paths, "expected": expected, "n": n}


def _config(setup, out: str, **workers) -> str:
    cfg = {"candidates": setup["cand"], "tokenizer": None, "model": MODEL.model_dump(mode="json"),
           "reference_weights": setup["paths"]["reference"], "proxy_weights": setup["paths"]["proxy"],
           "gamma": 0.5, "batch_size": B, "output_dir": out, "progress": False,
           "workers": {"count": 2, "range_steps": 3, **workers}}
    path = os.path.join(out + ".yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _env() -> dict:
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONUNBUFFERED": "1"}


_JOB = load_job("curate", "_here")


def _run_here(config: str, capfd, *args: str) -> tuple[int, str, str]:  # noqa: ANN001 - pytest's capfd
    """The job's ``main`` in this test process, which has its imports done and a Ray instance to join (fixture
    ``ray_local``): (exit status, stdout, stderr)."""
    capfd.readouterr()
    rc = _JOB.main(["--config", config, *args])
    out, err = capfd.readouterr()
    return rc, out, err


def _run(config: str, *args: str) -> subprocess.CompletedProcess:
    return timing.run([sys.executable, JOB, "--config", config, *args], capture_output=True, text=True, timeout=300,
                      env=_env())


def _assert_expected(out: str, expected: list) -> None:
    sel = os.path.join(out, "selected")
    validate_shard_dir(sel, "selected")
    r = ShardReader(sel)
    got = [r[i] for i in range(len(r))]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g["step"] == e["step"] and g["source"] == e["source"]
        for col in ("tokens", "loss_mask", "score"):
            assert np.array_equal(g[col], e[col], equal_nan=col == "score")
    m = Manifest.load(sel)
    assert m.complete and len({s.state["unit"] for s in m.shards}) == len(m.shards)
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    assert s["sequences"] == len(expected) and s["kept_tokens"] == sum(int(e["loss_mask"].sum()) for e in expected)


def test_bad_record_fails_naming_it_then_a_killed_rerun_resumes_to_the_one_pass_shards(setup, session_killer,
                                                                                        ray_local, capfd):
    """Run 1 meets a bad record: fails naming shard and record, keeps its finished parts. Run 2 (input fixed)
    is killed mid-way. Run 3 resumes and ends with exactly the shards of one uninterrupted pass. (Runs 1 and 3 in this
    process, run 2 a fresh one.)"""
    cand = setup["cand"]
    parts = [s.name for s in Manifest.load(cand).shards]
    n = setup["n"]
    pos = n // 2  # a record in the middle of the pass: the units before it get finished
    sample = int(CandidateStream(n, B, 0).positions(0, n)[pos])
    shard, record = ShardReader(cand).locate(sample)
    part = os.path.dirname(shard)
    backup = str(setup["dir"] / "backup")
    shutil.copytree(os.path.join(cand, part), backup)
    reader = ShardReader(os.path.join(cand, part))
    rows = [reader[i] for i in range(len(reader))]
    rows[record]["tokens"] = rows[record]["tokens"].copy()
    rows[record]["tokens"][7] = 600  # outside the model's 512 ids
    write_part(os.path.join(cand, part), CANDIDATE, rows, vocab_size=512)
    merge_part_indexes(cand, parts)
    out = str(setup["dir"] / "run")
    try:
        rc, stdout, stderr = _run_here(_config(setup, out), capfd)
        assert rc == 1, stdout + stderr
        want = (f"{cand}: shard {shard}, record {record} (sample {sample}, step {pos // B}): "
                f"token id 600 at position 7 is outside the model's vocabulary")
        assert want in stderr, stderr[-3000:]
        failed = Manifest.load(os.path.join(out, "selected"))
        assert failed.shards and not failed.complete  # finished parts are kept
    finally:
        shutil.rmtree(os.path.join(cand, part))
        shutil.copytree(backup, os.path.join(cand, part))
        merge_part_indexes(cand, parts)

    cfg = _config(setup, out, count=1)
    with open(out + ".killed.stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, JOB, "--config", cfg], stdout=subprocess.DEVNULL, stderr=err,
                                env=_env(), start_new_session=True)
    manifest = os.path.join(out, "selected", "manifest.json")
    deadline = timing.Deadline(240)
    while proc.poll() is None and not deadline.expired():
        if len(Manifest.load(os.path.dirname(manifest)).shards) >= len(failed.shards) + 2:
            break
        time.sleep(0.01)
    session_killer(proc.pid)  # the job, its local Ray instance and the workers
    timing.wait(proc, timeout=60)
    assert proc.returncode == -9, "the job ended before it could be killed:\n" + open(out + ".killed.stderr").read()[-3000:]
    killed = Manifest.load(os.path.join(out, "selected"))
    assert not killed.complete and {s.name for s in failed.shards} < {s.name for s in killed.shards}

    rc, stdout, stderr = _run_here(cfg, capfd)
    assert rc == 0, stdout + stderr
    done = Manifest.load(os.path.join(out, "selected"))
    assert {s.name for s in killed.shards} <= {s.name for s in done.shards}  # finished parts were not redone
    _assert_expected(out, setup["expected"])


def test_a_rerun_redoes_damaged_or_deleted_parts(setup, flip_bit, ray_local, capfd):
    """Issue 14: a damaged part blocked its output directory on every rerun, and a deleted one gave
    '[Errno 2] … index.json'. Now the rerun (a fresh process: the engine's warnings are its stderr) checks the
    recorded parts' hashes and redoes those units."""
    out = str(setup["dir"] / "damaged")
    cfg = _config(setup, out)
    assert _run_here(cfg, capfd)[0] == 0
    sel = os.path.join(out, "selected")
    parts = [s.name for s in Manifest.load(sel).shards]
    shard = os.path.join(sel, parts[1], "shard.00000.mds.zstd")
    flip_bit(shard, offset=40)
    shutil.rmtree(os.path.join(sel, parts[-1]))
    proc = _run(cfg, "--set", "progress=true")  # (operational: the rerun resumes) with its progress, piped
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{parts[1]} is damaged" in proc.stderr and f"{parts[-1]} is damaged" in proc.stderr
    # issue 57: under a pipe, whole progress lines (no tqdm frames) and no Ray token notice at the start
    assert "\r" not in proc.stdout + proc.stderr and "Token authentication" not in proc.stdout + proc.stderr
    assert any(line.startswith(f"curate: {len(parts)}/{len(parts)} parts (100%)") for line in proc.stdout.splitlines()), \
        proc.stdout
    _assert_expected(out, setup["expected"])
    assert len(Manifest.load(sel).shards) == len(parts)


def test_sigterm_lets_the_workers_finish_their_units_then_a_rerun_completes_the_one_pass_shards(setup, session_killer,
                                                                                                ray_local, capfd):
    """Preemption: SIGTERM mid-run stops the job after the units in progress, exit 143 and a line saying what
    is finished and that a rerun does the rest; the rerun ends with exactly the shards of one pass."""
    out = str(setup["dir"] / "sigterm")
    cfg = _config(setup, out, count=1)
    err_path = out + ".stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, JOB, "--config", cfg], stdout=subprocess.DEVNULL, stderr=err,
                                env=_env(), start_new_session=True)
    try:
        sel = os.path.join(out, "selected")
        deadline = timing.Deadline(240)
        while proc.poll() is None and not deadline.expired():
            if os.path.exists(os.path.join(sel, "manifest.json")) and Manifest.load(sel).shards:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the job ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)  # the driver only, as a scheduler preempting the job
        timing.wait(proc, timeout=120)
    finally:
        session_killer(proc.pid)  # whatever is left of its local Ray instance
    stderr = open(err_path).read()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    stopped = Manifest.load(sel)
    assert not stopped.complete and stopped.shards
    last = stderr.strip().splitlines()[-1]
    n = len(stopped.shards)
    assert "SIGTERM received: finishing the work units in progress, then stopping" in stderr
    assert last.startswith(f"stopped on SIGTERM with {n} of ") and last.endswith(
        f"work units finished in {sel}; rerun the same command to do the other "
        f"{int(last.split(' of ')[1].split()[0]) - n} (finished parts are kept)"), last
    rc, stdout, stderr = _run_here(cfg, capfd)  # the rerun in this process
    assert rc == 0, stdout + stderr
    assert {s.name for s in stopped.shards} <= {s.name for s in Manifest.load(sel).shards}  # not redone
    _assert_expected(out, setup["expected"])
