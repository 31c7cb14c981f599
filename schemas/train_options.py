"""Training options of issue #22: experiment loggers and throughput reporting (``loggers:`` and ``throughput:`` of
:class:`~schemas.train_config.TrainConfig` and :class:`~schemas.train_config.ReplayConfig`; the trainer of
``jobs/curate_and_train.py`` is its ``train:`` section). How the model runs (``model.activation_checkpointing``,
``model.compile``) is :class:`~schemas.train_config.TrainModelConfig`.

No torch here. Both sections are operational (:data:`~schemas.records.OPERATIONAL`): what is logged where cannot
change what a run computes, so a rerun may add a logger and still resume. Runs recorded before these keys existed
resume too: a key absent from a record that holds its default counts as equal (:func:`schemas.records.config_diff`).

The loggers are optional extras; each is off unless its section is present, and written by rank 0 only:

- ``tensorboard``: event files (``tensorboard`` package), default ``output_dir/logs/tensorboard``;
- ``mlflow``: a local store and no server: ``sqlite:///output_dir/logs/mlflow.db`` by default, or a
  ``file:`` / ``sqlite:`` URI or a plain directory (file store); ``http(s)://`` only when asked;
- ``wandb``: ``mode: offline`` by default (runs are written under ``dir`` and can be synced later with
  ``wandb sync``); ``online`` needs a login and the network.

Checked on Python 3.11 and 3.13 next to our pins (torch 2.7.0, composer 0.32.1), through Composer's own
``TensorboardLogger``, ``MLFlowLogger`` and ``WandBLogger``, offline: tensorboard 2.21.0, mlflow 3.17.2
(``sqlite:///`` store, no server; it pulls pyarrow below 26) and wandb 0.28.2 in offline mode. wandb 0.29 and
later removed ``Run.get_url``, which Composer 0.32.1's ``WandBLogger`` calls at init: the wandb extra needs
``wandb<0.29``.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from schemas.config import StrictModel

__all__ = [
    "LOGGER_PACKAGES",
    "TensorBoardConfig",
    "MLflowConfig",
    "WandbConfig",
    "LoggersConfig",
    "ThroughputConfig",
]

#: logger section → the package it needs (installed by the optional extra of the same name).
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}

#: tracking URI schemes accepted by ``loggers.mlflow.tracking_uri`` (a plain path is a file store).
MLFLOW_SCHEMES = ("file", "sqlite", "http", "https")


def _non_empty(v: str | None) -> str | None:
    if v is not None and not v.strip():
        raise ValueError("must not be empty (leave the key out for its default)")
    return v


class TensorBoardConfig(StrictModel):
    """TensorBoard event files."""

    log_dir: str | None = Field(None, description="event-file directory; None = output_dir/logs/tensorboard")

    @field_validator("log_dir")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return _non_empty(v)

    def resolved_log_dir(self, output_dir: str) -> str:
        return self.log_dir or os.path.join(output_dir, "logs", "tensorboard")


class MLflowConfig(StrictModel):
    """MLflow tracking into a local store (no server needed)."""

    tracking_uri: str | None = Field(
        None, description="sqlite:///PATH, file:PATH or a directory (file store), or http(s)://HOST of a server; "
        "None = sqlite:///output_dir/logs/mlflow.db"
    )
    experiment: str = Field("blade", description="MLflow experiment name")
    run_name: str | None = Field(None, description="MLflow run name; None = the output directory's name")

    @field_validator("experiment", "run_name")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return _non_empty(v)

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("must not be empty (leave the key out for sqlite:///output_dir/logs/mlflow.db)")
        scheme, sep, rest = v.partition(":")
        if sep and len(scheme) > 1:  # a scheme (not a Windows drive letter or a plain path)
            if scheme not in MLFLOW_SCHEMES:
                raise ValueError(f"scheme {scheme!r} is not one of {', '.join(MLFLOW_SCHEMES)} "
                                 "(or give a plain directory for a file store)")
            if scheme == "sqlite" and not rest.startswith("///"):
                raise ValueError(f"{v!r}: a SQLite store is sqlite:///RELATIVE/PATH.db or "
                                 "sqlite:////ABSOLUTE/PATH.db")
            if scheme in ("http", "https") and not rest.startswith("//"):
                raise ValueError(f"{v!r}: expected {scheme}://HOST[:PORT]")
        return v

    def resolved_tracking_uri(self, output_dir: str) -> str:
        if self.tracking_uri is not None:
            return self.tracking_uri
        return "sqlite:///" + os.path.abspath(os.path.join(output_dir, "logs", "mlflow.db"))


class WandbConfig(StrictModel):
    """Weights & Biases, offline unless asked."""

    project: str = Field("blade-curation", description="W&B project")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: written under dir only (upload later with `wandb sync`); online: needs "
        "a login and the network"
    )
    dir: str | None = Field(None, description="where W&B writes its run files; None = output_dir/logs")
    entity: str | None = Field(None, description="W&B entity (team or user); None = the login's default")

    @field_validator("project", "dir", "entity")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return _non_empty(v)

    def resolved_dir(self, output_dir: str) -> str:
        return self.dir or os.path.join(output_dir, "logs")


class LoggersConfig(StrictModel):
    """Experiment loggers next to the run's own summary.json; a section that is absent (null) is off."""

    tensorboard: TensorBoardConfig | None = Field(None, description="TensorBoard event files (extra: tensorboard)")
    mlflow: MLflowConfig | None = Field(None, description="MLflow tracking in a local store (extra: mlflow)")
    wandb: WandbConfig | None = Field(None, description="Weights & Biases, offline by default (extra: wandb)")

    @property
    def enabled(self) -> list[str]:
        """Names of the loggers that are on, in a fixed order."""
        return [name for name in LOGGER_PACKAGES if getattr(self, name) is not None]


class ThroughputConfig(StrictModel):
    """Tokens/s, kept tokens/s, MFU and the time left, in the logs, the progress bar and ``summary.json``."""

    peak_flops: float | None = Field(
        None, gt=0, description="peak FLOP/s of one device at the run's precision, for MFU; None = Composer's table "
        "of common GPUs (A100, H100, H200, ...; none for a CPU: MFU is then not reported)")
    window: int = Field(20, ge=1, description="steps of the rolling tokens/s and MFU (Composer's SpeedMonitor)")
    log_interval: int = Field(
        10, ge=1, description="with progress_bar, when stdout or stderr is not a terminal (`> log`, ray job submit): "
        "a line every this many steps with step, loss, tokens/s, kept/s, MFU and ETA, instead of the bar (which a "
        "log cuts at 120 columns)")
