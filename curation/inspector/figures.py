"""The inspector's charts, from what a run recorded and what :mod:`curation.inspector.stats` gathered: each function
returns one chart's HTML (inline SVG, :mod:`curation.inspector.svg`) or ``""`` when the run has nothing to draw."""

from __future__ import annotations

import math
import os
from typing import Any

from curation.inspector.compare import Comparison
from curation.inspector.run import Run
from curation.inspector.stats import EpisodeDeltas, StepCurves
from curation.inspector.svg import PALETTE, Series, line_chart
from curation.io import storage
from schemas.manifest import Manifest

__all__ = ["refresh_steps", "share_chart", "threshold_chart", "delta_chart", "validation_chart", "distance_chart",
           "engine_charts", "jaccard_chart", "source_colors"]


def source_colors(sources: list[str]) -> dict[str, str]:
    return {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(sorted(sources))}


def refresh_steps(run: Run) -> list[int]:
    """The steps at which a reference was made (refresh moments), from the summary."""
    refs = (run.summary or {}).get("refreshes") or []
    return sorted({int(r["step"]) for r in refs if isinstance(r, dict) and isinstance(r.get("step"), int)})


def _gapped(xs: list[int], ys: list[float], gap: int) -> tuple[list[float], list[float | None]]:
    """``xs``/``ys`` with a break (None) where ``x`` jumps by more than ``gap``: the parts of a run not read are not
    drawn as lines across them."""
    ox: list[float] = []
    oy: list[float | None] = []
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if i and x - xs[i - 1] > gap:
            ox.append(math.nan)
            oy.append(None)
        ox.append(float(x))
        oy.append(y)
    return ox, oy


def share_chart(curves: StepCurves, colors: dict[str, str], chart_id: str, title: str, points: int = 60) -> str:
    """Per source, its share of the kept tokens (solid) against its share of the candidates (dashed), over windows of
    consecutive steps read (at most ``points`` of them)."""
    if not curves.steps:
        return ""
    window = max(1, math.ceil(len(curves.steps) / points))
    steps, kept, cand = curves.shares(window)
    series = []
    for s in kept:
        series.append(Series(f"{s}: kept", *_gapped(steps, kept[s], window), color=colors.get(s)))
        series.append(Series(f"{s}: candidates", *_gapped(steps, cand[s], window), color=colors.get(s), dashed=True,
                             width=1.0))
    per = f"each point: {window} steps read" if window > 1 else "each point: one step"
    return line_chart(series, title=title, xlabel="step", ylabel="share", chart_id=chart_id, ylim=(0.0, 1.0),
                      note=f"solid: the source's share of the kept tokens; dashed: its share of the candidates (a "
                           f"selection indifferent to sources keeps the two equal); {per}")


def threshold_chart(curves: StepCurves, markers: list[int], chart_id: str) -> str:
    """The kept threshold of Δ per step (the smallest kept Δ), refresh moments dashed."""
    if not any(math.isfinite(t) for t in curves.threshold):
        return ""
    return line_chart([Series("kept threshold of Δ", *_gapped(curves.steps, curves.threshold, 1))],
                      title="Kept threshold of Δ",
                      xlabel="step", ylabel="smallest kept Δ (nats)", chart_id=chart_id, markers=markers,
                      marker_label="refresh at step",
                      note="the smallest Δ among each step's kept tokens (top-γ of the batch); dashed: refreshes")


def delta_chart(deltas: EpisodeDeltas, chart_id: str, most: int = 12) -> str:
    """Δ per episode (fraction of the episode's tokens per bin) on an axis fitted to the data; at most ``most``
    episodes drawn, spread over the run."""
    if not deltas.counts:
        return ""
    edges, curves = deltas.curves()
    episodes = sorted(curves)
    if len(episodes) > most:
        step = (len(episodes) - 1) / (most - 1)
        episodes = sorted({episodes[round(i * step)] for i in range(most)})
    series = []
    for i, e in enumerate(episodes):
        shade = i / max(len(episodes) - 1, 1)  # early episodes light, late ones dark
        color = f"rgb({int(230 - 200 * shade)},{int(120 - 90 * shade)},{int(40 + 120 * shade)})"
        series.append(Series(f"episode {e}", edges, [*curves[e], None], color=color, steps=True, width=1.3))
    lo, hi = edges[0], edges[-1]
    return line_chart(series, title="Δ per episode", xlabel="Δ = ℓ(u) − ℓ(w̃) (nats)",
                      ylabel="fraction of the episode's tokens", chart_id=chart_id, xlim=(lo, hi),
                      note=f"axis fitted to the data: 0.2% to 99.8% of Δ ({lo:.2f} … {hi:.2f} nats)")


def _points(run: Run, summary_key: str, value: str, metric: str) -> tuple[list[float], list[float]]:
    pts = [(p["step"], p[value]) for p in (run.summary or {}).get(summary_key) or []
           if isinstance(p, dict) and p.get(value) is not None]
    if not pts:
        pts = run.metrics.get(metric, [])
    return [float(s) for s, _ in pts], [float(v) for _, v in pts]


