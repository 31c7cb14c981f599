"""SIGTERM to the Composer jobs run as a user runs them (issue 32): ``python jobs/train.py`` and ``python
jobs/replay.py`` in a fresh process, nothing imported before the job (Composer installs its own SIGTERM handler,
``sys.exit(143)`` at once, when first imported: the job must install the project's after it). Each ends after the
step in progress with a checkpoint at that step, exit status 143 and one line naming the step and the checkpoint.
(``test_train_stop`` slows the steps down through a wrapper that imports Composer first, and checks the rerun.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from schemas.config import load_config
from schemas.train_config import ReplayConfig, TrainConfig
from tests.jobs.test_train_job import _config_file, small_demo  # noqa: F401 (small_demo: a fixture)
from training.runs.single import train

pytestmark = pytest.mark.slow  # job processes (CI runs them: pytest --all)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 400  # far more than run before the signal lands (the tiny model trains a step in tens of ms)


def _stop_as_a_user(job: str, config: str, out: str) -> tuple[int, str]:
    """Run ``python jobs/<job>.py --config <config>``, SIGTERM it once its first checkpoint (step 4) is written; returns
    the step it stopped after and its stderr (asserting the message and the checkpoint)."""
    proc = subprocess.Popen([sys.executable, os.path.join("jobs", f"{job}.py"), "--config", config], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = os.path.join(out, "checkpoints", "latest-rank0.pt")
    deadline = time.time() + 240
    while not os.path.lexists(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM received: finishing the training step in progress and its checkpoint, then stopping" in err, err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"stopped on SIGTERM after step (\d+) of {STEPS} \(checkpoint (.+)\); rerun the same command to "
                     r"resume from it at step (\d+)", last)
    assert m, last
    step = int(m[1])
    assert 4 <= step < STEPS and int(m[3]) == step + 1
    assert re.fullmatch(rf"ep\d+-ba{step}-rank0\.pt", os.path.basename(m[2])), m[2]  # (replay: epochs of 4 steps)
    assert os.path.dirname(m[2]) == os.path.join(out, "checkpoints") and os.path.isfile(m[2])
    assert os.path.realpath(os.path.join(out, "checkpoints", "latest-rank0.pt")) == os.path.realpath(m[2])
    assert not os.path.exists(os.path.join(out, "final"))
    return step, err


def test_sigterm_to_train_py_as_run_by_a_user_stops_at_the_step_with_its_checkpoint(small_demo, tmp_path):  # noqa: F811
    out = str(tmp_path / "run")
    config = _config_file(small_demo, out, tmp_path / "t.yaml", max_steps=STEPS)
    _stop_as_a_user("train", config, out)


def test_sigterm_to_replay_py_as_run_by_a_user_stops_at_the_step_with_its_checkpoint(small_demo, tmp_path):  # noqa: F811
    trained = train(load_config(TrainConfig, path=_config_file(small_demo, str(tmp_path / "train"),
                                                               tmp_path / "t.yaml", max_steps=4)))
    rcfg = ReplayConfig.demo_default(small_demo).model_dump(mode="json")
    rcfg.update(selected=trained["selected"], output_dir=str(tmp_path / "replay"), batch_size=8, max_steps=STEPS,
                progress_bar=False, threads=1, validation=None, tokenizer=None,
                model=load_config(TrainConfig, path=str(tmp_path / "t.yaml")).model.model_dump(mode="json"))
    rcfg["checkpoint"].update(interval=4)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(rcfg))
    _stop_as_a_user("replay", str(tmp_path / "r.yaml"), rcfg["output_dir"])
