"""The quality benchmark's evaluation and comparisons: every finished run scored on the held-out sets, then

* **native selection** (the proxy): each policy vs ``full`` at equal proxy steps and at equal FLOPs, BLADE vs
  RHO-1 and vs its no-sync ablation, paired by seed with 95% t intervals; target-set curves over steps;
  the Δ distribution over time; when the proxies pass the static RHO-1 reference;
* **the baselines a team has**: every arm vs ``full+val`` (the target examples mixed into every batch) at equal
  compute; ``blade-lam1`` (the paper's λ) vs ``blade``;
* **forgetting**: each arm's loss on C4, WikiText-2 and LAMBADA against ``full`` (equal compute), ``full+val`` and
  the base model;
* **the choices**: dev loss versus FLOPs of every candidate of every family, the ones chosen, and each family's
  search FLOPs (a column of its own, charged to no verdict);
* **reused selection** (the target): each reused policy vs the target's ``full`` (and ``full+val``) at equal target
  steps, at equal total compute with the selector's whole run amortized over ``R`` target runs (``full`` read off
  its loss-versus-compute curve, per-document sums interpolated), the total FLOPs each needs to reach ``full``'s
  (and ``full+val``'s) final target-set loss, and the goal (``verdicts.GOAL``).

Every paired interval gets its family's pooled-SD interval beside it before any verdict is read
(``Intervals``, ``verdicts.pool``); then the verdicts and the pre-stated outcomes (``verdicts.outcomes``). Arms of
a recorded report (``bench.quality.recorded``) enter with their recorded per-seed means. Nothing here chooses
anything: every choice was made on the dev split in ``bench.quality.experiment``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

import torch

from bench.quality.clock import PAUSES, StageClock
from bench.quality.compute import run_flops
from bench.quality.experiment import train_all
from bench.quality.figures import make_figures
from bench.quality.plan import plan
from bench.quality.procs import shared_workers
from bench.quality.report import results_md
from bench.quality.runs import REUSED, Evaluator, final_val
from bench.quality.setting import (
    ARM_TEXT,
    BUDGET_MIN,
    CPU_ESTIMATE_MIN,
    EVAL_SETS,
    GENERAL_SETS,
    POLICIES,
    SELECTORS,
    SETTINGS,
    SOURCES,
    TARGET_SET,
    Setting,
    arm_policy,
    data_configs,
    dev_source,
    document_hashes,
    eval_sources,
    model_config,
    run_shape,
)
from bench.quality.stats import Intervals, compare_seeds, general_only, interpolate_scores
from bench.quality.target import reuse_analysis, reuse_verdicts
from bench.quality.trainer import FAMILIES, Runs, arms_of, curve_steps, run_prefix, score_means
from bench.quality.verdicts import (
    GOAL,
    VERDICT_RULES,
    blade_vs_rho1_verdict,
    direction,
    native_verdict,
    outcomes,
    outcomes_json,
)
from curation.core.stats import Histogram
from curation.evaluation.heldout import DocScores, export_hf
from curation.io.atomic import atomic_write_text
from curation.io.models import build_causal_lm

__all__ = ["run_benchmark", "analyse", "compare_seeds", "interpolate_scores", "share_above", "delta_over_time", "passed_at"]

QUANTILES = (0.1, 0.5, 0.9, 0.99)


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


def _final_w(arm: str, res: dict[str, Any], steps: int) -> str:
    return res["snapshots"][str(steps)] if arm in ("full", "full+val") else res["final_weights"]


def _arm_data(r: Runs, setting: str, arm: str, ev: Evaluator, base_ev: dict[str, DocScores]) -> dict[str, Any]:
    """One arm's per-seed numbers in one setting: trained (scored here) or from the recorded report."""
    s, shape, small, pre = r.s, run_shape(r.s), model_config(r.s), run_prefix(setting)
    if r.uses_recorded(setting, arm):
        d = r.recorded.native(setting, arm)
        d["scores"] = d["eval"]  # means only (paired t intervals need no more)
        d["recorded"] = True
        return d
    rs = r.main[setting][arm]
    scores = [ev(f"{pre}{arm}-seed{k}@{s.steps}", small, _final_w(arm, res, s.steps)) for k, res in enumerate(rs)]
    snaps = sorted(curve_steps(s.curve_interval, s.steps))
    sel = r.selection(setting, arm)
    policy = arm_policy(arm)
    summaries = [res["summary"] for res in rs]
    return {
        "recorded": False, "scores": scores, "eval": [score_means(e) for e in scores],
        "test_curves": [[(0, base_ev[TARGET_SET].mean)] + [
            (n, ev(f"{pre}{arm}-seed{k}@{n}", small, res["snapshots"][str(n)], sets=(TARGET_SET,))[TARGET_SET].mean)
            for n in snaps] for k, res in enumerate(rs)],
        "val_curves": [[pt for pt in res["validation"] if pt["step"] <= s.steps] for res in rs],
        "compute_curves": [[(run_flops(shape, policy, pt["step"], sel).total, pt["loss"]) for pt in res["validation"]
                            if pt["step"] <= s.steps] for res in rs],
        "final_val": [final_val(res, s.steps) for res in rs],
        "step_seconds": [res["step_seconds"] for res in rs],
        "part_seconds": {k: statistics.fmean(x["seconds"].get(k, 0.0) / x["steps"] for x in summaries)
                         for k in ("refresh", "score", "select")},
        "kept_share": {k: v["kept_fraction"] for k, v in sorted(rs[0]["summary"]["tokens"]["per_source"].items())},
        "param_distance": rs[0]["summary"].get("param_distance", []),
        "delta_over_time": delta_over_time(summaries) if arm in SELECTORS else None,
    }


