"""The experiment loggers of a run (``loggers:``): Composer's own TensorBoard, MLflow and W&B logger destinations,
next to the JSON-lines log (``logs/metrics.jsonl``). Every metric the trainer logs reaches each of them with the
same name and step.

* **tensorboard** (``TensorboardLogger``): event files under ``log_dir/<run name>/`` (``train`` or ``replay``),
  flushed every ``checkpoint.interval`` steps, after each evaluation and at the end.
* **mlflow** (``MLFlowLogger``): a run in ``experiment`` of the local store ``tracking_uri`` (SQLite by default: no
  server; a new experiment's artifacts in ``mlflow-artifacts/`` beside the database), tagged ``blade.output_dir``;
  a resumed training run continues the MLflow run of its output directory.
  Every step's value is recorded (Composer's default skips a value equal to the last one).
* **wandb** (``WandBLogger``, :class:`StepOrderedWandB`): offline by default, a run directory under ``dir/wandb/``
  (``wandb sync`` uploads it later); each attempt of a resumed run is its own offline run. W&B drops a value logged
  under a step below one it has seen; a step's loss is read (and logged, under its own step) a step later
  (:mod:`training.blocks.step_reads`), so W&B's values (an episode's histogram table too) are handed over in step
  order, a step's once a later step's have come (the rest at the end).

Histograms (:func:`log_histogram`, e.g. each episode's Δ) go to TensorBoard as histograms and, through Composer's
``log_table``, to MLflow (a JSON table artifact) and W&B (a table), over the bins from the first to the last one
holding a value (the axis fitted to the data). :class:`SelectionFigures` holds what the selection's statistics give
the loggers beyond each step's scalars: per log interval, per finished episode.

A package that is missing is one line naming the extra to install (:func:`check_installed`), raised before the
run starts. Under data-parallel training only rank 0 writes: the JSON-lines and TensorBoard destinations exist on
rank 0 only; MLflow's and W&B's exist on every rank (their start is a collective) and write on rank 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger, MLFlowLogger, TensorboardLogger, WandBLogger
from torch import Tensor

from curation.core.stats import Histogram, IntervalStats, SourceCounts
from schemas.train_options import LOGGER_PACKAGES, LoggersConfig

__all__ = ["check_installed", "experiment_loggers", "mlflow_resumption", "OUTPUT_DIR_TAG", "log_histogram",
           "histogram_rows", "SelectionFigures", "StepOrderedWandB"]

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
        if rank == 0:
            mlflow_artifacts_beside_store(cfg.mlflow.resolved_tracking_uri(output_dir), cfg.mlflow.experiment)
        out.append(MLFlowLogger(
            experiment_name=cfg.mlflow.experiment, run_name=cfg.mlflow.run_name or name,
            tracking_uri=cfg.mlflow.resolved_tracking_uri(output_dir), rank_zero_only=True, log_system_metrics=False,
            tags={OUTPUT_DIR_TAG: os.path.abspath(output_dir)}, logging_buffer_seconds=None,
            log_duplicated_metric_every_n_steps=1, flush_interval=flush_interval))
    if cfg.wandb is not None:
        directory = cfg.wandb.resolved_dir(output_dir)
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
        out.append(StepOrderedWandB(project=cfg.wandb.project, entity=cfg.wandb.entity, name=name,
                                    rank_zero_only=True, init_kwargs={"mode": cfg.wandb.mode, "dir": directory}))
    return out


def mlflow_artifacts_beside_store(uri: str, experiment: str) -> str | None:
    """For a SQLite store (the default, ``output_dir/logs/mlflow.db``): create ``experiment`` with its artifacts in
    ``mlflow-artifacts/`` beside the database (MLflow's default for a new experiment is ``./mlruns`` of whatever
    directory the job runs in: the Δ histogram tables landed in the user's checkout). Returns that folder; ``None``
    for other stores (a ``file:`` store keeps artifacts in itself, a server decides) or an experiment made before."""
    if not uri.startswith("sqlite:///"):
        return None
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    if client.get_experiment_by_name(experiment) is not None:
        return None
    folder = os.path.join(os.path.dirname(os.path.abspath(uri[len("sqlite:///"):])), "mlflow-artifacts")
    client.create_experiment(experiment, artifact_location=Path(folder).as_uri())
    return folder


class StepOrderedWandB(WandBLogger):
    """Composer's W&B destination, its values handed to W&B in step order (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[int, dict[str, object]] = {}

    def log_metrics(self, metrics: dict[str, float | Tensor], step: int | None = None) -> None:
        if step is None:
            super().log_metrics(metrics, step)
            return
        self._hold(int(step), metrics)

    def log_table(self, columns: list[str], rows: list[list[float | int | str]], name: str = "Table",
                  step: int | None = None) -> None:
        """A table (an episode's Δ histogram, logged when its record arrives, a step late) in the same step order."""
        if step is None:
            super().log_table(columns, rows, name, step)
            return
        import wandb

        self._hold(int(step), {name: wandb.Table(columns=columns, rows=rows)})

    def _hold(self, step: int, values: Mapping[str, object]) -> None:
        self._held.setdefault(step, {}).update(values)
        for s in sorted(k for k in self._held if k < step - 1):  # (a value comes at most a step late)
            super().log_metrics(self._held.pop(s), s)

    def flush_held(self) -> None:
        for s in sorted(self._held):
            super().log_metrics(self._held.pop(s), s)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush_held()

    def close(self, state: State, logger: Logger) -> None:
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


def histogram_rows(hist: Histogram) -> list[list[float]]:
    """``[left, right, count]`` of the bins from the first to the last non-empty one (the under- and overflow bins
    given one bin width beyond the outer edges)."""
    e = list(hist.edges)
    width = e[1] - e[0] if len(e) > 1 else 1.0
    bounds = [e[0] - width, *e, e[-1] + width]
    nonzero = [i for i, c in enumerate(hist.counts) if c]
    if not nonzero:
        return []
    return [[bounds[i], bounds[i + 1], float(hist.counts[i])] for i in range(nonzero[0], nonzero[-1] + 1)]


def log_histogram(logger: Logger, tag: str, hist: Histogram, *, step: int, table: str) -> None:
    """``hist`` to every destination that shows histograms: TensorBoard's ``add_histogram_raw`` under ``tag``, and
    Composer's ``log_table`` (``table``: MLflow's artifact ``<table>.json``, a W&B table) as rows ``left, right,
    count``; the bins trimmed to those holding values."""
    rows = histogram_rows(hist)
    if not rows:
        return
    for dest in logger.destinations:
        if isinstance(dest, TensorboardLogger) and dest.writer is not None:
            centers = [(a + b) / 2 for a, b, _ in rows]
            counts = [c for _, _, c in rows]
            dest.writer.add_histogram_raw(
                tag, min=rows[0][0], max=rows[-1][1], num=sum(counts),
                sum=sum(c * x for c, x in zip(counts, centers, strict=True)),
                sum_squares=sum(c * x * x for c, x in zip(counts, centers, strict=True)),
                bucket_limits=[b for _, b, _ in rows], bucket_counts=counts, global_step=step)
    logger.log_table(columns=["left", "right", "count"], rows=rows, name=table, step=step)


class SelectionFigures:
    """The selection's figures for the loggers beyond each step's scalars (fed by
    :class:`training.blocks.callbacks.SelectionStats` from each step's host record; checkpointed with it):

    * every ``log_interval`` steps, each source's share of the interval's kept tokens and of its candidates and the
      interval's Δ quantiles (:class:`~curation.core.stats.IntervalStats`);
    * each episode's Δ histogram once the episode has ended (:func:`log_histogram`, at the step after its last), the
      last one when the run reaches ``max_steps`` (a stopped run logs it when the resumed run finishes it).
    """

    def __init__(self, *, log_interval: int | None, max_steps: int | None) -> None:
        self.log_interval, self.max_steps = log_interval, max_steps
        self.interval = IntervalStats()
        self.logged: set[int] = set()  # episodes whose histogram went to the loggers

    def add(self, step: int, counts: SourceCounts, delta: Tensor | None = None,
            valid: Tensor | None = None) -> dict[str, float]:
        """Step ``step``'s counts (and Δ at its valid positions); the interval's scalars when it ends there."""
        self.interval.add(counts, delta, valid)
        if self.log_interval and (step + 1) % self.log_interval == 0:
            return self.interval.scalars()
        return {}

    def histograms(self, logger: Logger, hists: dict[int, Histogram], *, before: int | None, step: int) -> None:
        """The histograms of the episodes before ``before`` (all: None) not logged yet, at ``step``."""
        for e in sorted(hists):
            if e not in self.logged and (before is None or e < before):
                log_histogram(logger, "blade/delta_histogram", hists[e], step=step,
                              table=f"blade/delta_histogram/episode_{e:04d}")
                self.logged.add(e)

    def finish(self, logger: Logger, hists: dict[int, Histogram], *, steps: int) -> None:
        """At the end of a fit of ``steps`` steps: the last episode's histogram when the run is complete."""
        if self.max_steps is not None and steps >= self.max_steps:
            self.histograms(logger, hists, before=None, step=steps)

    def state_dict(self) -> str:
        i = self.interval
        return json.dumps({"valid": i.counts.valid, "kept": i.counts.kept, "histogram": i.histogram.to_dict(),
                           "steps": i.steps, "logged": sorted(self.logged)})

    def load_state_dict(self, state: str) -> None:
        d = json.loads(state)
        self.interval = IntervalStats(SourceCounts(d["valid"], d["kept"]), Histogram.from_dict(d["histogram"]),
                                      d["steps"])
        self.logged = {int(e) for e in d["logged"]}
