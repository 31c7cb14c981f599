"""The quality benchmark's verdict rules and pre-stated outcomes, fixed before any run and printed in the report
before the results.

Pure functions of intervals and break-even numbers (no torch, no I/O): what the report may call "better",
"pays", "reaches" or "held" is decided here and nowhere else, the same way in both settings, whichever policy it
favours. Every interval is a paired 95% interval of ``a − b`` (``policy − full``, ``blade − rho1``, ...),
negative = the first is better; each carries, under ``pooled``, the interval with the pooled seed SD of its
family (:func:`pool`), and a verdict needs both on the same side of 0.

The rules never choose among amortization counts: every R of the preset is reported, and "reuse pays" is
answered per R in the base-charged accounting (the free accounting is shown beside it, never used for the
verdict). The outcomes (:data:`OUTCOMES`) were written down before the v8 runs, with the rule that decides each.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["VERDICT_RULES", "MIN_SEEDS", "GOAL", "OUTCOMES", "direction", "native_verdict", "blade_vs_rho1_verdict",
           "reuse_verdict", "reuse_summary", "rules_md", "as_json", "t975", "pool", "goal_met", "outcomes",
           "outcomes_json"]

#: the fewest seeds an interval may rest on for a verdict other than "undecided"
MIN_SEEDS = 3

#: the project's goal for a reused selection (the target replaying a proxy's shards): it reaches the comparison's
#: final target-set loss with at most ``reach`` × the comparison's compute at R = ``runs`` with the proxy's base
#: charged, and forgets at most ``forgetting`` nats against the comparison (mean over seeds) on each general set
GOAL = {"runs": 4, "reach": 0.6, "forgetting": 0.05}

VERDICT_RULES: tuple[str, ...] = (
    "Every comparison is a paired 95% t interval over seeds (policy − `full`, or `blade` − `rho1`; negative = the "
    "first is better); with fewer than 3 seeds the verdict is 'undecided'.",
    "Each interval is also given with the pooled seed SD of its family (every paired comparison of the same "
    "level, proxy or target, setting and evaluation set: s_p² = Σ (n_i − 1) s_i² / Σ (n_i − 1), t at Σ (n_i − 1) "
    "degrees of freedom), under `pooled`, so that one comparison whose seeds happen to agree closely cannot "
    "claim a razor-thin interval. A policy is *better* only if both intervals lie wholly below 0, *worse* only if "
    "both lie wholly above 0; otherwise 'no significant difference' (a verdict whose sign the pooled interval "
    "does not keep is reported as that).",
    "Native selection *pays for its compute* only if it is better than `full` given the same analytic FLOPs "
    "(`full`'s snapshot at the equal-compute step, per seed). The same comparison against `full+val` (the "
    "target examples mixed into every batch) is reported beside it.",
    "Reuse *pays at R* only if the target's replay is better than the target's `full` of the same seed at equal "
    "total compute with the selector's whole run AND the proxy's base pretraining charged, amortized over R target "
    "runs. The free accounting (base not charged) is reported beside it and decides nothing.",
    "Every R of the preset is reported; no R is singled out. The target's `full` runs to the equal-compute point "
    "of the smallest R of the costliest reused selection, base charged, so every R is decided; should a point "
    "still lie beyond its run, `full`'s last snapshot stands in (it had less compute, so 'worse' still holds; "
    "'better' is not claimed).",
    "Break-even R per policy and accounting: R* = C / (X − T), with C the selection compute, T the target run's "
    "FLOPs and X the FLOPs `full` needs to reach the replay's final loss on the mean-over-seeds curve smoothed "
    "over 3 neighbouring snapshots; 'never' when `full` reaches it by T, 'beyond 64' when R* > 64.",
    "'Reaches `full`'s final loss' is read on the same smoothed mean-over-seeds curves, so one noisy snapshot "
    "cannot decide it; 'never' when it is not reached within the run.",
    "Forgetting is a policy's loss on the general held-out sets (C4, WikiText-2, LAMBADA) minus the comparison's: "
    "against `full` at equal compute (the proxy) or at equal target steps (the target's replays), against "
    "`full+val` likewise, and against the base model the run started from; each a paired interval over seeds.",
    f"The goal of a reused selection: it reaches the comparison's final target-set loss with at most "
    f"{GOAL['reach']}× the comparison's compute at R = {GOAL['runs']} with the proxy's base charged, and its "
    f"forgetting against the comparison is at most {GOAL['forgetting']} nats (mean over seeds) on each general "
    "set; read against `full` and, beside it, against `full+val`.",
    "Every choice (BLADE's refresh setting; RHO-1's reference length and η_w; full+val's share of target "
    "examples) is made at equal compute (each family's cheapest candidate's FLOPs) on the dev split of GSM8K "
    "train (in no pool, no reference's training data, no evaluation set), seed 0, before any evaluation set is "
    "scored; the paper's pool makes its own choices. Search FLOPs (every candidate's whole run) are reported in a "
    "column of their own and charged to no verdict.",
)


def t975(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (a table to 10, then the
    Cornish-Fisher expansion around the normal quantile: within 2e-4 of the exact value there)."""
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df in table:
        return table[df]
    z = 1.959963984540054
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) + \
        (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)


