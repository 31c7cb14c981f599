"""The engine–trainer seam (curation/engine/handle.py): the engine's handles implement the declared protocol, and a
feed handed to trainer processes elsewhere carries their handle, the rest unchanged."""

from __future__ import annotations

import pickle

from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream
from curation.engine.handle import EngineFeed, EngineHandle
from curation.engine.plan import TrainingPlan
from curation.engine.ray_backend import EngineClient, RayEngine

#: What the trainer may call (the protocol's members, written out: a member added to one side only fails here).
MEMBERS = ("wait_part", "trainer_at", "publish_proxy", "reference", "progress", "check", "close", "for_workers")


def test_the_protocol_declares_what_the_trainer_calls():
    declared = {n for n in vars(EngineHandle) if not n.startswith("_")} | set(EngineHandle.__annotations__)
    assert declared == {*MEMBERS, "wait_seconds"}


def test_the_ray_engine_and_its_worker_client_are_engine_handles():
    client = EngineClient(None, "/engine")  # (no Ray needed: the coordinator's handle is only called)
    assert isinstance(client, EngineHandle) and client.wait_seconds == 0.0
    assert isinstance(client.for_workers(), EngineClient) and client.for_workers() is not client
    assert issubclass(RayEngine, EngineClient)
    # the driver's own: it checks the workers and ends the engine; a worker's client does neither
    assert RayEngine.check is not EngineClient.check and RayEngine.close is not EngineClient.close
    assert RayEngine.for_workers is not EngineClient.for_workers
    assert client.check() is None and client.close() is None


class _Handle:
    """A handle whose workers' handle is another object (as the driver's RayEngine gives an EngineClient)."""

    wait_seconds = 0.0

    def __init__(self, name: str) -> None:
        self.name = name

    def for_workers(self) -> _Handle:
        return _Handle(self.name + "-for-workers")


def test_a_feed_for_workers_carries_their_handle_and_the_same_objects():
    plan = TrainingPlan(Schedule(2, 3, 11), "exact", True)
    feed = EngineFeed(_Handle("driver"), "/out/scored", CandidateStream(40, 4, 7), plan, timeout_s=5.0)
    theirs = feed.for_workers()
    assert theirs.handle.name == "driver-for-workers" and feed.handle.name == "driver"
    assert (theirs.out_dir, theirs.stream, theirs.plan, theirs.timeout_s) == ("/out/scored", feed.stream, plan, 5.0)
    again = pickle.loads(pickle.dumps(theirs))  # it travels to the Ray Train workers as it is
    assert again.plan.schedule == Schedule(2, 3, 11) and again.stream.batch_ids(5).tolist() == \
        feed.stream.batch_ids(5).tolist()
