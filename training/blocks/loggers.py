"""The experiment loggers of a run (``loggers:``): Composer's own TensorBoard, MLflow and W&B logger destinations,
next to the JSON-lines log (``logs/metrics.jsonl``). Every metric the trainer logs reaches each of them with the
same name and step.

* **tensorboard** (``TensorboardLogger``): event files under ``log_dir/<run name>/`` (``train`` or ``replay``),
  flushed every ``checkpoint.interval`` steps, after each evaluation and at the end.
* **mlflow** (``MLFlowLogger``): a run in ``experiment`` of the local store ``tracking_uri`` (SQLite by default: no
  server), tagged ``blade.output_dir``; a resumed training run continues the MLflow run of its output directory.
  Every step's value is recorded (Composer's default skips a value equal to the last one).
* **wandb** (``WandBLogger``, :class:`StepOrderedWandB`): offline by default, a run directory under ``dir/wandb/``
  (``wandb sync`` uploads it later); each attempt of a resumed run is its own offline run. W&B drops a value logged
  under a step below one it has seen; a step's loss is read (and logged, under its own step) a step later
  (:mod:`training.blocks.step_reads`), so W&B's values are handed over in step order, a step's once a later step's
  have come (the rest at the end).

A package that is missing is one line naming the extra to install (:func:`check_installed`), raised before the
run starts. Under data-parallel training only rank 0 writes: the JSON-lines and TensorBoard destinations exist on
rank 0 only; MLflow's and W&B's exist on every rank (their start is a collective) and write on rank 0.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from composer.loggers import MLFlowLogger, TensorboardLogger, WandBLogger

from schemas.train_options import LOGGER_PACKAGES, LoggersConfig

__all__ = ["check_installed", "experiment_loggers", "mlflow_resumption", "OUTPUT_DIR_TAG", "StepOrderedWandB"]

#: MLflow tag naming the run's output directory (a resumed run continues the MLflow run that has it).
OUTPUT_DIR_TAG = "blade.output_dir"


def check_installed(cfg: LoggersConfig) -> None:
    """Raise ``ValueError`` naming the extra to install for the first logger whose package is missing, in README's
    form (the project is installed from its checkout, not from a package index)."""
    for name in cfg.enabled:
        package = LOGGER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f'loggers.{name} needs the {package} package: pip install -e ".[{name}]" in the '
                             f"project's checkout (or remove loggers.{name})")


def experiment_loggers(cfg: LoggersConfig, output_dir: str, *, rank: int, flush_interval: int) -> list[Any]:
    """Composer logger destinations of the enabled loggers for the process of ``rank`` (module docstring)."""
    check_installed(cfg)
    out: list[Any] = []
    name = os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    if cfg.tensorboard is not None and rank == 0:
        out.append(TensorboardLogger(log_dir=cfg.tensorboard.resolved_log_dir(output_dir),
                                     flush_interval=flush_interval))
    if cfg.mlflow is not None:
        out.append(MLFlowLogger(
            experiment_name=cfg.mlflow.experiment, run_name=cfg.mlflow.run_name or name,
            tracking_uri=cfg.mlflow.resolved_tracking_uri(output_dir), rank_zero_only=True, log_system_metrics=False,
            tags={OUTPUT_DIR_TAG: os.path.abspath(output_dir)}, logging_buffer_seconds=None,
            log_duplicated_metric_every_n_steps=1, flush_interval=flush_interval))
    if cfg.wandb is not None:
        directory = cfg.wandb.resolved_dir(output_dir)
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
        out.append(StepOrderedWandB(project=cfg.wandb.project, entity=cfg.wandb.entity, name=name, rank_zero_only=True,
                               init_kwargs={"mode": cfg.wandb.mode, "dir": directory}))
    return out


class StepOrderedWandB(WandBLogger):
    """Composer's W&B destination, its values handed to W&B in step order (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[int, dict[str, Any]] = {}

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if step is None:
            super().log_metrics(metrics, step)
            return
        self._held.setdefault(int(step), {}).update(metrics)
        for s in sorted(k for k in self._held if k < step - 1):  # (a value comes at most a step late)
            super().log_metrics(self._held.pop(s), s)

    def flush_held(self) -> None:
        for s in sorted(self._held):
            super().log_metrics(self._held.pop(s), s)

    def fit_end(self, state: Any, logger: Any) -> None:
        self.flush_held()

    def close(self, state: Any, logger: Any) -> None:
        self.flush_held()
        super().close(state, logger)


@contextmanager
def mlflow_resumption(cfg: LoggersConfig, output_dir: str, *, resuming: bool, rank: int) -> Iterator[None]:
    """While the trainer starts (``with`` around ``Trainer(...)``): a resumed run continues the newest MLflow run
    tagged with its output directory (rank 0, which writes), through Composer's documented ``MLFLOW_RUN_ID`` (set
    only meanwhile)."""
    run_id = _mlflow_run_of(cfg, output_dir) if resuming and rank == 0 and cfg.mlflow is not None else None
    if run_id is None:
        yield
        return
    previous = os.environ.get("MLFLOW_RUN_ID")
    os.environ["MLFLOW_RUN_ID"] = run_id
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_RUN_ID", None)
        else:
            os.environ["MLFLOW_RUN_ID"] = previous


def _mlflow_run_of(cfg: LoggersConfig, output_dir: str) -> str | None:
    from mlflow import MlflowClient

    assert cfg.mlflow is not None
    client = MlflowClient(cfg.mlflow.resolved_tracking_uri(output_dir))
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    if experiment is None:
        return None
    mine = os.path.abspath(output_dir)  # compared here, not in a filter string (a path may hold quotes)
    for run in client.search_runs([experiment.experiment_id], max_results=1000, order_by=["attributes.start_time DESC"]):
        if run.data.tags.get(OUTPUT_DIR_TAG) == mine:
            return run.info.run_id
    return None
