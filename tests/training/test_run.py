"""The one way a run finishes (``training.runs.finish.finish``): ``final/`` (model, HF config, the last reference) and
``summary.json`` in its one schema, from a rank's result (which travels as plain data) and the engine's report."""

from __future__ import annotations

import json
import os
import pickle

import pytest
from safetensors.torch import load_file

from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream
from curation.engine.plan import TrainingPlan
from curation.engine.report import EngineProgress, EngineReport, RunStats
from curation.ingest.tokenizer import train_bpe_tokenizer
from curation.io.hf_export import TokenizerFiles
from curation.io.models import build_causal_lm, save_weights, weights_fingerprint
from schemas.train_config import ModelConfig, demo_model_config
from training.runs.finish import finish
from training.runs.rank import FinalWeights, RankResult

#: Every key of summary.json (schema 2), in every job's summary.
KEYS = ["schema_version", "policy", "steps", "world_size", "resumed_from", "stream", "selected_dir", "tokens",
        "validation", "delta_quantiles_per_episode", "delta_histograms", "param_distance", "train_loss", "refreshes",
        "seconds", "counts", "per_step", "throughput", "memory", "engine"]
#: What ``save_pretrained`` writes of a tokenizer: ``final/`` holds them beside the weights (issue 57).
TOKENIZER = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
ENGINE_KEYS = ["mode", "refresh", "workers", "threads_per_worker", "snapshot_period", "staleness_delta",
               "trainer_wait_seconds", "trainer_waits", "publish_seconds", "units_redone_after_restart", "scored",
               "engine_seconds_this_run", "job_seconds_this_run", "output_dir"]


def _model(seed: int = 0):
    return build_causal_lm(demo_model_config(64, hidden=16, layers=1).model_copy(update={"init_seed": seed}))


_TOKENIZERS: dict[str, TokenizerFiles] = {}


def _tokenizer(tmp_path) -> TokenizerFiles:
    """The run's shards' tokenizer (its vocabulary need not be the model's here)."""
    key = str(tmp_path)
    if key not in _TOKENIZERS:
        path = train_bpe_tokenizer(["a few words", "and a few more words"] * 5, vocab_size=300,
                                   save_to=str(tmp_path / "tok" / "tokenizer.json")).path
        _TOKENIZERS[key] = TokenizerFiles(path)
    return _TOKENIZERS[key]


def _result(hf, *, reference=None, tokenizer=None, **fields) -> RankResult:
    return RankResult(weights=FinalWeights(hf.state_dict(), hf.config, reference, tokenizer), **fields)


def _stats(policy: str = "blade") -> dict:
    steps = [{"step": 0, "episode": -1, "kept": 10, "valid": 10, "loss": 4.0, "kept_fraction": {"a": 1.0}},
             {"step": 1, "episode": 0, "kept": 6, "valid": 10, "loss": 3.5, "param_distance": 0.25,
              "kept_fraction": {"a": 0.6}}]
    return {"policy": policy, "steps": steps, "validation": [], "tokens": {"valid": {"a": 20}, "kept": {"a": 16}},
            "delta_histograms": {}, "refreshes": [{"version": 0, "step": 1}], "timers": {"refresh": 0.5},
            "counts": {"refreshes": 1}}


def _report(tmp_path, versions=(0, 1)) -> EngineReport:
    engine = str(tmp_path / "engine")
    for v in versions:
        save_weights(_model(10 + v), os.path.join(engine, f"reference-{v:04d}.safetensors"), metadata={"v": str(v)})
    plan = TrainingPlan(Schedule(1, 1, 2), "pipelined", True, snapshot_period=2)
    progress = EngineProgress(units_done=2, units_total=2, trainer_step=2, redone=1, failed=None, tokens=40,
                              kept_tokens=24)
    return EngineReport(progress=progress, stats=RunStats(tokens=40, kept_tokens=24, parts=2),
                        refreshes=tuple({"version": v, "step": 1 + v, "staleness": v} for v in versions), seconds=3.0,
                        engine_dir=engine, out_dir=str(tmp_path / "selected"), plan=plan, workers=2,
                        threads_per_worker=1, job_seconds=7.5)


def _loaded(final: str):
    return build_causal_lm(ModelConfig(path=final, weights=os.path.join(final, "model.safetensors")))


def test_final_model_loads_back_as_the_trained_one_and_its_reference_is_written(tmp_path):
    hf, ref = _model(), _model(7)
    out = finish(str(tmp_path / "run"), _result(hf, stats=_stats(), steps=2, tokenizer=_tokenizer(tmp_path)),
                 plots=False)
    assert out.final == str(tmp_path / "run" / "final") and out.final_reference is None
    assert sorted(os.listdir(out.final)) == sorted(["config.json", "model.safetensors", *TOKENIZER])  # no reference
    assert weights_fingerprint(_loaded(out.final)) == weights_fingerprint(hf)
    from transformers import AutoTokenizer  # the run's tokenizer beside the weights (issue 57)

    tok = AutoTokenizer.from_pretrained(out.final)
    assert tok.eos_token == "<|endoftext|>" and tok.convert_tokens_to_ids("<|endoftext|>") == 0
    again = finish(str(tmp_path / "b"), _result(hf, reference=ref.state_dict(), stats=_stats()), plots=False)
    assert weights_fingerprint(load_file(again.final_reference)) == weights_fingerprint(ref)  # the in-process one


