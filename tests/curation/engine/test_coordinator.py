"""The coordinator's decisions without Ray (:mod:`curation.engine.state`): resume from the files of a killed run,
proxy-snapshot retention, refresh triggering for each RefreshMode, run statistics, failures, GPU shares."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from curation.core.policies import RefreshMode
from curation.core.refresh_data import RecentMasks
from curation.core.schedule import Schedule
from curation.engine.ledger import PartLedger, PartResult
from curation.engine.plan import PROXY, REFERENCE, EngineError, TrainingPlan
from curation.engine.refresh_runner import proxy_path, reference_log_path, reference_path
from curation.engine.report import PartInfo, RunStats
from curation.engine.state import (
    EngineState,
    RefreshTask,
    gpu_shares,
    recent_path,
    save_snapshot,
    weights_on_disk,
)
from curation.engine.weights import Weights
from curation.io.recent import load_recent, save_recent
from curation.io.shards import write_part
from schemas.shards import SCORED, SELECTED

SCHED = Schedule(2, 4, 14)  # W = 2, τ = 4: refreshes before steps 2, 6, 10


class Launcher:
    """Stands in for the refresh actor: records each task, returns a handle naming the reference."""

    def __init__(self) -> None:
        self.tasks: list[RefreshTask] = []

    def __call__(self, task: RefreshTask) -> str:
        self.tasks.append(task)
        return f"ref{task.version}"


def _state(tmp_path, *, mode=RefreshMode.SYNC, plan="exact", lookahead=4, overlap=0, period=1, units=None):
    if plan is None:
        training = None
    else:
        refreshes = mode in (RefreshMode.SYNC, RefreshMode.CONTINUE)
        training = TrainingPlan(SCHED, plan, refreshes, period, overlap)
    if units is None:
        units = training.units(2) if training is not None else []
    kind = "selected" if plan == "pipelined" else "scored"
    ledger = PartLedger(str(tmp_path / kind), kind=kind, job="test", run_key={"t": 1}, vocab_size=100)
    loaded: list[str] = []
    launch = Launcher()

    def load(path: str) -> str:
        loaded.append(path)
        return "disk:" + os.path.basename(path)

    state = EngineState(units, ledger=ledger, engine_dir=str(tmp_path / "engine"), lookahead=lookahead, plan=training,
                        refresh_mode=mode, load=load, launch=launch)
    return state, launch, loaded


def _touch(path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x")
    return path


def _write(state: EngineState, wid: int, unit, kept_every: int = 2) -> PartResult:
    """The part a worker would write for ``unit`` (2 sequences of 6 tokens per step, sources ``a`` then ``b``)."""
    spec = SCORED if unit.output == "scored" else SELECTED
    name = f"worker-{wid:02d}/{unit.name}"
    rows, sources = [], {}
    for t in unit.steps:
        for i, src in enumerate(("a", "b")):
            row = {"tokens": np.arange(6, dtype=np.uint16) + t, "source": src, "episode": unit.ref_version}
            if spec is SCORED:
                row["ref_loss"] = np.zeros(6, np.float16)
            else:
                row.update(loss_mask=(np.arange(6) % kept_every == 0).astype(np.uint8), score=np.zeros(6, np.float16),
                           step=t)
            rows.append(row)
            c = sources.setdefault(src, {"sequences": 0, "tokens": 0, "kept_tokens": 0})
            c["sequences"] += 1
            c["tokens"] += 6
            c["kept_tokens"] += 3 * i  # "a" keeps none, "b" keeps 3 per sequence
    n = write_part(os.path.join(state.ledger.out_dir, name), spec, rows, vocab_size=100)
    return PartResult(worker=wid, unit=unit.name, name=name, first=unit.first, stop=unit.stop, samples=n,
                      tokens=n * 6, kept_tokens=sum(c["kept_tokens"] for c in sources.values()), sources=sources,
                      seconds=0.25)


# ------------------------------------------------------------------------------------------------
# resume from disk
# ------------------------------------------------------------------------------------------------
def test_weights_on_disk_reads_versions_from_the_names_the_engine_writes(tmp_path):
    d = str(tmp_path)
    for path in (reference_path(d, 0), reference_path(d, 12), proxy_path(d, 6), recent_path(d, 6), proxy_path(d, 10)):
        _touch(path)
    for other in ("reference-0000.json", "reference-0001.optim.pt", "proxy-000000007.safetensors.tmp", "notes.txt"):
        _touch(os.path.join(d, other))
    assert weights_on_disk(d, REFERENCE) == {0: reference_path(d, 0), 12: reference_path(d, 12)}
    assert weights_on_disk(d, PROXY) == {6: proxy_path(d, 6), 10: proxy_path(d, 10)}  # not the .recent masks
    assert recent_path(d, 6) == os.path.join(d, "proxy-000000006.recent.safetensors")
    w = Weights({"w": np.arange(3, dtype=np.float32)})
    save_snapshot(d, 14, w, RecentMasks())  # no recent steps (warm-up): no masks file
    save_snapshot(d, 18, w, RecentMasks.from_pairs([(17, np.ones((1, 2), np.uint8))]))
    assert sorted(weights_on_disk(d, PROXY)) == [6, 10, 14, 18] and not os.path.exists(recent_path(d, 14))
    assert Weights.load(proxy_path(d, 18)).fingerprint() == w.fingerprint()
    assert load_recent(recent_path(d, 18)).steps == [17]


def test_resume_publishes_what_a_killed_run_left_and_reruns_the_interrupted_refresh(tmp_path):
    engine = str(tmp_path / "engine")
    _touch(reference_path(engine, 0))
    _touch(reference_log_path(engine, 0))  # (written after the weights: reference 0 is complete)
    _touch(proxy_path(engine, 6))  # refresh 1's source snapshot, saved before the kill; reference 1 never written
    save_recent(RecentMasks.from_pairs([(4, np.ones((2, 3), np.uint8)), (5, np.zeros((2, 3), np.uint8))]),
                recent_path(engine, 6))
    state, launch, loaded = _state(tmp_path)
    assert loaded == [proxy_path(engine, 6)]  # snapshots are loaded at once; references when asked for
    assert state.core.published == {(REFERENCE, 0), (PROXY, 6)}
    assert launch.tasks == []  # nothing runs before start()
    state.start()
    [task] = launch.tasks
    assert (task.version, task.source_step, task.static, task.proxy, task.previous) == (1, 6, False,
                                                                                        "disk:proxy-000000006.safetensors", None)
    assert task.recent.steps == [4, 5] and task.recent.masks[0].tolist() == [[1, 1, 1]] * 2
    assert state.refreshing == {1: 6} and state.published(REFERENCE, 1) and state.handle(REFERENCE, 1) == "ref1"
    assert state.progress().references == (0, 1) and state.progress().refreshing == (1,)


def test_a_reference_killed_before_its_log_was_written_is_refreshed_again(tmp_path):
    """_save writes the weights, then the log: a kill between the two left weights the resumed run used as they
    were, and the run's summary lacked that refresh (seen once in CI:
    test_a_killed_job_resumes_to_the_same_outputs). Without its log the version is redone from its source."""
    engine = str(tmp_path / "engine")
    for v in (0, 1):
        _touch(reference_path(engine, v))
    _touch(reference_log_path(engine, 0))  # reference 1: weights, no log
    _touch(proxy_path(engine, 6))  # its source, kept until its refresh ends
    state, launch, _ = _state(tmp_path)
    assert state.core.published == {(REFERENCE, 0), (PROXY, 6)}
    state.start()
    assert [(t.version, t.source_step) for t in launch.tasks] == [(1, 6)]


def test_resume_without_recent_masks_refreshes_with_none_and_without_plan_loads_no_snapshot(tmp_path):
    engine = str(tmp_path / "engine")
    _touch(proxy_path(engine, 2))  # refresh 0 interrupted, no masks saved (warm-up only)
    state, launch, _ = _state(tmp_path)
    state.start()
    assert [(t.version, t.source_step, t.recent.steps) for t in launch.tasks] == [(0, 2, [])]
    batch, _, loaded = _state(tmp_path / "batch", mode=RefreshMode.NONE, plan=None, lookahead=None)
    assert batch.core.published == set() and loaded == []


# ------------------------------------------------------------------------------------------------
# refresh triggering, per RefreshMode
# ------------------------------------------------------------------------------------------------
def test_sync_starts_each_refresh_when_its_source_snapshot_is_published(tmp_path):
    state, launch, _ = _state(tmp_path, mode=RefreshMode.SYNC)
    state.start()
    assert launch.tasks == []
    recent = RecentMasks.from_pairs([(1, np.ones((2, 3), np.uint8))])
    assert state.publish_proxy(2, "u2", recent) is True
    assert [(t.version, t.source_step, t.proxy, t.previous, t.recent) for t in launch.tasks] == [(0, 2, "u2", None, recent)]
    assert state.publish_proxy(2, "u2 again") is False and len(launch.tasks) == 1  # registered once
    state.publish_proxy(3, "u3")  # not a refresh source
    state.publish_proxy(6, "u6")
    assert [(t.version, t.source_step, t.previous, t.recent.steps) for t in launch.tasks] == [(0, 2, None, [1]),
                                                                                               (1, 6, None, [])]


def test_continue_hands_over_the_previous_reference_and_refuses_when_it_is_missing(tmp_path):
    state, launch, _ = _state(tmp_path, mode=RefreshMode.CONTINUE)
    state.publish_proxy(2, "u2")
    state.publish_proxy(6, "u6")
    assert [(t.version, t.proxy, t.previous) for t in launch.tasks] == [(0, "u2", None), (1, "u6", "ref0")]
    # a resumed run whose refresh 1 was interrupted but whose reference 0 is gone cannot continue it
    _touch(proxy_path(str(tmp_path / "b" / "engine"), 6))
    broken, _, _ = _state(tmp_path / "b", mode=RefreshMode.CONTINUE)
    with pytest.raises(EngineError, match=r"refresh 1 \(blade-nosync\) needs reference 0, which is missing"):
        broken.start()


def test_static_trains_the_reference_once_and_none_never_refreshes(tmp_path):
    state, launch, _ = _state(tmp_path, mode=RefreshMode.STATIC)
    state.start()
    assert launch.tasks == [RefreshTask(0, static=True)] and state.refreshing == {0: 0}
    state.publish_proxy(2, "u2")  # rho1 publishes no snapshot; one published anyway starts nothing
    assert len(launch.tasks) == 1
    _touch(reference_path(str(tmp_path / "again" / "engine"), 0))
    _touch(reference_log_path(str(tmp_path / "again" / "engine"), 0))  # (the killed run finished saving it)
    resumed, launch2, _ = _state(tmp_path / "again", mode=RefreshMode.STATIC)
    resumed.start()
    assert launch2.tasks == [] and resumed.published(REFERENCE, 0)  # trained by the killed run: reused
    none, launch3, _ = _state(tmp_path / "none", mode=RefreshMode.NONE)
    none.start()
    none.publish_proxy(2, "u2")
    assert launch3.tasks == []
    with pytest.raises(ValueError, match="refresh mode 'sync' does not match a plan with refreshes=False"):
        EngineState([], ledger=state.ledger, engine_dir=state.engine_dir, plan=TrainingPlan(SCHED, "exact", False),
                     refresh_mode=RefreshMode.SYNC, load=str)


def test_overlapped_refresh_starts_from_the_snapshot_delta_steps_earlier(tmp_path):
    state, launch, _ = _state(tmp_path, overlap=1)
    for step in range(1, 11):
        state.publish_proxy(step, f"u{step}")
    assert [(t.version, t.source_step) for t in launch.tasks] == [(0, 1), (1, 5), (2, 9)]


def test_a_failed_refresh_fails_the_engine_with_its_message(tmp_path):
    state, _, _ = _state(tmp_path)
    state.publish_proxy(2, "u2")
    state.refresh_done(0, "ValueError: out of memory")
    assert state.refreshing == {} and state.core.failed == "refresh of reference 0 failed: ValueError: out of memory"
    with pytest.raises(EngineError, match="refresh of reference 0 failed: ValueError: out of memory"):
        state.part_info(2)
    assert state.core.next_unit(0) == ("stop", None)


# ------------------------------------------------------------------------------------------------
# snapshot retention
# ------------------------------------------------------------------------------------------------
def test_a_refresh_source_is_kept_until_its_refresh_ends_then_deleted(tmp_path):
    state, _, _ = _state(tmp_path)
    engine = state.engine_dir
    for step in (2, 3):
        _touch(proxy_path(engine, step))
        _touch(recent_path(engine, step))
    state.publish_proxy(3, "u3")  # exact mode: no unit and no refresh needs u^(3)
    assert not state.published(PROXY, 3) and not os.path.exists(proxy_path(engine, 3))
    assert not os.path.exists(recent_path(engine, 3))
    state.publish_proxy(2, "u2")
    assert state.published(PROXY, 2) and os.path.exists(proxy_path(engine, 2))  # refresh 0 runs from it
    state.refresh_done(0)
    assert not state.published(PROXY, 2) and not os.path.exists(proxy_path(engine, 2))
    assert not os.path.exists(recent_path(engine, 2)) and state.published(REFERENCE, 0)
    assert state.handles == {(REFERENCE, 0): "ref0"}  # the latest reference stays held


def test_a_snapshot_whose_refresh_has_not_started_is_kept(tmp_path):
    state, launch, _ = _state(tmp_path, lookahead=None)
    state.publish_weights(PROXY, 6, "u6")  # registered without starting refresh 1 (e.g. given weights)
    state.prune()
    assert state.published(PROXY, 6) and launch.tasks == []


def test_pipelined_snapshots_live_until_their_units_are_done(tmp_path):
    state, _, _ = _state(tmp_path, plan="pipelined", period=2, lookahead=None)
    state.publish_proxy(2, "u2")  # refresh 0's source and the snapshot of the units [2, 4)
    state.refresh_done(0)
    for first, stop in ((0, 2), (2, 4)):  # warm-up, then the unit scored with u^(2)
        assert state.published(PROXY, 2)
        status, unit = state.core.next_unit(0)
        assert status == "work" and (unit.first, unit.stop) == (first, stop)
        if unit.proxy_version is not None:
            assert state.handle(PROXY, unit.proxy_version) == "u2"
        state.complete(0, _write(state, 0, unit))
    assert not state.published(PROXY, 2) and (PROXY, 2) not in state.handles  # its last unit is done


def test_an_older_reference_is_reloaded_from_disk_when_asked_for_and_a_missing_file_is_named(tmp_path):
    state, _, loaded = _state(tmp_path, lookahead=None)
    engine = state.engine_dir
    state.publish_proxy(2, "u2")
    state.refresh_done(0)
    state.publish_proxy(6, "u6")
    state.refresh_done(1)
    assert set(state.handles) == {(REFERENCE, 0), (REFERENCE, 1)}  # the latest, and one units still need
    _touch(reference_path(engine, 0))
    for _ in range(2):  # the two units of episode 0
        status, unit = state.core.next_unit(0)
        assert status == "work" and unit.ref_version == 0
        state.complete(0, _write(state, 0, unit))
    assert set(state.handles) == {(REFERENCE, 1)} and state.published(REFERENCE, 0)
    assert state.handle(REFERENCE, 0) == "disk:reference-0000.safetensors" and loaded == [reference_path(engine, 0)]
    os.remove(reference_path(engine, 0))
    state.prune()
    with pytest.raises(EngineError, match=r"weights reference 0 are registered but .*reference-0000.safetensors is missing"):
        state.handle(REFERENCE, 0)


# ------------------------------------------------------------------------------------------------
# workers, statistics, reporting
# ------------------------------------------------------------------------------------------------
def test_stats_add_up_the_parts_per_source_and_the_report_keeps_its_json_form(tmp_path):
    state, _, _ = _state(tmp_path, lookahead=None)
    state.publish_weights(REFERENCE, 0, "r0")
    state.publish_weights(REFERENCE, 1, "r1")
    units = []
    for wid in (0, 1):
        status, unit = state.core.next_unit(wid)
        assert status == "work"
        units.append(unit)
    assert state.part_info(2) is None  # not finished yet
    for wid, unit in enumerate(units):
        state.complete(wid, _write(state, wid, unit))
    # units [2, 4) and [4, 6): 4 steps × 2 sequences of 6 tokens; source b keeps 3 tokens per sequence
    expected = {"tokens": 48, "kept_tokens": 12, "parts": 2, "seconds": 0.5,
                "sources": {"a": {"sequences": 4, "tokens": 24, "kept_tokens": 0},
                            "b": {"sequences": 4, "tokens": 24, "kept_tokens": 12}}}
    report = state.report()
    assert json.dumps(report.stats.to_dict()) == json.dumps(expected)  # same keys in the same order
    assert (report.progress.tokens, report.progress.kept_tokens) == (48, 12)
    assert report.progress.units_done == 2 and report.refreshes == () and report.final_reference is None
    assert state.part_info(5) == PartInfo(f"worker-01/{units[1].name}", first=4, stop=6, ref_version=0)
    state.complete(0, _write(state, 0, state.next_unit(0)[1]))  # a part more: the report taken before is unchanged
    assert report.stats.parts == 2 and state.report().stats.parts == 3
    with pytest.raises(EngineError, match="no work unit covers step 1"):
        state.part_info(1)  # warm-up: exact mode scores nothing there
    with pytest.raises(EngineError, match=r"finish\(\) with 3 units not done"):
        state.finish()
    assert state.ledger.manifest.sources["b"].kept_tokens == 18  # the ledger recorded the same parts


def test_run_stats_merge_sources_with_source_counts():
    stats = RunStats()
    for tokens in (10, 20):
        stats.add(PartResult(0, "u", "w/u", 0, 1, 2, tokens, 1, sources={"x": {"sequences": 1, "tokens": tokens,
                                                                               "kept_tokens": 1}}, seconds=1.5))
    assert stats.to_dict() == {"tokens": 30, "kept_tokens": 2, "parts": 2, "seconds": 3.0,
                               "sources": {"x": {"sequences": 2, "tokens": 30, "kept_tokens": 2}}}


def test_units_whose_weights_are_gone_are_named_after_the_trainer(tmp_path):
    state, _, _ = _state(tmp_path, plan="pipelined", period=2, lookahead=None)
    for v in range(3):
        state.publish_weights(REFERENCE, v, f"r{v}")
    for step in range(2, 14, 2):
        state.publish_weights(PROXY, step, f"u{step}")
    state.check_finishable()
    state.core.retract(PROXY, 2)  # dropped: a part [2, 4) found damaged now cannot be redone
    with pytest.raises(EngineError, match=r"parts steps-000000002-000000004 of .*selected were damaged and cannot "
                                          r"be redone: the proxy snapshots they were scored with are gone"):
        state.check_finishable()


def test_gpu_shares():
    assert gpu_shares(4.0, 2, refresh=True) == (1.0, 1.0)
    assert gpu_shares(1.0, 2, refresh=True) == (1 / 3, 1 / 3)
    assert gpu_shares(1.0, 3, refresh=False) == (1 / 3, 0.0)
    assert gpu_shares(0.0, 2, refresh=True) == (0.0, 0.0)
    assert gpu_shares(8.0, 2, refresh=True, device="cpu") == (0.0, 0.0)
    assert gpu_shares(1.0, 1, refresh=True, per_worker=0.25) == (0.25, 0.75)
    assert gpu_shares(4.0, 1, refresh=True, per_worker=1.0) == (1.0, 1.0)
    with pytest.raises(ValueError, match="workers.device=cuda but the Ray cluster has no GPU"):
        gpu_shares(0.0, 1, refresh=False, device="cuda")


def test_gpu_shares_leave_the_trainer_groups_gpus_alone():
    # 8 GPUs, a 4-GPU trainer group: 2 scoring workers and the refresh get one each of the other 4
    assert gpu_shares(8.0, 2, refresh=True, reserved=4.0) == (1.0, 1.0)
    # 4 GPUs, a 2-GPU trainer group: 3 slots share the 2 left
    assert gpu_shares(4.0, 2, refresh=True, reserved=2.0) == (2 / 3, 2 / 3)
    assert gpu_shares(4.0, 1, refresh=True, per_worker=1.0, reserved=2.0) == (1.0, 1.0)
    assert gpu_shares(3.0, 1, refresh=True, per_worker=1.0, reserved=2.0) == (1.0, 0.0)
    with pytest.raises(ValueError, match=r"workers.gpus=1 × 2 scoring workers do not fit the Ray cluster's 4 GPUs "
                                         r"beside the trainer's 3: lower workers.gpus"):
        gpu_shares(4.0, 2, refresh=False, per_worker=1.0, reserved=3.0)
    with pytest.raises(ValueError, match="workers.device=cuda but the Ray cluster has no GPU left beside the "
                                         "trainer's 2"):
        gpu_shares(2.0, 1, refresh=False, device="cuda", reserved=2.0)
    assert gpu_shares(2.0, 1, refresh=True, reserved=2.0) == (0.0, 0.0)  # auto: the engine scores on CPU
