"""jobs/evaluate.py: the CLI (config, --set, --print-config), clear errors, and the demo default after
jobs/train.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from curation.ingest.demo import write_demo_corpus
from curation.ingest.prepare import prepare
from schemas.config import PrepareConfig
from schemas.eval_config import EvaluateConfig
from schemas.train_config import TrainConfig, demo_model_config
from tests.conftest import load_job

REPO = Path(__file__).resolve().parents[2]

evaluate_job = load_job("evaluate")


def test_print_config_shows_the_demo_default(capsys):
    with pytest.raises(SystemExit) as e:
        evaluate_job.main(["--print-config", "--set", "max_len=64"])
    assert e.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["max_len"] == 64
    assert cfg["models"] == [{"path": os.path.join("runs", "demo", "train", "*"), "name": None, "tokenizer": None,
                              "weights": None}]
    assert EvaluateConfig.model_validate(cfg).sets[0].name == "target_val"


def test_bad_inputs_are_named(tmp_path, capsys):
    assert evaluate_job.main(["--set", f"models=[{{path: {tmp_path / 'nope'}}}]"]) == 1
    assert f"models.0 ({tmp_path / 'nope'}): no such model directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        evaluate_job.main(["--set", "sets=[]"])
    assert e.value.code == 2 and "sets: Value error, at least one entry is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_job.main(["--set", "bootstrapp=10"])
    assert "bootstrapp: unknown key" in capsys.readouterr().err


@pytest.mark.slow
def test_no_arguments_evaluates_the_demo_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = os.path.join("runs", "demo")
    write_demo_corpus(os.path.join(root, "raw"), sizes={"target": 120, "general": 120, "noise": 60, "target_val": 40})
    cfg = PrepareConfig.demo_default(root)
    prepare(cfg.model_copy(update={"progress": False, "tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": 400})}))
    from training.runs.train_job import train

    for policy in ("full", "blade"):
        t = TrainConfig.demo_default(root, policy=policy)
        t = TrainConfig.model_validate({
            **t.model_dump(), "model": demo_model_config(400, hidden=32, layers=1).model_dump(), "max_steps": 4,
            "batch_size": 4, "progress_bar": False, "plots": False, "threads": 1,
            "selection": {**t.selection.model_dump(), "warmup_steps": 1, "tau": 2, "refresh_steps": 1}})
        train(t)
    assert evaluate_job.main(["--set", "bootstrap=50", "--set", "progress=false"]) == 0
    res = json.loads((tmp_path / root / "eval" / "results.json").read_text())
    assert set(res["models"]) == {"blade", "full"}
    assert res["sets"] == {"target_val": {"documents": 40}}
    lo = res["loss"]["target_val"]
    assert all(0 < v["lo"] <= v["mean"] <= v["hi"] < 10 for v in lo.values())
    (pair,) = res["paired"]["target_val"]
    assert pair["mean"] == pytest.approx(lo[pair["a"]]["mean"] - lo[pair["b"]]["mean"])
    assert "| blade − full |" in (tmp_path / root / "eval" / "results.md").read_text()


@pytest.mark.slow
def test_lm_eval_section_exports_a_run_and_scores_it(tmp_path, monkeypatch):
    from curation.evaluation.harness import HARNESS_MISSING, harness_available

    if not harness_available():
        pytest.skip(HARNESS_MISSING)
    from curation.ingest.tokenizer import train_bpe_tokenizer
    from curation.io.models import build_causal_lm, save_weights
    from tests.conftest import write_jsonl

    rows = [{"question": f"Tom has {i} apples and buys 2 more. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
            for i in range(4)]
    data = write_jsonl(tmp_path / "test.jsonl", rows)
    tok = train_bpe_tokenizer([r["question"] + "\n" + r["answer"] for r in rows] * 3, vocab_size=300,
                              save_to=str(tmp_path / "tok" / "tokenizer.json"))
    run = tmp_path / "run"  # what training.runs.wiring.train leaves: config.yaml + final/{model.safetensors,config.json}
    model = build_causal_lm(demo_model_config(tok.vocab_size, hidden=32, layers=1))
    save_weights(model, str(run / "final" / "model.safetensors"))
    model.config.to_json_file(str(run / "final" / "config.json"))
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": tok.path}}))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # restored after the test
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    out = tmp_path / "eval"
    code = evaluate_job.main([
        "--set", f"models=[{{path: {run}}}]", "--set", f"output_dir={out}", "--set", "progress=false",
        "--set", f"sets=[{{name: gsm8k, paths: [{data}], template: '{{question}} {{answer}}'}}]",
        "--set", f"lm_eval={{gsm8k_file: {data}, limit: 2, max_gen_toks: 4, batch_size: 2}}",
    ])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert res["lm_eval"]["run"]["gsm8k_local"]["exact_match,strict-match"] == 0.0
    assert (out / "hf" / "run" / "tokenizer.json").exists()  # the run was exported as an HF directory
    assert "| run | gsm8k_local | exact_match,strict-match | 0.0000 |" in (out / "results.md").read_text()
