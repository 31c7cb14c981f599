"""Evaluating trained causal LMs on local evaluation sets: whole-document token loss with bootstrap intervals.

The metric of a set is the mean token loss over all its documents (nats per token): each document is
tokenized on its own as ``[EOS] + ids + [EOS]`` (EOS is the document separator of the packed training
data, so the first word is predicted from a document boundary and the closing EOS is predicted too) and
every target token is predicted exactly once, in windows of at most ``max_len`` tokens that overlap by one
token (a document longer than the window loses the context before its window's start). A 95% interval
comes from resampling the documents (bootstrap); for two models the paired difference is bootstrapped
with the same resamples for both.

Models are HF directories (``save_pretrained``) or a training run (``output_dir`` or its ``final/``: weights
+ HF config, with the run's tokenizer). Evaluation sets are :class:`~schemas.config.SourceConfig` sources
read by :mod:`curation.ingest.corpus`, the readers of ``jobs/prepare.py``. Pure torch: no ray, no composer.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from curation.core.losses import model_logits, token_losses
from curation.ingest.corpus import BadRecordError, iter_documents
from curation.ingest.tokenizer import LoadedTokenizer, load_tokenizer
from curation.io.models import build_causal_lm, check_vocab
from curation.io.progress import progress_iter
from schemas.config import SourceConfig
from schemas.eval_config import EvalModelSpec, EvaluateConfig
from schemas.manifest import Manifest
from schemas.train_config import ModelConfig

__all__ = [
    "EvalError",
    "ModelRef",
    "DocScores",
    "Interval",
    "resolve_models",
    "load_model",
    "read_set",
    "document_windows",
    "score_documents",
    "bootstrap_mean",
    "paired_difference",
    "evaluate_models",
    "results_markdown",
    "export_hf",
]


class EvalError(ValueError):
    """Bad evaluation input (a model, tokenizer or set); the message names it."""


@dataclass(frozen=True)
class ModelRef:
    """A model to evaluate: where its HF config and weights are, and its tokenizer."""

    name: str
    model_dir: str  # has config.json (an HF directory or a run's final/)
    weights: str | None  # safetensors loaded over the model (None: the directory's own weights)
    tokenizer: str  # tokenizer.json or a directory holding one
    run_candidates: str | None = None  # a run's candidate shards (their manifest records the tokenizer)


@dataclass
class DocScores:
    """Per-document sums of token losses (nats) and counts of predicted tokens."""

    sums: np.ndarray  # float64 (n,)
    counts: np.ndarray  # int64 (n,)

    @property
    def mean(self) -> float:
        return float(self.sums.sum() / self.counts.sum())

    def to_json(self) -> dict[str, list]:
        return {"sums": self.sums.tolist(), "counts": self.counts.tolist()}

    @classmethod
    def from_json(cls, d: dict[str, list]) -> DocScores:
        return cls(np.asarray(d["sums"], dtype=np.float64), np.asarray(d["counts"], dtype=np.int64))


@dataclass(frozen=True)
class Interval:
    """A point estimate with a 95% bootstrap interval."""

    value: float
    lo: float
    hi: float

    def fmt(self, digits: int = 3, sign: bool = False) -> str:
        f = f"{{:{'+' if sign else ''}.{digits}f}}"
        return f"{f.format(self.value)} [{f.format(self.lo)}, {f.format(self.hi)}]"


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------
def _run_dir_of(d: str) -> str | None:
    """The training run a directory belongs to (``d`` or its parent has config.yaml + final/model.safetensors)."""
    for run in (d, os.path.dirname(os.path.abspath(d))):
        if os.path.isfile(os.path.join(run, "config.yaml")) and os.path.isfile(
                os.path.join(run, "final", "model.safetensors")):
            if d == run or os.path.basename(os.path.normpath(d)) == "final":
                return run
    return None


def _ref_of(d: str, spec: EvalModelSpec, where: str) -> ModelRef:
    run = _run_dir_of(d)
    if run is not None:  # a training run: final/ holds the HF config and the weights, the tokenizer is the run's
        final = os.path.join(run, "final")
        if not os.path.isfile(os.path.join(final, "config.json")):
            raise EvalError(f"{where}: {final} has no config.json (written by training runs since final/ exists)")
        with open(os.path.join(run, "config.yaml"), encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
        data = cfg.get("data") or {}
        tok = spec.tokenizer or data.get("tokenizer")
        if tok is None:
            guess = os.path.join(os.path.dirname(os.path.normpath(data.get("candidates", ""))), "tokenizer")
            if not os.path.isfile(os.path.join(guess, "tokenizer.json")):
                raise EvalError(f"{where}: run {run} records no data.tokenizer; set the model's `tokenizer`")
            tok = guess
        name = spec.name or os.path.basename(os.path.abspath(run))  # abspath: never '.' or '..'
        return ModelRef(name, final, spec.weights or os.path.join(final, "model.safetensors"), tok,
                        data.get("candidates"))
    if not os.path.isfile(os.path.join(d, "config.json")):
        raise EvalError(f"{where}: {d} is neither an HF model directory (no config.json) nor a training run "
                        "(no config.yaml + final/model.safetensors)")
    if spec.weights is None and not (glob.glob(os.path.join(d, "*.safetensors")) or
                                     glob.glob(os.path.join(d, "*.safetensors.index.json"))):
        raise EvalError(f"{where}: {d} has no model.safetensors (weights are loaded from safetensors only)")
    tok = spec.tokenizer or d
    if spec.tokenizer is None and not os.path.isfile(os.path.join(d, "tokenizer.json")):
        raise EvalError(f"{where}: {d} has no tokenizer.json; set the model's `tokenizer`")
    return ModelRef(spec.name or os.path.basename(os.path.abspath(d)), d, spec.weights, tok)


def resolve_models(specs: Sequence[EvalModelSpec]) -> list[ModelRef]:
    """Expand globs and classify each directory (HF directory or training run).

    Raises:
        EvalError: a path that is missing or not a model (names the entry), a glob matching no finished
            run, or two models with the same name.
    """
    refs: list[ModelRef] = []
    for i, spec in enumerate(specs):
        where = f"models.{i} ({spec.path})"
        if glob.has_magic(spec.path):
            if spec.name:
                raise EvalError(f"{where}: `name` cannot be set for a glob (each match is named by its directory)")
            matched = []
            for d in sorted(p for p in glob.glob(spec.path) if os.path.isdir(p)):
                if _run_dir_of(d) or os.path.isfile(os.path.join(d, "config.json")):
                    matched.append(_ref_of(d, spec, f"models.{i} ({d})"))
            if not matched:
                raise EvalError(f"{where}: no finished run or HF model directory matches "
                                "(train one first, e.g. `python jobs/train.py`)")
            refs.extend(matched)
        else:
            if not os.path.exists(spec.path):
                raise EvalError(f"{where}: no such model directory")
            refs.append(_ref_of(spec.path, spec, where))
        if spec.weights is not None and not os.path.isfile(spec.weights):
            raise EvalError(f"models.{i}.weights: no such file {spec.weights}")
    names = [r.name for r in refs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise EvalError(f"models: duplicate names {dup}; give each model a distinct `name`")
    return refs


def load_model(ref: ModelRef, *, eos_token: str = "<|endoftext|>",
               device: str | torch.device = "cpu") -> tuple[nn.Module, LoadedTokenizer]:
    """The model (eval mode, float32, on ``device``) and its tokenizer, checked against each other.

    Raises:
        EvalError: unreadable tokenizer or weights, or a tokenizer that does not fit the model's vocabulary
            (more ids than the model embeds, or not the tokenizer the run's shards were made with).
    """
    try:
        tok = load_tokenizer(ref.tokenizer, eos_token=eos_token)
    except (OSError, ValueError) as e:
        raise EvalError(f"model {ref.name}: tokenizer {ref.tokenizer}: {e}") from e
    if ref.run_candidates:
        m = Manifest.load_if_exists(ref.run_candidates)
        if m is not None and m.tokenizer_fingerprint and m.tokenizer_fingerprint != tok.fingerprint:
            raise EvalError(f"model {ref.name}: tokenizer {tok.path} is not the one its training shards were made "
                            f"with ({Manifest.path_in(ref.run_candidates)} records another sha256)")
    try:
        model = build_causal_lm(ModelConfig(path=ref.model_dir, weights=ref.weights))
    except (OSError, ValueError) as e:
        raise EvalError(f"model {ref.name}: cannot load {ref.weights or ref.model_dir}: {e}") from e
    try:
        check_vocab(model, tok.vocab_size, what=f"tokenizer {tok.path}", setting=ref.model_dir,
                    fix="not this model's tokenizer")
    except ValueError as e:
        raise EvalError(f"model {ref.name}: {e}") from None
    return model.to(device).eval(), tok


# ------------------------------------------------------------------------------------------------
# sets
# ------------------------------------------------------------------------------------------------
def read_set(source: SourceConfig) -> list[str]:
    """Every document of an evaluation set (with the source's skip/max), read by :mod:`curation.ingest.corpus`.

    Raises:
        EvalError: a bad record (``file:line: reason``) or an empty set, naming the set.
    """
    texts: list[str] = []
    skip = source.skip_documents
    try:
        for doc in iter_documents(source):
            if isinstance(doc, BadRecordError):
                raise doc
            if skip:
                skip -= 1
                continue
            texts.append(doc.text)
            if source.max_documents is not None and len(texts) >= source.max_documents:
                break
    except BadRecordError as e:
        raise EvalError(f"set '{source.name}': {e}") from e
    if not texts:
        raise EvalError(f"set '{source.name}': no documents in {', '.join(source.paths)}"
                        + (f" after skipping {source.skip_documents}" if source.skip_documents else ""))
    return texts


def document_windows(ids: Sequence[int], eos_id: int, max_len: int) -> list[list[int]]:
    """``[EOS] + ids + [EOS]`` cut into windows of ≤ ``max_len`` tokens overlapping by one token.

    In every window, positions 1.. are the targets; over all windows each of ``ids + [EOS]`` is a
    target exactly once.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    seq = [eos_id, *ids, eos_id]
    out, start = [], 0
    while True:
        out.append(seq[start:start + max_len])
        if start + max_len >= len(seq):
            return out
        start += max_len - 1


@torch.inference_mode()
def score_documents(model: nn.Module, tok: LoadedTokenizer, texts: Sequence[str], *, max_len: int,
                    batch_size: int = 16, progress: bool = False, desc: str = "") -> DocScores:
    """Per-document token-loss sums and counts of ``model`` on ``texts`` (see the module docstring)."""
    windows: list[tuple[int, list[int]]] = []
    for d, ids in enumerate(tok.encode_batch(list(texts))):
        windows += [(d, w) for w in document_windows(ids, tok.eos_id, max_len)]
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i][1]))  # similar lengths share a batch
    sums = np.zeros(len(texts), dtype=np.float64)
    counts = np.zeros(len(texts), dtype=np.int64)
    device = next(model.parameters()).device
    starts = range(0, len(order), batch_size)
    for b in progress_iter(starts, total=len(starts), desc=desc, unit="batch", enabled=progress, leave=False):
        rows = [windows[i] for i in order[b:b + batch_size]]
        width = max(len(w) for _, w in rows)
        toks = torch.full((len(rows), width), tok.eos_id, dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for r, (_, w) in enumerate(rows):
            toks[r, :len(w)] = torch.as_tensor(w)
            valid[r, :len(w)] = True
        toks, valid = toks.to(device), valid.to(device)
        losses, tvalid = token_losses(model_logits(model, toks, valid), toks, valid)
        row_sums = (losses.double() * tvalid).sum(1).cpu().numpy()
        row_counts = tvalid.sum(1).cpu().numpy()
        docs = np.asarray([d for d, _ in rows])
        np.add.at(sums, docs, row_sums)
        np.add.at(counts, docs, row_counts)
    return DocScores(sums, counts)


# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------
def _resamples(n: int, rounds: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(rounds, n))


def bootstrap_mean(s: DocScores, *, rounds: int = 1000, seed: int = 0) -> Interval:
    """Mean token loss with a 95% percentile interval over document resamples (rounds = 0: no interval)."""
    value = s.mean
    if rounds == 0 or len(s.sums) < 2:
        return Interval(value, value, value)
    idx = _resamples(len(s.sums), rounds, seed)
    boot = s.sums[idx].sum(1) / s.counts[idx].sum(1)
    return Interval(value, float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5)))


