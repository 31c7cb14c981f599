"""Models from a config dict or a local directory; weights as safetensors; the vocabulary checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from curation.io.models import (
    build_causal_lm,
    check_token_range,
    check_vocab,
    load_weights,
    save_weights,
    weights_fingerprint,
)
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


def test_vocabulary_mismatch_names_the_setting():
    model = build_causal_lm(demo_model_config(256, hidden=32, layers=1))
    with pytest.raises(ValueError, match=r"vocab_size 512 .* model \(model\) embeds only 256.*model.hf_config.vocab_size"):
        check_vocab(model, 512, what="x/manifest.json", setting="model")
    check_vocab(model, 200, what="x", setting="model")  # a larger (padded) model vocabulary is fine
    check_vocab(model, 256, what="x", setting="model")  # exactly the model's ids
    # another caller's advice replaces the default one (the evaluation names the model directory)
    with pytest.raises(ValueError) as e:
        check_vocab(model, 300, what="tokenizer t/tokenizer.json", setting="runs/a/final", fix="not this model's tokenizer")
    assert str(e.value) == ("vocabulary mismatch: tokenizer t/tokenizer.json has vocab_size 300 but the model "
                            "(runs/a/final) embeds only 256 ids; not this model's tokenizer")


class _OwnError(ValueError):
    pass


def test_token_range_names_the_place_the_first_bad_id_and_its_position():
    check_token_range(np.array([0, 5, 9], dtype=np.uint16), 10, "x")  # every id < 10
    check_token_range(np.zeros((0,), dtype=np.uint16), 10, "x")  # nothing to check
    with pytest.raises(ValueError) as e:
        check_token_range(np.array([3, 12, 10, 4], dtype=np.uint16), 10, "cand/shard.00000.mds.zstd, record 3")
    assert str(e.value) == ("cand/shard.00000.mds.zstd, record 3: token id 12 at position 1 is outside the model's "
                            "vocabulary (10 ids): tokenizer and model do not match")
    batch = np.array([[1, 2, 3], [4, 10, 99]], dtype=np.int64)  # a batch: the first bad id in row order
    with pytest.raises(ValueError, match=r"^runs/c \(step 7\): token id 10 at row 1, position 1 is outside"):
        check_token_range(batch, 10, "runs/c (step 7)")
    with pytest.raises(_OwnError, match="token id 10 at position 0"):  # a caller's own error class
        check_token_range(np.array([10]), 10, "w", error=_OwnError)


def test_model_path_weights_of_the_wrong_shape_or_a_renamed_pickle_end_in_one_line_naming_the_file(tmp_path):
    """Issue 32: these were 37–55-line tracebacks (torch's size-mismatch list, safetensors' header error)."""
    import json

    from transformers import GPT2Config, GPT2LMHeadModel

    from curation.io.models import build_causal_lm, read_weights
    from schemas.train_config import ModelConfig

    d = tmp_path / "m"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32)).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "n_embd": 32}))  # the weights are of n_embd 16
    with pytest.raises(ValueError) as e:
        build_causal_lm(ModelConfig(path=str(d)))
    assert str(e.value).startswith(f"model.path: {d}/model.safetensors: cannot be loaded as the model its config.json "
                                   "describes (Error(s) in loading state_dict for ") and "size mismatch" in str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 500
    (d / "config.json").write_text(json.dumps(cfg))
    torch.save({"x": torch.ones(2)}, d / "model.safetensors")  # a pickle named .safetensors: never unpickled
    with pytest.raises(ValueError, match=rf"^model.path: {d}/model.safetensors: cannot be loaded as the model its "
                                         r"config.json describes \(Error while deserializing header: [^\n]*\)$"):
        build_causal_lm(ModelConfig(path=str(d)))
    with pytest.raises(ValueError, match=rf"^{d}/model.safetensors: not a safetensors file \(Error while "
                                         r"deserializing header: [^\n]*\)$"):
        read_weights(str(d / "model.safetensors"))
