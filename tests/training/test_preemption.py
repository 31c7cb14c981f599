"""Preemption of the trainer (issue 24): a SIGTERM / SIGINT ends training after the step in progress with a
checkpoint at that step; a rerun resumes at the next step and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal

import pytest
from composer.core import Callback

from curation.io.stop import GracefulStop, StopRequested
from tests.training.test_resume import _columns
from training.runs.train_job import train


class Signal(Callback):
    """Send ``signum`` to this process at the end of step ``at`` (1-based: after ``at`` steps)."""

    def __init__(self, at: int, signum: int = signal.SIGTERM) -> None:
        self.at, self.signum = at, signum

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.at:
            os.kill(os.getpid(), self.signum)


def _weights(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _trained_steps(output_dir: str) -> list[int]:
    """The steps logged with a training loss in ``logs/metrics.jsonl`` (every run appends to it)."""
    steps = []
    with open(os.path.join(output_dir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "loss/train/total" in rec:
                steps.append(rec["step"])
    return steps


@pytest.mark.parametrize(("policy", "at", "signum"), [("blade", 6, signal.SIGTERM), ("random", 3, signal.SIGINT)])
def test_a_signal_stops_after_the_step_with_its_checkpoint_and_a_rerun_equals_an_uninterrupted_run(
        make_config, policy, at, signum):
    full = train(make_config(policy, "uninterrupted"))
    cfg = make_config(policy, "stopped")
    with GracefulStop() as stop, pytest.raises(StopRequested) as e:
        train(cfg, callbacks=[Signal(at, signum)])
    assert stop.signum == signum and e.value.signum == signum
    ckpt = os.path.join(cfg.output_dir, "checkpoints", f"ep0-ba{at}-rank0.pt")
    assert str(e.value) == (f"stopped on {signal.Signals(signum).name} after step {at} of {cfg.max_steps} "
                            f"(checkpoint {ckpt}); rerun the same command to resume from it at step {at + 1}")
    assert os.path.realpath(os.path.join(cfg.output_dir, "checkpoints", "latest-rank0.pt")) == os.path.realpath(ckpt)
    assert not os.path.exists(os.path.join(cfg.output_dir, "final"))  # a stopped run is not finished
    assert not os.path.exists(os.path.join(cfg.output_dir, "summary.json"))
    assert _trained_steps(cfg.output_dir) == list(range(at))  # steps 0 … at - 1 (logged 0-based)

    resumed = train(cfg)
    assert resumed.run.resumed_from.endswith("latest-rank0.pt")
    assert _trained_steps(cfg.output_dir) == list(range(cfg.max_steps))  # no completed step redone
    assert _weights(full.final_weights) == _weights(resumed.final_weights)  # byte for byte
    a, b = _columns(full.selected), _columns(resumed.selected)
    assert a["step"] == b["step"] and all((x == y).all() for x, y in zip(a["loss_mask"], b["loss_mask"], strict=True))
    if policy == "blade":
        assert _weights(full.final_reference) == _weights(resumed.final_reference)
        # the episode's remaining scores came from the checkpoint: nothing was scored twice
        assert full.run.algorithm.counts["score_steps"] == resumed.run.algorithm.counts["score_steps"]


def test_a_signal_at_the_last_step_just_finishes_the_run(make_config):
    cfg = make_config("random", "last")
    with GracefulStop() as stop:
        out = train(cfg, callbacks=[Signal(cfg.max_steps)])
    assert stop.requested and os.path.exists(out.final_weights) and os.path.exists(out.summary)


def test_a_signal_before_the_first_step_stops_before_training(make_config):
    cfg = make_config("random", "early")
    with GracefulStop(), pytest.raises(StopRequested) as e:
        os.kill(os.getpid(), signal.SIGTERM)  # (as if it came while the model and the data were loading)
        train(cfg)
    assert str(e.value) == ("stopped on SIGTERM before training (nothing trained in this run); rerun the same "
                            "command to start from the beginning")
    assert not os.path.lexists(os.path.join(cfg.output_dir, "checkpoints", "latest-rank0.pt"))  # no step trained
    assert os.path.exists(train(cfg).final_weights)  # the rerun trains the whole run
