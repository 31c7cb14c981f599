"""Composer callbacks of a BLADE run: selected-token shard writer, selection statistics, JSON log.

* :class:`SelectedShardWriter` writes exactly what each proxy step trained on (``tokens``,
  ``loss_mask``, ``score`` = Δ as float16, ``source``, ``step``, ``episode``) as selected-token
  shards, one part per ``flush_every`` steps, with a manifest (per-source counts incl. kept tokens,
  completion records). Its state (finished parts + rows not yet flushed) is in the checkpoint; on
  resume, parts written after that checkpoint are removed first, so no step is written twice. A run
  extended past the ``max_steps`` it finished with reopens the short part flushed there, so its parts are
  those of a run that had the larger ``max_steps`` from the start.
* :class:`SelectionStats` logs kept fraction per source, Δ quantiles, ‖u − w‖ and the validation
  loss, and accumulates what the run summary needs (also checkpointed); every ``log_interval`` steps each source's
  share of the interval's kept tokens and of its candidates and the interval's Δ quantiles, and each finished
  episode's Δ histogram (:class:`training.blocks.loggers.SelectionFigures`).
* :class:`JSONLinesLogger` is a Composer logger destination writing every metric as a JSON line.
* :class:`StepTimes` records each step's wall and CPU time (``jobs/bench_scaling.py``).

They receive what a step trained on from a :class:`StepSelections` they subscribe to: the BLADE algorithm
(:class:`training.selection.BladeAlgorithm`) or the engine-fed trainer's record
(:class:`training.selection.EngineSelection`), which deliver each step's record a step later
(:class:`training.blocks.step_reads.StepReads`: the one host read of a steady step) and the step still pending when
a checkpoint's state is taken (``state_dict`` drains it first).
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from composer.core import Callback, State
from composer.loggers import Logger, LoggerDestination

from curation.core.divergence import PATIENCE, check_proxy
from curation.core.policies import ScoreKind, SelectionPolicy
from curation.core.stats import DEFAULT_DELTA_EDGES, Histogram, SelectionRecord, batch_stats
from curation.core.stats import SourceCounts as BatchCounts
from curation.io import storage
from curation.io.atomic import atomic_write_text
from curation.io.paths import safe_join
from curation.io.shards import PART_PREFIX, ShardReader, part_name, publish_parts, verify_part, write_part
from schemas.manifest import Manifest, ShardRecord, SourceCounts
from schemas.shards import SELECTED, token_dtype
from training.blocks.loggers import SelectionFigures

__all__ = ["StepSelections", "SelectedShardWriter", "SelectionStats", "ValidationCurve", "JSONLinesLogger",
           "StepTimes"]


class StepSelections(Protocol):
    """What a trainer's selection shows its callbacks: the policy, the last delivered step's record, the recent steps'
    masks (the next refresh's ``L_train``), the refresh log, timers and counts; every record as it is delivered
    (:meth:`subscribe`), and the step still pending (:meth:`drain`)."""

    policy: SelectionPolicy
    last: SelectionRecord | None
    recent: Sequence[tuple[int, np.ndarray]]
    refresh_log: list[dict[str, Any]]
    timers: dict[str, float]
    counts: dict[str, int]
    extra_values: list[Any]

    def subscribe(self, fn: Callable[[SelectionRecord], None]) -> None: ...

    def drain(self) -> None: ...

#: Δ quantile levels logged per step.
LOGGED_QUANTILES = (0.1, 0.5, 0.9)


def _f16(x: np.ndarray) -> np.ndarray:
    # Δ beyond the float16 range would become inf; clip (it only affects |Δ| > 65504 nats).
    return np.clip(x, -65504.0, 65504.0).astype(np.float16)


class SelectedShardWriter(Callback):
    """Write the trained-on tokens of every step as selected-token shards.

    Args:
        out_dir: output directory (parts ``steps-<first>-<stop>/``, merged ``index.json``, ``manifest.json``).
        algorithm: the selection whose records are written (as they are delivered).
        vocab_size: tokenizer vocabulary (token column dtype).
        seq_len: ``L``.
        max_steps: the run's last step + 1 (the final part is flushed there).
        flush_every: steps per part.
        manifest_fields: ``config``, ``tokenizer_fingerprint``, ``model_fingerprints``, ``extra`` of the manifest.
        rank: a data-parallel worker's rank: rank 0 writes every step's full batch once; the other ranks write
            nothing (their writer state is never saved: Composer saves rank 0's).
    """

    def __init__(
        self, out_dir: str, *, algorithm: StepSelections, vocab_size: int, seq_len: int, max_steps: int,
        flush_every: int, manifest_fields: dict[str, Any] | None = None, rank: int = 0,
    ) -> None:
        self.rank = rank
        self.out_dir = out_dir
        self.algorithm = algorithm
        self.vocab_size = vocab_size
        self.max_steps = max_steps
        self.flush_every = flush_every
        self.dtype = np.dtype(token_dtype(vocab_size))
        self.fields = dict(manifest_fields or {})
        self.manifest = Manifest(kind=SELECTED.name, job="train", vocab_size=vocab_size, seq_len=seq_len,
                                 **self.fields)
        self.pending: list[dict[str, Any]] = []
        self.pending_counts: dict[str, SourceCounts] = {}
        self.resumed = False
        algorithm.subscribe(self.on_record)

    # --- events ------------------------------------------------------------------------------
    def fit_start(self, state: State, logger: Logger) -> None:
        if self.rank > 0:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        on_disk = Manifest.load_if_exists(self.out_dir)
        if not self.resumed and on_disk is not None and on_disk.shards and on_disk.config != self.manifest.config:
            raise ValueError(
                f"{self.out_dir}: holds selected-token shards of another run and there is no checkpoint to "
                "resume from; use a new output_dir or delete this one"
            )
        # (Same config, no checkpoint: a run killed before its first checkpoint; its parts are redone below.)
        damaged = [p for r in self.manifest.shards if (p := verify_part(self._recorded_part(r.name)))]
        if damaged:  # their masks come from steps already trained: only retraining would rewrite them
            raise ValueError(
                f"{self.out_dir}: selected-token parts recorded by the checkpoint are missing or damaged "
                f"({'; '.join(damaged[:3])}); they hold masks of steps already trained and cannot be rewritten "
                "without retraining: restore them from a copy, or train into a new output_dir"
            )
        self._reopen_short_part()
        keep = {r.name for r in self.manifest.shards}
        for entry in sorted(os.listdir(self.out_dir)):
            # Parts written after the checkpoint this run resumes from (or half-written ones) go first.
            if entry.startswith(PART_PREFIX) and (entry.endswith(".tmp") or entry not in keep):
                storage.remove(os.path.join(self.out_dir, entry))
        self._publish()

    def on_record(self, rec: SelectionRecord) -> None:
        if self.rank > 0:
            return
        self._add(rec)
        if (rec.step + 1) % self.flush_every == 0 or rec.step + 1 >= self.max_steps:
            self.flush()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.rank > 0:
            return
        self.algorithm.drain()
        self.flush()
        self.manifest.complete = int(state.timestamp.batch) >= self.max_steps
        self._publish()

    def _reopen_short_part(self) -> None:
        """An extended run (``max_steps`` raised past the step its checkpoint's last part stops at, flushed short
        there by the shorter run): that part's rows become pending again and its record goes, so the part is
        written whole, as by a run that had this ``max_steps`` from the start (the part itself is removed with
        the parts the checkpoint does not record)."""
        if self.pending or not self.manifest.shards:
            return
        last = self.manifest.shards[-1]
        stop = int(last.state["stop_step"])
        if stop % self.flush_every == 0 or stop >= self.max_steps:
            return
        reader = ShardReader(self._recorded_part(last.name))
        for i in range(len(reader)):
            row = reader[i]
            self._append(row["tokens"].astype(self.dtype), row["loss_mask"].astype(np.uint8),
                         row["score"].astype(np.float16), str(row["source"]), int(row["step"]), int(row["episode"]))
        self.manifest.shards.pop()
        for src, c in self.pending_counts.items():
            left = self.manifest.counts(src).model_dump()
            self.manifest.sources[src] = SourceCounts(**{k: v - getattr(c, k) for k, v in left.items()})
        self.manifest.complete = False

    def _recorded_part(self, name: str) -> str:
        """The directory of a part the checkpoint's manifest names: the name is read back (untrusted), so it is
        checked and resolved (:func:`curation.io.paths.safe_join`: no ``..``, no absolute path, no symbolic link
        leading out of ``out_dir``) before the part is read, kept or rewritten."""
        return safe_join(self.out_dir, name, what="selected part",
                         source_file=f"{storage.display(self.out_dir)} (the manifest recorded in the checkpoint)")

    # --- rows --------------------------------------------------------------------------------
    def _append(self, tokens: np.ndarray, mask: np.ndarray, score: np.ndarray, source: str, step: int,
                episode: int) -> None:
        self.pending.append({"tokens": tokens, "loss_mask": mask, "score": score, "source": source, "step": step,
                             "episode": episode})
        c = self.pending_counts.setdefault(source, SourceCounts())
        c.sequences += 1
        c.tokens += int(tokens.shape[0])
        c.kept_tokens += int(mask.sum())

    def _add(self, rec: SelectionRecord) -> None:
        scores = _f16(rec.scores)
        for i in range(rec.tokens.shape[0]):
            self._append(rec.tokens[i].astype(self.dtype), rec.mask[i].astype(np.uint8), scores[i], rec.sources[i],
                         int(rec.step), int(rec.episode))

    def flush(self) -> None:
        """Write the pending rows as one part and record it (no-op when nothing is pending)."""
        if not self.pending:
            return
        first, last = self.pending[0]["step"], self.pending[-1]["step"]
        name = part_name(first, last + 1)
        n = write_part(os.path.join(self.out_dir, name), SELECTED, self.pending, vocab_size=self.vocab_size)
        tokens = sum(int(r["tokens"].shape[0]) for r in self.pending)
        kept = sum(int(r["loss_mask"].sum()) for r in self.pending)
        self.manifest.shards.append(ShardRecord(
            name=name, samples=n, tokens=tokens, state={"first_step": first, "stop_step": last + 1, "kept_tokens": kept},
        ))
        for src, c in self.pending_counts.items():
            self.manifest.sources[src] = self.manifest.counts(src) + c
        self.pending, self.pending_counts = [], {}
        self._publish()

    def _publish(self) -> None:
        publish_parts(self.out_dir, self.manifest)

    # --- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.algorithm.drain()  # the step taken last is part of the checkpoint
        p = self.pending
        return {
            "manifest": self.manifest.model_dump(mode="json"),
            "pending_counts": {k: v.model_dump() for k, v in self.pending_counts.items()},
            "pending": None if not p else {
                "tokens": torch.from_numpy(np.stack([r["tokens"].astype(np.int64) for r in p])),
                "loss_mask": torch.from_numpy(np.stack([r["loss_mask"] for r in p])),
                "score": torch.from_numpy(np.stack([r["score"] for r in p])),
                "source": [r["source"] for r in p],
                "step": torch.tensor([r["step"] for r in p], dtype=torch.int64),
                "episode": torch.tensor([r["episode"] for r in p], dtype=torch.int64),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (the run's own config, fingerprints and schedule: an extended run's max_steps is the raised one)
        self.manifest = Manifest.model_validate({**state["manifest"], **self.fields})
        self.pending_counts = {k: SourceCounts(**v) for k, v in state["pending_counts"].items()}
        self.pending = []
        p = state.get("pending")
        if p is not None:
            for i in range(len(p["source"])):
                self.pending.append({
                    "tokens": p["tokens"][i].numpy().astype(self.dtype),
                    "loss_mask": p["loss_mask"][i].numpy(),
                    "score": p["score"][i].numpy(),
                    "source": p["source"][i],
                    "step": int(p["step"][i]),
                    "episode": int(p["episode"][i]),
                })
        self.resumed = True


class SelectionStats(Callback):
    """Per-step selection metrics to the Composer logger, and the data of the run summary.

    Args:
        algorithm: the run's selection (what each step trained on).
        edges: Δ histogram bin edges.
        log_interval: steps per logged interval (kept and candidate shares per source, Δ quantiles); None: none.
        max_steps: the run's length: an episode still open when the fit ends is logged only there (a stopped run
            logs it when its resumed run finishes it).
    """

    def __init__(self, algorithm: StepSelections, *, edges: tuple[float, ...] = DEFAULT_DELTA_EDGES,
                 vocab_size: int | None = None, lr: float | None = None, log_interval: int | None = None,
                 max_steps: int | None = None) -> None:
        self.algorithm = algorithm
        self.vocab_size, self.lr = vocab_size, lr  # given: a diverging proxy stops the run (check_proxy)
        self.recent_losses: collections.deque[float] = collections.deque(maxlen=PATIENCE)
        self.edges = tuple(edges)
        self.has_delta = algorithm.policy.score_kind is ScoreKind.EXCESS_LOSS
        self.steps: list[dict[str, Any]] = []
        self.val: list[dict[str, float]] = []
        self.histograms: dict[int, Histogram] = {}
        self.valid: dict[str, int] = {}
        self.kept: dict[str, int] = {}
        self.figures = SelectionFigures(log_interval=log_interval, max_steps=max_steps)
        self._logger: Logger | None = None
        algorithm.subscribe(self.on_record)

    def fit_start(self, state: State, logger: Logger) -> None:
        self._logger = logger

    def on_record(self, rec: SelectionRecord) -> None:
        """A step's record, as it is delivered (a step later; its metrics are logged at the step after it, as
        Composer logs what a step's end logs)."""
        metrics: dict[str, float] = {}
        entry: dict[str, Any] = {"step": rec.step, "episode": rec.episode, "kept": rec.n_kept, "valid": rec.n_valid}
        if rec.loss is not None:
            entry["loss"] = float(rec.loss)
            if self.lr is not None:  # one line naming optim.lr, instead of a run that trains on at a uniform guess
                self.recent_losses.append(entry["loss"])
                check_proxy(self.recent_losses, vocab_size=self.vocab_size, lr=self.lr)
        mask, valid = torch.from_numpy(rec.mask), torch.from_numpy(rec.valid)
        scores = torch.from_numpy(rec.scores)
        if self.has_delta and rec.ref_version >= 0:
            st = batch_stats(scores, valid, mask, rec.sources, edges=self.edges)
            prev = self.histograms.get(rec.episode)
            self.histograms[rec.episode] = st.histogram if prev is None else prev + st.histogram
            entry["delta_quantiles"] = {str(q): v for q, v in st.quantiles.items()}
            for q in LOGGED_QUANTILES:
                metrics[f"blade/delta_q{int(q * 100):02d}"] = st.quantiles[q]
            counts = st.counts
            interval = self.figures.add(rec.step, counts, scores, valid)
        else:
            counts = BatchCounts.from_batch(mask, valid, rec.sources)
            interval = self.figures.add(rec.step, counts)
        for src, n in counts.valid.items():
            self.valid[src] = self.valid.get(src, 0) + n
            self.kept[src] = self.kept.get(src, 0) + counts.kept.get(src, 0)
        entry["kept_fraction"] = counts.kept_fraction()
        for src, frac in entry["kept_fraction"].items():
            metrics[f"blade/kept_fraction/{src}"] = frac
        metrics["blade/kept_tokens"] = float(rec.n_kept)
        metrics["blade/episode"] = float(rec.episode)
        if rec.distance is not None:
            entry["param_distance"] = rec.distance
            metrics["blade/param_distance"] = rec.distance
        self.steps.append(entry)
        if self._logger is not None:
            self._logger.log_metrics({**metrics, **interval}, step=rec.step + 1)
            # (an episode's histogram at the step after its last: where that step's values are logged)
            self.figures.histograms(self._logger, self.histograms, before=rec.episode, step=rec.step)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.algorithm.drain()  # (the fit's last step, delivered before its episode's histogram)
        self.figures.finish(logger, self.histograms, steps=int(state.timestamp.batch))

    def eval_end(self, state: State, logger: Logger) -> None:
        metrics = state.eval_metrics.get("eval") or next(iter(state.eval_metrics.values()), {})
        if "TokenLoss" not in metrics:
            return
        loss = float(metrics["TokenLoss"].compute())
        step = int(state.timestamp.batch)
        if self.val and self.val[-1]["step"] == step:
            return
        self.val.append({"step": step, "loss": loss, "perplexity": math.exp(min(loss, 50.0))})

    def summary_data(self) -> dict[str, Any]:
        """Everything the run summary needs (JSON-ready)."""
        alg = self.algorithm
        return {
            "policy": alg.policy.name,
            "steps": self.steps,
            "validation": self.val,
            "tokens": {"valid": dict(self.valid), "kept": dict(self.kept)},
            "delta_histograms": {str(e): h.to_dict() for e, h in sorted(self.histograms.items())},
            "refreshes": list(alg.refresh_log),
            "timers": dict(alg.timers),
            "counts": dict(alg.counts),
        }

    def state_dict(self) -> dict[str, Any]:
        self.algorithm.drain()  # the step taken last is part of the checkpoint
        return {
            "steps": json.dumps(self.steps),
            "val": json.dumps(self.val),
            "histograms": json.dumps({str(e): h.to_dict() for e, h in self.histograms.items()}),
            "valid": dict(self.valid),
            "kept": dict(self.kept),
            "figures": self.figures.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = json.loads(state["steps"])
        self.val = json.loads(state["val"])
        self.histograms = {int(e): Histogram.from_dict(h) for e, h in json.loads(state["histograms"]).items()}
        self.valid = dict(state["valid"])
        self.kept = dict(state["kept"])
        if "figures" in state:  # (a checkpoint from before them: the interval starts afresh)
            self.figures.load_state_dict(state["figures"])


class ValidationCurve(Callback):
    """Validation loss (and perplexity, as :class:`SelectionStats` records it) after each evaluation (runs without
    :class:`SelectionStats`, e.g. replay)."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []

    def eval_end(self, state: State, logger: Logger) -> None:
        metrics = state.eval_metrics.get("eval", {})
        if "TokenLoss" in metrics:
            step = int(state.timestamp.batch)
            if not self.points or self.points[-1]["step"] != step:
                loss = float(metrics["TokenLoss"].compute())
                self.points.append({"step": step, "loss": loss, "perplexity": math.exp(min(loss, 50.0))})

    def state_dict(self) -> dict[str, Any]:
        return {"points": json.dumps(self.points)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.points = json.loads(state["points"])


class JSONLinesLogger(LoggerDestination):
    """Write every logged metric (and the hyperparameters) as one JSON object per line.

    Args:
        path: the ``.jsonl`` file (appended to, so a resumed run continues it).
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def _write(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, default=_jsonable) + "\n")
        self._file.flush()

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._write({"hyperparameters": hyperparameters})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not metrics:  # (Composer logs its train metrics' empty dict every step: the model has none)
            return
        self._write({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}})

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table", step: int | None = None) -> None:
        self._write({"step": step, "table": name, "columns": list(columns),
                     "rows": [[_jsonable(v) for v in r] for r in rows]})

    def close(self, state: State, logger: Logger) -> None:
        if not self._file.closed:
            self._file.close()


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return str(v)


class StepTimes(Callback):
    """Wall and process CPU time at the end of every step (``jobs/bench_scaling.py``); written by each rank to
    ``output_dir/parallel/step_times-rank<r>.json`` at the end of the fit."""

    def __init__(self, output_dir: str, rank: int = 0) -> None:
        self.path = os.path.join(output_dir, "parallel", f"step_times-rank{rank}.json")
        self.points: list[tuple[int, float, float]] = []

    def batch_end(self, state: State, logger: Logger) -> None:
        self.points.append((int(state.timestamp.batch), time.perf_counter(), time.process_time()))

    def fit_end(self, state: State, logger: Logger) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.points))
