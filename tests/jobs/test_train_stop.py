"""`jobs/train.py` sent SIGTERM mid-run (issue 24): training ends after the step in progress with a checkpoint at
that step, the job exits 143 with one line naming the step and the checkpoint, and a rerun of the same command
ends with the final weights of an uninterrupted run, byte for byte; a second signal stops the job at once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from schemas.config import load_config
from schemas.train_config import TrainConfig
from tests import timing
from tests.conftest import load_job
from tests.jobs.test_train_job import _config_file, small_demo  # noqa: F401 (small_demo: a fixture)
from training.runs.train_job import train

pytestmark = pytest.mark.slow  # job processes (CI runs them: pytest --all)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "jobs", "train.py")

#: Runs jobs/train.py with every forward pass and every checkpoint write slowed down (so signals land mid-run).
_SLOW_JOB = """
import runpy, sys, time
sys.path.insert(0, {repo!r})
from composer.callbacks.checkpoint_saver import CheckpointSaver
import training.blocks.model as m
forward, save = m.MaskedCausalLM.forward, CheckpointSaver._save_checkpoint
def slow_forward(*a, **k):
    time.sleep({step_delay})
    return forward(*a, **k)
def slow_save(*a, **k):
    time.sleep({save_delay})
    return save(*a, **k)
m.MaskedCausalLM.forward, CheckpointSaver._save_checkpoint = slow_forward, slow_save
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": REPO}


def _start(config: str, *, step_delay: float, save_delay: float = 0.0) -> subprocess.Popen:
    code = _SLOW_JOB.format(repo=REPO, script=JOB, step_delay=step_delay, save_delay=save_delay)
    return subprocess.Popen([sys.executable, "-c", code, "--config", config], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = timing.Deadline(timeout)
    while not os.path.exists(path) and not deadline.expired() and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None and os.path.exists(path), proc.stderr.read() if proc.poll() is not None else ""


_TRAIN = load_job("train", "_stop")


def _rerun(config: str, capfd) -> str:  # noqa: ANN001 - pytest's capfd
    """The rerun of the stopped job, in this test process (the stopped run was a fresh one): its stdout."""
    capfd.readouterr()
    rc = _TRAIN.main(["--config", config])
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def uninterrupted(small_demo, tmp_path):  # noqa: F811
    """``uninterrupted(config)``: the final weights of the config's run without a stop (in this process)."""

    def run(config: str) -> bytes:
        cfg = load_config(TrainConfig, path=config)
        out = train(cfg.model_copy(update={"output_dir": str(tmp_path / "uninterrupted")}))
        return _read(out.final_weights)

    return run


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_a_rerun_equals_an_uninterrupted_run(
        small_demo, tmp_path, uninterrupted, capfd):  # noqa: F811
    out = str(tmp_path / "run")
    config = _config_file(small_demo, out, tmp_path / "t.yaml", max_steps=12)
    proc = _start(config, step_delay=0.3)
    _wait_for(os.path.join(out, "checkpoints", "ep0-ba4-rank0.pt"), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = timing.communicate(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM received: finishing the training step in progress and its checkpoint, then stopping" in err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"stopped on SIGTERM after step (\d+) of 12 \(checkpoint (.+)\); rerun the same command to "
                     r"resume from it at step (\d+)", last)
    assert m, last
    step = int(m[1])
    assert 4 <= step < 12 and int(m[3]) == step + 1
    assert m[2] == os.path.join(out, "checkpoints", f"ep0-ba{step}-rank0.pt") and os.path.isfile(m[2])
    assert not os.path.exists(os.path.join(out, "final")) and not os.path.exists(os.path.join(out, "summary.json"))

    stdout = _rerun(config, capfd)
    assert f"(resumed from {os.path.join(out, 'checkpoints', 'latest-rank0.pt')})" in stdout
    assert _read(os.path.join(out, "final", "model.safetensors")) == uninterrupted(config)


def test_a_second_sigterm_stops_at_once_and_a_rerun_still_equals_an_uninterrupted_run(
        small_demo, tmp_path, uninterrupted, capfd):  # noqa: F811
    out = str(tmp_path / "run")
    config = _config_file(small_demo, out, tmp_path / "t.yaml", max_steps=12)
    proc = _start(config, step_delay=0.3, save_delay=2.0)  # the stop's checkpoint takes ≥ 2 s to write
    _wait_for(os.path.join(out, "checkpoints", "ep0-ba4-rank0.pt"), proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    at_once = timing.Deadline(3)  # (3 s on an idle machine: the stop's checkpoint alone takes 2 s)
    proc.send_signal(signal.SIGTERM)
    timing.communicate(proc, timeout=60)
    assert proc.returncode == -signal.SIGTERM and not at_once.expired(), at_once  # ended by the signal, not at a step end
    assert not os.path.exists(os.path.join(out, "final"))

    _rerun(config, capfd)
    assert _read(os.path.join(out, "final", "model.safetensors")) == uninterrupted(config)
