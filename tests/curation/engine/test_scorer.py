"""The plain reference scorer and scored shards addressed by stream step."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from curation.core.losses import token_losses
from curation.core.stream import CandidateStream
from curation.engine.scorer import ScoredShards, TokenLossScorer, write_scored_steps
from curation.io.models import build_causal_lm, save_weights
from curation.io.shards import merge_part_indexes, write_part
from curation.io.stream_reader import StreamReader
from schemas.shards import CANDIDATE, validate_shard_dir
from schemas.train_config import ScorerConfig, demo_model_config

VOCAB = 300


def _cfg(**kw) -> ScorerConfig:
    return ScorerConfig(model=demo_model_config(VOCAB, hidden=32, layers=1, seq_len=16), device="cpu", **kw)


def test_scorer_returns_float16_reference_losses_matching_token_losses():
    scorer = TokenLossScorer(_cfg(batch_size=3))  # 5 rows → chunks of 3 + 2
    tokens = torch.randint(0, VOCAB, (5, 16), generator=torch.Generator().manual_seed(0))
    out = scorer(tokens)
    assert isinstance(out, np.ndarray) and out.dtype == np.float16 and out.shape == (5, 16)
    with torch.no_grad():
        expected, _ = token_losses(scorer.model(input_ids=tokens).logits, tokens)
    np.testing.assert_array_equal(out, expected.to(torch.float16).numpy())
    assert (out[:, 0] == 0).all() and (out[:, 1:] > 0).all()
    # the same answer for a numpy batch and a mapping; no parameter needs gradients
    np.testing.assert_array_equal(scorer(tokens.numpy().astype(np.uint16)), out)
    np.testing.assert_array_equal(scorer({"tokens": tokens}), out)
    assert not any(p.requires_grad for p in scorer.model.parameters())


def test_scorer_loads_new_weights_by_version(tmp_path):
    a = TokenLossScorer(_cfg())
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    before = a(tokens)
    other = build_causal_lm(demo_model_config(VOCAB, hidden=32, layers=1, seq_len=16).model_copy(update={"init_seed": 7}))
    a.load_weights(other.state_dict(), version=3)
    assert a.version == 3 and not np.array_equal(a(tokens), before)
    path = save_weights(other, str(tmp_path / "w.safetensors"))
    b = TokenLossScorer(_cfg(weights=path))
    np.testing.assert_array_equal(b(tokens), a(tokens))


def test_scorer_rejects_non_finite_losses():
    scorer = TokenLossScorer(_cfg())
    with torch.no_grad():
        scorer.model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        scorer(torch.zeros((1, 16), dtype=torch.long))


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
    scorer = TokenLossScorer(_cfg())
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
