"""The quality benchmark's reuse analysis: the target's runs of one setting (its ``full``, ``full+val`` and each
seed's replays, trained or from the recorded report) compared at equal target steps and at equal total compute for
every R in both accountings, "reaches", break-even R, the goal and forgetting."""

from __future__ import annotations

import statistics
from typing import Any

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
from bench.quality.runs import Evaluator
from bench.quality.setting import GENERAL_SETS, TARGET_SET, Setting, arm_policy, model_config, run_shape
from bench.quality.stats import Intervals, general_only, interpolate_scores, value_mean
from bench.quality.trainer import Runs, reuse_policies, run_prefix, score_means
from bench.quality.verdicts import GOAL, direction, goal_met, reuse_summary, reuse_verdict
from curation.evaluation.heldout import DocScores

__all__ = ["reuse_analysis", "reuse_verdicts"]


def reuse_analysis(r: Runs, setting: str, ev: Evaluator, tbase: dict[str, DocScores], iv: Intervals) -> dict[str, Any]:
    """One setting's target runs, every reuse seed: replay − the same seed's `full` (and `full+val`), at equal
    target steps and at equal total compute for every R in both accountings; "reaches", break-even R and the
    goal on smoothed mean curves; forgetting."""
    s, shape, tshape = r.s, run_shape(r.s), run_shape(r.s, target=True)
    big, target_only, pre, entry = model_config(s, target=True), (TARGET_SET,), run_prefix(setting), r.reuse[setting]
    per_step = run_flops(tshape, "full", 1).total
    T, base = s.steps * per_step, r.bases["proxy"]["flops"]
    seeds = len(entry["full"])
    fam = f"target/{setting}"

    def points(name: str, res: dict[str, Any], last: int) -> list[tuple[int, dict[str, DocScores]]]:
        steps = sorted(int(n) for n in res["snapshots"])
        return [(0, tbase)] + [(n, ev(f"{name}@{n}", big, res["snapshots"][str(n)],
                                      sets=None if n == last else target_only)) for n in steps]

    full_pts = []  # per seed: [(FLOPs, scores)]
    for k, tfull in enumerate(entry["full"]):
        steps = sorted(int(n) for n in tfull["snapshots"])
        full_pts.append([(0.0, tbase)] + [(n * per_step, ev(f"{pre}target-full-seed{k}@{n}", big,
                                                              tfull["snapshots"][str(n)],
                                                              sets=None if n >= s.steps else target_only))
                                          for n in steps])
    full_final = [next(sc for x, sc in pts if x == T) for pts in full_pts]
    full_mean = mean_curve([[(x, sc[TARGET_SET].mean) for x, sc in pts] for pts in full_pts])
    level = loss_at(smooth(full_mean, s.smooth_window), T)  # full's final target loss, smoothed
    tbase_rows = [dict(tbase) for _ in range(seeds)]
    out: dict[str, Any] = {
        "seeds": seeds, "target_steps": s.steps, "full_steps": entry["full"][0]["config"]["max_steps"],
        "target_step_flops": per_step, "full_flops": T, "proxy_base_flops": base, "base_vs_target_run": base / T,
        "full_final": [score_means(f) for f in full_final], "full_curve": full_mean, "full_level_smoothed": level,
        "full_forgetting_vs_base": general_only(iv.compare(f"{fam}/vs base", full_final, tbase_rows)),
        "base": score_means(tbase), "policies": {}, "break_even": {}, "recorded_replays": []}
    fv_final = fv_level = None
    if entry.get("full+val"):
        fv_pts = [points(f"{pre}target-full+val-seed{k}", res, s.steps) for k, res in enumerate(entry["full+val"])]
        fv_final = [pts[-1][1] for pts in fv_pts]
        fv_mean = mean_curve([[(n, sc[TARGET_SET].mean) for n, sc in pts] for pts in fv_pts])
        fv_level = fv_mean[-1][1]  # its final loss, mean over seeds (an end: smoothing keeps it)
        out.update({
            "fullval_final": [score_means(f) for f in fv_final], "fullval_curve_steps": fv_mean, "fullval_level": fv_level,
            "fullval_vs_full_equal_steps": iv.compare(fam, fv_final, full_final),
            "fullval_forgetting_vs_base": general_only(iv.compare(f"{fam}/vs base", fv_final, tbase_rows)),
            "fullval_reach_full": flops_to_reach(smooth([(n * per_step, v) for n, v in fv_mean], s.smooth_window),
                                                 level)})
    for p in reuse_policies(s, setting):
        sel = selection_flops(shape, arm_policy(p), s.steps, r.selection(setting, p))
        if r.uses_recorded(setting, p, replay=True):
            rec = r.recorded.replay(setting, p)
            finals, rep_mean = rec["final"], rec["curve_steps"]
            out["recorded_replays"].append(p)
        else:
            finals, curves = [], []
            for k, rep in enumerate(entry["replays"][p]):
                pts = points(f"{pre}target-replay-{p}-seed{k}", rep, s.steps)
                finals.append(pts[-1][1])
                curves.append([(n, sc[TARGET_SET].mean) for n, sc in pts])
            rep_mean = mean_curve(curves)
        rep_level = rep_mean[-1][1]  # the replay's final loss, mean over seeds (an end: smoothing keeps it)
        e: dict[str, Any] = {
            "selection_flops": sel, "selection_vs_target_run": sel / T,
            "final": [{k: value_mean(v) for k, v in f.items()} for f in finals],
            "curve_steps": rep_mean, "equal_steps": iv.compare(fam, finals, full_final), "accountings": {}}
        e["forgetting_vs_base"] = general_only(iv.compare(f"{fam}/vs base", finals, tbase_rows))
        if fv_final is not None:
            e["vs_fullval_equal_steps"] = iv.compare(fam, finals, fv_final)
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
                diff = iv.compare(fam, finals, ats)
                curve = smooth([(c / runs + n * per_step, v) for n, v in rep_mean], s.smooth_window)
                need = flops_to_reach(curve, level)
                need_fv = None if fv_level is None else flops_to_reach(curve, fv_level)
                per_r[str(runs)] = {
                    "total_flops": total, "curve": curve, "bound": bound,
                    "full_at_equal_compute": {k: statistics.fmean(value_mean(a[k]) for a in ats) for k in finals[0]},
                    "equal_compute": diff, "flops_to_reach_full": need, "vs_full_flops": None if need is None else need / T,
                    **({} if fv_level is None else {"flops_to_reach_fullval": need_fv,
                                                    "vs_fullval_flops": None if need_fv is None else need_fv / T})}
            e["accountings"][acct] = {"selection": c, "runs": per_r}
            out["break_even"].setdefault(p, {})[acct] = break_even_runs(c, T, full_mean, rep_level,
                                                                        window=s.smooth_window)
        out["policies"][p] = e
    return out