def pool(intervals: Sequence[dict[str, Any]], family: str) -> None:
    """Attach to each interval of one family (dicts with ``mean`` and ``per_seed``, two seeds or more) the
    interval with the family's pooled seed SD, under ``pooled``: ``mean ± t975(df) · s_p / √n``."""
    usable = [iv for iv in intervals if len(iv.get("per_seed") or ()) >= 2]
    df = sum(len(iv["per_seed"]) - 1 for iv in usable)
    if not df:
        return
    sp = math.sqrt(sum((len(iv["per_seed"]) - 1) * statistics.variance(iv["per_seed"]) for iv in usable) / df)
    t = t975(df)
    for iv in usable:
        half = t * sp / math.sqrt(len(iv["per_seed"]))
        iv["pooled"] = {"lo": iv["mean"] - half, "hi": iv["mean"] + half, "sd": sp, "df": df, "family": family,
                        "comparisons": len(usable)}


def direction(iv: Mapping[str, Any], seeds: int) -> str:
    """``better`` / ``worse`` / ``no significant difference`` for an interval of ``seeds`` paired seeds, or
    ``undecided`` with fewer than :data:`MIN_SEEDS`; with a ``pooled`` interval beside it, both must agree."""
    if seeds < MIN_SEEDS:
        return "undecided"
    ivs = [iv, *([iv["pooled"]] if "pooled" in iv else [])]
    if all(x["hi"] < 0 for x in ivs):
        return "better"
    if all(x["lo"] > 0 for x in ivs):
        return "worse"
    return "no significant difference"


def native_verdict(iv: Mapping[str, float], seeds: int) -> str:
    """Does native selection pay for its compute (``policy − full`` at equal FLOPs)?"""
    return {"better": "pays", "worse": "full wins", "no significant difference": "no significant difference",
            "undecided": "undecided"}[direction(iv, seeds)]


def blade_vs_rho1_verdict(iv: Mapping[str, float], seeds: int) -> str:
    """Which of BLADE and RHO-1 is better at the long horizon (``blade − rho1`` at equal tokens)?"""
    return {"better": "BLADE is better", "worse": "RHO-1 is better",
            "no significant difference": "no significant difference", "undecided": "undecided"}[direction(iv, seeds)]


def reuse_verdict(iv: Mapping[str, float], seeds: int, *, bound: bool = False) -> str:
    """Does reuse pay at one R (``replay − full`` at equal total compute, base charged)? ``bound``: ``full``'s last
    snapshot stood in for a point beyond its run, so only "does not pay" can be concluded."""
    d = direction(iv, seeds)
    if bound and d == "better":
        return "undecided (beyond full's run)"
    return {"better": "pays", "worse": "does not pay", "no significant difference": "no significant difference",
            "undecided": "undecided"}[d]


def reuse_summary(per_r: Mapping[str, str], runs: Iterable[int]) -> str:
    """One phrase for a policy over every R (in the preset's order): the R at which it pays, or that it pays at
    none; never a single favourable R alone."""
    runs = [str(n) for n in runs]
    pays = [n for n in runs if per_r.get(n) == "pays"]
    listed = ", ".join(f"R = {n}: {per_r.get(n, 'n/a')}" for n in runs)
    if not pays:
        return f"pays at no R ({listed})"
    return f"pays at R ∈ {{{', '.join(pays)}}} of {{{', '.join(runs)}}} ({listed})"


def goal_met(reach: float | None, forgetting: Mapping[str, float]) -> bool:
    """Whether a reused selection meets :data:`GOAL`: ``reach`` (its compute to reach the comparison's final
    loss ÷ the comparison's, at R = GOAL runs, base charged; None = never) and its mean forgetting per general
    set."""
    return reach is not None and reach <= GOAL["reach"] and all(v <= GOAL["forgetting"] for v in forgetting.values())


