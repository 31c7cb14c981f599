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

from bench.quality.compute import (
    amortized_total,
    break_even_runs,
    charged_selection,
    flops_to_reach,
    loss_at,
    mean_curve,
    run_flops,
    selection_flops,
    smooth,
)
from bench.quality.experiment import Runs, StageClock, run_prefix, train_all
from bench.quality.report import make_figures, results_md, seed_interval
from bench.quality.runs import REUSED, Evaluator, final_val
from bench.quality.setting import (
    CPU_ESTIMATE_MIN,
    EVAL_SETS,
    POLICIES,
    SETTINGS,
    SOURCES,
    TARGET_SET,
    Setting,
    data_configs,
    dev_source,
    document_hashes,
    eval_sources,
    model_config,
    run_shape,
)
from bench.quality.verdicts import (
    VERDICT_RULES,
    blade_vs_rho1_verdict,
    direction,
    native_verdict,
    reuse_summary,
    reuse_verdict,
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


def _native(r: Runs, setting: str, ev: Evaluator, base_ev: dict[str, DocScores]) -> dict[str, Any]:
    """One setting's proxy runs scored and compared (the first two questions)."""
    s, out, shape = r.s, r.out, run_shape(r.s)
    small, target_only, pre, main = model_config(s), (TARGET_SET,), run_prefix(setting), r.main[setting]

    def snap(res: dict[str, Any], step: int) -> str:
        return res["snapshots"][str(step)]

    def final_w(p: str, res: dict[str, Any]) -> str:
        return snap(res, s.steps) if p == "full" else res["final_weights"]

    ev_main = {p: [ev(f"{pre}{p}-seed{k}@{s.steps}", small, final_w(p, res)) for k, res in enumerate(rs)]
               for p, rs in main.items()}
    ev_eq = {p: [ev(f"{pre}full-seed{k}@{r.eq_steps[p]}", small, snap(full, r.eq_steps[p]))
                 for k, full in enumerate(main["full"])] for p in POLICIES[1:]}
    for p, rs in main.items():  # models/<setting-><policy>-seed<k>/: HF directories for jobs/evaluate.py
        for k, res in enumerate(rs):
            export_hf(build_causal_lm(small.model_copy(update={"weights": final_w(p, res)})), r.tokenizer,
                      os.path.join(out, "models", f"{pre}{p}-seed{k}"))
    curve_steps = sorted(int(n) for n in main["rho1"][0]["snapshots"] if int(n) <= s.steps)
    test_curves = {p: [[(0, base_ev[TARGET_SET].mean)] + [
        (n, ev(f"{pre}{p}-seed{k}@{n}", small, snap(res, n), sets=target_only)[TARGET_SET].mean) for n in curve_steps]
        for k, res in enumerate(rs)] for p, rs in main.items()}
    ref_w = main["rho1"][0].get("final_reference")
    val_src = data_configs(s, out)["pool"].validation[0]
    static_ref = _means(ev(f"{pre}static-reference", small, ref_w, extra=(val_src, dev_source(s))))
    margin = 0.1  # nats: "passed by a wide margin"
    passed = {p: [passed_at(c, static_ref[TARGET_SET], margin) for c in cs] for p, cs in test_curves.items()}
    compute_curves = {p: [[(run_flops(shape, p, pt["step"], r.best).total, pt["loss"]) for pt in res["validation"]]
                          for res in rs] for p, rs in main.items()}
    full_val_curve = [(run_flops(shape, "full", pt["step"]).total, pt["loss"]) for pt in main["full"][0]["validation"]]
    data = r.data["pool" if setting == SETTINGS[0] else "pool-paper"]
    domain = {src[0]: src[3] for src in SOURCES}
    pool_m = data.manifests["candidates"]
    pool_share = {k: c.sequences / pool_m.totals().sequences for k, c in pool_m.sources.items()}
    eq_tokens = {p: compare_seeds(ev_main[p], ev_main["full"]) for p in POLICIES[1:]}
    eq_compute = {p: compare_seeds(ev_main[p], ev_eq[p]) for p in POLICIES[1:]}
    blade_rho1 = compare_seeds(ev_main["blade"], ev_main["rho1"])
    seeds = len(main["full"])
    return {
        "pool_share": pool_share, "math_share": sum(v for k, v in pool_share.items() if domain[k] == "math"),
        "pool_counts": {k: c.model_dump() for k, c in pool_m.sources.items()},
        "eval": {p: [_means(e) for e in es] for p, es in ev_main.items()},
        "eval_equal_compute_full": {p: [_means(e) for e in es] for p, es in ev_eq.items()},
        "vs_full_equal_tokens": eq_tokens, "vs_full_equal_compute": eq_compute, "blade_vs_rho1": blade_rho1,
        "blade_vs_nosync": compare_seeds(ev_main["blade"], ev_main["blade-nosync"]),
        "verdicts": {"blade_vs_rho1": blade_vs_rho1_verdict(blade_rho1[TARGET_SET], seeds),
                     "native": {p: native_verdict(eq_compute[p][TARGET_SET], seeds) for p in POLICIES[2:]},
                     "native_all_sets": {p: {k: direction(v, seeds) for k, v in eq_compute[p].items()}
                                         for p in POLICIES[2:]}},
        "compute_curves": compute_curves, "full_val_compute_curve": full_val_curve,
        "test_curves": test_curves, "static_reference": static_ref, "passed_static_reference": passed,
        "pass_margin": margin,
        "step_seconds": {p: [res["step_seconds"] for res in rs] for p, rs in main.items()},
        "part_seconds": {p: {k: statistics.fmean(res["summary"]["seconds"].get(k, 0.0) / res["summary"]["steps"]
                                                for res in rs) for k in ("refresh", "score", "select")}
                         for p, rs in main.items()},
        "final_val": {p: [final_val(res, s.steps) for res in rs] for p, rs in main.items()},
        "val_curves": {p: [[pt for pt in res["validation"] if pt["step"] <= s.steps] for res in rs]
                       for p, rs in main.items()},
        "kept_share": {p: {k: v["kept_fraction"] for k, v in sorted(rs[0]["summary"]["tokens"]["per_source"].items())}
                       for p, rs in main.items()},
        "param_distance": {p: rs[0]["summary"].get("param_distance", []) for p, rs in main.items()},
        "delta_over_time": {p: delta_over_time([res["summary"] for res in main[p]])
                            for p in ("rho1", "blade", "blade-nosync")},
    }


def _reuse(r: Runs, setting: str, ev: Evaluator, tbase: dict[str, DocScores]) -> dict[str, Any]:
    """One setting's target runs, every reuse seed: replay − the same seed's `full`, at equal target steps and at
    equal total compute for every R in both accountings; "reaches" and break-even R on smoothed mean curves."""
    s, shape, tshape = r.s, run_shape(r.s), run_shape(r.s, target=True)
    big, target_only, pre, entry = model_config(s, target=True), (TARGET_SET,), run_prefix(setting), r.reuse[setting]
    per_step = run_flops(tshape, "full", 1).total
    T, base = s.steps * per_step, r.bases["proxy"]["flops"]
    seeds = len(entry["full"])

    def snap(res: dict[str, Any], step: int) -> str:
        return res["snapshots"][str(step)]

    full_pts = []  # per seed: [(FLOPs, scores)]
    for k, tfull in enumerate(entry["full"]):
        steps = sorted(int(n) for n in tfull["snapshots"])
        full_pts.append([(0.0, tbase)] + [(n * per_step, ev(f"{pre}target-full-seed{k}@{n}", big, snap(tfull, n),
                                                              sets=None if n >= s.steps else target_only))
                                          for n in steps])
    full_final = [next(sc for x, sc in pts if x == T) for pts in full_pts]
    full_mean = mean_curve([[(x, sc[TARGET_SET].mean) for x, sc in pts] for pts in full_pts])
    level = loss_at(smooth(full_mean, s.smooth_window), T)  # full's final target loss, smoothed
    out: dict[str, Any] = {
        "seeds": seeds, "target_steps": s.steps, "full_steps": entry["full"][0]["config"]["max_steps"],
        "target_step_flops": per_step, "full_flops": T, "proxy_base_flops": base, "base_vs_target_run": base / T,
        "full_final": [_means(f) for f in full_final], "full_curve": full_mean, "full_level_smoothed": level,
        "base": _means(tbase), "policies": {}, "break_even": {}}
    for p, reps in entry["replays"].items():
        sel = selection_flops(shape, p, s.steps, r.best)
        finals, curves = [], []
        for k, rep in enumerate(reps):
            steps_p = sorted(int(n) for n in rep["snapshots"])
            pts = [(0, tbase)] + [(n, ev(f"{pre}target-replay-{p}-seed{k}@{n}", big, snap(rep, n),
                                         sets=None if n == s.steps else target_only)) for n in steps_p]
            finals.append(pts[-1][1])
            curves.append([(n, sc[TARGET_SET].mean) for n, sc in pts])
        rep_mean = mean_curve(curves)
        rep_level = rep_mean[-1][1]  # the replay's final loss, mean over seeds (an end: smoothing keeps it)
        e: dict[str, Any] = {
            "selection_flops": sel, "selection_vs_target_run": sel / T, "final": [_means(f) for f in finals],
            "curve_steps": rep_mean, "equal_steps": compare_seeds(finals, full_final), "accountings": {}}
        e["equal_steps_verdict"] = direction(e["equal_steps"][TARGET_SET], seeds)
        for acct in ("charged", "free"):
            c = charged_selection(p, sel, base, charged=acct == "charged")
            per_r = {}
            for runs in s.reuse_runs:
                total = amortized_total(T, c, runs)
                ats, bound = [], False
                for pts in full_pts:
                    at = {k: interpolate_scores([(x, sc[k]) for x, sc in pts if k in sc], total) for k in finals[0]}
                    if any(v is None for v in at.values()):  # beyond full's run: its last snapshot, a bound
                        at, bound = dict(pts[-1][1]), True
                    ats.append(at)
                diff = compare_seeds(finals, ats)
                curve = smooth([(c / runs + n * per_step, v) for n, v in rep_mean], s.smooth_window)
                need = flops_to_reach(curve, level)
                per_r[str(runs)] = {
                    "total_flops": total, "curve": curve, "bound": bound,
                    "full_at_equal_compute": {k: statistics.fmean(a[k].mean for a in ats) for k in finals[0]},
                    "equal_compute": diff, "verdict": reuse_verdict(diff[TARGET_SET], seeds, bound=bound),
                    "flops_to_reach_full": need, "vs_full_flops": None if need is None else need / T}
            e["accountings"][acct] = {"selection": c, "runs": per_r,
                                      "summary": reuse_summary({n: v["verdict"] for n, v in per_r.items()},
                                                               s.reuse_runs)}
            out["break_even"].setdefault(p, {})[acct] = break_even_runs(c, T, full_mean, rep_level,
                                                                        window=s.smooth_window)
        out["policies"][p] = e
    return out


def dev_split(s: Setting) -> dict[str, Any]:
    """The dev split and its overlaps (by document text hashes) with the pool's GSM8K, the validation slice and
    every evaluation set: all zero, or the choices made on it would have seen evaluation data."""
    dev = dev_source(s)
    hashes = document_hashes(dev)
    cfg = data_configs(s, "/nonexistent")
    others = {"validation": cfg["pool"].validation[0],
              **{f"pool:{c.name}": c for c in cfg["pool"].sources if c.name == "gsm8k"},
              **{c.name: c for c in eval_sources(s)}}
    return {"source": dev.paths[0], "skip_documents": dev.skip_documents, "documents": len(hashes),
            "overlap": {name: len(hashes & document_hashes(src)) for name, src in others.items()}}


def analyse(r: Runs) -> dict[str, Any]:
    """Evaluate every run and compare; returns the JSON-ready results (``bench.quality.report`` renders them).
    The models are scored first, ``parallel_runs`` at a time (:meth:`Evaluator.prefetch`)."""
    s = r.s
    ev = Evaluator(r.out, r.tokenizer, eval_sources(s), max_len=s.seq_len, threads=s.threads, parallel=s.parallel_runs)
    ev.prefetch(lambda: _analyse(r, ev))
    return _analyse(r, ev)


def _analyse(r: Runs, ev: Evaluator) -> dict[str, Any]:
    s = r.s
    shape, tshape = run_shape(s), run_shape(s, target=True)
    small, big = model_config(s), model_config(s, target=True)
    base_ev = ev("base-proxy", small, r.bases["proxy"]["final_weights"])
    tbase = ev("base-target", big, r.bases["target"]["final_weights"])
    settings = {}
    for name in SETTINGS:
        settings[name] = _native(r, name, ev, base_ev)
        settings[name]["reuse"] = _reuse(r, name, ev, tbase) if r.reuse else {}
    full_step = run_flops(shape, "full", 1).total
    sweep = [{k: v for k, v in c.items() if k != "run"}
             | {"name": c["run"]["name"], "flops_vs_full": c["flops"]["total"] / (full_step * s.steps)}
             | ({"kt": c["setting"]["refresh_steps"] / s.tau} if c["policy"] == "blade" else {})
             for c in [*r.sweep, *r.rho1_sweep]]
    return {
        "verdict_rules": list(VERDICT_RULES), "settings": settings, "reuse_seeds": list(range(s.reuse_seeds)),
        "reuse_runs": list(s.reuse_runs),
        "break_even": {name: st["reuse"].get("break_even", {}) for name, st in settings.items()},
        "setting": _setting_dict(s), "best_refresh": r.best, "sweep": sweep, "sweep_budget": r.sweep_budget,
        "rho1_budget": r.rho1_budget, "dev_split": dev_split(s) | {"base_loss": r.dev_base},
        "eval_sets": EVAL_SETS, "target_set": TARGET_SET, "eval_documents": dict(ev.documents),
        "bases": {role: {k: b[k] for k in ("parameters", "tokens", "tokens_per_parameter", "epochs", "unique_tokens",
                                           "flops")}
                  | {"curve": b["validation"], "final_val": final_val(b), "run_seconds": b.get("run_seconds")}
                  for role, b in r.bases.items()},
        "base_eval": _means(base_ev), "target_base_eval": _means(tbase),
        "flops_ratio": tshape.forward_flops / shape.forward_flops,
        "equal_compute_steps": r.eq_steps, "flops": {p: run_flops(shape, p, s.steps, r.best).as_dict() for p in POLICIES},
        "full_step_flops": full_step, "estimate_minutes": CPU_ESTIMATE_MIN,
        "reused_runs": sorted(set(REUSED)),
    }


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
                else f"{platform.processor() or platform.machine()}, {s.all_threads} CPU threads"
                + (f", {s.parallel_runs} runs at a time of {s.threads} thread(s) each" if s.parallel_runs > 1 else ""))
    reading_path = os.path.join(out, "READING.md")
    reading = open(reading_path, encoding="utf-8").read() if os.path.exists(reading_path) else ""
    path = os.path.join(out, "RESULTS.md")
    atomic_write_text(path, results_md(results, figs, command, hardware=hardware, reading=reading))
    return path