def _native(r: Runs, setting: str, ev: Evaluator, base_ev: dict[str, DocScores], iv: Intervals) -> dict[str, Any]:
    """One setting's proxy arms scored and compared (the first two questions, forgetting, full+val)."""
    s, out, shape = r.s, r.out, run_shape(r.s)
    small, pre, main = model_config(s), run_prefix(setting), r.main[setting]
    arms = arms_of(s, setting)
    eq = r.eq_steps[setting]
    data = {a: _arm_data(r, setting, a, ev, base_ev) for a in arms}
    for a in arms:  # models/<setting-><arm>-seed<k>/: HF directories for jobs/evaluate.py (trained arms only)
        for k, res in enumerate(main.get(a, []) if not data[a]["recorded"] else []):
            export_hf(build_causal_lm(small.model_copy(update={"weights": _final_w(a, res, s.steps)})), r.tokenizer,
                      os.path.join(out, "models", f"{pre}{a}-seed{k}"))

    def at_eq(base: str, a: str) -> list[dict[str, DocScores]]:  # the baseline's snapshot at a's equal-compute step
        return [ev(f"{pre}{base}-seed{k}@{eq[a]}", small, res["snapshots"][str(eq[a])]) for k, res in enumerate(main[base])]

    fv = "full+val" in arms
    ev_eq = {a: at_eq("full", a) for a in arms if a != "full"}
    ev_eqv = {a: at_eq("full+val", a) for a in arms if fv and a not in ("full", "full+val")}
    sc = {a: data[a]["scores"] for a in arms}
    fam = f"proxy/{setting}"
    if data["rho1"]["recorded"]:
        static_ref = data["rho1"]["static_reference"]
    else:
        val_src = data_configs(s, out)["pool"].validation[0]
        static_ref = score_means(ev(f"{pre}static-reference", small, main["rho1"][0]["final_reference"],
                               extra=(val_src, dev_source(s))))
    margin = 0.1  # nats: "passed by a wide margin"
    passed = {a: [passed_at(c, static_ref[TARGET_SET], margin) for c in data[a]["test_curves"]] for a in arms}
    full_val_curve = [(run_flops(shape, "full", pt["step"]).total, pt["loss"]) for pt in main["full"][0]["validation"]]
    pool_m = r.data["pool" if setting == SETTINGS[0] else "pool-paper"].manifests["candidates"]
    domain = {src[0]: src[3] for src in SOURCES}
    pool_share = {k: c.sequences / pool_m.totals().sequences for k, c in pool_m.sources.items()}
    base_rows = [dict(base_ev) for _ in range(len(sc["full"]))]
    st: dict[str, Any] = {
        "arms": list(arms), "recorded_arms": [a for a in arms if data[a]["recorded"]],
        "best": r.best[setting], "equal_compute_steps": eq,
        "selection": {a: r.selection(setting, a) for a in arms},
        "validation_share": r.best[setting].get("full+val", {}).get("validation_share"),
        "pool_share": pool_share, "math_share": sum(v for k, v in pool_share.items() if domain[k] == "math"),
        "pool_counts": {k: c.model_dump() for k, c in pool_m.sources.items()},
        "eval": {a: data[a]["eval"] for a in arms},
        "eval_equal_compute_full": {a: [score_means(e) for e in es] for a, es in ev_eq.items()},
        "eval_equal_compute_fullval": {a: [score_means(e) for e in es] for a, es in ev_eqv.items()},
        "vs_full_equal_tokens": {a: iv.compare(fam, sc[a], sc["full"]) for a in arms if a != "full"},
        "vs_full_equal_compute": {a: iv.compare(fam, sc[a], ev_eq[a]) for a in arms if a != "full"},
        "vs_fullval_equal_compute": {a: iv.compare(fam, sc[a], ev_eqv[a]) for a in ev_eqv},
        "blade_vs_rho1": iv.compare(fam, sc["blade"], sc["rho1"]),
        "blade_vs_nosync": iv.compare(fam, sc["blade"], sc["blade-nosync"]),
        "lam1_vs_blade": iv.compare(fam, sc["blade-lam1"], sc["blade"]),
        "forgetting_vs_base": {a: general_only(iv.compare(f"{fam}/vs base", sc[a], base_rows)) for a in arms},
        "compute_curves": {a: data[a]["compute_curves"] for a in arms}, "full_val_compute_curve": full_val_curve,
        "test_curves": {a: data[a]["test_curves"] for a in arms}, "static_reference": static_ref,
        "passed_static_reference": passed, "pass_margin": margin,
        "step_seconds": {a: data[a]["step_seconds"] for a in arms},
        "part_seconds": {a: data[a]["part_seconds"] for a in arms},
        "final_val": {a: data[a]["final_val"] for a in arms}, "val_curves": {a: data[a]["val_curves"] for a in arms},
        "kept_share": {a: data[a]["kept_share"] for a in arms},
        "param_distance": {a: data[a]["param_distance"] for a in arms},
        "delta_over_time": {a: data[a]["delta_over_time"] for a in arms if a in SELECTORS},
    }
    if fv:  # blade against full+val at blade's equal compute (the outcomes read it both ways round)
        st["blade_vs_fullval"] = st["vs_fullval_equal_compute"]["blade"]
    return st


