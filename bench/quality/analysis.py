"""The quality benchmark's evaluation and comparisons: every finished run scored on the held-out sets, then

* **native selection** (the proxy): each policy vs ``full`` at equal proxy steps and at equal FLOPs, BLADE vs
  RHO-1 and vs its no-sync ablation, paired by seed with 95% t intervals; target-set curves over steps;
  the Δ distribution over time; when the proxies pass the static RHO-1 reference;
* **the refresh frontier**: validation loss versus FLOPs of each refresh strength, and the one chosen;
* **reused selection** (the target): each reused policy vs the target's ``full`` at equal target steps, at
  equal total compute with the selector's whole run amortized over ``R`` target runs (``full`` read off its
  loss-versus-compute curve, per-document sums interpolated, so the difference keeps a paired bootstrap), and
  the total FLOPs each needs to reach ``full``'s final target-set loss.

Nothing here chooses anything: the only choice (the refresh strength) was made on validation loss in
``bench.quality.experiment``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

import torch

from bench.quality.compute import amortized_total, flops_to_reach, loss_at, run_flops, selection_flops
from bench.quality.experiment import Runs, StageClock, train_all
from bench.quality.report import make_figures, results_md, seed_interval
from bench.quality.runs import REUSED, Evaluator, final_val
from bench.quality.setting import (
    EVAL_SETS,
    POLICIES,
    SOURCES,
    TARGET_SET,
    Setting,
    data_configs,
    eval_sources,
    model_config,
    run_shape,
)
from curation.core.stats import Histogram
from curation.evaluation.heldout import DocScores, export_hf, paired_difference
from curation.io.atomic import atomic_write_text
from curation.io.models import build_causal_lm

__all__ = ["run_benchmark", "analyse", "compare_seeds", "interpolate_scores", "share_above", "delta_over_time", "passed_at"]

QUANTILES = (0.1, 0.5, 0.9, 0.99)


def _means(scores: dict[str, DocScores]) -> dict[str, float]:
    return {k: v.mean for k, v in scores.items()}


def compare_seeds(a: list[dict[str, DocScores]], b: list[dict[str, DocScores]]) -> dict[str, dict[str, Any]]:
    """Per set: mean of a − b over seeds with a 95% interval (t over seeds; one seed: document bootstrap)."""
    out = {}
    for name in a[0]:
        diffs = [x[name].mean - y[name].mean for x, y in zip(a, b, strict=True)]
        if len(diffs) > 1:
            iv, method = seed_interval(diffs), f"t over {len(diffs)} seeds"
        else:
            iv, method = paired_difference(a[0][name], b[0][name], rounds=1000, seed=0), "document bootstrap, 1 seed"
        out[name] = {"mean": iv.value, "lo": iv.lo, "hi": iv.hi, "per_seed": diffs, "method": method}
    return out


def interpolate_scores(points: list[tuple[float, DocScores]], flops: float) -> DocScores | None:
    """Per-document loss sums at ``flops`` on a (compute, scores) curve, linear between the two snapshots around
    it (token counts are the same documents'); the mean of the result is :func:`loss_at` of the means."""
    for (x0, s0), (x1, s1) in zip(points, points[1:], strict=False):
        if x0 <= flops <= x1:
            w = (flops - x0) / (x1 - x0)
            return DocScores((1 - w) * s0.sums + w * s1.sums, s0.counts)
    return points[0][1] if len(points) == 1 and points[0][0] == flops else None


def share_above(h: Histogram, x: float) -> float:
    """Fraction of a histogram's values above ``x`` (linear within a bin)."""
    if h.total == 0:
        return float("nan")
    above = 0.0
    for i, c in enumerate(h.counts):
        lo = h.edges[i - 1] if i > 0 else float("-inf")
        hi = h.edges[i] if i < len(h.edges) else float("inf")
        if lo >= x:
            above += c
        elif hi > x:  # the bin holding x (outer bins: all or nothing)
            above += c * ((hi - x) / (hi - lo) if lo != float("-inf") and hi != float("inf") else 0.0)
    return above / h.total


def delta_over_time(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per episode, the Δ distribution of the kept-or-not candidate tokens pooled over seeds: quantiles and the
    share of tokens the proxy still has more to learn on than the reference (Δ > 0)."""
    pooled: dict[int, Histogram] = {}
    for summary in summaries:
        for e, h in (summary.get("delta_histograms") or {}).items():
            hist = Histogram.from_dict(h)
            pooled[int(e)] = pooled[int(e)] + hist if int(e) in pooled else hist
    return [{"episode": e, "tokens": h.total, "positive": share_above(h, 0.0),
             **{f"q{q}": h.quantile(q) for q in QUANTILES}} for e, h in sorted(pooled.items())]


def passed_at(curve: list[tuple[int, float]], reference: float, margin: float) -> int | None:
    """First step of a (step, loss) curve below ``reference − margin``; None when it never gets there."""
    return next((n for n, v in curve if v < reference - margin), None)


def analyse(r: Runs) -> dict[str, Any]:
    """Evaluate every run and compare; returns the JSON-ready results (``bench.quality.report`` renders them)."""
    s, out = r.s, r.out
    shape, tshape = run_shape(s), run_shape(s, target=True)
    ev = Evaluator(out, r.tokenizer, eval_sources(s), max_len=s.seq_len)
    small, big = model_config(s), model_config(s, target=True)
    target_only = (TARGET_SET,)

    def snap(res: dict[str, Any], step: int) -> str:
        return res["snapshots"][str(step)]

    # ---- native selection (proxy) --------------------------------------------------------------------
    def final_w(p: str, res: dict[str, Any]) -> str:
        return snap(res, s.steps) if p == "full" else res["final_weights"]

    ev_main = {p: [ev(f"{p}-seed{k}@{s.steps}", small, final_w(p, res)) for k, res in enumerate(rs)]
               for p, rs in r.main.items()}
    ev_eq = {p: [ev(f"full-seed{k}@{r.eq_steps[p]}", small, snap(full, r.eq_steps[p]))
                 for k, full in enumerate(r.main["full"])] for p in POLICIES[1:]}
    for p, rs in r.main.items():  # models/<policy>-seed<k>/: HF directories for jobs/evaluate.py
        for k, res in enumerate(rs):
            export_hf(build_causal_lm(small.model_copy(update={"weights": final_w(p, res)})), r.tokenizer,
                      os.path.join(out, "models", f"{p}-seed{k}"))
    base_ev = ev("base-proxy", small, r.bases["proxy"]["final_weights"])
    curve_steps = sorted(int(n) for n in r.main["rho1"][0]["snapshots"] if int(n) <= s.steps)
    test_curves = {p: [[(0, base_ev[TARGET_SET].mean)] + [
        (n, ev(f"{p}-seed{k}@{n}", small, snap(res, n), sets=target_only)[TARGET_SET].mean) for n in curve_steps]
        for k, res in enumerate(rs)] for p, rs in r.main.items()}
    ref_w = r.main["rho1"][0].get("final_reference")
    val_src = data_configs(s, out)["pool"].validation[0]
    static_ref = _means(ev("static-reference", small, ref_w, extra=(val_src,)))
    margin = 0.1  # nats: "passed by a wide margin"
    passed = {p: [passed_at(c, static_ref[TARGET_SET], margin) for c in cs] for p, cs in test_curves.items()}
    flops = {p: run_flops(shape, p, s.steps, r.best).as_dict() for p in POLICIES}
    full_step = run_flops(shape, "full", 1).total
    compute_curves = {p: [[(run_flops(shape, p, pt["step"], r.best).total, pt["loss"]) for pt in res["validation"]]
                          for res in rs] for p, rs in r.main.items()}
    sweep = [{k: v for k, v in c.items() if k != "run"} | {"name": c["run"]["name"], "kt": c["setting"]["refresh_steps"] / s.tau,
                                                           "flops_vs_full": c["flops"]["total"] / (full_step * s.steps)}
             for c in r.sweep]
    full_val_curve = [(run_flops(shape, "full", pt["step"]).total, pt["loss"]) for pt in r.main["full"][0]["validation"]]

    # ---- reused selection (target) -------------------------------------------------------------------
    reuse: dict[str, Any] = {}
    if r.target_full is not None:
        per_step = run_flops(tshape, "full", 1).total
        tfull = r.target_full
        t_steps = sorted(int(n) for n in tfull["snapshots"])
        tbase = ev("base-target", big, r.bases["target"]["final_weights"])
        full_pts = [(0.0, tbase)] + [
            (n * per_step, ev(f"target-full@{n}", big, snap(tfull, n), sets=None if n >= s.steps else target_only))
            for n in t_steps]
        full_final = next(sc for x, sc in full_pts if x == s.steps * per_step)
        full_curve = [(x, sc[TARGET_SET].mean) for x, sc in full_pts]
        reuse = {"target_forward_flops": tshape.forward_flops, "proxy_forward_flops": shape.forward_flops,
                 "flops_ratio": tshape.forward_flops / shape.forward_flops, "target_step_flops": per_step,
                 "target_steps": s.steps, "full_steps": r.target_full["config"]["max_steps"],
                 "full_final": _means(full_final), "full_curve": full_curve, "base": _means(tbase),
                 "full_flops": s.steps * per_step, "policies": {}}
        for p, rep in r.replays.items():
            sel = selection_flops(shape, p, s.steps, r.best)
            steps_p = sorted(int(n) for n in rep["snapshots"])
            pts = [(0, tbase)] + [(n, ev(f"target-replay-{p}@{n}", big, snap(rep, n),
                                         sets=None if n == s.steps else target_only)) for n in steps_p]
            final = pts[-1][1]
            entry: dict[str, Any] = {
                "selection_flops": sel, "selection_vs_target_run": sel / (s.steps * per_step),
                "final": _means(final), "curve_steps": [(n, sc[TARGET_SET].mean) for n, sc in pts],
                "equal_steps": {k: _iv(paired_difference(final[k], full_final[k], rounds=1000, seed=0))
                                for k in final},
                "amortized": {}}
            for runs in s.reuse_runs:
                total = amortized_total(s.steps * per_step, sel, runs)
                at = {k: interpolate_scores([(x, sc[k]) for x, sc in full_pts if k in sc], total) for k in final}
                curve = [(sel / runs + n * per_step, sc[TARGET_SET].mean) for n, sc in pts]
                need = flops_to_reach(curve, full_final[TARGET_SET].mean)
                entry["amortized"][str(runs)] = {
                    "total_flops": total, "curve": curve,
                    "full_at_equal_compute": {k: v.mean for k, v in at.items() if v is not None},
                    "equal_compute": {k: _iv(paired_difference(final[k], v, rounds=1000, seed=0))
                                      for k, v in at.items() if v is not None},
                    "flops_to_reach_full": need,
                    "vs_full_flops": None if need is None else need / (s.steps * per_step),
                }
            reuse["policies"][p] = entry
        reuse["full_equal_compute_check"] = loss_at(full_curve, s.steps * per_step)

    domain = {src[0]: src[3] for src in SOURCES}
    pool_m = r.data["pool"].manifests["candidates"]
    pool_share = {k: c.sequences / pool_m.totals().sequences for k, c in pool_m.sources.items()}
    return {
        "setting": _setting_dict(s), "best_refresh": r.best, "sweep": sweep, "sweep_budget": r.sweep_budget,
        "eval_sets": EVAL_SETS, "target_set": TARGET_SET, "eval_documents": dict(ev.documents),
        "pool_share": pool_share, "math_share": sum(v for k, v in pool_share.items() if domain[k] == "math"),
        "pool_counts": {k: c.model_dump() for k, c in pool_m.sources.items()},
        "bases": {role: {k: b[k] for k in ("parameters", "tokens", "tokens_per_parameter", "epochs", "unique_tokens")}
                  | {"curve": b["validation"], "final_val": final_val(b), "run_seconds": b.get("run_seconds")}
                  for role, b in r.bases.items()},
        "base_eval": _means(base_ev),
        "eval": {p: [_means(e) for e in es] for p, es in ev_main.items()},
        "eval_equal_compute_full": {p: [_means(e) for e in es] for p, es in ev_eq.items()},
        "vs_full_equal_tokens": {p: compare_seeds(ev_main[p], ev_main["full"]) for p in POLICIES[1:]},
        "vs_full_equal_compute": {p: compare_seeds(ev_main[p], ev_eq[p]) for p in POLICIES[1:]},
        "blade_vs_rho1": compare_seeds(ev_main["blade"], ev_main["rho1"]),
        "blade_vs_nosync": compare_seeds(ev_main["blade"], ev_main["blade-nosync"]),
        "equal_compute_steps": r.eq_steps, "flops": flops, "full_step_flops": full_step,
        "compute_curves": compute_curves, "full_val_compute_curve": full_val_curve,
        "test_curves": test_curves, "static_reference": static_ref, "passed_static_reference": passed,
        "pass_margin": margin,
        "step_seconds": {p: [res["step_seconds"] for res in rs] for p, rs in r.main.items()},
        "part_seconds": {p: {k: statistics.fmean(res["summary"]["seconds"].get(k, 0.0) / res["summary"]["steps"]
                                                for res in rs) for k in ("refresh", "score", "select")}
                         for p, rs in r.main.items()},
        "final_val": {p: [final_val(res, s.steps) for res in rs] for p, rs in r.main.items()},
        "val_curves": {p: [[pt for pt in res["validation"] if pt["step"] <= s.steps] for res in rs]
                       for p, rs in r.main.items()},
        "kept_share": {p: {k: v["kept_fraction"] for k, v in sorted(rs[0]["summary"]["tokens"]["per_source"].items())}
                       for p, rs in r.main.items()},
        "param_distance": {p: rs[0]["summary"].get("param_distance", []) for p, rs in r.main.items()},
        "delta_over_time": {p: delta_over_time([res["summary"] for res in r.main[p]])
                            for p in ("rho1", "blade", "blade-nosync")},
        "reuse": reuse,
        "reused_runs": sorted(set(REUSED)),
    }


def _iv(iv) -> dict[str, float]:
    return {"mean": iv.value, "lo": iv.lo, "hi": iv.hi, "method": "document bootstrap, 1 seed"}


def _setting_dict(s) -> dict[str, Any]:
    return asdict(s)


def run_benchmark(s: Setting, out: str, *, until: str | None, command: str, preset: str) -> str | None:
    """Train every stage up to ``until``; without ``until``, evaluate, and write ``results.json``, the figures and
    ``RESULTS.md`` (with ``out/READING.md``, the hand-written reading, when present). Returns RESULTS.md's path."""
    runs = train_all(s, out, until=until)
    if until is not None:
        return None
    clock = StageClock(out)
    with clock.stage("evaluate"):  # timed like the training stages (the evaluation cache makes a rerun cheap)
        results = analyse(runs)
        figs = make_figures(results, os.path.join(out, "figures"))
    results.update(preset=preset, stage_times=clock.times)
    atomic_write_text(os.path.join(out, "results.json"), json.dumps(results, indent=1))
    hardware = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                else f"{platform.processor() or platform.machine()}, {s.threads} CPU threads")
    reading_path = os.path.join(out, "READING.md")
    reading = open(reading_path, encoding="utf-8").read() if os.path.exists(reading_path) else ""
    path = os.path.join(out, "RESULTS.md")
    atomic_write_text(path, results_md(results, figs, command, hardware=hardware, reading=reading))
    return path
