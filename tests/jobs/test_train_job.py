"""jobs/train.py and jobs/replay.py: CLI, outputs, resume, clear errors for bad inputs."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from curation.io.shards import read_column
from schemas.config import load_config
from schemas.shards import validate_shard_dir
from schemas.train_config import ReplayConfig, TrainConfig, demo_model_config
from tests import timing
from tests.conftest import load_job

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "jobs"


train_job, replay_job = load_job("train"), load_job("replay")


@pytest.fixture
def small_demo(engine_demo) -> str:
    """The session's small prepared demo (tests/conftest.py: ≈ 400 candidate sequences, vocabulary 512)."""
    return engine_demo


def _config_file(root: str, out: str, path: Path, **updates) -> str:
    cfg = TrainConfig.demo_default(root).model_dump(mode="json")
    cfg.update(model=demo_model_config(512, hidden=32, layers=1).model_dump(mode="json"), output_dir=out,
               batch_size=8, max_steps=9, progress_bar=False, threads=1)
    cfg["selection"].update(warmup_steps=2, tau=3, refresh_steps=2, refresh_batch_size=2)
    cfg["eval"].update(interval=4, max_batches=1)
    cfg["checkpoint"].update(interval=4)
    cfg.update(updates)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_shipped_configs_equal_the_embedded_defaults():
    assert load_config(TrainConfig, path=str(JOBS / "configs" / "train_demo.yaml")) == TrainConfig.demo_default()
    assert load_config(ReplayConfig, path=str(JOBS / "configs" / "replay_demo.yaml")) == ReplayConfig.demo_default()


def test_print_config_with_policy_shortcut(capsys):
    with pytest.raises(SystemExit) as e:
        train_job.main(["--set", "policy=rho1", "--print-config"])
    assert e.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["selection"]["policy"] == "rho1" and cfg["output_dir"] == os.path.join("runs", "demo", "train", "rho1")


@pytest.mark.parametrize("override,needle", [("policy=bogus", "selection.policy"), ("gamma=1.5", "gamma"),
                                             ("selection.gamma=0", "gamma")])
