"""Batch curation (jobs/curate.py) on Ray workers: bad data fails naming shard and record and keeps the
finished parts; a rerun after the fix completes; a killed run resumes; damaged or deleted parts are redone; SIGTERM
lets the workers finish their units; outputs equal one in-process pass. One output directory goes through all of
them in turn (each early end followed by the rerun that resumes it): the killed and the preempted runs are fresh
job processes (``python jobs/curate.py``, as a user runs it), the others run in the test process."""

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


def _start(cfg: str, err_path: str, *args: str) -> subprocess.Popen:
    """The job as a fresh process in a session of its own (it starts its own local Ray instance there); stdout piped
    to a file beside ``err_path`` (``.out``), stderr to ``err_path``."""
    with open(err_path, "w") as err, open(err_path[:-len(".stderr")] + ".stdout", "w") as out:
        return subprocess.Popen([sys.executable, JOB, "--config", cfg, *args], stdout=out, stderr=err, env=_env(),
                                start_new_session=True)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_failed_killed_damaged_and_sigterm_stopped_runs_each_resume_to_the_one_pass_shards(setup, flip_bit,
                                                                                            session_killer, ray_local,
                                                                                            capfd):
    """One output directory through every way a run ends early, each rerun resuming (the in-process runs with the
    test process's Ray instance, the others fresh job processes with their own):

    1. A bad record (in process, two workers): the job fails naming shard and record and keeps its finished parts.
    2. The input fixed, the rerun (a fresh process, one worker) is killed mid-way (SIGKILL to its session: the job,
       its local Ray instance, the workers); 3. the next rerun (in process) finishes with exactly the
       shards of one uninterrupted pass and does not redo the parts finished before.
    4. Issue 14: a damaged part blocked its output directory on every rerun, and a deleted one gave '[Errno 2] …
       index.json'. One finished part damaged and half of them deleted, the rerun (a fresh process, its output
       piped, progress on) checks the recorded parts' hashes, warns that it redoes them (the engine's warnings are
       its stderr, through the job's Ray instance), prints whole progress lines (issue 57: no tqdm frames, no Ray
       token notice at the start) and is preempted:
       SIGTERM mid-run stops it after the units in progress, exit 143 and a line saying what is finished and that a
       rerun does the rest. 5. That rerun (in process) ends with the shards of one pass, its last progress line at
       100%, the parts finished before not redone."""
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
    sel = os.path.join(out, "selected")
    try:  # 1. the bad record
        rc, stdout, stderr = _run_here(_config(setup, out), capfd)
        assert rc == 1, stdout + stderr
        want = (f"{cand}: shard {shard}, record {record} (sample {sample}, step {pos // B}): "
                f"token id 600 at position 7 is outside the model's vocabulary")
        assert want in stderr, stderr[-3000:]
        failed = Manifest.load(sel)
        assert failed.shards and not failed.complete  # finished parts are kept
    finally:
        shutil.rmtree(os.path.join(cand, part))
        shutil.copytree(backup, os.path.join(cand, part))
        merge_part_indexes(cand, parts)

    # 2. killed mid-way
    cfg = _config(setup, out, count=1)
    proc = _start(cfg, out + ".killed.stderr")
    deadline = timing.Deadline(240)
    while proc.poll() is None and not deadline.expired():
        if len(Manifest.load(sel).shards) >= len(failed.shards) + 2:
            break
        time.sleep(0.01)
    session_killer(proc.pid)  # the job, its local Ray instance and the workers
    timing.wait(proc, timeout=60)
    assert proc.returncode == -9, "the job ended before it could be killed:\n" + _read(out + ".killed.stderr")[-3000:]
    killed = Manifest.load(sel)
    assert not killed.complete and {s.name for s in failed.shards} < {s.name for s in killed.shards}

    # 3. the rerun finishes (one worker, as every rerun here: workers.count is operational; the parts of the two
    # workers of run 1 are among those compared with the one pass)
    rc, stdout, stderr = _run_here(cfg, capfd)
    assert rc == 0, stdout + stderr
    done = Manifest.load(sel)
    assert {s.name for s in killed.shards} <= {s.name for s in done.shards}  # finished parts were not redone
    _assert_expected(out, setup["expected"])

    # 4. damaged and deleted parts; the rerun that redoes them is preempted
    finished = [s.name for s in done.shards]
    flip_bit(os.path.join(sel, finished[1], "shard.00000.mds.zstd"), offset=40)
    deleted = finished[len(finished) // 2:]
    for name in deleted:
        shutil.rmtree(os.path.join(sel, name))
    err_path = out + ".sigterm.stderr"
    proc = _start(cfg, err_path, "--set", "progress=true")  # (operational: the rerun resumes), piped
    warned = [f"{finished[1]} is damaged", f"{finished[-1]} is damaged"]
    try:
        deadline = timing.Deadline(240)
        base = len(finished) - len(deleted) - 1  # recorded once the rerun has dropped the damaged and deleted ones
        while proc.poll() is None and not deadline.expired():  # a part redone, and the warnings through
            m = Manifest.load(sel)
            if not m.complete and len(m.shards) > base and all(w in _read(err_path) for w in warned):
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the job ended before it could be stopped:\n" + _read(err_path)[-3000:]
        proc.send_signal(signal.SIGTERM)  # the driver only, as a scheduler preempting the job
        timing.wait(proc, timeout=120)
    finally:
        session_killer(proc.pid)  # whatever is left of its local Ray instance
    stderr, stdout = _read(err_path), _read(out + ".sigterm.stdout")
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert all(w in stderr for w in warned), stderr[-3000:]
    assert "\r" not in stdout + stderr and "Token authentication" not in stdout + stderr
    assert any(line.startswith("curate: ") for line in stdout.splitlines()), stdout
    stopped = Manifest.load(sel)
    assert not stopped.complete and len(stopped.shards) > base
    last = stderr.strip().splitlines()[-1]
    k = len(stopped.shards)
    assert "SIGTERM received: finishing the work units in progress, then stopping" in stderr
    assert last.startswith(f"stopped on SIGTERM with {k} of ") and last.endswith(
        f"work units finished in {sel}; rerun the same command to do the other "
        f"{int(last.split(' of ')[1].split()[0]) - k} (finished parts are kept)"), last

    # 5. the rerun finishes
    rc, stdout, stderr = _run_here(cfg, capfd, "--set", "progress=true")
    assert rc == 0, stdout + stderr
    assert {s.name for s in stopped.shards} <= {s.name for s in Manifest.load(sel).shards}  # not redone
    assert "\r" not in stdout + stderr
    assert any(line.startswith(f"curate: {len(finished)}/{len(finished)} parts (100%)")
               for line in stdout.splitlines()), stdout
    _assert_expected(out, setup["expected"])
    assert len(Manifest.load(sel).shards) == len(finished)