def _goal(out: dict[str, Any]) -> dict[str, Any]:
    """The goal table of one setting's reuse (verdicts.GOAL): per replayed policy, its reach at R = GOAL runs with
    the base charged and its mean forgetting per general set, against `full` and against `full+val`."""
    n = str(GOAL["runs"])
    rows = {}
    for p, e in out["policies"].items():
        x = e["accountings"]["charged"]["runs"].get(n)
        if x is None:
            continue
        forget = {k: e["equal_steps"][k]["mean"] for k in GENERAL_SETS}
        row = {"vs_full": {"reach": x["vs_full_flops"], "forgetting": forget,
                           "met": goal_met(x["vs_full_flops"], forget)}}
        if "vs_fullval_equal_steps" in e:
            fg = {k: e["vs_fullval_equal_steps"][k]["mean"] for k in GENERAL_SETS}
            row["vs_fullval"] = {"reach": x["vs_fullval_flops"], "forgetting": fg,
                                 "met": goal_met(x["vs_fullval_flops"], fg)}
        rows[p] = row
    return {**GOAL, "policies": rows}


def reuse_verdicts(out: dict[str, Any], s: Setting) -> None:
    seeds = out["seeds"]
    for e in out["policies"].values():
        e["equal_steps_verdict"] = direction(e["equal_steps"][TARGET_SET], seeds)
        if "vs_fullval_equal_steps" in e:
            e["vs_fullval_verdict"] = direction(e["vs_fullval_equal_steps"][TARGET_SET], seeds)
        for a in e["accountings"].values():
            for x in a["runs"].values():
                x["verdict"] = reuse_verdict(x["equal_compute"][TARGET_SET], seeds, bound=x["bound"])
            a["summary"] = reuse_summary({n: x["verdict"] for n, x in a["runs"].items()}, s.reuse_runs)
    out["goal"] = _goal(out)


