"""The main job end to end on a tiny demo: exact on Ray equals the single-process trainer and the one-page loop
(tests/jobs/test_oracle.py's oracle), pipelined with P = 1 equals exact and the loop, a killed job resumes to the same
outputs, a finished run extended equals the longer run, a damaged scored part is redone. The exact run is a job
submitted with ``ray job submit`` to a local head node (its process joins that cluster); the killed run is a fresh job
process with its own local Ray instance; the reruns run in the test process, on its shared Ray instance (one scoring
worker: ``workers.count`` is operational, the outputs are the same for any number). A fresh job process that starts
its own Ray instance and runs to the end: tests/jobs/test_readme.py (the README's commands)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from bench.sessions import free_ports
from curation.io.shards import ShardReader
from schemas.manifest import Manifest
from schemas.shards import validate_shard_dir
from tests import timing
from tests.conftest import kill_session, load_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "jobs", "curate_and_train.py")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _config(path, train: dict, **sections) -> str:
    # the engine's workers and refresh on the CPU, as the trainer (tiny_train): the runs are compared bit for bit with
    # the single-process trainer and the loop, in CPU float32, also on a machine with a GPU
    data = {"train": train, "workers": {"count": 2, "range_steps": 2, "device": "cpu"},
            "engine": {"lookahead": 4, "refresh_device": "cpu"}}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return str(path)


_MAIN = load_job("curate_and_train", "_here")


def _run_here(config: str, capfd) -> str:  # noqa: ANN001 - pytest's capfd
    """The job's ``main`` in this test process, which has its heavy imports done and a Ray instance to join (fixture
    ``ray_local``): a rerun costs no new interpreter and no Ray start. Returns its stdout."""
    capfd.readouterr()
    rc = _MAIN.main(["--config", config])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-5000:]
    return out


def _rows(directory: str) -> list[dict]:
    r = ShardReader(directory)
    return [r[i] for i in range(len(r))]


def _assert_same_rows(ra: list[dict], rb: list[dict]) -> None:
    assert len(ra) == len(rb) > 0
    for x, y in zip(ra, rb, strict=True):
        for col in ("tokens", "loss_mask", "step", "episode", "source"):
            assert np.array_equal(x[col], y[col]), (col, x["step"])
        assert np.array_equal(x["score"], y["score"], equal_nan=True), x["step"]


def assert_same_run(a: str, b: str) -> None:
    """Same selected-token rows (tokens, masks, Δ, steps) and bitwise the same final proxy."""
    _assert_same_rows(_rows(os.path.join(a, "selected")), _rows(os.path.join(b, "selected")))
    wa, wb = load_file(os.path.join(a, "final", "model.safetensors")), load_file(os.path.join(b, "final", "model.safetensors"))
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


#: Logged (and ‖u − w‖ measured: distance_interval's default) every 2 steps, so the 14-step runs have a curve.
EVERY_2 = {"throughput": {"log_interval": 2}}
#: The engine of the killed run and the reruns: one scoring worker (``workers.count`` is operational: the outputs are
#: the same for any number; the exact and the pipelined runs have two).
ONE_WORKER = {"count": 1}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ray_cli(env: dict, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return timing.run(["ray", *args], capture_output=True, text=True, timeout=timeout, env=env)


@contextlib.contextmanager
def _head_node(env: dict):
    """A local Ray head node with its job server, as docs/REFERENCE.md's cluster section starts one; yields the job
    server's address and the head's process once ``ray job list`` answers there.

    The head node runs in the foreground (``--block``) in its own session, so that stopping it ends exactly the
    processes it started (``ray stop`` would end every Ray instance on the machine, other users' included). Its
    dashboard agent gets a free port too: the default 52365 is taken by any other Ray instance of the machine
    (another test run's), and an agent without its HTTP port answers every submission "No available agent"."""
    with tempfile.TemporaryDirectory(prefix="blade-head-") as logs:
        for attempt in range(1, 4):
            head, address, log = _start_head(env, os.path.join(logs, f"head-{attempt}.log"))
            try:
                if _up(head, address, env):
                    yield address, head
                    return
            finally:
                _stop_head(head)
            # (it ended before its job server answered: one of the ports it was given was taken meanwhile, or its
            # raylet missed Ray's 30-s registration limit on a loaded machine; started again on new ports)
        raise AssertionError(f"ray start --head ended before its job server answered, {attempt} times; "
                             f"the last start's output ends with:\n{_tail(log)}")


def _start_head(env: dict, log: str) -> tuple[subprocess.Popen, str, str]:
    port, dash, agent = free_ports(3)
    with open(log, "wb") as out:
        head = subprocess.Popen(["ray", "start", "--head", "--block", "--num-cpus", "2", "--node-ip-address",
                                 "127.0.0.1", "--port", str(port), "--dashboard-host", "127.0.0.1", "--dashboard-port",
                                 str(dash), "--dashboard-agent-listen-port", str(agent), "--include-dashboard",
                                 "true", "--disable-usage-stats"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return head, f"http://127.0.0.1:{dash}", log


def _up(head: subprocess.Popen, address: str, env: dict) -> bool:
    """Until the head's job server answers (True) or the head ends (False)."""
    deadline, dash = timing.Deadline(120), int(address.rsplit(":", 1)[1])
    # (the dashboard's port first: a `ray job list` is a Python process importing Ray, a socket is not)
    while not _listening(dash) or _ray_cli(env, "job", "list", "--address", address).returncode != 0:
        if head.poll() is not None:
            return False
        assert not deadline.expired(), "the head node's job server did not come up"
        time.sleep(1)
    return True


def _stop_head(head: subprocess.Popen) -> None:
    head.terminate()  # `ray start --block` stops the node's processes when it is terminated
    try:
        timing.wait(head, timeout=60)
    except subprocess.TimeoutExpired:
        pass
    kill_session(head.pid)  # whatever of that session is left


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-3000:]


def _submit(address: str, head: subprocess.Popen, cfg: str, env: dict) -> tuple[str, subprocess.CompletedProcess]:
    """``ray job submit`` of the main job with ``cfg``; (its job id, the CLI's run: the job's logs streamed until it
    ended). Without --no-wait the CLI streams the job's logs until it ends. A submission the job server did not accept
    (no job id printed: nothing ran) is retried, as a user would; its output is kept for the message. On a loaded
    machine the head's job agent comes up after its job server ("No available agent to submit job, please try again
    later"): retried for up to two minutes."""
    outputs = []
    deadline = timing.Deadline(120)
    while True:
        sub = _ray_cli(env, "job", "submit", "--address", address, "--working-dir", REPO,
                       "--", "python", "jobs/curate_and_train.py", "--config", cfg, timeout=300)
        logs = sub.stdout + sub.stderr
        outputs.append(logs[-3000:])
        ids = [w.strip("'") for line in logs.splitlines() for w in line.split() if w.strip("'").startswith("raysubmit_")]
        if ids or deadline.expired():
            break
        assert head.poll() is None, "the head node exited:\n" + "\n---\n".join(outputs[-3:])
        time.sleep(5)
    assert ids, "ray job submit never printed a job id:\n" + "\n---\n".join(outputs[-3:])
    return ids[0], sub


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory, tiny_train):
    """The exact run (two scoring workers, plots, TensorBoard where its extra is installed), submitted with
    ``ray job submit`` to a local head node: its output directory, config, the CLI's output (the job's logs) and
    the job's status."""
    d = tmp_path_factory.mktemp("exact")
    out = str(d / "run")
    loggers = {"tensorboard": {}} if importlib.util.find_spec("tensorboard") is not None else {}  # (its extra)
    # ‖u − w‖ every throughput.log_interval steps (distance_interval's default): 2 here, 10 by default
    cfg = _config(d / "cfg.yaml", tiny_train(out, plots=True, loggers=loggers, **EVERY_2))
    # Ray 2.60 turns token authentication on for local clusters, but its job CLI only sends the token
    # (~/.ray/auth_token) with RAY_AUTH_MODE=token (ray-project/ray#64755).
    env = {**_env(), "RAY_AUTH_MODE": "token"}
    with _head_node(env) as (address, head):
        job_id, sub = _submit(address, head, cfg, env)
        st = _ray_cli(env, "job", "status", "--address", address, job_id)
    return {"out": out, "cfg": cfg, "logs": sub.stdout + sub.stderr, "returncode": sub.returncode, "job_id": job_id,
            "status": st.stdout + st.stderr, "train": tiny_train(out, **EVERY_2)}


def test_exact_run_submitted_to_a_local_head_node_writes_shards_checkpoints_summary_and_plots(exact_run):
    out, logs = exact_run["out"], exact_run["logs"]
    assert f"Job '{exact_run['job_id']}' succeeded" in exact_run["status"], exact_run["status"] + logs[-5000:]
    assert exact_run["returncode"] == 0  # (the CLI's, waiting for the job: SUCCEEDED)
    assert "trained 14 steps" in logs and "engine: exact, 2 workers" in logs
    assert "sync refresh, starting a new run" in logs and "resuming" not in logs
    assert os.path.exists(os.path.join(out, "engine_config.yaml")) and os.path.exists(os.path.join(out, "config.yaml"))
    validate_shard_dir(os.path.join(out, "scored"), "scored")
    validate_shard_dir(os.path.join(out, "selected"), "selected")
    scored = Manifest.load(os.path.join(out, "scored"))
    assert scored.complete and [(r.state["first_step"], r.state["stop_step"]) for r in scored.shards] == [
        (a, a + 2) for a in range(2, 14, 2)]
    assert {r.name.split("/")[0] for r in scored.shards} <= {"worker-00", "worker-01"}
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    assert s["steps"] == 14 and [r["version"] for r in s["refreshes"]] == [0, 1, 2]
    assert [p["step"] for p in s["param_distance"]] == list(range(2, 14, 2))
    assert s["engine"]["mode"] == "exact" and s["engine"]["units_redone_after_restart"] == 0
    assert set(s["tokens"]["per_source"]) == {"target", "general", "noise"}
    assert sorted(os.listdir(os.path.join(out, "plots"))) == ["delta_histograms.png", "param_distance.png", "val_loss.png"]
    assert os.path.exists(os.path.join(out, "final", "reference.safetensors"))
    assert os.path.exists(os.path.join(out, "checkpoints", "latest-rank0.pt"))
    assert not [f for f in os.listdir(os.path.join(out, "engine")) if f.startswith("proxy-")]  # snapshots cleaned up
    tp = s["throughput"]  # the trainer's; the reference's work is done by the engine's workers
    assert (tp["steps"], tp["tokens"], tp["kept_tokens"]) == (14, 14 * 8 * 128, s["tokens"]["kept"])
    assert tp["reference_flops_per_device"] == 0.0 and tp["tokens_per_sec"] > 0
    if importlib.util.find_spec("tensorboard") is not None:  # train.loggers.tensorboard (the extra)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(os.path.join(out, "logs", "tensorboard", "train"), size_guidance={"scalars": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("loss/train/total")] == list(range(14))
        assert len(acc.Scalars("blade/param_distance")) == 6


@pytest.fixture(scope="module")
def loop(tiny_train, tmp_path_factory):
    """The one-page BLADE loop (curation.core.loop, the oracle) on tiny_train's config: (result, candidates)."""
    from tests.jobs.test_oracle import oracle

    return oracle(tiny_train(str(tmp_path_factory.mktemp("loop") / "unused")))


def test_ray_exact_mode_equals_the_single_process_trainer_and_the_loop(exact_run, single_run, loop):
    from tests.jobs.test_oracle import assert_equals_oracle

    # the same config but where it writes and how often it logs (a log interval changes no weight: compared below)
    same = {"output_dir": None, "throughput": None}
    assert {**exact_run["train"], **same} == {**single_run["config"], **same}
    assert_same_run(exact_run["out"], single_run["out"])
    assert_equals_oracle(exact_run["out"], *loop)  # the sequences, masks, final proxy and refresh log of the loop


def test_pipelined_with_p1_gives_the_exact_masks(exact_run, tmp_path, tiny_train, ray_local, loop):
    """Run in-process through the library function the job calls (training.runs.engine_job): the exact run's
    outputs, and the loop's."""
    from schemas.config import load_config
    from schemas.engine_config import CurateAndTrainConfig
    from tests.jobs.test_oracle import assert_equals_oracle
    from training.runs.engine_job import curate_and_train

    out = str(tmp_path / "pipelined")
    cfg = _config(tmp_path / "cfg.yaml", tiny_train(out), engine={"mode": "pipelined", "snapshot_period": 1})
    res = curate_and_train(load_config(CurateAndTrainConfig, path=cfg))
    assert res.selected == os.path.join(out, "selected") and res.engine.out_dir == res.selected  # the workers'
    assert res.final_reference == os.path.join(out, "final", "reference.safetensors")  # the engine's last one
    with open(res.final_reference, "rb") as a, open(res.engine.final_reference, "rb") as b:
        assert a.read() == b.read() and res.engine.final_reference.endswith("reference-0002.safetensors")
    with open(res.summary) as f:
        s = json.load(f)
    assert s["engine"]["mode"] == "pipelined" and s["engine"]["snapshot_period"] == 1 and s["world_size"] == 1
    assert s["selected_dir"] == res.selected and s["schema_version"] == 2
    m = Manifest.load(os.path.join(out, "selected"))  # written by the workers, one part per step after W
    assert m.complete and m.job == "curate_and_train" and len(m.shards) == 1 + 12
    assert_same_run(exact_run["out"], out)
    assert_equals_oracle(out, *loop)


def _parts(run: str) -> list[str]:
    return sorted(os.path.basename(r.name) for r in Manifest.load(os.path.join(run, "scored")).shards)


def test_a_killed_job_resumes_to_the_same_outputs_and_a_finished_run_extended_equals_the_longer_run(
        exact_run, tmp_path, tiny_train, session_killer, ray_local, capfd):
    """A 9-step run, a fresh job process with its own Ray instance, is killed (its whole session: the driver, the
    local Ray instance, its actors) after its first checkpoint (step 5); the rerun resumes
    from it and ends as the 14-step exact run's first 9 steps. Issue 34: that finished run, rerun with
    train.max_steps 14, ends as the 14-step run: the scored part [8, 9) cut short by the old end is redone as
    [8, 10), the trainer continues from its checkpoint; its summary (tokens, validation, ‖u − w‖, Δ per episode,
    refreshes) is the longer run's, with the shorter run's last evaluation (at its end, step 9) kept. (The reruns in
    this process.)"""
    out = str(tmp_path / "killed")
    short_cfg = _config(tmp_path / "short.yaml", tiny_train(out, max_steps=9, **EVERY_2), workers=ONE_WORKER)
    proc = subprocess.Popen([sys.executable, JOB, "--config", short_cfg],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), start_new_session=True)
    ckpt = os.path.join(out, "checkpoints", "latest-rank0.pt")
    deadline = timing.Deadline(240)
    while not os.path.exists(ckpt) and proc.poll() is None and not deadline.expired():
        time.sleep(0.02)
    session_killer(proc.pid)  # the driver (trainer), the local Ray instance and its actors
    timing.wait(proc, timeout=60)
    assert proc.returncode == -9, "the job ended before it could be killed"
    assert not Manifest.load(os.path.join(out, "scored")).complete
    resumed = _run_here(short_cfg, capfd)
    assert "resuming from" in resumed and "latest-rank0.pt" in resumed
    assert "trained 9 steps" in resumed
    _assert_same_rows(_rows(os.path.join(out, "selected")),
                      [r for r in _rows(os.path.join(exact_run["out"], "selected")) if r["step"] < 9])
    assert _parts(out)[-1] == "steps-000000008-000000009"
    with open(os.path.join(out, "summary.json")) as f:
        short = json.load(f)
    assert short["steps"] == 9 and short["validation"][-1]["step"] == 9

    longer = _run_here(_config(tmp_path / "long.yaml", tiny_train(out, **EVERY_2), workers=ONE_WORKER), capfd)
    assert "extending the run: train.max_steps 9 → 14 (continuing from its checkpoint)" in longer
    assert "resuming from" in longer
    assert_same_run(exact_run["out"], out)
    assert _parts(out) == _parts(exact_run["out"]) and Manifest.load(os.path.join(out, "scored")).complete
    with open(os.path.join(out, "summary.json")) as f, open(os.path.join(exact_run["out"], "summary.json")) as g:
        a, b = json.load(f), json.load(g)
    # the 9-step run's last evaluation (a run evaluates at its end) stays in the record of the extended run
    assert a["validation"] == sorted(b["validation"] + [short["validation"][-1]], key=lambda v: v["step"])
    diff = [key for key in ("tokens", "param_distance", "delta_quantiles_per_episode") if a[key] != b[key]]
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in a["refreshes"]]
    if strip != [{k: v for k, v in r.items() if k != "seconds"} for r in b["refreshes"]]:
        diff.append("refreshes")
    assert not diff, {k: (a[k], b[k], short[k]) for k in diff}


