"""The token-loss scorer (curation/core/scorer.py; built from a config by curation.io.models.build_scorer): its losses
are the per-token losses of its model, in chunks, float16; new weights by state dict; a diverged model is named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from curation.core.losses import token_losses
from curation.io.models import build_causal_lm, build_scorer, save_weights
from schemas.train_config import ScorerConfig, demo_model_config

VOCAB = 300


def _cfg(**kw) -> ScorerConfig:
    return ScorerConfig(model=demo_model_config(VOCAB, hidden=32, layers=1, seq_len=16), device="cpu", **kw)


def test_scorer_returns_float16_reference_losses_matching_token_losses():
    scorer = build_scorer(_cfg(batch_size=3))  # 5 rows → chunks of 3 + 2
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
    a = build_scorer(_cfg())
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    before = a(tokens)
    other = build_causal_lm(demo_model_config(VOCAB, hidden=32, layers=1, seq_len=16).model_copy(update={"init_seed": 7}))
    a.load_weights(other.state_dict(), version=3)
    assert a.version == 3 and not np.array_equal(a(tokens), before)
    path = save_weights(other, str(tmp_path / "w.safetensors"))
    b = build_scorer(_cfg(weights=path))
    np.testing.assert_array_equal(b(tokens), a(tokens))


def test_scorer_rejects_non_finite_losses():
    scorer = build_scorer(_cfg())
    with torch.no_grad():
        scorer.model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        scorer(torch.zeros((1, 16), dtype=torch.long))
