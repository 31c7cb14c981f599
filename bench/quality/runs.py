"""The quality benchmark's runs: one training or replay run (reused when finished with the same settings,
resumed from its checkpoints when not), weight snapshots along a run, and the held-out evaluator.

A run's outputs live in ``out/runs/<name>/`` with a ``result.json`` recording its settings; a rerun into the
same ``out`` reuses every run whose recorded settings match, resumes an unfinished one from its checkpoints,
and retrains a run whose settings changed. With a constant learning rate and a data stream that depends only
on (seed, step), a snapshot of a run after ``n`` steps holds the weights of an ``n``-step run
(``tests/training/test_quality.py``), so one long run gives every shorter length.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import as_completed
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from composer.core import Callback

from bench.quality.procs import process_pool
from bench.quality.scoring import score, score_in_worker
from curation.evaluation.heldout import DocScores, read_set
from curation.ingest.tokenizer import load_tokenizer
from curation.io.atomic import atomic_write_text
from curation.io.models import save_weights
from curation.io.outdir import ConfigMismatch, check_config_record
from curation.io.paths import inside
from schemas.config import SourceConfig
from schemas.manifest import sha256_file
from schemas.records import config_diff, operational_keys
from schemas.train_config import ModelConfig, ReplayConfig, TrainConfig
from training.runs.train_job import replay, train

__all__ = ["REUSED", "StepTimer", "SaveAtSteps", "lookup", "run_training", "run_replay", "Evaluator", "final_val", "same_training"]

REUSED: list[str] = []  # runs of this invocation taken from an earlier one


class StepTimer(Callback):
    """Time of training steps only (data, selection, scoring, refresh, forward/backward, optimizer), excluding
    evaluation and checkpointing. On a CPU, process CPU time (other load on a shared machine does not distort
    the per-policy ratios); on a GPU, wall time after synchronising the device."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.clock = "wall" if self.cuda else "process CPU"  # of all the run's threads: 2 threads count twice
        self.seconds, self.steps, self._t0 = 0.0, 0, None

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def before_dataloader(self, state, logger) -> None:
        self._t0 = self._now()

    def batch_end(self, state, logger) -> None:
        if self._t0 is not None:
            self.seconds += self._now() - self._t0
            self.steps += 1
            self._t0 = None


class SaveAtSteps(Callback):
    """Save the trained model's weights after the given step counts (``<directory>/step<n>.safetensors``)."""

    def __init__(self, steps: list[int], directory: str) -> None:
        self.steps, self.directory = set(steps), directory

    def batch_end(self, state, logger) -> None:
        n = int(state.timestamp.batch)  # steps finished
        if n in self.steps:
            save_weights(state.model.model, os.path.join(self.directory, f"step{n}.safetensors"))


# selection keys a policy does not read (a finished full/random run stays valid when the refresh setting changes;
# rho1's static reference trains with the refresh's η_w and batch but not its K or λ; blade never reads rho1_steps)
_UNUSED_BY = {**{p: ("refresh_steps", "ref_lr", "lam", "ref_weight_decay", "ref_grad_clip", "refresh_batch_size",
                     "refresh_candidate_batches", "rho1_steps", "reference_weights") for p in ("full", "random")},
              "rho1": ("refresh_steps", "lam"), "blade": ("rho1_steps",), "blade-nosync": ("rho1_steps",)}
#: Settings a run may change and still resume (progress bars, checkpoint retention): train()/replay() ignore them too.
_OPERATIONAL = operational_keys(TrainConfig) | operational_keys(ReplayConfig)


