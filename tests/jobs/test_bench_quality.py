"""The quality benchmark's --quick smoke setting runs end to end on real text and writes its report."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_quality_benchmark(tmp_path, shared_data):
    out = tmp_path / "q"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "jobs", "bench_quality.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    policies = {"full", "random", "rho1", "blade", "blade-nosync"}
    assert set(res["eval_gsm8k_test"]) == policies
    assert all(0 < v < 20 for vs in res["eval_gsm8k_test"].values() for v in vs)
    assert res["best_refresh"] in [row["setting"] for row in res["sweep"]]
    # the chosen refresh setting is the one with the lowest validation loss (never the evaluation set)
    assert min(res["sweep"], key=lambda r: r["val_loss"])["setting"] == res["best_refresh"]
    # full keeps every token; the others keep about γ of them
    assert all(v == 1.0 for v in res["kept_share"]["full"].values())
    md = (out / "RESULTS.md").read_text()
    assert "| blade |" in md and "GSM8K test" in md
    for fig in ("val_loss.png", "long_horizon.png", "delta_hist.png", "param_distance.png", "gamma_sweep.png", "tau_sweep.png"):
        assert (out / "figures" / fig).stat().st_size > 1000
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = out / "models" / "blade-seed0"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert model.config.vocab_size == len(tok)
    # rerun with the same --out skips every finished run and reproduces the table
    again = subprocess.run([sys.executable, os.path.join(REPO, "jobs", "bench_quality.py"), "--quick", "--out", str(out)],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0 and json.loads((out / "results.json").read_text())["eval_gsm8k_test"] == res["eval_gsm8k_test"]