#: The outcomes stated before the v8 runs (issue 54), each with the rule that decides it from the results
#: (``bench.quality.analysis`` computes the intervals): ``id``, the setting it is read in, the statement, the rule.
OUTCOMES: tuple[dict[str, str], ...] = (
    {"id": "mix", "setting": "paper",
     "statement": "`full+val` beats `blade` on GSM8K at equal compute with no more forgetting → in the "
                  "target-absent regime, mix, do not select",
     "rule": "`blade` − `full+val` (full+val's snapshot at blade's equal-compute step) on the target set is "
             "'worse' (rules 1-2), and on none of C4, WikiText-2, LAMBADA is `full+val` − `blade` 'worse'"},
    {"id": "select", "setting": "paper",
     "statement": "`blade` beats `full+val` with equal or less forgetting → BLADE is the method when the pool "
                  "lacks the target",
     "rule": "`blade` − `full+val` at equal compute on the target set is 'better', and on none of C4, WikiText-2, "
             "LAMBADA is `blade` − `full+val` 'worse'"},
    {"id": "tie-rho1", "setting": "paper",
     "statement": "a retuned RHO-1 within `blade`'s interval → a tie; prefer the static reference",
     "rule": "`blade` − `rho1` (RHO-1 as chosen in the paper's pool) at equal proxy steps on the target set is "
             "'no significant difference'"},
    {"id": "lambda", "setting": "both",
     "statement": "λ = 1 vs λ = 0: whether the L_train term helps",
     "rule": "`blade-lam1` − `blade` at equal proxy steps on the target set, in each setting where the chosen "
             "`blade` has λ = 0: 'better' → it helps, 'worse' → it hurts, otherwise no measurable effect (where "
             "the dev split chose λ = 1 the two arms are one run)"},
)


def outcomes(settings: Mapping[str, Mapping[str, Any]], seeds: int, paper: str = "paper") -> list[dict[str, Any]]:
    """The pre-stated outcomes decided from the results' settings (``settings[name]``: ``blade_vs_fullval`` and
    ``fullval_vs_blade`` per set, ``blade_vs_rho1``, ``lam1_vs_blade``, ``best``): each with ``held`` (True, False,
    or None when the arms it needs were not run or too few seeds decide nothing; the λ outcome, a question, has a
    ``finding`` per setting instead)
    and the numbers it rests on."""
    out = []
    target = "gsm8k_test"
    st = settings.get(paper, {})
    general = ("c4_heldout", "wikitext2_heldout", "lambada_heldout")
    bf, fb = st.get("blade_vs_fullval"), st.get("fullval_vs_blade")
    for o in OUTCOMES:
        row: dict[str, Any] = {**o, "held": None, "evidence": {}}
        if o["id"] in ("mix", "select") and bf:
            d = direction(bf[target], seeds)
            if o["id"] == "mix":
                forget = {k: direction(fb[k], seeds) for k in general}
                row["held"] = d == "worse" and "worse" not in forget.values()
            else:
                forget = {k: direction(bf[k], seeds) for k in general}
                row["held"] = d == "better" and "worse" not in forget.values()
            if d == "undecided":  # fewer than MIN_SEEDS: nothing is decided
                row["held"] = None
            row["evidence"] = {"blade − full+val": _short(bf[target]), "target": d, "forgetting": forget}
        elif o["id"] == "tie-rho1" and st.get("blade_vs_rho1"):
            d = direction(st["blade_vs_rho1"][target], seeds)
            row["held"] = None if d == "undecided" else d == "no significant difference"
            row["evidence"] = {"blade − rho1": _short(st["blade_vs_rho1"][target]), "target": d,
                               "rho1": (st.get("best") or {}).get("rho1")}
        elif o["id"] == "lambda":
            per = {}
            for name, x in settings.items():
                lam = ((x.get("best") or {}).get("blade") or {}).get("lam")
                if lam not in (None, 0, 0.0):
                    per[name] = "the dev split chose λ = 1 here: `blade` is `blade-lam1`"
                elif x.get("lam1_vs_blade"):
                    d = direction(x["lam1_vs_blade"][target], seeds)
                    per[name] = {"better": "helps", "worse": "hurts"}.get(d, "no measurable effect") + \
                        f" ({_short(x['lam1_vs_blade'][target])})"
            row["finding"] = per or None  # not a held/not-held outcome: what was found, per setting
            row["evidence"] = {name: _short(x["lam1_vs_blade"][target]) for name, x in settings.items()
                               if x.get("lam1_vs_blade")}
        out.append(row)
    return out


def _short(iv: Mapping[str, Any]) -> str:
    p = iv.get("pooled")
    return f"{iv['mean']:+.3f} [{iv['lo']:+.3f}, {iv['hi']:+.3f}]" + \
        (f", pooled [{p['lo']:+.3f}, {p['hi']:+.3f}]" if p else "")


def outcomes_json() -> list[dict[str, str]]:
    """The outcomes as stated (``verdict_rules``' companion in results.json, before they are decided)."""
    return [dict(o) for o in OUTCOMES]


def rules_md() -> list[str]:
    """The rules as a numbered Markdown list."""
    return [f"{i}. {rule}" for i, rule in enumerate(VERDICT_RULES, 1)]


def as_json() -> list[str]:
    """The rules for results.json (``verdict_rules``)."""
    return list(VERDICT_RULES)