def test_bad_settings_exit_2_naming_the_key(capsys, override, needle):
    with pytest.raises(SystemExit) as e:
        train_job.main(["--set", override, "--print-config"])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_train_job_writes_everything_and_a_rerun_resumes(small_demo, tmp_path, capsys):
    out = str(tmp_path / "run")
    # ‖u − w̃‖ every throughput.log_interval steps (distance_interval's default)
    config = _config_file(small_demo, out, tmp_path / "train.yaml",
                          throughput={"peak_flops": None, "window": 20, "log_interval": 2})
    assert train_job.main(["--config", config]) == 0
    printed = capsys.readouterr().out
    assert "blade: 9 steps" in printed and "target" in printed
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["policy"] == "blade" and summary["steps"] == 9
    assert set(summary["tokens"]["per_source"]) == {"target", "general", "noise"}
    assert [v["step"] for v in summary["validation"]] == [4, 8, 9]
    assert set(summary["delta_quantiles_per_episode"]) == {"0", "1", "2"}
    assert [p["step"] for p in summary["param_distance"]] == [2, 4, 6, 8]
    assert [r["step"] for r in summary["refreshes"]] == [2, 5, 8]
    for png in ("delta_histograms.png", "param_distance.png", "val_loss.png"):
        assert os.path.getsize(os.path.join(out, "plots", png)) > 1000
    validate_shard_dir(os.path.join(out, "selected"), "selected")
    assert len(read_column(os.path.join(out, "selected"), "step")) == 9 * 8
    logged = [json.loads(line) for line in open(os.path.join(out, "logs", "metrics.jsonl"))]
    keys = set().union(*(d.keys() for d in logged))
    assert {"loss/train/total", "blade/kept_fraction/target", "blade/delta_q50", "blade/param_distance",
            "metrics/eval/TokenLoss"} <= keys
    assert os.path.exists(os.path.join(out, "checkpoints", "latest-rank0.pt"))
    assert os.path.exists(os.path.join(out, "final", "model.safetensors"))
    # the same command again: resumes from the final checkpoint, nothing is written twice
    assert train_job.main(["--config", config]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert len(read_column(os.path.join(out, "selected"), "step")) == 9 * 8

    # replay into a bigger model
    rcfg = ReplayConfig.demo_default(small_demo).model_dump(mode="json")
    rcfg.update(selected=os.path.join(out, "selected"), output_dir=str(tmp_path / "replay"), batch_size=8,
                progress_bar=False, threads=1, model=demo_model_config(512, hidden=48, layers=2).model_dump(mode="json"))
    (tmp_path / "replay.yaml").write_text(yaml.safe_dump(rcfg))
    assert replay_job.main(["--config", str(tmp_path / "replay.yaml")]) == 0
    assert "validation loss" in capsys.readouterr().out


def test_damaged_selected_shard_stops_replay_and_resume_naming_it(small_demo, tmp_path, capsys, flip_bit):
    """A damaged selected-token shard: replay and a resumed train.py stop naming it (it cannot be rewritten
    without retraining); before, replay trained on altered masks or died in a zstd traceback."""
    out = str(tmp_path / "run")
    config = _config_file(small_demo, out, tmp_path / "train.yaml", checkpoint={"interval": 4, "keep": -1})
    assert train_job.main(["--config", config]) == 0
    capsys.readouterr()
    ckpts = os.path.join(out, "checkpoints")
    for f in os.listdir(ckpts):  # back to the checkpoint after step 4, as if the run had been killed later
        if not f.endswith("-ba4-rank0.pt"):
            os.remove(os.path.join(ckpts, f))
    (first,) = os.listdir(ckpts)
    os.symlink(first, os.path.join(ckpts, "latest-rank0.pt"))
    sel = os.path.join(out, "selected")
    shard = sorted(Path(sel).glob("steps-*/shard.*.mds.zstd"))[0]
    flip_bit(shard)
    rcfg = ReplayConfig.demo_default(small_demo).model_dump(mode="json")
    rcfg.update(selected=sel, output_dir=str(tmp_path / "replay"), batch_size=8, progress_bar=False, threads=1,
                model=demo_model_config(512, hidden=32, layers=1).model_dump(mode="json"))
    (tmp_path / "replay.yaml").write_text(yaml.safe_dump(rcfg))
    assert replay_job.main(["--config", str(tmp_path / "replay.yaml")]) == 1
    err = capsys.readouterr().err
    assert f"error: {shard}: corrupt shard" in err and "cannot be rewritten without retraining" in err
    assert train_job.main(["--config", config]) == 1  # the same command again: resumes after step 4
    err = capsys.readouterr().err
    assert f"{shard}: corrupt shard" in err and "cannot be rewritten without retraining" in err


def test_bad_shard_schema_fails_naming_the_directory_and_column(small_demo, tmp_path, capsys):
    cand = os.path.join(small_demo, "data", "candidates")
    config = _config_file(small_demo, str(tmp_path / "run"), tmp_path / "t.yaml")
    # selected-token shards are expected for replay; candidate shards are not
    rc = replay_job.main(["--set", f"selected={cand}", "--set", f"output_dir={tmp_path / 'r'}",
                          "--set", "validation=null", "--set", "tokenizer=null"])
    err = capsys.readouterr().err
    assert rc == 1 and cand in err and "loss_mask" in err
    # and a scored directory that is not one
    assert train_job.main(["--config", config, "--set", f"data.scored={cand}"]) == 1
    err = capsys.readouterr().err
    assert cand in err and "ref_loss" in err


def test_vocabulary_mismatch_fails_naming_the_setting_and_file(small_demo, tmp_path, capsys):
    config = _config_file(small_demo, str(tmp_path / "run"), tmp_path / "t.yaml")
    assert train_job.main(["--config", config, "--set", "model.hf_config.vocab_size=300"]) == 1
    err = capsys.readouterr().err
    assert "model.hf_config.vocab_size" in err and "manifest.json" in err and "512" in err
    other_tok = tmp_path / "tok.json"
    other_tok.write_text(open(os.path.join(small_demo, "data", "tokenizer", "tokenizer.json")).read()
                         .replace("<|endoftext|>", "<|eot|>"))
    assert train_job.main(["--config", config, "--set", f"data.tokenizer={other_tok}"]) == 1
    assert "tokenizer mismatch" in capsys.readouterr().err


def test_missing_demo_data_says_how_to_prepare(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train_job.main([]) == 1
    assert "python jobs/prepare.py" in capsys.readouterr().err


@pytest.mark.slow
def test_train_job_runs_as_a_script(small_demo, tmp_path):
    config = _config_file(small_demo, str(tmp_path / "run"), tmp_path / "t.yaml", max_steps=3)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = timing.run([sys.executable, str(JOBS / "train.py"), "--config", config, "--set", "policy=random"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "random: 3 steps" in proc.stdout


@pytest.mark.slow
def test_output_to_a_pipe_gets_progress_lines_with_every_field(small_demo, tmp_path):
    """Issue 34: with stdout and stderr not terminals (a pipe, `> log`, ray job submit) the progress bar, cut at 120
    columns there (`… kept/s=5.5k, e`), gives way to a line every throughput.log_interval steps with every field."""
    config = _config_file(small_demo, str(tmp_path / "run"), tmp_path / "t.yaml", max_steps=7, progress_bar=True,
                          throughput={"window": 2, "log_interval": 3, "peak_flops": 1e12})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = timing.run([sys.executable, str(JOBS / "train.py"), "--config", config], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pattern = re.compile(r"^step (\d+)/7 \| loss \d+\.\d{4} \| tok/s (\S+) \| kept/s (\S+) \| mfu (\S+) \| eta (\S+)$")
    lines = [m for line in proc.stdout.splitlines() if (m := pattern.match(line))]
    assert [int(m.group(1)) for m in lines] == [3, 6, 7]  # every 3 steps and the last one
    for m in lines:  # measured rates in SI form, MFU from the given peak, the time left (0s at the end)
        assert all(re.fullmatch(r"\d+(\.\d)?[kMG]?", m.group(i)) for i in (2, 3)), m.group(0)
        # MFU from the given peak: "12.3%", or two significant digits below 0.1% ("0.028%", "9.5e-05%": the rate of a
        # busy machine), as training.blocks.throughput formats it
        assert re.fullmatch(r"\d+\.\d%|0\.0*[1-9]\d?%|[1-9](\.\d)?e-\d+%", m.group(4)), m.group(0)
        assert re.fullmatch(r"(\d+h)?(\d+m)?\d+s|\d+h\d+m", m.group(5))
    assert lines[-1].group(5) == "0s"
    assert "\r" not in proc.stdout + proc.stderr and "it/s" not in proc.stderr  # no tqdm bar


def test_damaged_candidate_shard_stops_training_naming_the_file(small_demo, tmp_path, capsys, flip_bit):
    """Issue 14: one flipped bit in a candidate shard was trained on silently (exit 0); a corrupt zstd
    shard gave a raw traceback without a path."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(os.path.join(small_demo, "data"), data)
    cand = data / "candidates"
    shard = sorted(cand.glob("*/part-*/shard.*.mds.zstd"))[0]
    flip_bit(shard)
    config = _config_file(small_demo, str(tmp_path / "run"), tmp_path / "t.yaml")
    rc = train_job.main(["--config", config, "--set", f"data.candidates={cand}", "--set", f"data.validation={data / 'validation'}",
                         "--set", "data.tokenizer=null"])
    err = capsys.readouterr().err
    part = os.path.relpath(shard.parent, cand)
    assert rc == 1 and f"error: {shard}: corrupt shard" in err
    assert f"part {part} can be regenerated: rerun jobs/prepare.py" in err and "Traceback" not in err


def test_a_copied_run_directory_resumes_from_its_new_place(small_demo, tmp_path, capsys):  # noqa: F811
    """issue 32: a run directory copied (or moved) elsewhere was refused (``differs in: output_dir``); now the copy
    resumes from its own checkpoint, and an output_dir spelled with a trailing '/' is the same directory."""
    import shutil
    import signal

    from composer.core import Callback

    from curation.io.stop import GracefulStop, StopRequested
    from training.runs.train_job import train

    class SigtermAtStep4(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    out, copy = str(tmp_path / "run"), str(tmp_path / "copy")
    config = _config_file(small_demo, out, tmp_path / "train.yaml")
    with pytest.raises(StopRequested, match="after step 4 of 9"), GracefulStop():
        train(load_config(TrainConfig, path=config), callbacks=[SigtermAtStep4()])
    shutil.copytree(out, copy, symlinks=True)
    capsys.readouterr()
    assert train_job.main(["--config", config, "--set", f"output_dir={copy}/"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "blade: 9 steps" in printed and f"(resumed from {copy}/checkpoints/latest-rank0.pt)" in printed, printed
    assert json.load(open(os.path.join(copy, "summary.json")))["steps"] == 9
    assert yaml.safe_load(open(os.path.join(copy, "config.yaml")))["output_dir"] == f"{copy}/"
    assert not os.path.exists(os.path.join(out, "final"))  # the original is left as it was


@pytest.mark.parametrize(("model", "line"), [
    ({"model_type": "gpt2", "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 512},
     "error: model: the model embeds positions for 64 tokens (n_positions) but the sequences of {m} hold 128: set "
     "model.hf_config.n_positions >= 128, or prepare the data with seq_len <= 64"),
    ({"max_position_embeddings": 64},
     "error: model: the model embeds positions for 64 tokens (max_position_embeddings) but the sequences of {m} hold "
     "128: set model.hf_config.max_position_embeddings >= 128, or prepare the data with seq_len <= 64"),
    ({"batch_size": 10**9}, "error: batch_size 1000000000 is more than the {n} candidate sequences of {c}: a step "
     "takes batch_size of them; lower batch_size"),
])
def test_settings_the_data_cannot_run_end_in_one_line_before_the_config_is_recorded(small_demo, tmp_path, capsys,
                                                                                      model, line):  # noqa: F811
    """issue 32: a GPT-2 with fewer positions than seq_len ended in an 85-line IndexError, a Llama trained past them
    silently, batch_size=1e9 in a memory-error traceback; each left a config.yaml that refused the corrected rerun."""
    out = str(tmp_path / "run")
    base = TrainConfig.model_validate(yaml.safe_load(open(_config_file(small_demo, out, tmp_path / "t.yaml"))))
    if "batch_size" in model:
        updates = model
    elif "model_type" in model:
        updates = {"model": {**base.model.model_dump(mode="json"), "hf_config": model}}
    else:
        updates = {"model": {**base.model.model_dump(mode="json"),
                             "hf_config": {**base.model.hf_config, **model}}}
    config = _config_file(small_demo, out, tmp_path / "bad.yaml", **updates)
    capsys.readouterr()
    assert train_job.main(["--config", config]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    cand = os.path.join(small_demo, "data", "candidates")
    n = json.load(open(os.path.join(cand, "manifest.json")))
    n = sum(c["sequences"] for c in n["sources"].values())
    want = line.format(m=os.path.join(cand, "manifest.json"), n=n, c=cand)
    assert err == [want], err
    assert not os.path.exists(os.path.join(out, "config.yaml"))  # the corrected rerun is not refused by a record


def test_an_infinite_learning_rate_is_refused_with_the_other_bad_settings(capsys):
    with pytest.raises(SystemExit) as e:
        train_job.main(["--set", "optim.lr=.inf", "--print-config"])
    assert e.value.code == 2
    assert "  optim.lr: Input should be a finite number (got inf)" in capsys.readouterr().err.splitlines()


def test_a_diverging_reference_stops_the_run_naming_the_setting(small_demo, tmp_path, capsys):  # noqa: F811
    """issue 32: ``--set selection.ref_lr=1e3`` ran to the end (rc 0) with a reference at the uniform loss."""
    config = _config_file(small_demo, str(tmp_path / "run"), tmp_path / "t.yaml")
    capsys.readouterr()
    # on the CPU: there the validation loss is the first figure to leave the finite (on an H200 the weights were,
    # and the line names them instead: the same setting, another first symptom)
    assert train_job.main(["--config", config, "--set", "selection.ref_lr=1e3", "--set", "device=cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the reference diverged in a refresh: its validation loss "), err
    assert err[0].endswith("; lower selection.ref_lr (now 1000)"), err


def test_a_diverging_proxy_stops_the_run_naming_optim_lr(small_demo, tmp_path, capsys):  # noqa: F811
    """issue 32: a proxy whose learning rate is far too large trained on at a loss worse than a uniform guess (lr 1:
    finite losses of 16 and more against ln V = 6.24, which no check caught; a NaN was caught before)."""
    config = _config_file(small_demo, str(tmp_path / "run"), tmp_path / "t.yaml")
    capsys.readouterr()
    assert train_job.main(["--config", config, "--set", "policy=full", "--set", "optim.lr=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the proxy diverged: its training loss "), err
    assert err[0].endswith("; lower optim.lr (now 1)"), err
