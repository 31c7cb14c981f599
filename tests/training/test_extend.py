"""Extending a run (issue 34): a rerun with a raised ``max_steps`` continues a finished or stopped run from its
checkpoint and ends as a run that had the larger ``max_steps`` from the start, bit for bit on CPU; any other
changed setting is still refused, naming it, and so is a lowered ``max_steps``."""

from __future__ import annotations

import json
import os

import pytest

from curation.io.outdir import ConfigMismatch
from curation.io.stop import GracefulStop, StopRequested
from schemas.engine_config import CurateAndTrainConfig
from schemas.records import extendable_keys
from schemas.train_config import ReplayConfig, TrainConfig
from tests.training.test_preemption import Signal, _trained_steps, _weights
from training.runs.train_job import train

# W = 2, τ = 3 (episodes start at 2, 5, 8, 11), checkpoints and selected parts every 4 steps: a run of 10 steps ends
# mid-episode (its reference has scored steps 8, 9 only) and mid-part (its last part holds steps 8, 9).
SHORT, LONG = 10, 14


def _files(directory: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def _manifests(a: dict[str, bytes], b: dict[str, bytes]) -> tuple[dict, dict]:
    """The two directories' manifests (taken out of the file maps), without the run's own output_dir."""
    out = []
    for files in (a, b):
        m = json.loads(files.pop("manifest.json"))
        m["config"].pop("output_dir")
        out.append(m)
    return out[0], out[1]


def _assert_same_outputs(full: dict, extended: dict) -> None:
    """The same final proxy and reference (bytes), the same selected-token shards: every part file and index byte
    for byte, the same manifest."""
    assert _weights(full.final_weights) == _weights(extended.final_weights)
    assert _weights(full.final_reference) == _weights(extended.final_reference)
    a, b = _files(full.selected), _files(extended.selected)
    ma, mb = _manifests(a, b)
    assert sorted(a) == sorted(b) and all(a[k] == b[k] for k in a), sorted(k for k in a if a[k] != b.get(k))
    assert ma == mb
    sa, sb = (x.run.stats.summary_data() for x in (full, extended))
    assert sa["steps"] == sb["steps"] and sa["refreshes"] == sb["refreshes"]
    # (a shorter run also evaluates at its last step: the extended summary keeps that point, if it is an extra one)
    assert [v for v in sb["validation"] if v["step"] in {w["step"] for w in sa["validation"]}] == sa["validation"]


@pytest.mark.parametrize("policy", ["blade", "blade-nosync"])
def test_a_finished_run_extended_equals_the_longer_run(make_config, policy, capsys):
    full = train(make_config(policy, "long", max_steps=LONG))
    short = make_config(policy, "extended", max_steps=SHORT)
    first = train(short)
    assert sorted(os.listdir(first.selected))[-1] == "steps-000000008-000000010"  # flushed short at its end
    capsys.readouterr()
    extended = train(short.model_copy(update={"max_steps": LONG}))
    assert f"extending the run: max_steps {SHORT} → {LONG} (continuing from its checkpoint)" in capsys.readouterr().out
    assert extended.run.resumed_from.endswith("latest-rank0.pt")
    assert _trained_steps(short.output_dir) == list(range(LONG))  # no step trained twice
    _assert_same_outputs(full, extended)
    with open(os.path.join(short.output_dir, "config.yaml")) as f:
        assert f"max_steps: {LONG}\n" in f.read()  # the record is the extended run's
    # the episode cut by the shorter run was scored on from its checkpoint's float32 reference, nothing twice
    assert full.run.algorithm.counts["score_steps"] == extended.run.algorithm.counts["score_steps"]


def test_a_stopped_run_extended_equals_the_longer_run(make_config):
    full = train(make_config("blade", "long", max_steps=LONG))
    short = make_config("blade", "stopped", max_steps=SHORT)
    with GracefulStop(), pytest.raises(StopRequested):
        train(short, callbacks=[Signal(6)])
    extended = train(short.model_copy(update={"max_steps": LONG}))
    assert _trained_steps(short.output_dir) == list(range(LONG))
    assert _weights(full.final_weights) == _weights(extended.final_weights)
    a, b = _files(full.selected), _files(extended.selected)
    ma, mb = _manifests(a, b)
    assert a == b and ma == mb


def test_a_changed_setting_or_a_lowered_max_steps_is_still_refused(make_config):
    cfg = make_config("blade", "run", max_steps=SHORT)
    train(cfg)
    changed = cfg.model_copy(update={"max_steps": LONG, "batch_size": 4})
    with pytest.raises(ConfigMismatch, match=r"differs in: batch_size\)") as err:
        train(changed)
    assert err.value.keys == ["batch_size"]  # the raised max_steps is not a difference
    with pytest.raises(ConfigMismatch, match=r"differs in: max_steps\)") as err:
        train(cfg.model_copy(update={"max_steps": SHORT - 2}))
    assert f"max_steps: {SHORT} → {SHORT - 2} (it can only be raised: a run is extended, never shortened)" \
        in str(err.value)
    with open(os.path.join(cfg.output_dir, "config.yaml")) as f:
        assert f"max_steps: {SHORT}\n" in f.read()  # refused reruns leave the record as it was


def test_max_steps_is_the_only_extendable_key():
    """What a rerun may raise (docs/FAILURES.md, 'Extending a run'): nothing of the first steps depends on it."""
    assert extendable_keys(TrainConfig) == {"max_steps"}
    assert extendable_keys(CurateAndTrainConfig) == {"train.max_steps"}
    assert extendable_keys(ReplayConfig) == set()  # (replay's max_steps counts passes over given shards)
