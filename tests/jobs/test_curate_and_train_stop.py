"""`jobs/curate_and_train.py` sent SIGTERM mid-run (issue 24): the trainer stops at the end of its step with a
checkpoint there, the engine's workers finish their units, the local Ray instance is shut down, the job exits 143
with one line naming the step and the checkpoint, and a rerun ends with an uninterrupted run's outputs. A second
SIGTERM ends the job at once, its local Ray instance with it. Both here in pipelined mode (P = 2, 2 scoring
workers), on one run: stopped, its rerun stopped twice, rerun to the end. Exact mode's stop: the soak's smoke
(tests/jobs/test_soak.py, whose trainer SIGTERM is that stop, checked the same way, under actor kills)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import timing
from tests.jobs.test_curate_and_train import JOB, REPO, _config, _env, _run_here, assert_same_run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

#: Runs jobs/curate_and_train.py with every forward pass of the driver's trainer (and every checkpoint write) slowed
#: down (the Ray workers run at full speed), so that a signal lands mid-run.
_SLOW_JOB = """
import runpy, sys, time
sys.path.insert(0, {repo!r})
from composer.callbacks.checkpoint_saver import CheckpointSaver
import training.blocks.model as m
forward, save = m.MaskedCausalLM.forward, CheckpointSaver._save_checkpoint
def slow_forward(*a, **k):
    time.sleep({delay})
    return forward(*a, **k)
def slow_save(*a, **k):
    time.sleep({save_delay})
    return save(*a, **k)
m.MaskedCausalLM.forward, CheckpointSaver._save_checkpoint = slow_forward, slow_save
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def _start_until(cfg: str, ready, err, *, save_delay: float = 0.0) -> subprocess.Popen:  # noqa: ANN001
    """Start the slowed job in a session of its own; return it once ``ready()`` (or once it ended)."""
    code = _SLOW_JOB.format(repo=REPO, script=JOB, delay=0.5, save_delay=save_delay)
    proc = subprocess.Popen([sys.executable, "-c", code, "--config", cfg], stdout=subprocess.DEVNULL,
                            stderr=err, env=_env(), start_new_session=True)
    deadline = timing.Deadline(240)
    while not ready() and proc.poll() is None and not deadline.expired():
        time.sleep(0.02)
    return proc


def _trained(out: str, step: int) -> bool:
    """Whether the run in ``out`` has logged training step ``step`` (0-based) or a later one."""
    path = os.path.join(out, "logs", "metrics.jsonl")
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.endswith("\n")]
    return any("loss/train/total" in r and int(r["step"]) >= step for r in recs)


def _stop_mid_run(cfg: str, out: str, session_killer, *, after: str = "ep0-ba5-rank0.pt") -> int:
    """Start the job, SIGTERM its driver once checkpoint ``after`` exists; check the exit and its message; return
    the step it stopped after."""
    with open(os.path.join(os.path.dirname(cfg), "stderr.txt"), "w+") as err:
        proc = None
        try:
            proc = _start_until(cfg, lambda: os.path.exists(os.path.join(out, "checkpoints", after)), err)
            assert proc.poll() is None, "the job ended before the signal"
            proc.send_signal(signal.SIGTERM)  # the driver only, as a scheduler preempting the job
            timing.wait(proc, timeout=120)
            err.seek(0)
            stderr = err.read()
            assert not _ray_left(proc.pid), "the job left its Ray instance running"
        finally:
            if proc is not None:
                session_killer(proc.pid)  # whatever is left (nothing, when the test passes)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "SIGTERM received: finishing the training step in progress and its checkpoint, then stopping" in stderr
    last = stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"stopped on SIGTERM after step (\d+) of 14 \(checkpoint (.+)\); rerun the same command to "
                     r"resume from it at step (\d+)", last)
    assert m, last
    step = int(m[1])
    assert 5 <= step < 14 and int(m[3]) == step + 1
    assert m[2] == os.path.join(out, "checkpoints", f"ep0-ba{step}-rank0.pt") and os.path.isfile(m[2])
    assert not os.path.exists(os.path.join(out, "final")) and not os.path.exists(os.path.join(out, "summary.json"))
    return step