def _negated(iv: dict[str, Any]) -> dict[str, Any]:
    """``b − a`` from ``a − b`` (the same interval mirrored, its pooled one too)."""
    out = {"mean": -iv["mean"], "lo": -iv["hi"], "hi": -iv["lo"], "per_seed": [-x for x in iv["per_seed"]],
           "method": iv["method"]}
    if "pooled" in iv:
        out["pooled"] = {**iv["pooled"], "lo": -iv["pooled"]["hi"], "hi": -iv["pooled"]["lo"]}
    return out


def _native_verdicts(st: dict[str, Any], seeds: int) -> dict[str, Any]:
    t = TARGET_SET
    sel = [a for a in st["arms"] if a in SELECTORS]
    v = {"blade_vs_rho1": blade_vs_rho1_verdict(st["blade_vs_rho1"][t], seeds),
         "native": {a: native_verdict(st["vs_full_equal_compute"][a][t], seeds) for a in sel},
         "native_all_sets": {a: {k: direction(x, seeds) for k, x in st["vs_full_equal_compute"][a].items()}
                             for a in st["vs_full_equal_compute"]},
         "lam1_vs_blade": direction(st["lam1_vs_blade"][t], seeds)}
    if st["vs_fullval_equal_compute"]:
        v["vs_fullval"] = {a: {k: direction(x, seeds) for k, x in st["vs_fullval_equal_compute"][a].items()}
                           for a in st["vs_fullval_equal_compute"]}
    v["forgetting_vs_base"] = {a: {k: direction(x, seeds) for k, x in d.items()}
                               for a, d in st["forgetting_vs_base"].items()}
    return v


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


