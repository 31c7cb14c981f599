"""The engine directory's reference logs and weights are read back for the report and the coordinator: only the files
the run wrote, from the bucket for an object-store run (written on another node)."""

from __future__ import annotations

import json
import os

import pytest

from curation.engine.plan import EngineError
from curation.engine.refresh_runner import refresh_logs
from curation.io.paths import UnsafeNameError


def test_a_reference_log_that_is_a_link_is_refused_not_reported(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "reference-0000.json").write_text(json.dumps({"version": 0, "steps": 3}))
    assert refresh_logs(str(engine)) == [{"version": 0, "steps": 3}]
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"version": 1, "secret": "outside the run"}))
    os.symlink(secret, engine / "reference-0001.json")
    with pytest.raises(UnsafeNameError, match=rf"^{engine}/reference-0001.json: a symbolic link \(to '{secret}'\), "
                                              r"not a reference log written by the run; refused") as e:
        refresh_logs(str(engine))
    assert "\n" not in str(e.value) and "outside the run" not in str(e.value)


def test_an_object_store_engine_directory_is_read_from_the_bucket_whatever_node_wrote_it(s3, tmp_path):
    """A refresh actor on another node writes its references and logs into its own node's cache and the bucket: the
    coordinator's report (:func:`refresh_logs`) and its reload of an older reference (``EngineState.handle``) read
    them from the bucket into this process's cache, which never held them."""
    from curation.core.policies import RefreshMode
    from curation.core.schedule import Schedule
    from curation.engine.ledger import PartLedger
    from curation.engine.plan import PROXY, REFERENCE, TrainingPlan
    from curation.engine.refresh_runner import reference_log_path, reference_path
    from curation.engine.state import EngineState
    from curation.io import objects, storage

    url = s3.url("run/engine")
    engine = storage.local_path(url)
    ledger = PartLedger(storage.local_path(s3.url("run/scored")), kind="scored", job="test", run_key={"t": 1},
                        vocab_size=100)
    state = EngineState([], ledger=ledger, engine_dir=engine, plan=TrainingPlan(Schedule(2, 4, 14), "exact", True),
                        refresh_mode=RefreshMode.SYNC, load=lambda path: open(path, "rb").read(),
                        launch=lambda task: f"ref{task.version}")
    for version in (0, 1):  # (the other node's uploads, log last)
        objects.write_object(f"{url}/reference-{version:04d}.safetensors", b"weights %d" % version)
        objects.write_object(f"{url}/reference-{version:04d}.json", json.dumps({"version": version}).encode())
    for name in ("proxy-000000002.safetensors", "proxy-000000002.recent.safetensors"):  # (rank 0's, elsewhere)
        objects.write_object(f"{url}/{name}", b"not a log")
    assert not os.path.exists(reference_log_path(engine, 0))
    assert refresh_logs(engine) == [{"version": 0}, {"version": 1}]
    assert [r["version"] for r in state.report().refreshes] == [0, 1]
    assert state.report().final_reference == reference_path(engine, 1)
    assert not os.path.exists(os.path.join(engine, "proxy-000000002.safetensors"))  # (logs only)
    # u^(2), refresh 0's source, registered then pruned once that refresh ended: its objects go, though this node's
    # cache never held them
    state.publish_proxy(2, "u2")
    state.refresh_done(0)
    assert not state.published(PROXY, 2)
    assert not [k for k in objects.list_objects(url) if k.startswith("proxy-")]
    state.publish_weights(REFERENCE, 0, None)  # registered, its handle dropped: reloaded from the file when asked
    state.handles.clear()
    assert state.handle(REFERENCE, 0) == b"weights 0"
    with pytest.raises(EngineError, match=r"weights reference 7 are registered but .*reference-0007.safetensors is "
                                          "missing"):
        state.publish_weights(REFERENCE, 7, None)
        state.handles.clear()
        state.handle(REFERENCE, 7)
