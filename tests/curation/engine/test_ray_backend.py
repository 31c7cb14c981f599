"""The engine on a local Ray instance: same output as in-process, a killed worker redoes its unit once,
back-pressure over the trainer, the refresh actor and the weights registry."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from curation.core.policies import RefreshMode
from curation.core.refresh_data import RecentMasks
from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream
from curation.engine.ledger import LedgerSpec
from curation.engine.plan import PROXY, REFERENCE, TrainingPlan, plan_batch_units
from curation.engine.ray_backend import RayEngine
from curation.engine.refresh_runner import RefreshRunner, RefreshSpec, proxy_path
from curation.engine.weights import Weights
from curation.engine.work import EngineWork
from curation.engine.workers import BatchOrder, ScoringWorker, WorkerSpec
from curation.io.models import build_causal_lm
from curation.io.recent import save_recent
from curation.io.shards import ShardReader, open_shards
from schemas.engine_config import WorkersConfig
from schemas.manifest import Manifest
from schemas.train_config import SelectionConfig, demo_model_config
from tests import timing

pytestmark = [pytest.mark.ray, pytest.mark.slow]

B = 8
MODEL = demo_model_config(512, hidden=32, layers=1)


def _w(seed: int) -> Weights:
    return Weights.from_state_dict(build_causal_lm(MODEL.model_copy(update={"init_seed": seed})))


@pytest.fixture(scope="module")
def batch_setup(engine_demo):
    cand = os.path.join(engine_demo, "data", "candidates")
    n = len(open_shards(cand))
    order = BatchOrder("blocks", n, B)
    fixed = {(REFERENCE, 0): _w(1), (PROXY, 0): _w(2)}

    def spec(out: str) -> WorkerSpec:
        return WorkerSpec(candidates=cand, out_dir=out, model=MODEL, order=order,
                          vocab_size=512, gamma=0.6, needs_proxy=True)

    # the uninterrupted in-process result: rows of every step, in step order
    worker = ScoringWorker(spec("/nonexistent"), 0)
    expected = [row for step in range(order.num_steps) for row in _unit_rows(worker, step, fixed)]
    return {"order": order, "fixed": fixed, "spec": spec, "expected": expected}


def _unit_rows(worker, step, fixed):
    from curation.engine.plan import WorkUnit

    unit = WorkUnit(step, step + 1, "selected", 0, 0)
    worker._ensure(unit, lambda k, v: fixed[(k, v)])
    return [row for block in worker.rows(unit, {}) for row in block]  # (one RowBlock of rows per step)


def _engine(setup, out, workers=2, **kw):
    ledger = LedgerSpec(out, kind="selected", job="test", run_key={"t": 1}, vocab_size=512, seq_len=128)
    work = EngineWork(units=plan_batch_units(setup["order"].num_steps, kw.pop("range_steps", 10)),
                      worker_spec=setup["spec"](out), ledger=ledger, engine_dir=os.path.join(out, "engine"))
    engine = RayEngine(work, WorkersConfig(count=workers, threads=1, device="cpu", **kw))
    engine.pids  # noqa: B018 - every worker is up: then the weights make the units ready for all at once
    for (kind, version), w in setup["fixed"].items():
        engine.publish_weights(kind, version, w)
    return engine


def _same_rows(out, expected):
    reader = ShardReader(out)
    got = [reader[i] for i in range(len(reader))]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g["step"] == e["step"] and g["source"] == e["source"]
        for col in ("tokens", "loss_mask", "score"):
            assert np.array_equal(g[col], e[col], equal_nan=col == "score")


def test_two_workers_write_what_one_process_writes(ray_local, batch_setup, tmp_path):
    out = str(tmp_path / "sel")
    engine = _engine(batch_setup, out)
    try:
        engine.run(progress=False)
        engine.finish()
        rep = engine.report()
    finally:
        engine.close()
    _same_rows(out, batch_setup["expected"])
    m = Manifest.load(out)
    assert m.complete and len({r.state["unit"] for r in m.shards}) == len(m.shards)
    assert {r.state["worker"] for r in m.shards} == {0, 1}  # both workers took units
    assert rep.progress.redone == 0 and rep.stats.kept_tokens == m.totals().kept_tokens


def test_a_worker_killed_mid_unit_is_restarted_and_redoes_it_once(ray_local, batch_setup, tmp_path):
    out = str(tmp_path / "sel")
    engine = _engine(batch_setup, out, range_steps=12, max_restarts=2)
    try:
        victim = engine.workers[1]
        pid = engine.pids[1]
        wdir = os.path.join(out, "worker-01")
        deadline = timing.Deadline(60)
        while not (os.path.isdir(wdir) and any(e.endswith(".tmp") for e in os.listdir(wdir))):
            assert not deadline.expired(), "worker 1 never started a unit"
            time.sleep(0.002)
        ray_local.kill(victim, no_restart=False)  # mid-unit: its part is still a .tmp directory
        engine.run(progress=False)
        engine.finish()
        rep = engine.report()
        assert ray_local.get(victim.pid.remote()) != pid  # the same actor, restarted in a new process
    finally:
        engine.close()
    assert rep.progress.redone == 1
    assert engine.worker_results[1]["restarted"] is True  # (what its serve() returned, kept by the driver)
    _same_rows(out, batch_setup["expected"])  # same sequences, none twice
    names = [r.name for r in Manifest.load(out).shards]
    assert len(names) == len(set(names)) == len(plan_batch_units(batch_setup["order"].num_steps, 12))
    assert not [e for e in os.listdir(os.path.join(out, "worker-01")) if e.endswith(".tmp")]


def test_a_killed_coordinator_ends_the_engine_in_one_line_saying_to_rerun(ray_local, batch_setup, tmp_path):
    """P33 (issue 55): killing the coordinator ended the job with Ray's 7-line actor dump and no word of the rerun
    (which is exact: tests/jobs/test_soak.py)."""
    from curation.engine.plan import EngineError

    engine = _engine(batch_setup, str(tmp_path / "sel"), range_steps=12)
    try:
        pid = ray_local.get(engine.coordinator.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineError) as e:
            engine.run(progress=False)
    finally:
        engine.close()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"the engine's Coordinator (pid {pid}) died: "), msg
    assert msg.endswith("; finished work is kept: rerun the same command to resume"), msg


def test_exact_mode_refresh_back_pressure_and_registry(ray_local, engine_demo, tmp_path):
    """A scripted trainer on a resumed engine directory: the interrupted refresh 0 is redone from disk, the
    workers stay within the look-ahead, later refreshes start when their snapshots are published."""
    cand = os.path.join(engine_demo, "data", "candidates")
    val = os.path.join(engine_demo, "data", "validation")
    n = len(open_shards(cand))
    sched = Schedule(2, 4, 14)
    plan = TrainingPlan(sched, "exact", True)
    stream = CandidateStream(n, B, 0)
    sel = SelectionConfig(warmup_steps=2, tau=4, refresh_steps=2, refresh_batch_size=2, refresh_candidate_batches=2)
    out, engine_dir = str(tmp_path / "scored"), str(tmp_path / "engine")
    rspec = RefreshSpec(model=MODEL, validation=val, candidates=cand, stream=stream, selection=sel, ref_lr=1e-3,
                        refresh_batch_size=2, engine_dir=engine_dir, schedule=sched, device="cpu",
                        threads=1)
    wspec = WorkerSpec(candidates=cand, out_dir=out, model=MODEL, order=BatchOrder("stream", n, B), vocab_size=512,
                       schedule=sched,
                       needs_proxy=False, device="cpu")
    ledger = LedgerSpec(out, kind="scored", job="test", run_key={"t": 2}, vocab_size=512,
                        extra={"stream": stream.to_dict()})
    model = build_causal_lm(MODEL)
    recent = RecentMasks.from_pairs([(0, np.ones((B, 128), np.uint8)), (1, np.ones((B, 128), np.uint8))])
    # As left by a job killed during refresh 0: its source snapshot and recent masks on disk, no reference.
    os.makedirs(engine_dir)
    Weights.from_state_dict(model).save(proxy_path(engine_dir, 2))
    save_recent(recent, proxy_path(engine_dir, 2).replace(".safetensors", ".recent.safetensors"))
    work = EngineWork(units=plan.units(2), worker_spec=wspec, ledger=ledger, engine_dir=engine_dir, plan=plan,
                      refresh_mode=RefreshMode.SYNC, refresh_spec=rspec)
    engine = RayEngine(work, WorkersConfig(count=2, threads=1, device="cpu"), lookahead=4)
    try:
        engine.trainer_at(2)
        info = engine.wait_part(2, timeout_s=timing.scaled(120))  # the interrupted refresh ran again from the files
        assert (info.first, info.stop, info.ref_version) == (2, 4, 0)
        time.sleep(1.0)  # workers would run ahead here without back-pressure
        stops = [r.state["stop_step"] for r in Manifest.load(out).shards]
        assert max(stops) <= 2 + 4  # nothing beyond trainer step + look-ahead
        # the refresh actor's reference equals an in-process refresh with the same inputs
        ref = engine.reference(0).state_dict()
        local, _ = RefreshRunner(rspec).refresh(0, Weights.from_state_dict(model), recent, source_step=2)
        assert all(np.array_equal(ref[k].numpy(), v.numpy()) for k, v in local.state_dict().items())
        assert not os.path.exists(os.path.join(engine_dir, "proxy-000000002.safetensors"))  # no longer needed
        engine.trainer_at(6)
        engine.publish_proxy(6, model, recent)  # starts refresh 1
        for t in range(6, 14):
            engine.trainer_at(t)
            if t == 10:
                engine.publish_proxy(10, model, recent)  # refresh 2
            assert engine.wait_part(t, timeout_s=timing.scaled(120)).ref_version == sched.episode(t)
        engine.finish()
        rep = engine.report()
    finally:
        engine.close()
    assert [(r["version"], r["step"], r["source_step"]) for r in rep.refreshes] == [(0, 2, 2), (1, 6, 6), (2, 10, 10)]
    m = Manifest.load(out)
    assert m.complete and [(r.state["first_step"], r.state["stop_step"]) for r in m.shards] == [
        (a, min(a + 2, 14)) for a in range(2, 14, 2)]
    from curation.io.scored_shards import ScoredShards

    scored = ScoredShards(out, stream)  # the single-process trainer can read the engine's output offline
    assert list(scored.steps()) == list(range(2, 14))
    assert scored.read(9)[2].tolist() == [1] * B
