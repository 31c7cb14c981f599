"""The quality benchmark's --quick smoke setting runs end to end on real text and writes its report."""

import json
import os
import shutil
import statistics
import sys
from hashlib import sha256

import pytest

from tests import timing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
# ≈ 9 min of process CPU for the first invocation (two settings, 2 seeds of reuse, 4 sweep runs): ≈ 6 min on 2 idle
# cores, 40 min on the 2-core machine shared by seven engineers; the rerun reuses everything (≈ 1.5 min)
@pytest.mark.timeout(7200)
def test_quick_quality_benchmark(tmp_path, shared_data):
    out = tmp_path / "q"
    proc = timing.run([sys.executable, os.path.join(REPO, "jobs", "bench_quality.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=3300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    policies = {"full", "random", "rho1", "blade", "blade-nosync"}
    sets = {"gsm8k_test", "math_test", "aqua", "c4_heldout", "wikitext2_heldout", "lambada_heldout"}
    assert set(res["eval_sets"]) == sets
    # the keys a script reads: both settings, the rules, 3-seed reuse, both accountings, the sweep, the dev split
    assert list(res["settings"]) == ["gsm8k-in-pool", "paper"]
    assert res["verdict_rules"] and all(isinstance(x, str) for x in res["verdict_rules"])
    assert res["reuse_seeds"] == [0, 1] and res["reuse_runs"] == [1, 4, 16]
    assert res["bases"]["target"]["tokens_per_parameter"] == pytest.approx(
        res["bases"]["target"]["tokens"] / res["bases"]["target"]["parameters"])
    assert res["dev_split"]["documents"] > 0 and set(res["dev_split"]["overlap"].values()) == {0}
    assert {"gsm8k_test", "validation", "pool:gsm8k"} <= set(res["dev_split"]["overlap"])
    steps = res["setting"]["steps"]
    eq = res["equal_compute_steps"]
    assert eq["full"] == eq["random"] == steps and min(eq["blade"], eq["rho1"]) > steps
    for p in policies:
        assert res["flops"][p]["total"] == pytest.approx(sum(res["flops"][p][k] for k in ("proxy", "scoring", "refresh")))
    for name, st in res["settings"].items():
        assert set(st["eval"]) == policies
        assert all(set(e) == sets and all(0 < v < 20 for v in e.values()) for es in st["eval"].values() for e in es)
        assert st["vs_full_equal_tokens"]["random"] == st["vs_full_equal_compute"]["random"]
        assert st["part_seconds"]["full"]["refresh"] == 0 and st["part_seconds"]["blade"]["refresh"] > 0
        d = st["vs_full_equal_compute"]["blade"]["gsm8k_test"]
        assert d["lo"] <= d["mean"] <= d["hi"]
        assert d["mean"] == pytest.approx(statistics.fmean(
            b["gsm8k_test"] - f["gsm8k_test"] for b, f in zip(st["eval"]["blade"], st["eval_equal_compute_full"]["blade"],
                                                              strict=True)))
        assert st["verdicts"]["blade_vs_rho1"] == "undecided"  # 2 seeds in --quick: the rules decide nothing
        assert all(v == 1.0 for v in st["kept_share"]["full"].values())
        assert st["test_curves"]["blade"][0][0] == [0, pytest.approx(res["base_eval"]["gsm8k_test"])]
        reuse = st["reuse"]
        assert reuse["seeds"] == 2 and len(reuse["full_final"]) == 2
        for p, e in reuse["policies"].items():
            assert len(e["final"]) == 2
            charged, free = e["accountings"]["charged"], e["accountings"]["free"]
            base = reuse["proxy_base_flops"] if p != "random" else 0.0
            assert charged["selection"] == pytest.approx(free["selection"] + base)
            for n in ("1", "4", "16"):
                assert charged["runs"][n]["total_flops"] == pytest.approx(reuse["full_flops"] + charged["selection"] / int(n))
                diff = charged["runs"][n]["equal_compute"]["gsm8k_test"]
                assert diff["mean"] == pytest.approx(statistics.fmean(e["final"][k]["gsm8k_test"] for k in range(2))
                                                     - charged["runs"][n]["full_at_equal_compute"]["gsm8k_test"])
            assert set(res["break_even"][name][p]) == {"charged", "free"}
    assert set(res["settings"]["gsm8k-in-pool"]["reuse"]["policies"]) == {"blade", "rho1", "random"}
    assert res["settings"]["paper"]["pool_share"].get("gsm8k") is None  # no GSM8K train in the paper's pool
    assert res["settings"]["paper"]["reuse"]["policies"]["rho1"]["selection_flops"] > 0
    # the choices: every setting tried is listed, one chosen per family, at equal compute on the dev split
    sweep = res["sweep"]
    assert len([x for x in sweep if x["policy"] == "blade"]) == 2 and len([x for x in sweep if x["policy"] == "rho1"]) == 2
    for policy, budget in (("blade", "sweep_budget"), ("rho1", "rho1_budget")):
        rows = [x for x in sweep if x["policy"] == policy]
        chosen = min(rows, key=lambda row: row["dev_at_budget"])
        assert chosen["chosen"] and sum(x["chosen"] for x in rows) == 1
        assert res[budget] == pytest.approx(min(row["flops"]["total"] for row in rows))
        assert all(row["curve"][0] == [0.0, pytest.approx(res["dev_split"]["base_loss"])] for row in rows)
    assert res["best_refresh"]["rho1_steps"] == next(x["setting"]["rho1_steps"] for x in sweep
                                                     if x["policy"] == "rho1" and x["chosen"])
    # RHO-1's reference trains with BLADE's chosen η_w and batch, in the sweep as in the main stage
    for n in (x["setting"]["rho1_steps"] for x in sweep if x["policy"] == "rho1"):
        sel = json.loads((out / "runs" / f"sweep-rho1-{n}" / "result.json").read_text())["config"]["selection"]
        assert (sel["ref_lr"], sel["refresh_batch_size"]) == (res["best_refresh"]["ref_lr"],
                                                               res["best_refresh"]["refresh_batch_size"])
    assert "trained otherwise" not in proc.stdout  # so its chosen run is the main stage's seed 0
    clock = json.loads((out / "runs" / "full-seed0" / "result.json").read_text())["step_clock"]
    assert clock in ("process CPU", "wall") and f"ms/step ({clock})" in proc.stdout
    for role in ("proxy", "target"):
        b = res["bases"][role]
        assert b["tokens_per_parameter"] == pytest.approx(b["tokens"] / b["parameters"]) and b["curve"]
        assert b["epochs"] <= 2
    md = (out / "RESULTS.md").read_text()
    head = md.split("## Verdict rules")[0]
    assert "## Three answers, both settings" in head and "| 1. BLADE vs RHO-1" in head and "| 3. Reused selection" in head
    assert "GSM8K train in the pool" in head and "the paper's regime" in head
    assert md.index("## Verdict rules") < md.index("## Setting") and "break-even R, base charged" in md
    for fig in ("bases.png", "sweep_frontier.png", "curves-gsm8k-in-pool.png", "curves-paper.png",
                "reuse-gsm8k-in-pool.png", "reuse-paper.png"):
        assert (out / "figures" / fig).stat().st_size > 1000
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = out / "models" / "blade-seed0"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert model.config.vocab_size == len(tok)
    # the runs trained and were scored two at a time (in processes of their own); two of them trained and scored
    # again one at a time, in the benchmark's process, give the same weights and scores bit for bit, and every
    # other run is reused
    main_runs = [out / "runs" / f"{pre}{p}-seed{k}" for pre in ("", "paper-") for p in ("full", "random", "blade-nosync")
                 for k in range(2)]
    pids = {json.loads((d / "result.json").read_text())["run_seconds"]["pid"] for d in main_runs}
    assert len(pids) == 2 and "2 runs at a time of 1 thread(s) each" in md  # the main stage's two workers
    # the proxy's base trained alone in the benchmark's process; the target's in the main stage's pool, beside its
    # runs, with their one thread
    pid = lambda n: json.loads((out / "runs" / n / "result.json").read_text())["run_seconds"]["pid"]  # noqa: E731
    rec = lambda n: json.loads((out / "runs" / n / "result.json").read_text())["config"]["threads"]  # noqa: E731
    assert pid("base-target") in pids and pid("base-proxy") not in pids and (rec("base-proxy"), rec("base-target")) == (2, 1)
    order = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith(("[run] ", "[sweep] "))]
    assert order.index("[run] base-proxy") < order.index("[sweep] chosen at equal compute on the dev split") < \
        order.index("[run] base-target")
    retrained = ("full-seed1", "paper-blade-nosync-seed0")
    weights = {n: sha256((out / "runs" / n / "final" / "model.safetensors").read_bytes()).hexdigest() for n in retrained}
    for n in retrained:
        shutil.rmtree(out / "runs" / n)
    # their scores too: scored again in this process (one thread), they equal the workers' scores
    cache = json.loads((out / "eval_cache.json").read_text())
    dropped = [k for k in cache if k.startswith(tuple(f"{n}@" for n in retrained))]
    assert len(dropped) >= 4
    (out / "eval_cache.json").write_text(json.dumps({k: v for k, v in cache.items() if k not in dropped}))
    again = timing.run([sys.executable, os.path.join(REPO, "jobs", "bench_quality.py"), "--quick", "--out", str(out),
                            "--parallel-runs", "1"], capture_output=True, text=True, timeout=1700, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert weights == {n: sha256((out / "runs" / n / "final" / "model.safetensors").read_bytes()).hexdigest()
                       for n in retrained}
    trained = [line.split(":")[0].removeprefix("[run] ") for line in again.stdout.splitlines()
               if line.startswith("[run] ") and not line.endswith("(recorded)")]
    assert sorted(trained) == sorted(retrained)
    for name, st in json.loads((out / "results.json").read_text())["settings"].items():
        assert st["eval"] == res["settings"][name]["eval"]
        assert st["eval_equal_compute_full"] == res["settings"][name]["eval_equal_compute_full"]
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
    assert bq._reusable(str(run_dir / "result.json"), blade) is not None
    assert run_dir.exists()
    # the sweep chose another refresh setting: the old run is removed and trained again
    changed = {**blade, "selection": {**blade["selection"], "refresh_batch_size": 16}}
    assert bq._reusable(str(run_dir / "result.json"), changed) is None
    assert not run_dir.exists()
    assert "blade-seed1: settings changed" in capsys.readouterr().out
    # full and random do not read the refresh settings: their finished runs stay valid
    full = {"max_steps": 300, "selection": {"policy": "full", "ref_lr": 1e-3, "refresh_batch_size": None}}
    full_dir = tmp_path / "runs" / "full-seed1"
    _write_run(full_dir, full)
    assert bq._reusable(str(full_dir / "result.json"), {**full, "selection": {**full["selection"], "ref_lr": 3e-3}}) is not None
    assert bq._reusable(str(full_dir / "result.json"), {**full, "max_steps": 600}) is None


def test_unfinished_run_of_other_settings_is_not_resumed(tmp_path):
    import yaml

    bq = _bench_module()
    run_dir = tmp_path / "runs" / "rho1-seed0"
    run_dir.mkdir(parents=True)
    old = {"selection": {"policy": "rho1", "refresh_batch_size": None}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old))
    assert bq._reusable(str(run_dir / "result.json"), old) is None
    assert run_dir.exists()  # same settings: left for train() to resume from its checkpoints
    assert bq._reusable(str(run_dir / "result.json"), {"selection": {"policy": "rho1", "refresh_batch_size": 16}}) is None
    assert not run_dir.exists()


def test_a_replay_of_shards_made_again_since_is_trained_again(tmp_path, capsys):
    import time

    bq = _bench_module()
    selected = tmp_path / "runs" / "rho1-seed0" / "selected"
    selected.mkdir(parents=True)
    manifest = selected / "manifest.json"
    manifest.write_text("{}")
    replay = {"selected": str(selected), "max_steps": None}
    run_dir = tmp_path / "runs" / "target-replay-rho1-seed0"
    _write_run(run_dir, replay)
    inputs = (str(manifest),)
    old = time.time() - 100
    os.utime(manifest, (old, old))
    assert bq._reusable(str(run_dir / "result.json"), replay, inputs) is not None  # the shards predate the replay
    manifest.write_text("{}")  # the proxy run was trained again: its shards are new
    assert bq._reusable(str(run_dir / "result.json"), replay, inputs) is None
    assert not run_dir.exists()
    assert f"{manifest} was written again since the recorded run" in capsys.readouterr().out
    # an unfinished replay of older shards does not resume either
    import yaml

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(replay))
    os.utime(run_dir / "config.yaml", (old, old))
    assert bq._reusable(str(run_dir / "result.json"), replay, inputs) is None
    assert not run_dir.exists()



def test_the_step_timer_names_its_clock_and_a_cpu_run_does_not_count_waiting(monkeypatch):
    """On a CPU the steps are timed in process CPU time (all threads: a 2-thread run counts twice), which the run
    line and result.json name; a wait inside a step is not counted. With CUDA, wall time (so the wait counts)."""
    import time

    import torch

    from bench.quality.runs import StepTimer

    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        timer = StepTimer()
        timer.before_dataloader(None, None)
        time.sleep(0.3)
        timer.batch_end(None, None)
        assert timer.steps == 1
        assert timer.clock == ("wall" if cuda else "process CPU")
        assert (timer.seconds >= 0.3) if cuda else (timer.seconds < 0.1)


@pytest.mark.parametrize("key", ["final_weights", "final_reference", "snapshots", "selected_dir", "link"])
def test_a_result_naming_paths_outside_its_run_is_not_reused(tmp_path, capsys, monkeypatch, key):
    """``result.json`` is read back as untrusted: the weights, reference, snapshots and selected shards it names must
    lie inside its own run directory; a record naming a path elsewhere (or a link leading there) is not reused: one
    line names result.json and the key, and the run is trained again (its directory removed, as for changed
    settings)."""
    bq = _bench_module()
    config = {"max_steps": 300, "selection": {"policy": "blade", "ref_lr": 1e-3, "refresh_batch_size": None}}
    monkeypatch.setattr(bq, "_record", lambda cfg, snapshots: config)  # (lookup's run config, without a TrainConfig)
    monkeypatch.setattr(bq, "_inputs", lambda cfg: ())
    run_dir = tmp_path / "runs" / "blade-seed0"
    result = str(run_dir / "result.json")
    good = {"config": config, "final_weights": str(run_dir / "final" / "model.safetensors"),
            "final_reference": str(run_dir / "final" / "reference.safetensors"),
            "snapshots": {"4": str(run_dir / "snapshots" / "step4.safetensors")},
            "summary": {"selected_dir": str(run_dir / "selected")}}
    _write_run(run_dir, config)
    (run_dir / "result.json").write_text(json.dumps(good))
    assert bq.lookup(None, result) == good
    (tmp_path / "elsewhere").mkdir()
    outside = str(tmp_path / "elsewhere" / "model.safetensors")
    tampered = json.loads(json.dumps(good))
    if key == "snapshots":
        tampered["snapshots"]["4"] = outside
    elif key == "selected_dir":
        outside = tampered["summary"]["selected_dir"] = str(run_dir / ".." / ".." / "elsewhere")
    elif key == "link":  # a path inside, but through a link leading out
        os.symlink(tmp_path / "elsewhere", run_dir / "final")
        outside = good["final_weights"]
    else:
        tampered[key] = outside
    (run_dir / "result.json").write_text(json.dumps(tampered))
    reused = list(bq.REUSED)
    capsys.readouterr()
    assert bq.lookup(None, result) is None
    assert bq.REUSED == reused and not run_dir.exists() and (tmp_path / "elsewhere").is_dir()
    shown = {"snapshots": "snapshots.4", "selected_dir": "summary.selected_dir", "link": "final_weights"}.get(key, key)
    assert capsys.readouterr().out == (f"[run] blade-seed0: {result}: {shown} {outside!r} is not a path inside "
                                       f"{run_dir}; refused, not reused; training it again\n")