def paired_difference(a: DocScores, b: DocScores, *, rounds: int = 1000, seed: int = 0) -> Interval:
    """Mean token loss of ``a`` minus ``b`` on the same documents, 95% interval from shared resamples.

    Raises:
        ValueError: the two were not scored on the same number of documents.
    """
    if len(a.sums) != len(b.sums):
        raise ValueError(f"paired difference needs the same documents: {len(a.sums)} vs {len(b.sums)}")
    value = a.mean - b.mean
    if rounds == 0 or len(a.sums) < 2:
        return Interval(value, value, value)
    idx = _resamples(len(a.sums), rounds, seed)
    boot = a.sums[idx].sum(1) / a.counts[idx].sum(1) - b.sums[idx].sum(1) / b.counts[idx].sum(1)
    return Interval(value, float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5)))


# ------------------------------------------------------------------------------------------------
# the whole evaluation
# ------------------------------------------------------------------------------------------------
def evaluate_models(refs: Sequence[ModelRef], cfg: EvaluateConfig, *,
                    device: str | torch.device = "cpu") -> dict[str, Any]:
    """Score every model on every set; per-set means with intervals and all paired differences.

    Args:
        refs: the models (``cfg.models`` resolved: :func:`resolve_models`).
        cfg: the evaluation's config: its ``sets``, ``max_len``, ``batch_size``, ``bootstrap`` resamples and
            ``seed``, ``eos_token`` and ``progress`` (its ``models`` are ``refs``).
        device: where the models run (``cfg.device`` resolved).

    Returns:
        A JSON-ready dict: ``models`` (facts per model), ``sets`` (documents per set), ``loss``
        (set → model → mean/lo/hi/tokens), ``paired`` (set → list of ``a − b`` rows) and ``scores``
        (set → model → per-document sums and counts).
    """
    max_len, rounds, seed = cfg.max_len, cfg.bootstrap, cfg.seed
    texts = {s.name: read_set(s) for s in cfg.sets}  # all sets are read first: a bad set fails before any scoring
    models: dict[str, Any] = {}
    scores: dict[str, dict[str, DocScores]] = {s: {} for s in texts}
    for ref in refs:
        model, tok = load_model(ref, eos_token=cfg.eos_token, device=device)
        models[ref.name] = {"path": ref.model_dir, "weights": ref.weights, "tokenizer": tok.path,
                            "tokenizer_sha256": tok.fingerprint,
                            "parameters": sum(p.numel() for p in model.parameters())}
        for name, docs in texts.items():
            scores[name][ref.name] = score_documents(model, tok, docs, max_len=max_len, batch_size=cfg.batch_size,
                                                     progress=cfg.progress, desc=f"{ref.name} / {name}")
        del model
    loss = {s: {m: {**_iv(bootstrap_mean(sc, rounds=rounds, seed=seed)), "tokens": int(sc.counts.sum())}
                for m, sc in per.items()} for s, per in scores.items()}
    names = [r.name for r in refs]
    paired = {s: [{"a": a, "b": b, **_iv(paired_difference(per[a], per[b], rounds=rounds, seed=seed)),
                   "same_tokenizer": models[a]["tokenizer_sha256"] == models[b]["tokenizer_sha256"]}
                  for i, a in enumerate(names) for b in names[i + 1:]] for s, per in scores.items()}
    return {"models": models, "sets": {s: {"documents": len(t)} for s, t in texts.items()}, "loss": loss,
            "paired": paired, "bootstrap": {"rounds": rounds, "seed": seed}, "max_len": max_len,
            "scores": {s: {m: sc.to_json() for m, sc in per.items()} for s, per in scores.items()}}


