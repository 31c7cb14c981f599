"""The one way a run finishes (``finish_run``): ``final/`` (model, HF config, the last reference) and the summary."""

from __future__ import annotations

import os

from safetensors.torch import load_file

from curation.ingest.tokenizer import train_bpe_tokenizer
from curation.io.hf_export import TokenizerFiles
from curation.io.models import build_causal_lm, save_weights, weights_fingerprint
from schemas.train_config import ModelConfig, demo_model_config
from training.blocks.model import MaskedCausalLM
from training.runs.wiring import RunOutputs, TrainRun, finish_run

#: What ``save_pretrained`` writes of a tokenizer: ``final/`` holds them beside the weights (issue 57).
TOKENIZER = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def _run(tmp_path, seed: int = 0, tokenizer: bool = True) -> TrainRun:
    hf = build_causal_lm(demo_model_config(64, hidden=16, layers=1).model_copy(update={"init_seed": seed}))
    tok = None
    if tokenizer:  # (the run's shards' tokenizer; its vocabulary need not be the model's here)
        path = train_bpe_tokenizer(["a few words", "and a few more words"] * 5, vocab_size=300,
                                   save_to=str(tmp_path / "tok" / "tokenizer.json")).path
        tok = TokenizerFiles(path)
    return TrainRun(trainer=None, model=MaskedCausalLM(hf), output_dir=str(tmp_path / "run"), tokenizer=tok)


def _finish(run: TrainRun, reference=None) -> str:
    out = run.outputs(reference=False)
    out.reference = reference
    return finish_run(run.output_dir, out, plots=False)["final"]


def _loaded(final: str):
    return build_causal_lm(ModelConfig(path=final, weights=os.path.join(final, "model.safetensors")))


def test_final_model_loads_back_as_the_trained_one(tmp_path):
    run = _run(tmp_path)
    final = _finish(run)
    assert final == str(tmp_path / "run" / "final")
    assert sorted(os.listdir(final)) == sorted(["config.json", "model.safetensors", *TOKENIZER])  # no reference
    assert weights_fingerprint(_loaded(final)) == weights_fingerprint(run.model.model)
    from transformers import AutoTokenizer  # the run's tokenizer beside the weights (issue 57)

    tok = AutoTokenizer.from_pretrained(final)
    assert tok.eos_token == "<|endoftext|>" and tok.convert_tokens_to_ids("<|endoftext|>") == 0


def test_final_reference_from_weights_or_copied_from_a_file(tmp_path):
    run = _run(tmp_path)
    ref = build_causal_lm(demo_model_config(64, hidden=16, layers=1).model_copy(update={"init_seed": 7}))
    final = _finish(run, {k: v.clone() for k, v in ref.state_dict().items()})  # the in-process reference
    got = load_file(os.path.join(final, "reference.safetensors"))
    assert weights_fingerprint(got) == weights_fingerprint(ref)
    # the engine's reference file: copied byte for byte, nothing half-written left behind
    engine_file = save_weights(ref, str(tmp_path / "engine" / "reference-0003.safetensors"), metadata={"v": "3"})
    run2 = _run(tmp_path / "b")
    final2 = _finish(run2, engine_file)
    with open(engine_file, "rb") as a, open(os.path.join(final2, "reference.safetensors"), "rb") as b:
        assert a.read() == b.read()
    assert sorted(os.listdir(final2)) == sorted(["config.json", "model.safetensors", "reference.safetensors", *TOKENIZER])
    assert weights_fingerprint(_loaded(final2)) == weights_fingerprint(run2.model.model)


def test_a_run_finished_in_two_processes_writes_each_part_once(tmp_path):
    """The data-parallel engine run: rank 0 writes the model, the driver the engine's reference and the summary."""
    run = _run(tmp_path)
    finish_run(run.output_dir, run.outputs(reference=False), plots=False)  # rank 0: no statistics, no reference
    final = os.path.join(run.output_dir, "final")
    assert sorted(os.listdir(final)) == sorted(["config.json", "model.safetensors", *TOKENIZER])
    assert not os.path.exists(os.path.join(run.output_dir, "summary.json"))
    ref = build_causal_lm(demo_model_config(64, hidden=16, layers=1).model_copy(update={"init_seed": 7}))
    engine_file = save_weights(ref, str(tmp_path / "engine" / "reference-0001.safetensors"))
    stats = {"policy": "blade", "steps": [], "validation": [], "tokens": {"valid": {}, "kept": {}},
             "delta_histograms": {}, "refreshes": [], "timers": {}, "counts": {}}
    paths = finish_run(run.output_dir, RunOutputs(reference=engine_file, stats=stats, extra={"engine": {"mode": "x"}}),
                       plots=False)
    assert sorted(os.listdir(final)) == sorted(["config.json", "model.safetensors", "reference.safetensors", *TOKENIZER])
    assert paths["summary"] == os.path.join(run.output_dir, "summary.json") and "final_weights" not in paths
    assert weights_fingerprint(_loaded(final)) == weights_fingerprint(run.model.model)  # the model left alone


def test_the_delta_plot_axis_is_fitted_to_the_data_not_the_bins():
    """Issue 57: ``plots/delta_histograms.png`` spanned the bins' −8…8 nats while Δ sat in −1…1.5: its axis runs from
    the 0.2% to the 99.8% quantile of every episode's Δ (a few outlying tokens do not stretch it), padded by 5%."""
    import torch

    from curation.core.stats import Histogram
    from training.blocks.summary import delta_axis

    a = Histogram.from_values(torch.linspace(-1.0, 1.5, 1001))
    b = Histogram.from_values(torch.cat([torch.linspace(-0.5, 1.0, 999), torch.tensor([-6.9, 7.3])]))
    lo, hi = delta_axis([a.to_dict(), b.to_dict()])
    assert -1.2 < lo < -0.9 and 1.4 < hi < 1.7  # not −8…8, nor stretched to the two outliers at −6.9 and 7.3
    assert delta_axis([]) is None and delta_axis([Histogram().to_dict()]) is None


def test_a_run_whose_tokenizer_is_unknown_says_so_and_writes_the_rest(tmp_path, capsys):
    run = _run(tmp_path, tokenizer=False)
    final = _finish(run)
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors"]
    assert capsys.readouterr().err.startswith(f"note: {final} has no tokenizer (the shards' manifests name none")
