"""The quality benchmark's --quick smoke setting runs end to end on real text and writes its report."""

import json
import os
import statistics
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ≈ 3 minutes on 2 idle cores; over 15 minutes per invocation on a heavily shared machine
def test_quick_quality_benchmark(tmp_path, shared_data):
    out = tmp_path / "q"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "jobs", "bench_quality.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1700, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    policies = {"full", "random", "rho1", "blade", "blade-nosync"}
    sets = {"gsm8k_test", "math_test", "aqua", "c4_heldout", "wikitext2_heldout", "lambada_heldout"}
    assert set(res["eval"]) == policies and set(res["eval_sets"]) == sets
    assert all(set(e) == sets and all(0 < v < 20 for v in e.values()) for es in res["eval"].values() for e in es)
    steps = res["setting"]["steps"]
    # equal compute: full's step count at each policy's FLOPs; selection costs more than a plain step
    eq = res["equal_compute_steps"]
    assert eq["full"] == eq["random"] == steps and min(eq["blade"], eq["rho1"]) > steps
    for p in policies:
        assert res["flops"][p]["total"] == pytest.approx(sum(res["flops"][p][k] for k in ("proxy", "scoring", "refresh")))
    # the equal-token comparison of random is the equal-compute one (same FLOPs, the same full snapshot)
    assert res["vs_full_equal_tokens"]["random"] == res["vs_full_equal_compute"]["random"]
    assert res["part_seconds"]["full"]["refresh"] == 0 and res["part_seconds"]["blade"]["refresh"] > 0
    d = res["vs_full_equal_compute"]["blade"]["gsm8k_test"]
    assert d["lo"] <= d["mean"] <= d["hi"]
    assert d["mean"] == pytest.approx(statistics.fmean(
        b["gsm8k_test"] - f["gsm8k_test"] for b, f in zip(res["eval"]["blade"], res["eval_equal_compute_full"]["blade"],
                                                          strict=True)))
    # the refresh setting is chosen by validation loss at equal compute (never an evaluation set)
    chosen = min(res["sweep"], key=lambda row: row["val_at_budget"])
    assert chosen["setting"] == res["best_refresh"] and chosen["chosen"]
    assert res["sweep_budget"] == pytest.approx(min(row["flops"]["total"] for row in res["sweep"]))
    assert all(v == 1.0 for v in res["kept_share"]["full"].values())
    # bases: tokens per parameter recorded; the curves over steps start at the base
    for role in ("proxy", "target"):
        b = res["bases"][role]
        assert b["tokens_per_parameter"] == pytest.approx(b["tokens"] / b["parameters"]) and b["curve"]
    assert res["test_curves"]["blade"][0][0] == [0, pytest.approx(res["base_eval"]["gsm8k_test"])]
    assert [row["episode"] for row in res["delta_over_time"]["blade"]] == list(range(len(res["delta_over_time"]["blade"])))
    # reuse: a ≥ 4× target; random's selection is free; amortizing over 4 runs costs less than over 1
    reuse = res["reuse"]
    assert reuse["flops_ratio"] >= 4 and set(reuse["policies"]) == {"blade", "rho1", "random"}
    assert reuse["policies"]["random"]["selection_flops"] == 0
    for e in reuse["policies"].values():
        one, four = e["amortized"]["1"], e["amortized"]["4"]
        assert one["total_flops"] == pytest.approx(reuse["full_flops"] + e["selection_flops"])
        assert four["total_flops"] == pytest.approx(reuse["full_flops"] + e["selection_flops"] / 4)
        diff = one["equal_compute"]["gsm8k_test"]["mean"]
        assert diff == pytest.approx(e["final"]["gsm8k_test"] - one["full_at_equal_compute"]["gsm8k_test"])
    md = (out / "RESULTS.md").read_text()
    assert "## Three answers" in md and "1. **BLADE vs RHO-1 at the long horizon**" in md
    assert "3. **Reused selection at equal total compute**" in md and "| blade |" in md
    for fig in ("bases.png", "curves.png", "loss_vs_compute.png", "delta_over_time.png", "param_distance.png",
                "reuse.png"):
        assert (out / "figures" / fig).stat().st_size > 1000
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = out / "models" / "blade-seed0"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert model.config.vocab_size == len(tok)
    # rerun with the same --out skips every finished run and reproduces the table
    again = subprocess.run([sys.executable, os.path.join(REPO, "jobs", "bench_quality.py"), "--quick", "--out", str(out)],
                           capture_output=True, text=True, timeout=1700, cwd=tmp_path)
    assert again.returncode == 0 and json.loads((out / "results.json").read_text())["eval"] == res["eval"]
    # every stage is timed, the evaluation too, added up over the invocations that ran it
    assert list(res["stage_times"]) == ["data", "bases", "sweep", "main", "reuse", "evaluate"]
    assert res["stage_times"]["evaluate"]["pieces"] == 1 and "| evaluate |" in md
    times = json.loads((out / "results.json").read_text())["stage_times"]
    assert times["evaluate"]["pieces"] == 2 and times["evaluate"]["wall"] > res["stage_times"]["evaluate"]["wall"]
    assert times["main"]["pieces"] == 2


def _bench_module():
    from bench.quality import runs

    return runs


def _write_run(run_dir, config):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "result.json").write_text(json.dumps({"config": config}))
    (run_dir / "checkpoints").mkdir(exist_ok=True)


def test_finished_run_reused_only_with_the_same_settings(tmp_path, capsys):
    bq = _bench_module()
    blade = {"max_steps": 300, "selection": {"policy": "blade", "ref_lr": 1e-3, "refresh_batch_size": None}}
    run_dir = tmp_path / "runs" / "blade-seed1"
    _write_run(run_dir, blade)
    assert bq._cached(str(run_dir / "result.json"), blade)
    assert run_dir.exists()
    # the sweep chose another refresh setting: the old run is removed and trained again
    changed = {**blade, "selection": {**blade["selection"], "refresh_batch_size": 16}}
    assert not bq._cached(str(run_dir / "result.json"), changed)
    assert not run_dir.exists()
    assert "blade-seed1: settings changed" in capsys.readouterr().out
    # full and random do not read the refresh settings: their finished runs stay valid
    full = {"max_steps": 300, "selection": {"policy": "full", "ref_lr": 1e-3, "refresh_batch_size": None}}
    full_dir = tmp_path / "runs" / "full-seed1"
    _write_run(full_dir, full)
    assert bq._cached(str(full_dir / "result.json"), {**full, "selection": {**full["selection"], "ref_lr": 3e-3}})
    assert not bq._cached(str(full_dir / "result.json"), {**full, "max_steps": 600})


def test_unfinished_run_of_other_settings_is_not_resumed(tmp_path):
    import yaml

    bq = _bench_module()
    run_dir = tmp_path / "runs" / "rho1-seed0"
    run_dir.mkdir(parents=True)
    old = {"selection": {"policy": "rho1", "refresh_batch_size": None}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old))
    assert not bq._cached(str(run_dir / "result.json"), old)
    assert run_dir.exists()  # same settings: left for train() to resume from its checkpoints
    assert not bq._cached(str(run_dir / "result.json"), {"selection": {"policy": "rho1", "refresh_batch_size": 16}})
    assert not run_dir.exists()
