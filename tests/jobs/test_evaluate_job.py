"""jobs/evaluate.py: the CLI (config, --set, --print-config), clear errors, and the demo default after
jobs/train.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from curation.demo import write_demo_corpus
from curation.prepare import prepare
from schemas.config import PrepareConfig
from schemas.eval_config import EvaluateConfig
from schemas.train_config import TrainConfig, demo_model_config

REPO = Path(__file__).resolve().parents[2]


def _load_job(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"job_{name}", REPO / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


evaluate_job = _load_job("evaluate")


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
    from training.run import train

    for policy in ("full", "blade"):
        t = TrainConfig.demo_default(root, policy=policy)
        t = t.model_copy(update={"model": demo_model_config(400, hidden=32, layers=1), "max_steps": 4, "batch_size": 4,
                                 "progress_bar": False, "plots": False, "threads": 1,
                                 "selection": t.selection.model_copy(update={"warmup_steps": 1, "tau": 2,
                                                                             "refresh_steps": 1})})
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
