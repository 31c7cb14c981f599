"""The soak's figures (bench/soak.py): growth, each process against itself over the last attempt; the work
the kills made it redo; the kills sent."""

from __future__ import annotations

import json

import pytest

from bench.soak import _growth, _kills, _redone, _StepLog, _unfinished_parts
from curation.io.atomic import write_manifest
from schemas.manifest import Manifest, ShardRecord


def _samples(pid: int, role: str, values: list[tuple[int, int]], attempt: int = 2, t0: float = 0.0) -> list[dict]:
    return [{"attempt": attempt, "t": t0 + i, "step": i, "role": role, "pid": pid, "rss": rss, "fds": fds}
            for i, (rss, fds) in enumerate(values)]


def test_growth_is_the_worst_process_of_the_last_attempt_against_itself():
    samples = (_samples(1, "driver", [(1, 1)] * 8, attempt=1)  # an earlier attempt: ignored
               + _samples(2, "driver", [(100, 10)] * 4 + [(110, 10)] * 4)
               + _samples(3, "worker", [(200, 20)] * 8)
               + _samples(4, "worker", [(200, 20)] * 6 + [(200, 30)] * 2)
               + _samples(5, "worker", [(50, 5), (400, 40)], t0=3.0))  # restarted mid-attempt: left out
    d, w = _growth(samples, "driver"), _growth(samples, "worker")
    assert d["processes"] == 1 and d["rss"] == pytest.approx(0.10) and d["fds"] == 0.0
    assert (d["rss_first"], d["rss_last"]) == (100.0, 110.0)
    assert w["processes"] == 2 and w["excluded"] == 1
    assert w["rss"] == 0.0 and w["fds"] == pytest.approx(0.5) and (w["fds_first"], w["fds_last"]) == (20.0, 30.0)
    assert _growth([], "worker")["rss"] is None


def test_the_redone_work_is_counted_from_the_metrics_log_the_parts_on_disk_and_the_summary(tmp_path):
    out = tmp_path / "chaos"
    (out / "logs").mkdir(parents=True)
    log = out / "logs" / "metrics.jsonl"
    # attempt 1 trained steps 0..11 (killed after its step-10 checkpoint), the engine logged 1 unit redone
    lines = [{"step": t, "loss/train/total": 1.0} for t in range(12)] + [{"step": 10, "engine/redone": 1}]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    first = _StepLog(str(out))
    assert (first.step, first.trained, first.fresh) == (12, 0, False)  # what an earlier attempt logged
    with log.open("a") as f:  # attempt 2 redoes steps 10, 11 and goes on to 14; a line still being written
        f.write("".join(json.dumps({"step": t, "loss/train/total": 1.0}) + "\n" for t in range(10, 15)))
        f.write(json.dumps({"step": 10, "engine/redone": 2}) + "\n" + '{"step": 15, "loss/tr')
    assert first.read() == 15 and first.trained == 5 and first.units_redone == 2 and first.fresh

    scored = out / "scored"
    for part in ("worker-00/steps-0-5", "worker-00/steps-10-15.tmp", "worker-01/steps-5-10", "worker-01/steps-15-20"):
        (scored / part).mkdir(parents=True)
    assert _unfinished_parts(str(out)) == 4  # no manifest yet: nothing is recorded
    write_manifest(str(scored), Manifest(kind="scored", job="curate_and_train", shards=[
        ShardRecord(name="worker-00/steps-0-5", samples=1, tokens=1),
        ShardRecord(name="worker-01/steps-5-10", samples=1, tokens=1)]))
    assert _unfinished_parts(str(out)) == 2  # the .tmp and the finished but unrecorded part

    (out / "summary.json").write_text(json.dumps({"engine": {"units_redone_after_restart": 3}}))
    attempts = [{"steps_trained": 12, "units_redone_logged": 1, "parts_left_unfinished": 2},
                {"steps_trained": 8, "units_redone_logged": 0, "parts_left_unfinished": 0},
                {"steps_trained": 5, "units_redone_logged": 2, "parts_left_unfinished": 7}]  # the last: its summary
    assert _redone(attempts, 20, str(out)) == {
        "steps_trained": 25, "steps": 5, "units_left_unfinished_by_trainer_deaths": 2,
        "units_redone_by_restarted_workers": 4}


def test_the_kills_sent_are_counted_by_target_and_signal():
    log = [{"target": "trainer", "signal": "SIGTERM", "exit": 143}, {"target": "worker", "signal": "SIGKILL",
           "killed": True}, {"target": "refresh", "signal": "SIGKILL", "killed": False},  # no such process then
           {"target": "worker", "signal": "SIGKILL", "killed": True}, {"target": "trainer", "signal": "SIGKILL"}]
    assert _kills(log) == {"trainer_SIGKILL": 1, "trainer_SIGTERM": 1, "worker_SIGKILL": 2}
