"""Models from a config dict or a local directory; weights as safetensors."""

from __future__ import annotations

import pytest
import torch

from curation.io.models import build_causal_lm, load_weights, save_weights, weights_fingerprint
from schemas.train_config import ModelConfig, demo_model_config


def test_built_from_config_is_seeded_and_leaves_the_global_rng_alone():
    cfg = demo_model_config(128, hidden=32, layers=1)
    state = torch.get_rng_state()
    a, b = build_causal_lm(cfg), build_causal_lm(cfg)
    assert torch.equal(torch.get_rng_state(), state)
    assert weights_fingerprint(a) == weights_fingerprint(b)
    c = build_causal_lm(cfg.model_copy(update={"init_seed": 1}))
    assert weights_fingerprint(a) != weights_fingerprint(c)


def test_loaded_from_a_local_directory_and_safetensors_round_trip(tmp_path):
    model = build_causal_lm(demo_model_config(128, hidden=32, layers=1).model_copy(update={"init_seed": 5}))
    model.save_pretrained(tmp_path / "m")
    loaded = build_causal_lm(ModelConfig(path=str(tmp_path / "m")))
    assert weights_fingerprint(loaded) == weights_fingerprint(model)
    path = save_weights(model, str(tmp_path / "w.safetensors"))
    fresh = build_causal_lm(demo_model_config(128, hidden=32, layers=1))
    load_weights(fresh, path)
    assert weights_fingerprint(fresh) == weights_fingerprint(model)
    with pytest.raises(ValueError, match="do not fit"):
        load_weights(build_causal_lm(demo_model_config(128, hidden=48, layers=1)), path)


def test_model_config_needs_exactly_one_source_and_keeps_remote_code_off():
    with pytest.raises(ValueError, match="exactly one"):
        ModelConfig()
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig(hf_config={"hidden_size": 8})
    assert ModelConfig(path="x").trust_remote_code is False
    with pytest.raises(ValueError, match="not a local model directory"):
        build_causal_lm(ModelConfig(path="/nonexistent/model"))
