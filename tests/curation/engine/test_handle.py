"""The engine–trainer seam (curation/engine/handle.py): the engine's handles implement the declared protocols (the
trainer's calls, the driver's), a feed handed to trainer processes elsewhere travels without the parts it had open,
and a feed's rows of a step are the part's rows of that step."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream
from curation.engine.handle import EngineDriver, EngineFeed, EngineHandle
from curation.engine.plan import TrainingPlan
from curation.engine.ray_backend import EngineClient, RayEngine
from curation.engine.report import PartInfo
from curation.io.shards import write_part
from schemas.shards import SCORED

#: What the trainer may call, and what the driver calls (written out: a member added to one side only fails here).
TRAINER = ("wait_part", "trainer_at", "publish_proxy", "reference", "progress")
DRIVER = ("check", "for_workers", "finish_units", "finish", "report", "close")


def _declared(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def test_the_protocols_split_what_the_trainer_calls_from_what_the_driver_calls():
    assert _declared(EngineHandle) == {*TRAINER, "wait_seconds", "waits"}
    assert _declared(EngineDriver) == set(DRIVER)


def test_a_worker_client_makes_the_trainer_calls_only_and_the_ray_engine_both():
    client = EngineClient(None, "/engine")  # (no Ray needed: the coordinator's handle is only called)
    assert isinstance(client, EngineHandle) and client.wait_seconds == 0.0 and client.waits == []
    assert not isinstance(client, EngineDriver) and not any(hasattr(client, n) for n in DRIVER)
    assert issubclass(RayEngine, EngineClient) and all(callable(getattr(RayEngine, n)) for n in DRIVER)


class _Handle:
    """A trainer's handle that answers where each step's part is (two steps per part; past step 3, part [2, 4): a
    wrong answer)."""

    wait_seconds = 0.0

    def __init__(self) -> None:
        self.waits: list[tuple[int, float]] = []
        self.asked: list[int] = []

    def wait_part(self, step: int, *, timeout_s: float = 1800.0) -> PartInfo:
        self.asked.append(step)
        first = min(step - step % 2, 2)
        return PartInfo(f"worker-00/steps-{first}", first, first + 2, ref_version=first // 2)


def _part(out_dir: str, first: int, batch: int) -> None:
    rows = [{"tokens": np.full(4, 10 * t + i, np.uint16), "source": f"s{i}", "ref_loss": np.full(4, t, np.float16),
             "episode": t // 2} for t in (first, first + 1) for i in range(batch)]
    write_part(f"{out_dir}/worker-00/steps-{first}", SCORED, rows, vocab_size=100)


def test_a_feeds_rows_of_a_step_are_its_parts_rows_of_that_step(tmp_path):
    out = str(tmp_path / "scored")
    for first in (0, 2):
        _part(out, first, batch=3)
    handle = _Handle()
    feed = EngineFeed(handle, out, CandidateStream(40, 3, 7), TrainingPlan(Schedule(0, 2, 4), "exact", True))
    rows = feed.rows(3)
    assert handle.asked == [3] and (rows.step, rows.ref_version, rows.where) == (3, 1, f"{out}/worker-00/steps-2")
    assert rows.column("tokens")[:, 0].tolist() == [30, 31, 32] and rows.column("ref_loss").shape == (3, 4)
    assert [str(s) for s in rows.column("source")] == ["s0", "s1", "s2"]
    with pytest.raises(ValueError, match="holds 6 rows, step 5 needs rows"):
        feed.rows(5)  # the handle names part [2, 4) for it: refused, not read past the part


def test_a_feed_travels_with_its_handle_and_objects_but_not_its_open_parts(tmp_path):
    out = str(tmp_path / "scored")
    _part(out, 0, batch=2)
    plan = TrainingPlan(Schedule(2, 3, 11), "exact", True)
    feed = EngineFeed(_Handle(), out, CandidateStream(40, 2, 7), plan, timeout_s=5.0)
    feed.rows(1)  # a part open in this process
    again = pickle.loads(pickle.dumps(feed))  # it travels to the Ray Train workers as it is
    assert (again.out_dir, again.plan.schedule, again.timeout_s) == (out, Schedule(2, 3, 11), 5.0)
    assert again.stream.batch_ids(5).tolist() == feed.stream.batch_ids(5).tolist()
    assert again.rows(0).column("tokens")[:, 0].tolist() == [0, 1]  # its own reader of the same part
    theirs = dataclasses.replace(feed, handle=_Handle())  # a data-parallel trainer's workers: their own handle
    assert theirs.handle is not feed.handle and theirs.rows(1).column("tokens")[:, 0].tolist() == [10, 11]
