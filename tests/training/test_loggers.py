"""Experiment loggers (``loggers:``): what TensorBoard, MLflow and W&B (offline) wrote, read back with each tool's own
reader, holds the same series as the JSON-lines log: loss, validation loss, kept fraction per source, ‖u − w̃‖,
refresh timings and throughput (skipped, with the reason, unless the three extras are installed: CI's second step).
A missing package is one line naming the extra."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest

from schemas.config import ConfigError, load_config
from schemas.train_config import TrainConfig
from training.blocks.loggers import OUTPUT_DIR_TAG, check_installed
from training.blocks.throughput import host_peak_rss
from training.runs.train_job import train

from .conftest import tiny_config
from .logger_series import (
    KEYS,
    jsonl_series,
    mlflow_series,
    mlflow_tables,
    require_extras,
    tensorboard_histograms,
    tensorboard_series,
    wandb_series,
    wandb_tables,
)

STEPS = 11


@pytest.fixture(scope="module")
def logged_run(demo_root, tmp_path_factory):
    require_extras()
    out = str(tmp_path_factory.mktemp("loggers") / "blade")
    cfg = tiny_config(demo_root, out, "blade", max_steps=STEPS, throughput={"window": 3, "log_interval": 4},
                      loggers={"tensorboard": {}, "mlflow": {"experiment": "tests"}, "wandb": {}})
    return cfg, train(cfg)


def _same(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    assert got.keys() == want.keys()
    assert all(got[s] == pytest.approx(want[s], rel=rel, abs=1e-12) for s in want)


def test_every_logger_holds_the_series_of_the_json_log(logged_run):
    cfg, _ = logged_run
    want = jsonl_series(cfg.output_dir)
    for key in KEYS:  # the run logged each of them
        assert want.get(key), key
    assert len(want["loss/train/total"]) == STEPS and sorted(want["metrics/eval/TokenLoss"]) == [5, 10, 11]
    assert sorted(want["blade/refresh_seconds"]) == [3, 6, 9]  # refreshes before steps 2, 5, 8

    tb = tensorboard_series(os.path.join(cfg.output_dir, "logs", "tensorboard", "train"))
    runs, ml = mlflow_series("sqlite:///" + os.path.join(cfg.output_dir, "logs", "mlflow.db"), "tests")
    (run_dir,) = glob.glob(os.path.join(cfg.output_dir, "logs", "wandb", "offline-run-*"))
    wb = wandb_series(run_dir)
    for key in KEYS:
        _same(tb[key], want[key], rel=1e-6)  # TensorBoard keeps float32
        _same(ml[key], want[key], rel=1e-12)
        _same(wb[key], want[key], rel=1e-12)

    (run,) = runs
    assert run.info.status == "FINISHED" and run.info.run_name == "blade"
    assert run.data.tags[OUTPUT_DIR_TAG] == os.path.abspath(cfg.output_dir)


def test_kept_shares_and_delta_quantiles_per_log_interval_match_the_selected_shards(logged_run):
    """Issue 57: every ``throughput.log_interval`` (4) steps each source's share of the interval's kept tokens and of
    its candidates, and the interval's Δ quantiles, recomputed here from the selected shards (Δ there is float16;
    the logged quantiles are to 0.02 nats)."""
    import numpy as np

    from curation.io.shards import read_column

    cfg, out = logged_run
    want = jsonl_series(cfg.output_dir)
    tb = tensorboard_series(os.path.join(cfg.output_dir, "logs", "tensorboard", "train"))
    cols = {c: read_column(out.selected, c) for c in ("loss_mask", "source", "step", "score")}
    for end in (4, 8):  # steps [end - 4, end), logged at step `end`
        rows = [i for i, s in enumerate(cols["step"]) if end - 4 <= int(s) < end]
        kept = {src: sum(int(cols["loss_mask"][i].sum()) for i in rows if cols["source"][i] == src) for src in
                {cols["source"][i] for i in rows}}
        cand = {src: sum(len(cols["loss_mask"][i]) - 1 for i in rows if cols["source"][i] == src) for src in kept}
        for src in kept:
            assert want[f"blade/kept_share/{src}"][end] == pytest.approx(kept[src] / sum(kept.values()), rel=1e-12)
            assert want[f"blade/candidate_share/{src}"][end] == pytest.approx(cand[src] / sum(cand.values()))
            assert tb[f"blade/kept_share/{src}"][end] == pytest.approx(kept[src] / sum(kept.values()), rel=1e-6)
        delta = np.concatenate([cols["score"][i][1:].astype(np.float64) for i in rows])
        delta = delta[np.isfinite(delta)]
        for q in (10, 50, 90):
            assert abs(want[f"blade/interval_delta_q{q}"][end] - np.quantile(delta, q / 100)) < 0.03
    assert sorted(want["blade/kept_share/target"]) == [4, 8]  # per interval, not per step


def test_delta_histograms_per_episode_in_tensorboard_mlflow_and_wandb(logged_run):
    """Issue 57: each episode's Δ histogram when the episode ends (W = 2, τ = 3: episodes end before steps 5 and 8,
    the last at the end, 11), its bins trimmed to those holding values: TensorBoard's histogram and MLflow's and
    W&B's tables hold the summary's counts, and as many values as the episode's candidates in the selected shards.
    An episode's end is known a step late (issue 52: its next step's record is read a step later); W&B, which drops
    a value under a step below one it has seen, still holds each table at its step."""
    from curation.core.stats import Histogram
    from curation.io.shards import read_column
    from training.blocks.loggers import histogram_rows

    cfg, out = logged_run
    with open(out.summary, encoding="utf-8") as f:
        hists = {int(e): Histogram.from_dict(h) for e, h in json.load(f)["delta_histograms"].items()}
    episodes, masks = read_column(out.selected, "episode"), read_column(out.selected, "loss_mask")
    tb = tensorboard_histograms(os.path.join(cfg.output_dir, "logs", "tensorboard", "train"), "blade/delta_histogram")
    ml = mlflow_tables("sqlite:///" + os.path.join(cfg.output_dir, "logs", "mlflow.db"), "tests",
                       "blade/delta_histogram")
    assert sorted(hists) == [0, 1, 2] and sorted(tb) == [5, 8, 11]
    assert sorted(ml) == ["episode_0000.json", "episode_0001.json", "episode_0002.json"]
    (run_dir,) = glob.glob(os.path.join(cfg.output_dir, "logs", "wandb", "offline-run-*"))
    wb = wandb_tables(run_dir, "blade/delta_histogram/")
    assert {k: step for k, (step, _) in wb.items()} == {f"blade/delta_histogram/episode_{e:04d}": s
                                                       for e, s in ((0, 5), (1, 8), (2, 11))}
    for e, step in zip((0, 1, 2), (5, 8, 11), strict=True):
        rows = histogram_rows(hists[e])
        candidates = sum(len(m) - 1 for m, ep in zip(masks, episodes, strict=True) if int(ep) == e)
        assert tb[step]["num"] == sum(c for _, _, c in rows) == hists[e].total == candidates
        assert tb[step]["bucket"] == [c for _, _, c in rows] and tb[step]["bucket_limit"] == [r for _, r, _ in rows]
        assert rows[0][2] > 0 and rows[-1][2] > 0  # the axis fitted to the data
        table = ml[f"episode_{e:04d}.json"]
        assert table["columns"] == ["left", "right", "count"] and table["data"] == rows
        assert wb[f"blade/delta_histogram/episode_{e:04d}"][1]["data"] == rows


def test_peak_memory_is_in_tensorboard_and_in_the_summary(logged_run):
    """Issue 34: the trainer's peak host memory every step (a running maximum) in TensorBoard's event file, and in
    summary.json in bytes; on this CPU run no device allocator peak."""
    cfg, out = logged_run
    tb = tensorboard_series(os.path.join(cfg.output_dir, "logs", "tensorboard", "train"))["memory/host_peak_rss_gib"]
    assert sorted(tb) == list(range(1, STEPS + 1))
    peaks = [tb[s] for s in sorted(tb)]
    assert peaks == sorted(peaks)  # a peak never falls
    with open(out.summary) as f:
        memory = json.load(f)["memory"]
    assert memory["device"] == "cpu" and memory["device_peak_allocated_bytes"] is None
    rss = memory["host_peak_rss_bytes"]
    # this process ran the training: its own peak bounds the run's; torch alone holds more than 100 MiB
    assert 100 * 2**20 < rss <= host_peak_rss()
    assert 0 < peaks[0] and peaks[-1] <= rss / 2**30 * (1 + 1e-6)  # (the summary is taken last; float32 in TB)


def test_a_rerun_continues_the_mlflow_run_of_its_output_directory(logged_run):
    """Resuming (here: a rerun of the finished run, which only reports) logs into the same MLflow run."""
    cfg, _ = logged_run
    train(cfg)
    from mlflow import MlflowClient

    client = MlflowClient("sqlite:///" + os.path.join(cfg.output_dir, "logs", "mlflow.db"))
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    # each attempt is its own offline W&B run
    assert len(glob.glob(os.path.join(cfg.output_dir, "logs", "wandb", "offline-run-*"))) == 2


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch, make_config):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(TrainConfig, default=lambda: make_config("blade"), overrides=["loggers.wandb={}"])
    with pytest.raises(ValueError) as e:
        check_installed(cfg.loggers)
    # README's form of an extra: the project is installed from its checkout, blade-curation is on no index
    assert str(e.value) == ('loggers.wandb needs the wandb package: pip install -e ".[wandb]" in the project\'s '
                            "checkout (or remove loggers.wandb)")
    with pytest.raises(ValueError, match=r"^loggers.wandb needs the wandb package"):
        train(cfg)  # before anything is written
    assert not os.path.exists(os.path.join(cfg.output_dir, "config.yaml"))
    with pytest.raises(ConfigError, match="loggers.wandb.mode"):
        load_config(TrainConfig, default=lambda: make_config("blade"), overrides=["loggers.wandb={mode: cloud}"])


def test_replay_writes_the_same_loggers(logged_run, tmp_path):
    """Replay (training on the selected shards) builds its trainer the same way: each logger holds its JSON log's
    training loss and throughput."""
    from schemas.train_config import ReplayConfig
    from training.runs.train_job import replay

    cfg, out = logged_run
    rcfg = ReplayConfig.demo_default(os.path.dirname(cfg.output_dir))
    rcfg = ReplayConfig.model_validate({
        **rcfg.model_dump(), "selected": out.selected, "validation": None, "tokenizer": None,
        "model": cfg.model.model_dump(), "output_dir": str(tmp_path / "replay"), "batch_size": cfg.batch_size,
        "threads": 1, "device": "cpu", "progress_bar": False, "throughput": {"window": 3},
        "loggers": {"tensorboard": {}, "mlflow": {"experiment": "replays"}, "wandb": {}}})
    replay(rcfg)
    want = jsonl_series(rcfg.output_dir)
    keys = ["loss/train/total", "throughput/tokens_per_sec", "throughput/kept_tokens_per_sec"]
    assert len(want["loss/train/total"]) == STEPS  # one epoch of the run's 11 steps
    (tb_dir,) = glob.glob(os.path.join(rcfg.output_dir, "logs", "tensorboard", "*"))
    tb = tensorboard_series(tb_dir)
    runs, ml = mlflow_series("sqlite:///" + os.path.join(rcfg.output_dir, "logs", "mlflow.db"), "replays")
    (run_dir,) = glob.glob(os.path.join(rcfg.output_dir, "logs", "wandb", "offline-run-*"))
    wb = wandb_series(run_dir)
    for key in keys:
        _same(tb[key], want[key], rel=1e-6)
        _same(ml[key], want[key], rel=1e-12)
        _same(wb[key], want[key], rel=1e-12)
    assert runs[0].info.status == "FINISHED" and runs[0].info.run_name == "replay"