def _search(r: Runs, setting: str, full_run: float) -> dict[str, Any]:
    """Each family's search in one setting: its candidates' whole runs' FLOPs, in `full` runs (charged to no
    verdict: the report's "search" column)."""
    out = {}
    for fam in FAMILIES:
        rows = [x for x in r.sweep if x["in_setting"] == setting and x["policy"] == fam]
        if rows:
            out[fam] = {"candidates": len(rows), "flops": sum(x["flops"]["total"] for x in rows),
                        "full_runs": sum(x["flops"]["total"] for x in rows) / full_run,
                        "recorded": any(x.get("recorded") for x in rows)}
    return out


def _arm_search(search: dict[str, Any], arm: str) -> float:
    """The search FLOPs (in `full` runs) charged to an arm: its family's (blade-lam1 and blade-nosync take BLADE's,
    whose choice they follow or were among)."""
    fam = "blade" if arm.startswith("blade") else arm
    return search.get(fam, {}).get("full_runs", 0.0)


def _analyse(r: Runs, ev: Evaluator) -> dict[str, Any]:
    s = r.s
    shape, tshape = run_shape(s), run_shape(s, target=True)
    small, big = model_config(s), model_config(s, target=True)
    base_ev = ev("base-proxy", small, r.bases["proxy"]["final_weights"])
    tbase = ev("base-target", big, r.bases["target"]["final_weights"])
    iv = Intervals()
    settings = {}
    for name in SETTINGS:
        settings[name] = _native(r, name, ev, base_ev, iv)
        settings[name]["reuse"] = reuse_analysis(r, name, ev, tbase, iv) if r.reuse else {}
    iv.pool()  # every interval of the analysis is made: pool each family's seed SD, then decide
    full_step = run_flops(shape, "full", 1).total
    for name, st in settings.items():
        st["verdicts"] = _native_verdicts(st, len(st["eval"]["full"]))
        if "blade_vs_fullval" in st:
            st["fullval_vs_blade"] = {k: _negated(v) for k, v in st["blade_vs_fullval"].items()}
        if st["reuse"]:
            reuse_verdicts(st["reuse"], s)
        st["flops"] = {a: run_flops(shape, arm_policy(a), s.steps, r.selection(name, a)).as_dict() for a in st["arms"]}
        st["search"] = _search(r, name, full_step * s.steps)
        st["search_full_runs"] = {a: _arm_search(st["search"], a) for a in st["arms"]}
    sweep = [{k: v for k, v in c.items() if k != "run"}
             | {"name": c["run"]["name"] if c.get("run") else c.get("name"),
                "flops_vs_full": c["flops"]["total"] / (full_step * s.steps)}
             | ({"kt": c["setting"]["refresh_steps"] / s.tau} if c["policy"] == "blade" else {})
             for c in r.sweep]
    seeds = min(len(st["eval"]["full"]) for st in settings.values())
    choices = {name: {fam: {"chosen": r.best[name][fam], "budget": r.budgets.get(name, {}).get(fam),
                            "candidates": [x["setting"] for x in sweep if x["in_setting"] == name and x["policy"] == fam],
                            "dev_at_budget": [x["dev_at_budget"] for x in sweep
                                              if x["in_setting"] == name and x["policy"] == fam]}
                      for fam in r.best[name]} for name in SETTINGS}
    rec = r.recorded
    return {
        "verdict_rules": list(VERDICT_RULES), "outcomes_stated": outcomes_json(),
        "outcomes": outcomes(settings, seeds, paper=SETTINGS[1]), "goal": dict(GOAL),
        "settings": settings, "reuse_seeds": list(range(s.reuse_seeds)), "reuse_runs": list(s.reuse_runs),
        "arms": list(POLICIES), "arm_text": ARM_TEXT,
        "break_even": {name: st["reuse"].get("break_even", {}) for name, st in settings.items()},
        "setting": _setting_dict(s), "best": r.best, "choices": choices, "sweep": sweep, "sweep_budgets": r.budgets,
        "dev_split": dev_split(s) | {"base_loss": r.dev_base},
        "eval_sets": EVAL_SETS, "target_set": TARGET_SET, "general_sets": list(GENERAL_SETS),
        "eval_documents": dict(ev.documents),
        "bases": {role: {k: b[k] for k in ("parameters", "tokens", "tokens_per_parameter", "epochs", "unique_tokens",
                                           "flops")}
                  | {"curve": b["validation"], "final_val": final_val(b), "run_seconds": b.get("run_seconds")}
                  for role, b in r.bases.items()},
        "base_eval": score_means(base_ev), "target_base_eval": score_means(tbase),
        "flops_ratio": tshape.forward_flops / shape.forward_flops,
        "equal_compute_steps": r.eq_steps, "flops": {name: st["flops"] for name, st in settings.items()},
        "full_step_flops": full_step, "target_steps": r.target_steps,
        "target_full_decides_r": min(s.reuse_runs),
        "estimate_minutes": CPU_ESTIMATE_MIN, "budget_minutes": BUDGET_MIN, "plan": plan(s),
        "recorded": None if rec is None else {
            "path": s.recorded, "sha256": rec.sha256, "used": r.recorded_ok(), "differences": r.recorded_differences,
            "checks": r.checks.rows, "trained_after_a_failed_check": r.trained_recorded,
            "arms": {name: st["recorded_arms"] for name, st in settings.items()},
            "replays": {name: (st["reuse"] or {}).get("recorded_replays", []) for name, st in settings.items()}},
        "reused_runs": sorted(set(REUSED)),
    }


