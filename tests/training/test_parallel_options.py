"""Issue 22 under data-parallel training (2 Ray Train workers, gloo): activation checkpointing (DDP: the HF model's)
leaves the run equal to the single-process one, and rank 0 alone writes the experiment loggers and the throughput
(the whole group's tokens). FSDP with Composer's activation checkpointing is checked by the FSDP runs of
tests/training/test_parallel.py (one group run for both)."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from safetensors.torch import load_file

from curation.io.shards import read_column
from schemas.train_config import TrainConfig
from training.runs.train_job import train

from .logger_series import mlflow_series, require_extras, tensorboard_series, wandb_series

pytestmark = [pytest.mark.slow, pytest.mark.ray]

STEPS, B, L, W = 12, 8, 128, 2


@pytest.fixture
def single(single_blade_12):
    """The single-process run the group is compared with (tests/training/conftest.py: 12 steps)."""
    assert STEPS == 12
    return single_blade_12


def _checkpointed(cfg: TrainConfig) -> TrainConfig:
    return TrainConfig.model_validate({**cfg.model_dump(),
                                       "model": {**cfg.model.model_dump(), "activation_checkpointing": True}})


def _masks(out: dict) -> np.ndarray:
    return np.stack(read_column(out.selected, "loss_mask")).astype(bool)


def _same_run(single: dict, group: dict) -> None:
    ma, mb = _masks(single), _masks(group)
    first = slice(W * B, (W + 1) * B)  # the first selecting step: exactly the single-process masks
    assert np.array_equal(ma[first], mb[first]) and (ma == mb).mean() >= 0.99
    wa, wb = load_file(single.final_weights), load_file(group.final_weights)
    assert wa.keys() == wb.keys() and max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4


def test_ddp_with_checkpointing_and_every_logger_writes_once(make_config, ray_local, single):
    require_extras()
    cfg = _checkpointed(make_config(
        "blade", "ddp", max_steps=STEPS, parallel={"workers": 2}, throughput={"window": 3, "peak_flops": 1e11},
        loggers={"tensorboard": {}, "mlflow": {"experiment": "ddp"}, "wandb": {}}))
    group = train(cfg)
    _same_run(single, group)

    logs = os.path.join(cfg.output_dir, "logs")
    assert os.listdir(os.path.join(logs, "tensorboard")) == ["train"]  # rank 0's event files only
    tb = tensorboard_series(os.path.join(logs, "tensorboard", "train"))
    runs, ml = mlflow_series("sqlite:///" + os.path.join(logs, "mlflow.db"), "ddp")
    (run_dir,) = glob.glob(os.path.join(logs, "wandb", "offline-run-*"))  # one W&B run, not one per rank
    wb = wandb_series(run_dir)
    assert len(runs) == 1
    for series in (tb, ml, wb):  # one value per step, the same everywhere
        assert sorted(series["loss/train/total"]) == list(range(STEPS))
        assert series["blade/param_distance"].keys() == tb["blade/param_distance"].keys()
        assert series["blade/param_distance"] == pytest.approx(tb["blade/param_distance"], rel=1e-6)

    # rank 0's values only: as many points as steps (two writers would log each step twice)
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(logs, "tensorboard", "train"), size_guidance={"scalars": 0})
    acc.Reload()
    assert len(acc.Scalars("loss/train/total")) == STEPS
    client = MlflowClient("sqlite:///" + os.path.join(logs, "mlflow.db"))
    assert len(client.get_metric_history(runs[0].info.run_id, "loss/train/total")) == STEPS

    s = json.load(open(group.summary, encoding="utf-8"))
    tp = s["throughput"]
    assert (s["world_size"], tp["tokens"]) == (2, STEPS * B * L)  # the group's tokens, counted once
    one = json.load(open(single.summary, encoding="utf-8"))["throughput"]
    # each rank scores its own half of the rows and repeats every refresh
    f = tp["forward_flops_per_token"]
    assert one["reference_flops_per_device"] - tp["reference_flops_per_device"] == f * (STEPS - W) * (B // 2) * L
    assert tp["mfu"] == pytest.approx(tp["proxy_flops"] / 2 / tp["train_seconds"] / 1e11)