def validation_chart(run: Run, chart_id: str) -> str:
    """The proxy's validation loss and the reference's (each refresh's first and last validation loss)."""
    xs, ys = _points(run, "validation", "loss", "metrics/eval/TokenLoss")
    series = [Series("proxy u", xs, ys)] if xs else []
    refs = [r for r in (run.summary or {}).get("refreshes") or [] if isinstance(r, dict)]
    last = [(r["step"], r["val_loss_last"]) for r in refs if r.get("val_loss_last") is not None]
    first = [(r["step"], r["val_loss_first"]) for r in refs if r.get("val_loss_first") is not None]
    if last:
        series.append(Series("w̃ after its refresh", [s for s, _ in last], [v for _, v in last]))
    if first:
        series.append(Series("w̃ before (= u)", [s for s, _ in first], [v for _, v in first],
                             dashed=True, width=1.0))
    if not series:
        return ""
    return line_chart(series, title="Validation loss", xlabel="step", ylabel="token loss (nats)", chart_id=chart_id,
                      markers=refresh_steps(run), marker_label="refresh at step")


def distance_chart(run: Run, chart_id: str) -> str:
    """‖u − w̃‖ per step, refresh moments dashed."""
    xs, ys = _points(run, "param_distance", "value", "blade/param_distance")
    if not xs:
        return ""
    return line_chart([Series("‖u − w̃‖₂", xs, ys)], title="Distance of the proxy to the reference", xlabel="step",
                      ylabel="‖u − w̃‖₂", chart_id=chart_id, markers=refresh_steps(run),
                      marker_label="refresh at step", note="dashed: refreshes (w̃ ← u, then K steps)")


def _engine_parts(run: Run) -> list[dict[str, Any]]:
    """The engine's part records (workers' output: ``scored/`` in exact mode, else the selected shards)."""
    for d in (os.path.join(run.path, "scored"), run.selected):
        if d is None:
            continue
        storage.refresh(os.path.join(d, "manifest.json"))
        m = Manifest.load_if_exists(d)
        if m is not None and any("worker" in r.state for r in m.shards):
            return [dict(r.state, tokens=r.tokens) for r in m.shards if r.complete]
    return []


def engine_charts(run: Run, chart_id: str) -> tuple[str, dict[str, Any]]:
    """For an engine run (the main job, batch curation): each worker's tokens/s per part, the trainer's waits per
    step; and the figures of a table (redone units, waits in all)."""
    engine = (run.summary or {}).get("engine") or {}
    facts: dict[str, Any] = {}
    if run.job == "curate":
        facts["redone units"] = (run.summary or {}).get("redone_units")
    if engine:
        facts.update({"mode": engine.get("mode"), "refresh": engine.get("refresh"), "workers": engine.get("workers"),
                      "units redone after a restart": engine.get("units_redone_after_restart"),
                      "trainer waited (s)": engine.get("trainer_wait_seconds")})
        scored = engine.get("scored") or {}
        if scored.get("seconds"):
            facts["scored tokens per worker-second"] = scored["tokens"] / scored["seconds"]
    charts = []
    parts = [p for p in _engine_parts(run) if p.get("seconds")]
    if parts:
        by: dict[int, list[tuple[float, float]]] = {}
        for p in sorted(parts, key=lambda p: int(p["first_step"])):
            by.setdefault(int(p["worker"]), []).append((float(p["first_step"]), p["tokens"] / p["seconds"]))
        series = [Series(f"worker {w}", [x for x, _ in pts], [y for _, y in pts]) for w, pts in sorted(by.items())]
        charts.append(line_chart(series, title="Scoring workers' throughput", xlabel="first step of the part",
                                 ylabel="tokens/s", chart_id=f"{chart_id}-workers",
                                 note="each part's tokens over the worker's seconds on it"))
    waits = [w for w in engine.get("trainer_waits") or [] if isinstance(w, dict)]
    if waits:
        charts.append(line_chart([Series("trainer wait", [w["step"] for w in waits], [w["seconds"] for w in waits],
                                         dots=True)],
                                 title="Trainer waits for the engine", xlabel="step", ylabel="seconds",
                                 chart_id=f"{chart_id}-waits", markers=refresh_steps(run),
                                 marker_label="refresh at step"))
    if not (facts or charts):
        return "", {}
    return "".join(charts), {k: v for k, v in facts.items() if v is not None}


def jaccard_chart(cmp: Comparison, colors: dict[str, str], chart_id: str) -> str:
    """Jaccard of the two runs' kept tokens per step, overall and per source."""
    if not cmp.steps:
        return ""
    series = [Series("all sources", cmp.steps, cmp.jaccard, color="#000000", width=2.2)]
    for s in sorted({s for d in cmp.by_source for s in d}):
        series.append(Series(s, cmp.steps, [d.get(s, math.nan) for d in cmp.by_source], color=colors.get(s),
                             width=1.2))
    return line_chart(series, title="Overlap of the kept tokens", xlabel="step", ylabel="Jaccard |A∩B| / |A∪B|",
                      chart_id=chart_id, ylim=(0.0, 1.0))
