"""schemas.train_options and TrainModelConfig: the logger and throughput sections and the model-execution flags, in
the training configs; every bad value is one line naming its key."""

from __future__ import annotations

import os

import pytest

from schemas.config import ConfigError, load_config
from schemas.engine_config import CurateAndTrainConfig
from schemas.train_config import ModelConfig, ReplayConfig, TrainConfig, TrainModelConfig, demo_model_config
from schemas.train_options import MLflowConfig, TensorBoardConfig, WandbConfig


def load(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, default=TrainConfig.demo_default, overrides=list(overrides))


def test_defaults_are_off():
    job = load()
    assert job.loggers.enabled == []
    assert job.model.activation_checkpointing is False and job.model.compile is False
    assert job.throughput.peak_flops is None and job.throughput.window == 20


def test_sections_turn_loggers_on_with_local_defaults(tmp_path):
    job = load("loggers.tensorboard={}", "loggers.mlflow={}", "loggers.wandb={}", "model.compile=true",
               "model.activation_checkpointing=true")
    out = str(tmp_path / "run")
    assert job.loggers.enabled == ["tensorboard", "mlflow", "wandb"]
    assert job.loggers.tensorboard.resolved_log_dir(out) == os.path.join(out, "logs", "tensorboard")
    assert job.loggers.mlflow.resolved_tracking_uri(out) == "sqlite:///" + os.path.join(out, "logs", "mlflow.db")
    assert job.loggers.mlflow.experiment == "blade"
    assert job.loggers.wandb.mode == "offline" and job.loggers.wandb.resolved_dir(out) == os.path.join(out, "logs")
    assert job.model.compile and job.model.activation_checkpointing


@pytest.mark.parametrize("uri", ["sqlite:///mlruns.db", "sqlite:////abs/mlflow.db", "file:///tmp/mlruns", "mlruns",
                                 "/abs/mlruns", "http://127.0.0.1:5000", "https://mlflow.example.org"])
def test_mlflow_tracking_uris_accepted(uri):
    assert MLflowConfig(tracking_uri=uri).resolved_tracking_uri("unused") == uri


@pytest.mark.parametrize("override,key,reason", [
    ("loggers.mlflow={tracking_uri: 'ftp://host/x'}", "loggers.mlflow.tracking_uri", "scheme 'ftp' is not one of"),
    ("loggers.mlflow={tracking_uri: 'sqlite:mlflow.db'}", "loggers.mlflow.tracking_uri", "sqlite:///"),
    ("loggers.mlflow={tracking_uri: 'http:host'}", "loggers.mlflow.tracking_uri", "expected http://HOST"),
    ("loggers.mlflow={tracking_uri: ' '}", "loggers.mlflow.tracking_uri", "must not be empty"),
    ("loggers.mlflow={experiment: ''}", "loggers.mlflow.experiment", "must not be empty"),
    ("loggers.wandb={mode: disabled}", "loggers.wandb.mode", "'offline' or 'online'"),
    ("loggers.wandb={project: ''}", "loggers.wandb.project", "must not be empty"),
    ("loggers.wandb={dir: 3}", "loggers.wandb.dir", "valid string"),
    ("loggers.tensorboard={logdir: x}", "loggers.tensorboard.logdir", "unknown key"),
    ("loggers.neptune={}", "loggers.neptune", "unknown key"),
    ("loggers.tensorboard=true", "loggers.tensorboard", "TensorBoardConfig"),
    ("model.compile=maybe", "model.compile", "valid boolean"),
    ("model.activation_checkpointing=1", "model.activation_checkpointing", "valid boolean"),
    ("throughput.peak_flops=0", "throughput.peak_flops", "greater than 0"),
    ("throughput.window=0", "throughput.window", "greater than or equal to 1"),
])
def test_bad_values_are_one_line_naming_the_key(override, key, reason):
    with pytest.raises(ConfigError) as e:
        load(override)
    errors = str(e.value).splitlines()[1:]  # after "invalid config (<origin>):"
    assert len(errors) == 1, errors
    assert errors[0].strip().startswith(f"{key}: ") and reason in errors[0], errors[0]


def test_models_construct_directly():
    assert TensorBoardConfig(log_dir="tb").resolved_log_dir("out") == "tb"
    assert WandbConfig(mode="online", dir="w").resolved_dir("out") == "w"


def test_every_training_config_has_the_sections():
    """train, replay and the main job's trainer (its train: section) take the same keys."""
    on = {"loggers": {"tensorboard": {}, "mlflow": {"experiment": "x"}}, "throughput": {"peak_flops": 312e12},
          "model": {**demo_model_config().model_dump(), "compile": True, "activation_checkpointing": True}}
    for cfg in (TrainConfig.demo_default(), ReplayConfig.demo_default(), CurateAndTrainConfig.demo_default().train):
        got = type(cfg).model_validate({**cfg.model_dump(), **on})
        assert got.loggers.enabled == ["tensorboard", "mlflow"] and got.throughput.peak_flops == 312e12
        assert got.model.compile and got.model.activation_checkpointing


def test_a_plain_model_config_is_a_train_model_with_both_options_off():
    cfg = TrainConfig.demo_default()
    assert isinstance(cfg.model, TrainModelConfig)  # demo_model_config() is a plain ModelConfig
    compiled = TrainModelConfig.model_validate({**cfg.model.model_dump(), "compile": True})
    # what the engine's workers build: the architecture, without how the trainer runs it
    assert type(compiled.architecture) is ModelConfig
    assert compiled.architecture.model_dump() == demo_model_config().model_dump()
