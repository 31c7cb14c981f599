"""The shard files an error blames (curation.io.bad_shards): set where bad data is found, kept through chained
errors, pickling (Ray) and the engine's coordinator, so the job's lock can record what a run failed on."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from curation.engine.coordinator import Coordinator
from curation.engine.plan import EngineError
from curation.io.bad_shards import blame, blamed
from curation.io.shards import ShardIntegrityError, ShardReader, merge_part_indexes, write_part
from schemas.shards import CANDIDATE


def _two_parts(root) -> str:
    for k, part in enumerate(("part-a", "part-b")):
        rows = [{"tokens": np.arange(i, i + 8, dtype=np.uint16) + 10 * k, "source": "web"} for i in range(4)]
        write_part(os.path.join(root, part), CANDIDATE, rows, vocab_size=512)
    merge_part_indexes(str(root), ["part-a", "part-b"])
    return str(root)


def test_a_damaged_shard_is_blamed_by_its_reader(tmp_path, flip_bit):
    root = _two_parts(tmp_path / "cand")
    assert ShardReader(root).shard_path(5) == os.path.join(root, "part-b/shard.00000.mds.zstd")
    flip_bit(os.path.join(root, "part-b", "shard.00000.mds.zstd"))
    reader = ShardReader(root)
    assert reader[0]["tokens"].tolist() == list(range(8))  # the other shard reads
    with pytest.raises(ShardIntegrityError) as e:
        reader[5]
    assert blamed(e.value) == [os.path.join(root, "part-b", "shard.00000.mds.zstd")]


def test_the_blame_travels_with_the_error_through_chains_and_pickling():
    inner = blame(ValueError("token id 600"), "rel/shard.00000.mds")
    assert blamed(inner) == [os.path.abspath("rel/shard.00000.mds")]
    assert blame(inner, "rel/shard.00000.mds", "/d/s1") is inner and blamed(inner)[1:] == ["/d/s1"]  # each once
    try:
        try:
            raise inner
        except ValueError:
            raise RuntimeError("the engine failed") from None  # (context kept, only not shown)
    except RuntimeError as outer:
        assert blamed(outer) == blamed(inner)
    copy = pickle.loads(pickle.dumps(inner))  # what Ray does with an actor's error
    assert blamed(copy) == blamed(inner) and str(copy) == "token id 600"

    class Wrapper(Exception):  # Ray's RayTaskError keeps the original as ``cause``
        def __init__(self, cause):
            super().__init__("wrapped")
            self.cause = cause

    assert blamed(Wrapper(copy)) == blamed(inner)
    assert blamed(RuntimeError("no data error")) == [] and blamed(None) == []


def test_the_engine_fails_with_the_first_failure_and_the_shards_it_blames():
    core = Coordinator([])
    core.fail("worker 0, unit steps-1: shard part-b/shard.00000.mds.zstd, record 1: token id 600", ["/c/part-b/s"])
    core.fail("a later failure", ["/c/part-a/s"])
    error = core.error()
    assert isinstance(error, EngineError) and str(error).startswith("worker 0, unit steps-1: shard part-b")
    assert blamed(error) == ["/c/part-b/s"]


def test_the_data_parallel_groups_fatal_record_keeps_the_blame():
    """A trainer worker of the group records an error no restart can fix on the group's channel, with the shards it
    blames (training.runs.group; by URL for an object-store input); the driver raises it blaming them again."""
    from curation.engine.ray_backend.train_group import recorded_fatal

    assert recorded_fatal(None) is None
    url = "s3://bucket/c/part-b/shard.00000.mds.zstd"
    error = recorded_fatal({"rank": 1, "error": "ValueError", "message": "c (step 3): token id 600 ...",
                            "shards": ["/c/part-b/shard.00000.mds.zstd", 7, url]})
    assert isinstance(error, ValueError) and str(error) == "c (step 3): token id 600 ..."
    assert blamed(error) == ["/c/part-b/shard.00000.mds.zstd", url]
    assert blamed(recorded_fatal({"rank": 0, "error": "ValueError", "message": "diverged"})) == []  # (no shards)


def test_a_shard_blamed_by_url_on_another_node_is_kept_as_a_url_and_a_path_made_absolute(tmp_path, monkeypatch):
    # a scoring worker or the refresh actor on another node blames by URL (its cache paths are its node's)
    monkeypatch.chdir(tmp_path)
    url = "s3://bucket/data/candidates/general/part-00000-00000/shard.00000.mds"
    e = blame(ValueError("bad"), url, "local/shard.00001.mds", url)
    assert blamed(e) == [url, str(tmp_path / "local" / "shard.00001.mds")]
