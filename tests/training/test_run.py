"""The one writer of a run's ``final/``: model, HF config, the last reference."""

from __future__ import annotations

import os

from safetensors.torch import load_file

from curation.io.models import build_causal_lm, save_weights, weights_fingerprint
from schemas.train_config import ModelConfig, demo_model_config
from training.blocks.model import MaskedCausalLM
from training.runs.wiring import TrainRun


def _run(tmp_path, seed: int = 0) -> TrainRun:
    hf = build_causal_lm(demo_model_config(64, hidden=16, layers=1).model_copy(update={"init_seed": seed}))
    return TrainRun(trainer=None, model=MaskedCausalLM(hf), output_dir=str(tmp_path / "run"))


def _loaded(final: str):
    return build_causal_lm(ModelConfig(path=final, weights=os.path.join(final, "model.safetensors")))


def test_final_model_loads_back_as_the_trained_one(tmp_path):
    run = _run(tmp_path)
    final = run.write_final()
    assert final == str(tmp_path / "run" / "final")
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors"]  # no reference: none written
    assert weights_fingerprint(_loaded(final)) == weights_fingerprint(run.model.model)


def test_final_reference_from_weights_or_copied_from_a_file(tmp_path):
    run = _run(tmp_path)
    ref = build_causal_lm(demo_model_config(64, hidden=16, layers=1).model_copy(update={"init_seed": 7}))
    final = run.write_final({k: v.clone() for k, v in ref.state_dict().items()})  # the in-process reference
    got = load_file(os.path.join(final, "reference.safetensors"))
    assert weights_fingerprint(got) == weights_fingerprint(ref)
    # the engine's reference file: copied byte for byte, nothing half-written left behind
    engine_file = save_weights(ref, str(tmp_path / "engine" / "reference-0003.safetensors"), metadata={"v": "3"})
    run2 = _run(tmp_path / "b")
    final2 = run2.write_final(engine_file)
    with open(engine_file, "rb") as a, open(os.path.join(final2, "reference.safetensors"), "rb") as b:
        assert a.read() == b.read()
    assert sorted(os.listdir(final2)) == ["config.json", "model.safetensors", "reference.safetensors"]
    assert weights_fingerprint(_loaded(final2)) == weights_fingerprint(run2.model.model)