def _current_schema(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded run config as the current schema would write it: settings added since the run was recorded
    get their defaults (which reproduce the old behaviour), so a package upgrade does not retrain (or delete)
    finished runs; a config the current schema rejects is returned as it is (and differs)."""
    body = {k: v for k, v in config.items() if k != "snapshots"}
    schema = ReplayConfig if "selected" in body else TrainConfig
    try:
        body = schema.model_validate(body).model_dump(mode="json")
    except ValueError:
        return config
    return {**body, **({"snapshots": config["snapshots"]} if "snapshots" in config else {})}


def _effective(config: dict[str, Any]) -> dict[str, Any]:
    config = _current_schema(config)
    sel = config.get("selection")
    if not isinstance(sel, dict):
        return config
    unused = _UNUSED_BY.get(sel.get("policy"), ())
    return {**config, "selection": {k: v for k, v in sel.items() if k not in unused}}


def same_training(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two recorded run configs train the same model on the same tokens: equal but for where the run is
    written, its snapshots, what the policy does not read and operational settings (progress output,
    checkpoint retention)."""
    ignore = {"output_dir", "snapshots", *_OPERATIONAL}
    return not config_diff(_effective(a), _effective(b), ignore=ignore)


def _newer(path: str, than: str) -> bool:
    return os.path.exists(path) and os.path.exists(than) and os.path.getmtime(path) > os.path.getmtime(than)


def _checked_paths(result_path: str, record: dict[str, Any]) -> str | None:
    """Why the paths a recorded result names cannot be used, or None: ``result.json`` is read back (untrusted), and
    each path it names (``final_weights``, ``final_reference``, every snapshot, ``summary.selected_dir``) must
    resolve (symbolic links followed) inside its own run directory, the one holding ``result.json``."""
    run_dir = os.path.dirname(os.path.abspath(result_path))
    summary = record.get("summary")
    snapshots = record.get("snapshots")
    named = [("final_weights", record.get("final_weights")), ("final_reference", record.get("final_reference")),
             *((f"snapshots.{k}", v) for k, v in (snapshots.items() if isinstance(snapshots, dict) else ())),
             ("summary.selected_dir", summary.get("selected_dir") if isinstance(summary, dict) else None)]
    if snapshots is not None and not isinstance(snapshots, dict):
        named.append(("snapshots", snapshots))
    for key, path in named:
        if path is None:
            continue
        if not isinstance(path, str) or not path or not inside(run_dir, path):
            return f"{result_path}: {key} {path!r:.120} is not a path inside {run_dir}; refused"
    return None


def _reusable(result_path: str, config: dict[str, Any], inputs: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """A finished run's recorded result when it can be reused, else None: it exists, was made with the same
    settings, names no path outside its run directory (:func:`_checked_paths`), and none of its ``inputs`` (files
    it read, e.g. the manifest of replayed shards) was written again since.

    A run directory left by a different setting (e.g. after the refresh sweep chose differently), made from
    inputs written since or whose record names paths elsewhere is removed so that the run starts afresh instead
    of resuming someone else's checkpoints."""
    run_dir = os.path.dirname(result_path)
    saved = os.path.join(run_dir, "config.yaml")
    remade = [p for p in inputs if _newer(p, result_path if os.path.exists(result_path) else saved)]
    if os.path.exists(result_path):
        with open(result_path) as f:
            record = json.load(f)
        record = record if isinstance(record, dict) else {}
        same = _effective(record.get("config", {})) == _effective(config)
        refused = _checked_paths(result_path, record) if same and not remade else None
        if same and not remade and refused is None:
            REUSED.append(os.path.basename(run_dir))
            return record
        if refused:
            why = f"{refused}, not reused"
        else:
            why = f"{remade[0]} was written again" if remade else "settings changed"
            why += " since the recorded run"
        print(f"[run] {os.path.basename(run_dir)}: {why}; training it again", flush=True)
    if os.path.isdir(run_dir):
        stale = os.path.exists(result_path) or bool(remade)
        if not stale and os.path.exists(saved):  # an unfinished run resumes only with the same config
            body: Any = {k: v for k, v in config.items() if k != "snapshots"}
            schema = ReplayConfig if "selected" in body else TrainConfig
            try:  # as the model: a setting added since the run was recorded, at its default, is no difference
                body = schema.model_validate(body)
            except ValueError:
                pass  # not a config the schema reads: compared as it is
            try:
                check_config_record(saved, body, ignore=_OPERATIONAL)
            except ConfigMismatch:
                stale = True
        if stale:
            shutil.rmtree(run_dir)
    return None


def _record(cfg: TrainConfig | ReplayConfig, snapshots: tuple[int, ...]) -> dict[str, Any]:
    config = cfg.model_dump(mode="json")
    if snapshots:
        config["snapshots"] = sorted(snapshots)
    return config


def _inputs(cfg: TrainConfig | ReplayConfig) -> tuple[str, ...]:
    # shards selected again since (a proxy run retrained) make a replay stale even under the same settings
    return (os.path.join(cfg.selected, "manifest.json"),) if isinstance(cfg, ReplayConfig) else ()


def lookup(cfg: TrainConfig | ReplayConfig, result_path: str, *, snapshots: tuple[int, ...] = ()) -> dict[str, Any] | None:
    """The recorded result of a finished run with the same settings, or None when the run is still to train (a
    stale run directory is removed first, an unfinished one with the same settings is left to resume)."""
    return _reusable(result_path, _record(cfg, snapshots), _inputs(cfg))


def _run(cfg: TrainConfig | ReplayConfig, result_path: str, snapshots: tuple[int, ...], fit) -> dict[str, Any]:
    config = _record(cfg, snapshots)
    found = lookup(cfg, result_path, snapshots=snapshots)
    if found is not None:
        return found
    timer = StepTimer()
    snap_dir = os.path.join(cfg.output_dir, "snapshots")
    callbacks = [timer] + ([SaveAtSteps(sorted(snapshots), snap_dir)] if snapshots else [])
    t0, c0 = time.perf_counter(), time.process_time()
    res = fit(callbacks)
    res.update(name=os.path.basename(cfg.output_dir), config=config,
               step_seconds=timer.seconds / max(timer.steps, 1), step_clock=timer.clock,
               run_seconds={"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "steps": timer.steps,
                            "pid": os.getpid()},
               snapshots={str(n): os.path.join(snap_dir, f"step{n}.safetensors") for n in sorted(snapshots)})
    missing = [p for p in res["snapshots"].values() if not os.path.isfile(p)]
    if missing:  # a resumed run whose snapshot step was before the checkpoint it resumed from
        raise RuntimeError(f"snapshots missing after training {cfg.output_dir}: {missing}; delete the run directory")
    atomic_write_text(result_path, json.dumps(res))
    return res


def run_training(cfg: TrainConfig, result_path: str, *, snapshots: tuple[int, ...] = ()) -> dict[str, Any]:
    """Train (or load the recorded result of a finished run with the same settings and snapshots)."""

    def fit(callbacks):
        out = train(cfg, callbacks=callbacks)
        with open(out.summary) as f:
            summary = json.load(f)
        return {"final_weights": out.final_weights, "final_reference": out.final_reference,
                "summary": summary, "validation": summary["validation"]}

    return _run(cfg, result_path, snapshots, fit)


def run_replay(cfg: ReplayConfig, result_path: str, *, snapshots: tuple[int, ...] = ()) -> dict[str, Any]:
    """Train a model on selected-token shards (or load the recorded result, as :func:`run_training`)."""

    def fit(callbacks):
        out = replay(cfg, callbacks=callbacks)
        return {"final_weights": out.final_weights, "validation": list(out.validation)}

    return _run(cfg, result_path, snapshots, fit)


def final_val(res: dict[str, Any], at: int | None = None) -> float:
    """A run's last validation loss (at or before step ``at``)."""
    curve = res["validation"]
    if at is not None:
        curve = [p for p in curve if p["step"] <= at]
    return curve[-1]["loss"]


#: sha256 of the files the evaluator has hashed in this process, by (path, inode, size, mtime): a model or an
#: evaluation set is asked for hundreds of times per invocation (a rerun of the quick preset with every score
#: cached hashed weights and 1-4 MB data files 1,747 times, 2.5 s of its 17.5 s of CPU); a file written again (a
#: retrained run, replaced atomically) is hashed again
_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def _digest(path: str) -> str:
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]


class Evaluator:
    """Whole-document token loss of a model on evaluation sets, cached in ``out/eval_cache.json`` by run name,
    weights hash and set (a retrained run or a changed set is evaluated again). It scores with ``threads`` torch
    threads, in this process or, through :meth:`prefetch`, ``parallel`` models at a time in processes of their
    own (the same threads: the same numbers)."""

    def __init__(self, out: str, tokenizer: str, sources: list[SourceConfig], *, max_len: int, threads: int = 0,
                 parallel: int = 1):
        self.sources, self.max_len = {s.name: s for s in sources}, max_len
        self.tokenizer, self.tok = tokenizer, load_tokenizer(tokenizer)
        self.threads, self.parallel = threads or torch.get_num_threads(), parallel
        self.texts: dict[str, list[str]] = {}
        self.documents: dict[str, int] = {}  # documents per set
        self.path = os.path.join(out, "eval_cache.json")
        self.cache = json.load(open(self.path)) if os.path.exists(self.path) else {}
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # while planning (prefetch): key → (model config, weights, {set key: source}) of the scores still missing
        self._plan: dict[str, tuple[ModelConfig, str, dict[str, SourceConfig]]] | None = None

    def _texts(self, src: SourceConfig) -> list[str]:
        if src.name not in self.texts:
            self.texts[src.name] = read_set(src)
        return self.texts[src.name]

    def __call__(self, name: str, mcfg: ModelConfig, weights: str, *, sets: tuple[str, ...] | None = None,
                 extra: tuple[SourceConfig, ...] = ()) -> dict[str, DocScores]:
        """Scores of ``weights`` on ``sets`` (default: every evaluation set) and the ``extra`` sources."""
        key = f"{name}@{_digest(weights)[:16]}"
        entry = self.cache.setdefault(key, {})
        out = {}
        chosen = [self.sources[n] for n in sets] if sets is not None else list(self.sources.values())
        for src in [*chosen, *extra]:
            skey = f"{src.name}@{_digest(src.paths[0])[:8]}:{src.skip_documents}:{src.max_documents}:{self.max_len}"
            if skey not in entry and self._plan is not None:  # a placeholder of the right size, never cached
                self._plan.setdefault(key, (mcfg, weights, {}))[2][skey] = src
                n = len(self._texts(src))
                out[src.name] = DocScores(np.ones(n), np.ones(n, dtype=np.int64))
                continue
            if skey not in entry:
                with _threads(self.threads):
                    entry[skey] = score(mcfg, weights, self.tok, self._texts(src), self.max_len, self.device)
                atomic_write_text(self.path, json.dumps(self.cache))
            out[src.name] = DocScores.from_json(entry[skey])
            self.documents[src.name] = len(out[src.name].sums)
        return out

    def prefetch(self, uses: Callable[[], Any]) -> None:
        """Score ahead, ``parallel`` models at a time, what ``uses()`` asks of this evaluator: ``uses`` runs once
        with the missing scores answered by placeholders (its result is dropped), then the models it asked for
        are scored in worker processes and cached, so that calling it again finds them all. Should ``uses`` fail
        on a placeholder, what it asked for until then is scored, and the rest when it is called again."""
        if self.parallel <= 1:
            return
        self._plan = {}
        try:
            uses()
        except Exception as e:  # noqa: BLE001 - a placeholder it could not use: the rest is scored later, in order
            print(f"[evaluate] planning stopped at {type(e).__name__}: {e}; the rest is scored in this process",
                  flush=True)
        finally:
            plan, self._plan = self._plan, None
        if not plan:
            return
        with process_pool(min(self.parallel, len(plan))) as pool:
            futures = {pool.submit(score_in_worker, mcfg, weights, self.tokenizer, srcs, self.max_len, self.threads,
                                   self.device): key
                       for key, (mcfg, weights, srcs) in plan.items()}
            for fut in as_completed(futures):
                self.cache.setdefault(futures[fut], {}).update(fut.result())
                atomic_write_text(self.path, json.dumps(self.cache))


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