#: The agents of a Ray node: they outlive a raylet that died unexpectedly by Ray's 60-s error report.
_RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _ray_left(sid: int, but: tuple[str, ...] = ()) -> list[int]:
    """Processes still alive (zombies aside) in the job's session (its local Ray instance: raylet, GCS, workers,
    agents), but those whose command line starts with one of ``but``."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True, text=True).stdout
    left = []
    for line in out.splitlines():
        pid, s, stat, *args = line.split(None, 3)
        if int(s) == sid and int(pid) != sid and not stat.startswith("Z") and not (args and args[0].startswith(but)):
            left.append(int(pid))
    return left


def _resume(cfg: str, capfd) -> None:  # noqa: ANN001 - pytest's capfd
    """The rerun, in this test process (the stopped run was a fresh one): it resumes from the stop's checkpoint."""
    rerun = _run_here(cfg, capfd)
    assert "resuming from" in rerun and "latest-rank0.pt" in rerun


def _stop_twice(cfg: str, out: str, session_killer, *, after_step: int) -> None:
    """Start the job (every checkpoint write taking ≥ 2 s) and SIGTERM its driver once it has trained step
    ``after_step``, then again while the stop's checkpoint is written: the driver ends at once, its local Ray
    instance with it; no final outputs."""
    with open(os.path.join(os.path.dirname(cfg), "stderr-twice.txt"), "w+") as err:
        proc = None
        try:
            proc = _start_until(cfg, lambda: _trained(out, after_step), err, save_delay=2.0)
            assert proc.poll() is None, "the job ended before the signal"
            proc.send_signal(signal.SIGTERM)
            deadline = timing.Deadline(60)
            while "SIGTERM received" not in open(err.name).read() and not deadline.expired():
                time.sleep(0.02)
            at_once = timing.Deadline(5)  # (5 s on an idle machine: the stop's checkpoint alone takes 2 s)
            proc.send_signal(signal.SIGTERM)
            timing.wait(proc, timeout=60)
            waited = (at_once.expired(), str(at_once))
            # the local Ray instance follows its driver: raylet, GCS and workers at once. Its two agents
            # (ray::DashboardAgent, ray::RuntimeEnvAgent) notice the raylet gone within a second, then spend Ray's
            # fixed 60-s timeout reporting an unexpected raylet death to the GCS that died with it
            # (ray/_private/process_watcher.py): they are Ray's to end, and are all that may remain
            deadline = timing.Deadline(60)
            while _ray_left(proc.pid, but=_RAY_AGENTS) and not deadline.expired():
                time.sleep(0.5)
            left = _ray_left(proc.pid, but=_RAY_AGENTS)
            err.seek(0)
            stderr = err.read()
        finally:
            if proc is not None:
                session_killer(proc.pid)
    assert proc.returncode == -signal.SIGTERM and not waited[0], (proc.returncode, waited[1], stderr[-3000:])
    assert "SIGTERM received: finishing the training step in progress and its checkpoint" in stderr
    assert not left, "the job left its Ray instance running"
    assert not os.path.exists(os.path.join(out, "final"))


def test_sigterm_stops_the_pipelined_job_at_a_step_end_a_second_sigterm_ends_its_rerun_at_once_and_a_rerun_equals_an_uninterrupted_run(
        tmp_path, tiny_train, session_killer, ray_local, capfd):
    """One run stopped twice: a SIGTERM stops it at a step end (exit 143, the line, no Ray process left); its rerun,
    SIGTERM'd twice, ends at once with its Ray instance; the next rerun (in this process) resumes from the last
    checkpoint written (the stop's, an interval's, or the second stop's if it was finished) and ends with the
    uninterrupted run's outputs."""
    from schemas.config import load_config
    from schemas.engine_config import CurateAndTrainConfig
    from training.runs.engine_job import curate_and_train

    engine = {"mode": "pipelined", "snapshot_period": 2}
    out = str(tmp_path / "stopped")
    cfg = _config(tmp_path / "cfg.yaml", tiny_train(out), engine=engine)
    step = _stop_mid_run(cfg, out, session_killer)
    # (a signal during the last step lets the run finish: the second stop needs two steps left after the first)
    assert step <= 11, f"the first SIGTERM, sent after step 5, stopped the job after step {step}"
    _stop_twice(cfg, out, session_killer, after_step=step)  # once it trained a step after the first stop's
    _resume(cfg, capfd)
    full = str(tmp_path / "uninterrupted")
    curate_and_train(load_config(CurateAndTrainConfig, path=_config(tmp_path / "full.yaml", tiny_train(full),
                                                                     engine=engine)))
    assert_same_run(full, out)