def test_the_engines_last_reference_is_copied_byte_for_byte(tmp_path, capsys):
    report = _report(tmp_path)
    assert report.final_reference == os.path.join(report.engine_dir, "reference-0001.safetensors")
    out = finish(str(tmp_path / "run"), _result(_model(), stats=_stats()), report, plots=False)
    with open(report.final_reference, "rb") as a, open(out.final_reference, "rb") as b:
        assert a.read() == b.read()
    assert sorted(os.listdir(out.final)) == ["config.json", "model.safetensors", "reference.safetensors"]  # no tokenizer
    assert "has no tokenizer" in capsys.readouterr().err
    assert not os.path.exists(out.final_reference + ".tmp")  # nothing half-written left behind
    none = finish(str(tmp_path / "none"), _result(_model(), stats=_stats()), _report(tmp_path / "x", ()), plots=False)
    assert none.final_reference is None and not os.path.exists(os.path.join(none.final, "reference.safetensors"))


def test_one_summary_schema_for_every_job_with_one_name_per_fact(tmp_path):
    stream = CandidateStream(100, 4, 3)
    trained = _result(_model(), stats=_stats(), steps=2, world_size=2, stream=stream, selected_dir="/x/selected",
                      validation=({"step": 2, "loss": 3.0, "perplexity": 20.0},), throughput={"steps": 2},
                      memory={"host_peak_rss_bytes": 1})
    s = json.load(open(finish(str(tmp_path / "train"), trained, plots=False).summary, encoding="utf-8"))
    assert list(s) == KEYS and s["schema_version"] == 2 and s["engine"] is None
    assert (s["policy"], s["steps"], s["world_size"], s["stream"]) == ("blade", 2, 2, stream.to_dict())
    assert s["tokens"] == {"valid": 20, "kept": 16, "per_source": {"a": {"valid_tokens": 20, "kept_tokens": 16,
                                                                         "kept_fraction": 0.8}}}
    assert s["param_distance"] == [{"step": 1, "value": 0.25}] and s["train_loss"][1] == {"step": 1, "value": 3.5}
    assert s["refreshes"] == [{"version": 0, "step": 1}] and s["validation"][0]["perplexity"] == 20.0

    fed = _result(_model(), stats={**_stats(), "refreshes": []}, steps=2, publish_seconds=0.5, wait_seconds=1.5,
                  waits=((1, 0.75),))
    s = json.load(open(finish(str(tmp_path / "main"), fed, _report(tmp_path), plots=False).summary, encoding="utf-8"))
    assert list(s) == KEYS and list(s["engine"]) == ENGINE_KEYS
    assert [r["version"] for r in s["refreshes"]] == [0, 1]  # the engine's refreshes: it refreshed, not the trainer
    e = s["engine"]
    assert (e["mode"], e["refresh"], e["snapshot_period"], e["workers"], e["threads_per_worker"]) == (
        "pipelined", "sync", 2, 2, 1)
    assert (e["trainer_wait_seconds"], e["trainer_waits"], e["publish_seconds"]) == (1.5, [{"step": 1, "seconds": 0.75}],
                                                                                     0.5)
    assert e["staleness_delta"] == {"0": 0, "1": 1} and e["units_redone_after_restart"] == 1
    assert (e["scored"]["tokens"], e["engine_seconds_this_run"], e["job_seconds_this_run"]) == (40, 3.0, 7.5)

    replayed = _result(_model(), steps=5, validation=({"step": 5, "loss": 2.0, "perplexity": 7.4},))
    s = json.load(open(finish(str(tmp_path / "replay"), replayed, plots=False).summary, encoding="utf-8"))
    assert list(s) == KEYS and (s["policy"], s["steps"], s["tokens"], s["stream"]) == (None, 5, None, None)
    assert s["validation"] == [{"step": 5, "loss": 2.0, "perplexity": 7.4}] and s["refreshes"] == []


def test_a_stopped_rank_leaves_nothing_to_finish_and_a_result_travels_as_plain_data(tmp_path):
    with pytest.raises(ValueError, match="holds no weights .*stopped after step 3"):
        finish(str(tmp_path / "run"), RankResult(stopped_at=3, signum=15), plots=False)
    assert not os.path.exists(tmp_path / "run")
    hf = _model()
    result = _result(hf, stats=_stats(), stream=CandidateStream(10, 2, 0), waits=((3, 0.5),))
    again = pickle.loads(pickle.dumps(result))  # what a group's rank 0 hands the driver through Ray
    assert again.stream == result.stream and again.waits == ((3, 0.5),) and again.stats == result.stats
    assert weights_fingerprint(again.weights.model) == weights_fingerprint(hf)
    assert again.weights.config.to_dict() == hf.config.to_dict()


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
    final = finish(str(tmp_path / "run"), _result(_model(), stats=_stats()), plots=False).final
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors"]
    assert capsys.readouterr().err.startswith(f"note: {final} has no tokenizer (the shards' manifests name none")
