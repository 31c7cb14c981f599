"""The deterministic candidate stream (seed, step) → sample ids: invariants across seeds and sizes."""

from __future__ import annotations

import numpy as np
import pytest

from curation.core.stream import CandidateStream
from curation.io.stream_reader import StreamReader


@pytest.mark.parametrize("n,b", [(10, 3), (7, 7), (5, 8), (1, 1), (100, 16)])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_every_epoch_visits_every_sample_exactly_once(n, b, seed):
    s = CandidateStream(n, b, seed)
    epochs = 3
    flat = s.positions(0, epochs * n)
    for e in range(epochs):
        chunk = flat[e * n : (e + 1) * n]
        assert sorted(chunk.tolist()) == list(range(n))
        assert np.array_equal(chunk, s.epoch_order(e))


@pytest.mark.parametrize("n,b", [(10, 3), (5, 8), (100, 16)])
def test_batches_are_consecutive_stream_positions_random_access_equals_sequential(n, b):
    s = CandidateStream(n, b, seed=3)
    seq = np.concatenate([ids for _, ids in s.steps(0, 20)])
    assert np.array_equal(seq, s.positions(0, 20 * b))
    for t in (0, 7, 19, 3):  # any order, any step: same answer
        assert np.array_equal(s.batch_ids(t), seq[t * b : (t + 1) * b])
        assert s.batch_ids(t).dtype == np.int64 and len(s.batch_ids(t)) == b


def test_deterministic_across_instances_and_seed_sensitive():
    a, b = CandidateStream(50, 4, 0), CandidateStream(50, 4, 0)
    assert all(np.array_equal(a.batch_ids(t), b.batch_ids(t)) for t in range(30))
    c = CandidateStream(50, 4, 1)
    assert not all(np.array_equal(a.batch_ids(t), c.batch_ids(t)) for t in range(30))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))  # epochs are reshuffled


def test_returned_arrays_do_not_alias_the_cache():
    s = CandidateStream(10, 3, 0)
    ids = s.batch_ids(0)
    ids[:] = -1
    assert (s.batch_ids(0) >= 0).all()
    order = s.epoch_order(0)
    order[:] = 0
    assert sorted(s.epoch_order(0).tolist()) == list(range(10))


@pytest.mark.parametrize("bad", [{"num_samples": 0, "batch_size": 1}, {"num_samples": 3, "batch_size": 0},
                                 {"num_samples": 3, "batch_size": 1, "seed": -1}, {"num_samples": 2.5, "batch_size": 1}])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        CandidateStream(**bad)
    with pytest.raises(ValueError):
        CandidateStream(4, 2).batch_ids(-1)


def test_the_dict_form_names_the_pool_the_batch_and_the_seed():
    assert CandidateStream(11, 4, 9).to_dict() == {"num_samples": 11, "batch_size": 4, "seed": 9}


def test_reader_reads_the_stream_rows():
    rows = [{"tokens": np.full(4, i, dtype=np.uint16), "source": f"s{i % 2}"} for i in range(9)]
    s = CandidateStream(9, 4, 2)
    batch = StreamReader(rows, s).read(3)
    assert batch.tokens.shape == (4, 4)
    assert batch.tokens[:, 0].tolist() == s.batch_ids(3).tolist()
    assert batch.sources == [f"s{i % 2}" for i in s.batch_ids(3)]
    with pytest.raises(ValueError, match="holds 9 sequences"):
        StreamReader(rows, CandidateStream(10, 4, 2))
