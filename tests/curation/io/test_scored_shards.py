"""Scored shards (curation/io/scored_shards.py): written by step range in any order, read back by step, refused for
another stream."""

from __future__ import annotations

import os

import numpy as np
import pytest

from curation.core.stream import CandidateStream
from curation.io.models import build_scorer
from curation.io.scored_shards import ScoredShards
from curation.io.shards import merge_part_indexes, write_part
from curation.io.stream_reader import StreamReader
from schemas.shards import CANDIDATE, validate_shard_dir
from schemas.train_config import ScorerConfig, demo_model_config
from tests.scored_steps import write_scored_steps

VOCAB = 300


def _cfg() -> ScorerConfig:
    return ScorerConfig(model=demo_model_config(VOCAB, hidden=32, layers=1, seq_len=16), device="cpu")


def _candidates(root: str, n: int = 12, length: int = 16) -> str:
    rng = np.random.default_rng(0)
    rows = [{"tokens": rng.integers(0, VOCAB, length).astype(np.uint16), "source": "a" if i % 3 else "b"}
            for i in range(n)]
    write_part(os.path.join(root, "part-0"), CANDIDATE, rows, vocab_size=VOCAB)
    merge_part_indexes(root, ["part-0"])
    return root


def test_scored_shards_written_by_step_range_and_read_back(tmp_path):
    cand = _candidates(str(tmp_path / "cand"))
    reader = StreamReader.open(cand, batch_size=4, seed=5)
    scorer = build_scorer(_cfg())
    out = str(tmp_path / "scored")
    # two workers' ranges, written out of order
    write_scored_steps(out, reader, scorer, range(3, 6), episode_of=lambda t: t // 3, vocab_size=VOCAB)
    write_scored_steps(out, reader, scorer, range(0, 3), episode_of=lambda t: t // 3, vocab_size=VOCAB)
    again = write_scored_steps(out, reader, scorer, range(0, 3), episode_of=lambda t: t // 3, vocab_size=VOCAB)
    assert again.samples == 12  # recorded once; not written twice
    validate_shard_dir(out, "scored")
    scored = ScoredShards(out, reader.stream)
    assert list(scored.steps()) == list(range(6)) and len(scored.dataset) == 24
    for t in range(6):
        tokens, ref, episode = scored.read(t)
        batch = reader.read(t)
        np.testing.assert_array_equal(tokens, batch.tokens)
        np.testing.assert_array_equal(ref, scorer(batch.tokens))
        assert (episode == t // 3).all() and ref.dtype == np.float16
    with pytest.raises(KeyError, match="no scores for step 6"):
        scored.read(6)
    with pytest.raises(ValueError, match="stream"):
        ScoredShards(out, CandidateStream(12, 4, seed=6))
