"""What the experiment loggers wrote, read back with each tool's own reader, as ``key → step → value``: shared by
the logger tests (``test_loggers``, ``test_parallel_options``). Each reader imports its tool when called, so
this module imports without the optional extras (a test module that skips itself must not be imported by
another: its skip would end the other's collection)."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

import pytest

#: The extras the read-back tests need (``pip install -e ".[tensorboard,mlflow,wandb]"``).
EXTRAS = ("tensorboard", "mlflow", "wandb")


def require_extras() -> None:
    """Skip the calling test (or fixture), with the reason, unless every logger extra is installed."""
    for name in EXTRAS:
        pytest.importorskip(name, reason=f"the {name} extra is not installed (pip install -e '.[{name}]')")


SOURCES = ("general", "noise", "target")
#: the metrics every logger must hold, as the trainer names them
KEYS = ["loss/train/total", "metrics/eval/TokenLoss", *(f"blade/kept_fraction/{s}" for s in SOURCES),
        "blade/param_distance", "blade/refresh_seconds", "time/refresh_seconds", "time/score_seconds",
        "throughput/tokens_per_sec", "throughput/kept_tokens_per_sec", "time/eta_seconds",
        "memory/host_peak_rss_gib", *(f"blade/kept_share/{s}" for s in SOURCES),
        *(f"blade/candidate_share/{s}" for s in SOURCES), "blade/interval_delta_q10", "blade/interval_delta_q50",
        "blade/interval_delta_q90"]


def series(rows: list[tuple[int, str, float]]) -> dict[str, dict[int, float]]:
    """``(step, key, value)`` rows → key → step → value (the last value of a key logged twice at a step)."""
    out: dict[str, dict[int, float]] = {}
    for step, key, value in rows:
        out.setdefault(key, {})[int(step)] = float(value)
    return out


def jsonl_series(out: str) -> dict[str, dict[int, float]]:
    with open(os.path.join(out, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return series([(r["step"], k, v) for r in lines if "step" in r for k, v in r.items()
                   if k != "step" and isinstance(v, int | float)])


def tensorboard_series(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return series([(e.step, tag, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)])


def mlflow_series(uri: str, experiment: str) -> tuple[list, dict[str, dict[int, float]]]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = [(m.step, key, m.value) for key in KEYS for m in client.get_metric_history(runs[0].info.run_id, key)]
    return runs, series(history)


def wandb_series(run_dir: str) -> dict[str, dict[int, float]]:
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    store = datastore.DataStore()
    store.open_for_scan(path)
    rows = []
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            rows += [(step, i.key or "/".join(i.nested_key), json.loads(i.value_json)) for i in record.history.item
                     if not (i.key or "/".join(i.nested_key)).startswith("_")]
    return series([r for r in rows if isinstance(r[2], int | float)])


def wandb_tables(run_dir: str, prefix: str) -> dict[str, tuple[int, dict]]:
    """key → (step, the table: ``columns``, ``data``) of the W&B tables whose key starts with ``prefix`` in the
    offline run ``run_dir`` (the history holds a table as ``<key>/_type``, ``<key>/path`` (its file under
    ``files/``), ...)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    store = datastore.DataStore()
    store.open_for_scan(path)
    fields: dict[tuple[int, str], dict[str, Any]] = {}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        for i in record.history.item:
            key = i.key or "/".join(i.nested_key)
            if key.startswith(prefix):
                table, _, name = key.rpartition("/")
                fields.setdefault((record.history.step.num, table), {})[name] = json.loads(i.value_json)
    out = {}
    for (step, table), f in fields.items():
        assert f["_type"] == "table-file" and table not in out, (table, f)
        with open(os.path.join(run_dir, "files", f["path"]), encoding="utf-8") as fh:
            out[table] = (step, json.load(fh))
    return out


def tensorboard_histograms(log_dir: str, tag: str) -> dict[int, dict]:
    """step → TensorBoard's histogram of ``tag`` (``bucket_limit``, ``bucket``, ``num``, ``min``, ``max``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"histograms": 0})
    acc.Reload()
    return {e.step: {"bucket_limit": list(e.histogram_value.bucket_limit), "bucket": list(e.histogram_value.bucket),
                     "num": e.histogram_value.num, "min": e.histogram_value.min, "max": e.histogram_value.max}
            for e in acc.Histograms(tag)}


def mlflow_tables(uri: str, experiment: str, folder: str) -> dict[str, dict]:
    """file name → the JSON table artifact (``columns``, ``data``) under ``folder`` of the experiment's run."""
    import tempfile

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    # the artifacts beside the SQLite store (MLflow's default: ./mlruns of the job's working directory)
    assert exp.artifact_location == Path(os.path.dirname(uri[len("sqlite:///"):]), "mlflow-artifacts").as_uri()
    run = client.search_runs([exp.experiment_id])[0]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for art in client.list_artifacts(run.info.run_id, folder):
            with open(client.download_artifacts(run.info.run_id, art.path, tmp), encoding="utf-8") as f:
                out[os.path.basename(art.path)] = json.load(f)
    return out