def _worker_log_lines(needle: str) -> list[str]:
    """The lines holding ``needle`` in the logs of this process's Ray instance's workers (the engine's actors: the
    shared instance of the tests does not send their output to the driver, as a job's own instance does)."""
    import ray

    ctx = ray.get_runtime_context()
    logs = os.path.join(ctx.get_temp_dir(), ctx.get_session_name(), "logs")
    lines = []
    for name in sorted(os.listdir(logs)):
        if name.startswith("worker-") and name.endswith(".err"):
            with open(os.path.join(logs, name), encoding="utf-8", errors="replace") as f:
                lines.extend(line for line in f if needle in line)
    return lines


def test_a_damaged_scored_part_is_redone_by_the_rerun(exact_run, tmp_path, flip_bit, ray_local, capfd):
    """Issue 14: a damaged scored part failed every rerun ('the scored sequences of step 58 are not the
    candidate stream's'). Now reading it stops the trainer naming the file; the rerun resumes from the
    checkpoint before it, the engine redoes the part (warning that it does), and the outputs equal an undamaged
    run's. The finished run damaged is a copy of the exact run (a run directory resumes wherever it is: its
    output_dir is not compared); the rerun in this process, with one scoring worker."""
    out = str(tmp_path / "damaged")
    shutil.copytree(exact_run["out"], out, symlinks=True)
    with open(exact_run["cfg"], encoding="utf-8") as f:
        data = yaml.safe_load(f)
    data["train"]["output_dir"] = out
    data["workers"].update(ONE_WORKER)
    cfg = str(tmp_path / "cfg.yaml")
    with open(cfg, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f)
    ckpts = os.path.join(out, "checkpoints")
    (first,) = [f for f in os.listdir(ckpts) if f.endswith("-ba5-rank0.pt")]
    for f in os.listdir(ckpts):  # back to the state after step 5, as if the job had failed at step 7
        if f != first:
            os.remove(os.path.join(ckpts, f))
    os.symlink(first, os.path.join(ckpts, "latest-rank0.pt"))
    scored = os.path.join(out, "scored")
    (part,) = [r.name for r in Manifest.load(scored).shards if r.state["first_step"] <= 7 < r.state["stop_step"]]
    shard = os.path.join(scored, part, "shard.00000.mds.zstd")
    flip_bit(shard, offset=50)
    with pytest.raises(ValueError, match=f"^{shard}: corrupt shard.*rerun the job that wrote it \\(curate_and_train\\)"):
        _rows(scored)
    resumed = _run_here(cfg, capfd)
    # the engine's coordinator (a Ray actor) opened the output directory: its warning, in its log
    (warned,) = _worker_log_lines(f"{scored}/{part} is damaged")
    assert "will be redone" in warned, warned
    assert "resuming from" in resumed and "latest-rank0.pt" in resumed
    assert_same_run(exact_run["out"], out)
    assert Manifest.load(scored).complete and len(_rows(scored)) == len(_rows(os.path.join(exact_run["out"], "scored")))
