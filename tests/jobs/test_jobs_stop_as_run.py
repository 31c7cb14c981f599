"""SIGTERM to the jobs run as a user runs them (issue 32): ``python jobs/train.py``, ``jobs/replay.py``,
``jobs/curate_and_train.py`` and ``jobs/prepare.py`` in a fresh process, nothing imported before the job (Composer
installs its own SIGTERM handler, ``sys.exit(143)`` at once, when first imported: the job must install the
project's after it). The trainers end after the step in progress with a checkpoint at that step, exit status 143
and one line naming the step and the checkpoint; prepare finishes the part in progress and names it.
(``test_train_stop``, ``test_curate_and_train_stop`` and ``test_prepare_stop`` slow the job down through a wrapper
that imports it first, and check the rerun; ``test_curate_job`` already runs ``python jobs/curate.py`` as is.)"""

from __future__ import annotations

import json
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
from tests import timing
from tests.jobs.test_train_job import _config_file, small_demo  # noqa: F401 (small_demo: a fixture)
from training.runs.train_job import train

pytestmark = pytest.mark.slow  # job processes (CI runs them: pytest --all)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 400  # far more than run before the signal lands (the tiny model trains a step in tens of ms)


def _stop_as_a_user(job: str, config: str, out: str, session_killer=None) -> tuple[int, str]:
    """Run ``python jobs/<job>.py --config <config>``, SIGTERM it once its first checkpoint is written; returns
    the step it stopped after and its stderr (asserting the message and the checkpoint). With ``session_killer``
    (a Ray job) the job runs in a session of its own, killed afterwards (nothing is left when the test passes)."""
    proc = subprocess.Popen([sys.executable, os.path.join("jobs", f"{job}.py"), "--config", config], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=session_killer is not None)
    try:
        first = os.path.join(out, "checkpoints", "latest-rank0.pt")
        deadline = timing.Deadline(240)
        while not os.path.lexists(first) and proc.poll() is None and not deadline.expired():
            time.sleep(0.01)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)  # the driver only, as a scheduler preempting the job
        _, err = timing.communicate(proc, timeout=120)
    finally:
        if session_killer is not None:
            session_killer(proc.pid)
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
    rcfg.update(selected=trained.selected, output_dir=str(tmp_path / "replay"), batch_size=8, max_steps=STEPS,
                progress_bar=False, threads=1, validation=None, tokenizer=None,
                model=load_config(TrainConfig, path=str(tmp_path / "t.yaml")).model.model_dump(mode="json"))
    rcfg["checkpoint"].update(interval=4)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(rcfg))
    _stop_as_a_user("replay", str(tmp_path / "r.yaml"), rcfg["output_dir"])


@pytest.mark.ray
def test_sigterm_to_curate_and_train_py_as_run_by_a_user_stops_at_the_step_with_its_checkpoint(
        tmp_path, tiny_train, session_killer):
    """(``test_curate_and_train_stop`` slows the trainer through a wrapper that imports Composer first.)"""
    from tests.jobs.test_curate_and_train import _config

    out = str(tmp_path / "run")
    _stop_as_a_user("curate_and_train", _config(tmp_path / "c.yaml", tiny_train(out, max_steps=STEPS)), out,
                    session_killer)


def test_sigterm_to_prepare_py_as_run_by_a_user_finishes_the_part_in_progress(tmp_path):
    """``python jobs/prepare.py`` in a fresh process (``tests/curation/ingest/test_prepare_stop`` slows the parts down
    through a wrapper that imports the package first): exit 143, the notice, and one line naming the last finished
    part, which is the manifest's last; no other part on disk (the rerun's exactness: ``test_prepare_stop``)."""
    from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
    from schemas.manifest import Manifest
    from tests.curation.ingest.test_prepare import _texts

    raw = tmp_path / "a.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(1, 3000)))
    src = SourceConfig(name="a", paths=[str(raw)])
    cfg = PrepareConfig(sources=[src], validation=[], tokenizer=TokenizerConfig(vocab_size=300), seq_len=16,
                        output_dir=str(tmp_path / "out"), sequences_per_part=1, progress=False, workers=1)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    job = [sys.executable, os.path.join("jobs", "prepare.py"), "--config", str(tmp_path / "p.yaml")]
    proc = subprocess.Popen(job, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    cand = os.path.join(cfg.output_dir, "candidates")
    deadline = timing.Deadline(240)
    while not os.path.exists(os.path.join(cand, "manifest.json")) and proc.poll() is None and not deadline.expired():
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    _, err = timing.communicate(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM received: finishing the part in progress, then stopping" in err and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped on SIGTERM after finishing {cand}/") and last.endswith(
        "; rerun the same command to resume from the next part (finished parts are kept)"), err
    m = Manifest.load(cand)
    assert not m.complete and last.split("after finishing ")[1].split(";")[0] == os.path.join(cand, m.shards[-1].name)
    parts = {f"a/{p}" for p in os.listdir(os.path.join(cand, "a")) if not p.startswith("unit-")}
    assert parts == {s.name for s in m.shards}  # the part in progress was finished and recorded, no other
