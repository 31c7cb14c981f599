"""The trainer group's line to its driver (``GroupChannel``: a Ray actor on the driver's node), without Ray Train: what
a rank on another node reads and records there instead of files under ``output_dir/parallel/``."""

from __future__ import annotations

import pickle

import pytest

from curation.engine.ray_backend.train_group import GroupChannel, recorded_fatal
from curation.io.bad_shards import blamed
from curation.io.carried import carry
from tests import timing

pytestmark = [pytest.mark.ray]


def test_the_channel_carries_the_stop_the_first_fatal_error_and_the_attempts(ray_local):
    channel = GroupChannel.open()
    try:
        rank = carry(channel).here()  # (how a rank gets it: inside its carried job)
        assert rank.on_driver_node() and rank.node_here() == channel.node_id
        assert rank.stop_signal() == 0  # asked in the background: never waits
        channel.request_stop(15)
        channel.request_stop(2)  # (the first signal counts)
        assert timing.until(lambda: rank.stop_signal() == 15, timeout=30)
        assert rank.stop_signal() == 15 and pickle.loads(pickle.dumps(rank)).stop_signal() in (0, 15)

        assert rank.fatal() is None and recorded_fatal(channel.fatal()) is None
        url = "s3://bucket/data/candidates/part-00000/shard.00000.mds"
        rank.record_fatal({"rank": 1, "error": "ValueError", "message": "token id 600", "shards": [url]})
        rank.record_fatal({"rank": 0, "error": "ValueError", "message": "a later one", "shards": []})
        error = recorded_fatal(channel.fatal())
        assert str(error) == "token id 600" and blamed(error) == [url]

        assert channel.new_attempts() == []
        rank.record_attempt({"rank": 0, "resumed_from": None})
        rank.record_attempt({"rank": 1, "resumed_from": None})
        assert [a["rank"] for a in channel.new_attempts()] == [0, 1]
        rank.record_attempt({"rank": 0, "resumed_from": "s3://bucket/run/checkpoints/ep0-ba4-rank0.pt"})
        assert channel.new_attempts() == [{"rank": 0, "resumed_from": "s3://bucket/run/checkpoints/ep0-ba4-rank0.pt"}]
    finally:
        channel.close()