def _setting_dict(s) -> dict[str, Any]:
    return asdict(s)


def pauses(out: str) -> dict[str, Any]:
    """The pause log the stage clock wrote (``out/pauses.jsonl``): every stopped interval, their count and
    minutes."""
    path = os.path.join(out, PAUSES)
    rows = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return {"count": len(rows), "minutes": sum(x["seconds"] for x in rows) / 60, "log": rows}


def run_benchmark(s: Setting, out: str, *, until: str | None, command: str, preset: str) -> str | None:
    """Train every stage up to ``until``; without ``until``, evaluate, and write ``results.json``, the figures and
    ``RESULTS.md`` (with ``out/READING.md``, the hand-written reading, when present). Returns RESULTS.md's path.
    Every stage's worker processes are one pool (:func:`~bench.quality.procs.shared_workers`)."""
    with shared_workers(s.parallel_runs):
        runs = train_all(s, out, until=until)
        if until is not None:
            return None
        clock = StageClock(out)
        with clock.stage("evaluate"):  # timed like the training stages (the evaluation cache makes a rerun cheap)
            results = analyse(runs)
            figs = make_figures(results, os.path.join(out, "figures"))
    results.update(preset=preset, stage_times=clock.times, pauses=pauses(out))
    atomic_write_text(os.path.join(out, "results.json"), json.dumps(results, indent=1))
    hardware = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                else f"{platform.processor() or platform.machine()}, {s.all_threads} CPU threads"
                + (f", {s.parallel_runs} runs at a time of {s.threads} thread(s) each" if s.parallel_runs > 1 else ""))
    reading_path = os.path.join(out, "READING.md")
    reading = open(reading_path, encoding="utf-8").read() if os.path.exists(reading_path) else ""
    path = os.path.join(out, "RESULTS.md")
    atomic_write_text(path, results_md(results, figs, command, hardware=hardware, reading=reading))
    return path
