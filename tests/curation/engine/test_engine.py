"""Ray-free engine logic: unit plans (invariants), publish steps, coordinator state, ledger, weights."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from curation.core.schedule import Schedule
from curation.engine.coordinator import Coordinator
from curation.engine.ledger import PartLedger, PartResult
from curation.engine.plan import (
    PROXY,
    REFERENCE,
    TrainingPlan,
    WorkUnit,
    plan_batch_units,
    plan_training_units,
)
from curation.engine.weights import Weights
from curation.io.shards import write_part
from schemas.manifest import Manifest
from schemas.shards import SCORED

PLANS = [(w, tau, total, r, p) for w in (0, 3) for tau in (1, 4, 7) for total in (1, 9, 23) for r in (1, 3, 5)
         for p in (1, 2, 6)]


@pytest.mark.parametrize("w,tau,total,r,p", PLANS)
def test_unit_plans_cover_the_run_and_never_straddle_a_version(w, tau, total, r, p):
    sched = Schedule(w, tau, total)
    exact = plan_training_units(sched, stop_step=total, mode="exact", range_steps=r)
    steps = [t for u in exact for t in u.steps]
    assert steps == list(range(min(w, total), total))  # every post-warm-up step exactly once, in order
    for u in exact:
        assert u.output == "scored" and len(u.steps) <= r and u.proxy_version is None
        assert {sched.episode(t) for t in u.steps} == {u.ref_version}

    piped = plan_training_units(sched, stop_step=total, mode="pipelined", range_steps=r, snapshot_period=p)
    assert [t for u in piped for t in u.steps] == list(range(total))
    for u in piped:
        assert u.output == "selected" and len(u.steps) <= r
        if sched.is_warmup(u.first):
            assert all(sched.is_warmup(t) for t in u.steps) and u.needs() == []
            continue
        assert {sched.episode(t) for t in u.steps} == {u.ref_version}
        for t in u.steps:  # staleness of the proxy snapshot: 0 <= t − s < P, snapshots on the W + jP grid
            assert 0 <= t - u.proxy_version < p and (u.proxy_version - w) % p == 0

    static = plan_training_units(sched, stop_step=total, mode="exact", range_steps=r, refreshed=False)
    assert {u.ref_version for u in static} <= {0}


def test_pipelined_with_p1_scores_each_step_with_the_proxy_before_it():
    units = plan_training_units(Schedule(2, 4, 12), stop_step=12, mode="pipelined", range_steps=5, snapshot_period=1)
    assert [(u.first, u.stop, u.ref_version, u.proxy_version) for u in units] == (
        [(0, 2, -1, None)] + [(t, t + 1, (t - 2) // 4, t) for t in range(2, 12)])


def test_batch_units():
    units = plan_batch_units(23, 10)
    assert [(u.first, u.stop) for u in units] == [(0, 10), (10, 20), (20, 23)]
    assert all(u.needs() == [(REFERENCE, 0), (PROXY, 0)] for u in units)
    with pytest.raises(ValueError, match="first < stop"):
        WorkUnit(3, 3, "scored")


def test_training_plan_publish_steps_and_refresh_sources():
    sched = Schedule(10, 30, 100)
    sync = TrainingPlan(sched, "exact", True)
    assert sync.refresh_sources() == {10: 0, 40: 1, 70: 2} and sync.publish_steps() == [10, 40, 70]
    over = TrainingPlan(sched, "exact", True, overlap_steps=12)
    assert over.refresh_sources() == {0: 0, 28: 1, 58: 2}
    assert [over.staleness(e) for e in range(3)] == [10, 12, 12]  # clipped at step 0 for the first refresh
    piped = TrainingPlan(sched, "pipelined", True, snapshot_period=25)
    assert piped.publish_steps() == [10, 35, 40, 60, 70, 85]
    assert TrainingPlan(sched, "exact", False).publish_steps() == []  # rho1: static reference, nothing to publish


def _units():
    return plan_training_units(Schedule(2, 4, 14), stop_step=14, mode="exact", range_steps=2)


def test_coordinator_waits_for_weights_and_respects_the_lookahead():
    c = Coordinator(_units(), lookahead=4)
    assert c.next_unit(0) == ("wait", None)  # no reference yet
    c.publish(REFERENCE, 0)
    status, u = c.next_unit(0)
    assert status == "work" and (u.first, u.stop) == (2, 4)
    assert c.next_unit(1) == ("wait", None)  # [4, 6) ends beyond trainer step 0 + look-ahead 4
    c.trainer_at(2)
    status, u1 = c.next_unit(1)
    assert (u1.first, u1.stop) == (4, 6)
    c.complete(0, u.name)
    c.complete(1, u1.name)
    c.trainer_at(10)
    assert c.next_unit(0) == ("wait", None)  # [6, 8) is episode 1: reference 1 not published
    c.publish(REFERENCE, 1)
    assert c.next_unit(0)[1].first == 6
    assert c.unit_for(7).first == 6 and c.unit_for(1) is None and c.unit_for(14) is None
    assert (REFERENCE, 0) not in c.needed() and (REFERENCE, 2) in c.needed()


def test_a_restarted_worker_gives_back_what_it_held_and_the_units_are_redone_then_it_stops():
    c = Coordinator(_units(), lookahead=None)
    for v in range(3):
        c.publish(REFERENCE, v)
    _, u = c.next_unit(0)
    _, ahead = c.next_unit(0)  # asked ahead while `u` is scored
    assert ahead.first == u.stop and c.held == {0: [u.name, ahead.name]} and c.pending()[0].first == ahead.stop
    with pytest.raises(ValueError, match="holds"):
        c.complete(1, u.name)
    c.worker_started(0)  # the worker died in `u` and came back: both go back to pending, `u` counted as redone
    assert c.held == {} and c.begun == set() and c.redone == 1 and c.pending()[:2] == [u, ahead]
    assert c.next_unit(0) == ("work", u)
    c.complete(0, u.name)
    while (nxt := c.next_unit(0))[0] == "work":
        c.complete(0, nxt[1].name)
    assert nxt == ("stop", None) and c.finished() and c.held == {} and c.begun == set() and c.redone == 1
    c2 = Coordinator(_units(), done=[_units()[0].name])
    c2.fail("worker 1: bad record")
    assert c2.next_unit(0) == ("stop", None) and c2.failed == "worker 1: bad record"
    with pytest.raises(ValueError, match="not units of this plan"):
        Coordinator(_units(), done=["steps-nope"])


def _write_scored(root, wid, unit, rows=2, length=6):
    name = f"worker-{wid:02d}/{unit.name}"
    samples = [{"tokens": np.arange(length, dtype=np.uint16) + t, "source": "s", "ref_loss": np.zeros(length, np.float16),
                "episode": unit.ref_version} for t in unit.steps for _ in range(rows)]
    n = write_part(os.path.join(root, name), SCORED, samples, vocab_size=100)
    return PartResult(worker=wid, unit=unit.name, name=name, first=unit.first, stop=unit.stop, samples=n,
                      tokens=n * length, kept_tokens=0, sources={"s": {"sequences": n, "tokens": n * length}})


def test_ledger_records_parts_in_step_order_and_cleans_leftovers_on_reopen(tmp_path):
    root = str(tmp_path / "scored")
    units = _units()
    key = {"stream": {"num_samples": 10}}
    ledger = PartLedger(root, kind="scored", job="test", run_key=key, vocab_size=100, extra={"stream": {}})
    with pytest.raises(ValueError, match="not on disk"):
        ledger.record(PartResult(0, units[0].name, f"worker-00/{units[0].name}", 2, 4, 4, 24, 0))
    ledger.record(_write_scored(root, 1, units[1]))
    ledger.record(_write_scored(root, 0, units[0]))
    with pytest.raises(ValueError, match="already recorded"):
        ledger.record(_write_scored(root, 0, units[0]))
    m = Manifest.load(root)
    assert [r.state["first_step"] for r in m.shards] == [2, 4] and m.sources["s"].sequences == 8
    with open(os.path.join(root, "index.json")) as f:
        index = json.load(f)
    assert [s["raw_data"]["basename"].split("/")[1] for s in index["shards"]] == [units[0].name, units[1].name]
    # a killed worker's half-written part and an unrecorded copy are removed when the directory is reopened
    os.makedirs(os.path.join(root, "worker-01", units[2].name + ".tmp"))
    _write_scored(root, 0, units[3])
    PartLedger(root, kind="scored", job="test", run_key=key, vocab_size=100)
    assert sorted(os.listdir(os.path.join(root, "worker-01"))) == [units[1].name]
    assert sorted(os.listdir(os.path.join(root, "worker-00"))) == [units[0].name]
    with pytest.raises(ValueError, match="different run.*stream"):
        PartLedger(root, kind="scored", job="test", run_key={"stream": {"num_samples": 11}})


def test_ledger_keeps_one_copy_of_a_unit_written_twice(tmp_path):
    root = str(tmp_path / "scored")
    ledger = PartLedger(root, kind="scored", job="test", run_key={}, vocab_size=100)
    u = _units()[0]
    _write_scored(root, 1, u)  # an attempt on worker 1 that was never recorded
    ledger.record(_write_scored(root, 0, u))
    assert not os.path.exists(os.path.join(root, "worker-01", u.name))


def test_weights_round_trip(tmp_path):
    sd = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "n": torch.tensor(7)}
    w = Weights.from_state_dict(sd)
    assert w.bf16 == ("b",)
    back = w.state_dict()
    assert all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)
    path = w.save(str(tmp_path / "w.safetensors"))
    w2 = Weights.load(path)
    assert w2.fingerprint() == w.fingerprint()
    model = torch.nn.Linear(4, 3)
    Weights.from_state_dict(model).load_into(torch.nn.Linear(4, 3))


def test_ledger_unrecords_damaged_or_missing_parts_on_reopen_so_they_are_redone(tmp_path, flip_bit):
    """Issue 14: a damaged scored part made every rerun fail ('the scored sequences of step 58 are not the
    candidate stream's'), and deleting it gave '[Errno 2] ... index.json'."""
    from curation.engine.ledger import PartCache
    from curation.io.shards import ShardIntegrityError

    root = str(tmp_path / "scored")
    units = _units()
    ledger = PartLedger(root, kind="scored", job="curate_and_train", run_key={}, vocab_size=100)
    parts = [ledger.record(_write_scored(root, i % 2, u)).name for i, u in enumerate(units[:3])]
    shard = os.path.join(root, parts[1], "shard.00000.mds.zstd")
    flip_bit(shard, offset=30)
    # the trainer's reader stops naming the file and the way out
    with pytest.raises(ShardIntegrityError) as e:
        PartCache(root, batch_size=2).rows(parts[1], units[1].first, units[1].first)
    assert str(e.value).startswith(f"{shard}: corrupt shard") and (
        f"part {parts[1]} can be regenerated: rerun the job that wrote it (curate_and_train)" in str(e.value))
    # the rerun unrecords it (counts too) and removes it; its unit is handed out again
    with pytest.warns(UserWarning, match=rf"{parts[1]} is damaged .*steps \[4, 6\) will be redone"):
        again = PartLedger(root, kind="scored", job="curate_and_train", run_key={}, vocab_size=100)
    assert again.dropped == [parts[1]] and set(again.done_units()) == {units[0].name, units[2].name}
    assert not os.path.exists(os.path.join(root, parts[1]))
    m = Manifest.load(root)
    assert m.sources["s"].sequences == 8 and not m.complete
    with open(os.path.join(root, "index.json")) as f:
        assert len(json.load(f)["shards"]) == 2
    again.record(_write_scored(root, 1, units[1]))
    assert Manifest.load(root).sources["s"].sequences == 12
    # a part deleted by hand is redone the same way
    import shutil

    shutil.rmtree(os.path.join(root, parts[0]))
    with pytest.warns(UserWarning, match="missing or unreadable index"):
        assert PartLedger(root, kind="scored", job="curate_and_train", run_key={}, vocab_size=100).dropped == [parts[0]]


def test_an_extended_plan_keeps_the_finished_parts_and_redoes_the_one_cut_short(tmp_path):
    """Issue 34: raising max_steps from 9 to 14 (W = 2, τ = 4, 2 steps per unit): the run key differs only in the
    plan's total_steps, so the ledger reopens; the part [8, 9) cut short by the old end is unrecorded and removed
    (its unit is [8, 10) now), the others stay done. A lowered total_steps is still another run."""
    root = str(tmp_path / "scored")

    def key(total: int) -> dict:
        return {"stream": {"num_samples": 10}, "plan": TrainingPlan(Schedule(2, 4, total), "exact", True).to_dict()}

    short = plan_training_units(Schedule(2, 4, 9), stop_step=9, mode="exact", range_steps=2)
    assert [u.name for u in short][-1] == "steps-000000008-000000009"
    ledger = PartLedger(root, kind="scored", job="test", run_key=key(9), vocab_size=100, config={"max_steps": 9})
    for i, u in enumerate(short):
        ledger.record(_write_scored(root, i % 2, u))
    ledger.finish()
    longer = PartLedger(root, kind="scored", job="test", run_key=key(14), vocab_size=100, config={"max_steps": 14})
    assert longer.manifest.extra["run_key"] == key(14) and longer.manifest.config == {"max_steps": 14}
    assert not longer.manifest.complete
    assert longer.keep_units({u.name for u in _units()}) == ["worker-01/steps-000000008-000000009"]
    assert set(longer.done_units()) == {u.name for u in short[:-1]}
    assert not os.path.exists(os.path.join(root, "worker-01", short[-1].name))
    m = Manifest.load(root)
    assert m.sources["s"].sequences == 2 * 6 and len(m.shards) == 3  # steps 2..7, two rows each
    with pytest.raises(ValueError, match=r"different run \(differs in: plan.schedule.total_steps\)"):
        PartLedger(root, kind="scored", job="test", run_key=key(12), vocab_size=100)


def test_extension_gaps_name_the_snapshots_a_shorter_run_never_published():
    sched = Schedule(2, 4, 14)
    assert TrainingPlan(sched, "exact", True).extension_gaps(9, 2) == []  # exact, sync: always exact
    # pipelined, P = 3 (snapshots 2, 5, 8, 11): from 9, the unit [9, 10) needs u^(8); from 8 nothing is missing
    piped = TrainingPlan(sched, "pipelined", True, snapshot_period=3)
    assert piped.extension_gaps(9, 2) == ["u^(8) for the pipelined unit steps-000000008-000000010"]
    assert piped.extension_gaps(8, 2) == []
    # overlapped, δ = 3: the refresh due before step 10 starts from u^(7), which a run ending at 8, 9 or 10 never
    # published (it had no refresh 2); a run ending at 7 resumes there and publishes it, one ending at 11 had it
    over = TrainingPlan(sched, "exact", True, overlap_steps=3)
    for old in (8, 9, 10):
        assert over.extension_gaps(old, 2) == ["u^(7) for the overlapped refresh 2"]
    assert over.extension_gaps(7, 2) == [] and over.extension_gaps(11, 2) == []


def test_a_worker_asks_ahead_and_its_reports_come_in_any_order():
    """A worker holds the unit it scores and the one asked ahead; reports arrive after the next request."""
    c = Coordinator(_units(), lookahead=None)
    for v in range(3):
        c.publish(REFERENCE, v)
    _, u0 = c.next_unit(0)
    _, u1 = c.next_unit(0)  # asked ahead: u0 is being scored
    _, u2 = c.next_unit(1)
    assert (u1.first, u2.first) == (u0.stop, u1.stop)  # handed out in step order, each once
    _, u3 = c.next_unit(0)  # u0 written, its report on the way, u1 being scored: the next one asked ahead
    assert c.held == {0: [u0.name, u1.name, u3.name], 1: [u2.name]} and c.held[0][0] == u0.name
    assert c.begun == {u0.name, u1.name}  # u3 is not begun before worker 0's next request, u2 before worker 1's
    assert u0 not in c.pending() and c.pending()[0].first == u3.stop and c.redone == 0
    assert c.complete(0, u1.name) == u1 and c.complete(0, u0.name) == u0  # in either order
    assert c.held == {0: [u3.name], 1: [u2.name]} and {u0.name, u1.name} <= c.done
    with pytest.raises(ValueError, match="holds"):
        c.complete(1, u3.name)  # held by worker 0
    with pytest.raises(ValueError, match="holds"):
        c.complete(0, u0.name)  # finished already
    assert c.complete(1, u2.name) == u2 and c.held == {0: [u3.name]}


def test_a_restarted_worker_gives_back_the_unit_whose_report_may_have_died_with_it():
    c = Coordinator(_units(), lookahead=None)
    for v in range(3):
        c.publish(REFERENCE, v)
    _, u0 = c.next_unit(0)
    _, u1 = c.next_unit(0)  # asked ahead as u0 began
    _, u2 = c.next_unit(0)  # asked ahead as u1 began (u0 written, its report on the way): the worker dies in u1
    c.worker_started(0)  # its serve() retried in the new process
    assert c.held == {} and c.redone == 2 and c.pending()[:3] == [u0, u1, u2]  # u0 and u1 redone, u2 not
    assert c.next_unit(0) == ("work", u0)  # the new process starts over from the lowest unit
    _, again = c.next_unit(1)
    assert again == u1  # the other given-back unit goes to the next asking worker
    with pytest.raises(ValueError, match="holds"):
        c.complete(0, u1.name)  # the old report arriving now: u1 is held by worker 1
    assert c.complete(1, u1.name) == u1
    c.worker_started(1)  # a first start: nothing of its held
    assert c.redone == 2 and c.held == {0: [u0.name]}
    c3 = Coordinator(_units(), lookahead=None)
    c3.publish(REFERENCE, 0)
    _, w0 = c3.next_unit(0)
    c3.next_unit(0)
    c3.worker_started(0)
    assert c3.complete(0, w0.name) is None and w0.name not in c3.done  # late report of a pending unit: ignored
    assert c3.pending()[0] == w0
