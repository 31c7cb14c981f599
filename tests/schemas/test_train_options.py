"""schemas.train_options: the logger sections and the model-execution flags validate on their own, and every bad
value is one line naming its key (they are not part of TrainConfig yet: see the module docstring)."""

from __future__ import annotations

import os

import pytest
from pydantic import Field

from schemas.config import ConfigError, StrictModel, load_config
from schemas.train_config import TrainConfig
from schemas.train_options import (
    LoggersConfig,
    MLflowConfig,
    ModelExecutionConfig,
    TensorBoardConfig,
    WandbConfig,
)


class Job(StrictModel):
    """A stand-in top level, as TrainConfig will hold them."""

    loggers: LoggersConfig = Field(default_factory=LoggersConfig)
    model: ModelExecutionConfig = Field(default_factory=ModelExecutionConfig)


def load(*overrides: str) -> Job:
    return load_config(Job, default=Job, overrides=list(overrides))


def test_defaults_are_off():
    job = load()
    assert job.loggers.enabled == []
    assert job.model.activation_checkpointing is False and job.model.compile is False


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


def test_not_part_of_train_config_yet():
    """A key the trainer would ignore must not validate; adding keys changes run records (resume compares them)."""
    fields = TrainConfig.model_fields
    assert "loggers" not in fields
    assert not {"compile", "activation_checkpointing"} & set(TrainConfig.model_fields["model"].annotation.model_fields)
