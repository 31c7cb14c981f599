"""Run summary: one JSON file and PNG plots (docs/DESIGN.md §6, usability; every key: docs/REFERENCE.md, "summary.json").

``summary.json`` is one schema for every job that trains (``jobs/train.py``, ``jobs/replay.py``,
``jobs/curate_and_train.py``), versioned by its ``schema_version`` (:data:`SCHEMA_VERSION`), written by
:func:`training.runs.finish.finish` only. This module holds its parts that know no run: the sections made from a
run's selection statistics (:func:`selection_sections`: tokens seen / kept per source, the validation loss curve, Δ
quantiles per episode from the per-episode Δ histogram — 0.25-nat bins, linear within a bin —, ‖u − w‖ per step,
the refresh log, the time spent per phase), the writer and the plots: ``delta_histograms.png`` (one curve per
episode, the x-axis fitted to the data: 0.2% to 99.8% of Δ), ``param_distance.png`` (‖u − w‖ per step) and ``val_loss.png``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from curation.core.stats import DEFAULT_QUANTILES, Histogram
from curation.io.atomic import atomic_write_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["SCHEMA_VERSION", "Section", "selection_sections", "write_summary", "plot_summary", "delta_axis"]

#: The version of ``summary.json``'s schema (docs/REFERENCE.md lists the changes; the summaries written before
#: the field existed are version 1).
SCHEMA_VERSION = 2

#: A JSON object of the summary, or one that becomes one (a section: numbers, strings, lists, nested objects).
Section = Mapping[str, object]


def _clean(x: object) -> Any:
    """JSON-safe copy: non-finite floats become ``None``."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def selection_sections(data: Section) -> dict[str, object]:
    """The summary's sections made from :meth:`training.blocks.callbacks.SelectionStats.summary_data`: ``policy``,
    ``steps``, ``tokens``, ``delta_quantiles_per_episode``, ``delta_histograms``, ``param_distance``,
    ``train_loss``, ``refreshes``, ``seconds``, ``counts``, ``per_step``."""
    valid, kept = data["tokens"]["valid"], data["tokens"]["kept"]
    per_source = {
        s: {"valid_tokens": n, "kept_tokens": kept.get(s, 0), "kept_fraction": kept.get(s, 0) / n if n else None}
        for s, n in sorted(valid.items())
    }
    episodes = {}
    for e, h in data["delta_histograms"].items():
        hist = Histogram.from_dict(h)
        episodes[e] = {"tokens": hist.total, "quantiles": {str(q): hist.quantile(q) for q in DEFAULT_QUANTILES}}
    steps = data["steps"]
    return {
        "policy": data["policy"],
        "steps": len(steps),
        "tokens": {"valid": sum(valid.values()), "kept": sum(kept.values()), "per_source": per_source},
        "delta_quantiles_per_episode": episodes,
        "delta_histograms": data["delta_histograms"],
        "param_distance": [{"step": s["step"], "value": s["param_distance"]} for s in steps if "param_distance" in s],
        "train_loss": [{"step": s["step"], "value": s["loss"]} for s in steps if "loss" in s],
        "refreshes": data["refreshes"],
        "seconds": data["timers"],
        "counts": data["counts"],
        "per_step": steps,
    }


def plot_summary(summary: Section, out_dir: str) -> list[str]:
    """Write the PNG plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    policy = summary["policy"]

    fig, ax = plt.subplots(figsize=(7, 4))
    hists = summary["delta_histograms"]
    for e, h in hists.items():
        edges, counts = h["edges"], h["counts"][1:-1]  # inner bins (under/overflow are open-ended)
        total = max(sum(h["counts"]), 1)
        centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
        ax.plot(centers, [c / total for c in counts], label=f"episode {e}")
    span = delta_axis(hists.values())
    if span is not None:  # the axis fitted to the data (the bins span -8…8 nats; Δ mostly sits within ±2)
        ax.set_xlim(*span)
    ax.set_xlabel("Δ = ℓ(u) − ℓ(w̃) (nats)")
    ax.set_ylabel("fraction of valid tokens")
    ax.set_title(f"{policy}: Δ per episode" if hists else f"{policy}: no Δ (policy without reference)")
    if hists:
        ax.legend(fontsize=7)
    paths.append(_save(fig, os.path.join(out_dir, "delta_histograms.png")))

    fig, ax = plt.subplots(figsize=(7, 4))
    pd = summary["param_distance"]
    ax.plot([p["step"] for p in pd], [p["value"] for p in pd], marker=".", lw=1)
    for r in summary["refreshes"]:
        ax.axvline(r["step"], color="grey", lw=0.5, ls="--")
    ax.set_xlabel("proxy step")
    ax.set_ylabel("‖u − w‖₂")
    ax.set_title(f"{policy}: distance proxy ↔ reference (dashed: refreshes)")
    paths.append(_save(fig, os.path.join(out_dir, "param_distance.png")))

    fig, ax = plt.subplots(figsize=(7, 4))
    val = summary["validation"]
    ax.plot([v["step"] for v in val], [v["loss"] for v in val], marker="o", label="validation")
    tl = summary["train_loss"]
    if tl:
        ax.plot([t["step"] for t in tl], [t["value"] for t in tl], lw=0.7, alpha=0.6, label="train (kept tokens)")
    ax.set_xlabel("proxy step")
    ax.set_ylabel("token loss (nats)")
    ax.set_title(f"{policy}: loss")
    ax.legend()
    paths.append(_save(fig, os.path.join(out_dir, "val_loss.png")))
    return paths


def delta_axis(hists: Iterable[Mapping[str, list[float]]], lo_q: float = 0.002,
               hi_q: float = 0.998) -> tuple[float, float] | None:
    """``(lo, hi)``: from the ``lo_q`` to the ``hi_q`` quantile of Δ over every episode's histogram (``edges``/``counts``
    dicts), widened by 5% on each side, so a few outlying tokens do not stretch the axis; ``None`` when no histogram
    holds anything."""
    merged = None
    for h in hists:
        hist = Histogram.from_dict(h)
        merged = hist if merged is None else merged + hist
    if merged is None or merged.total == 0:
        return None
    lo, hi = merged.quantile(lo_q), merged.quantile(hi_q)
    pad = max((hi - lo) * 0.05, 0.05)
    return lo - pad, hi + pad


def _save(fig: Figure, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(output_dir: str, summary: Mapping[str, object], *, plots: bool = True) -> tuple[str, list[str]]:
    """Write ``output_dir/summary.json`` (non-finite numbers as ``null``; and ``output_dir/plots/*.png``). Returns
    the paths."""
    summary = _clean(dict(summary))
    path = os.path.join(output_dir, "summary.json")
    atomic_write_text(path, json.dumps(summary, indent=1))
    pngs = plot_summary(summary, os.path.join(output_dir, "plots")) if plots else []
    return path, pngs