def _iv(iv: Interval) -> dict[str, float]:
    return {"mean": iv.value, "lo": iv.lo, "hi": iv.hi}


def results_markdown(res: dict[str, Any], *, title: str = "Evaluation") -> str:
    """The results of :func:`evaluate_models` as Markdown tables."""
    sets = list(res["sets"])
    lines = [f"# {title}", "",
             f"Mean token loss per set (nats per predicted token, whole documents, context {res['max_len']}); "
             f"[95% bootstrap interval over documents, {res['bootstrap']['rounds']} resamples]. Lower is better.",
             "", "| model | " + " | ".join(f"{s} ({res['sets'][s]['documents']} docs)" for s in sets) + " |",
             "|---|" + "---|" * len(sets)]
    for m in res["models"]:
        cells = [Interval(*(res["loss"][s][m][k] for k in ("mean", "lo", "hi"))).fmt() for s in sets]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    rows = res["paired"][sets[0]] if sets else []
    if rows:
        lines += ["", "Paired differences (row model − column model; negative: the first is better), "
                  "bootstrapped over the same document resamples:", "",
                  "| a − b | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
        for k, row in enumerate(rows):
            cells = []
            for s in sets:
                r = res["paired"][s][k]
                cell = Interval(r["mean"], r["lo"], r["hi"]).fmt(sign=True)
                cells.append(cell + ("" if r["same_tokenizer"] else " (different tokenizers: not comparable)"))
            lines.append(f"| {row['a']} − {row['b']} | " + " | ".join(cells) + " |")
    if res.get("lm_eval"):
        lines += ["", "## lm-evaluation-harness (offline, local files)", "", "| model | task | metric | value |",
                  "|---|---|---|---|"]
        for m, tasks in res["lm_eval"].items():
            for task, metrics in tasks.items():
                for k, v in metrics.items():
                    val = f"{v:.4f}" if isinstance(v, float) and math.isfinite(v) else str(v)
                    lines.append(f"| {m} | {task} | {k} | {val} |")
    lines.append("")
    return "\n".join(lines)


def export_hf(model: nn.Module, tokenizer_json: str, directory: str, *, eos_token: str = "<|endoftext|>") -> str:
    """Save ``model`` and its tokenizer as an HF directory (``save_pretrained``) any harness can load."""
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(directory, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token=eos_token).save_pretrained(directory)
    return directory
