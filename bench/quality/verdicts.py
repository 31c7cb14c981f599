"""The quality benchmark's verdict rules, fixed before any run and printed in the report before the results.

Pure functions of intervals and break-even numbers (no torch, no I/O): what the report may call "better",
"pays" or "reaches" is decided here and nowhere else, the same way in both settings, whichever policy it favours.
Every interval is a paired 95% interval of ``policy − full`` (or ``blade − rho1``), negative = the first is better.

The rules never choose among amortization counts: every R of the preset is reported, and "reuse pays" is
answered per R in the base-charged accounting (the free accounting is shown beside it, never used for the
verdict).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["VERDICT_RULES", "MIN_SEEDS", "direction", "native_verdict", "blade_vs_rho1_verdict", "reuse_verdict",
           "reuse_summary", "rules_md", "as_json"]

#: the fewest seeds an interval may rest on for a verdict other than "undecided"
MIN_SEEDS = 3

VERDICT_RULES: tuple[str, ...] = (
    "Every comparison is a paired 95% t interval over seeds (policy − `full`, or `blade` − `rho1`; negative = the "
    "first is better) on the target evaluation set; with fewer than 3 seeds the verdict is 'undecided'.",
    "A policy is *better* only if its interval lies wholly below 0, *worse* only if wholly above 0; otherwise 'no "
    "significant difference'.",
    "Native selection *pays for its compute* only if it is better than `full` given the same analytic FLOPs "
    "(`full`'s snapshot at the equal-compute step, per seed).",
    "Reuse *pays at R* only if the target's replay is better than the target's `full` of the same seed at equal "
    "total compute with the selector's whole run AND the proxy's base pretraining charged, amortized over R target "
    "runs. The free accounting (base not charged) is reported beside it and decides nothing.",
    "Every R of the preset is reported; no R is singled out. When `full`'s run ends before the equal-compute "
    "point, `full`'s last snapshot stands in (it had less compute, so 'worse' still holds; 'better' is not "
    "claimed).",
    "Break-even R per policy and accounting: R* = C / (X − T), with C the selection compute, T the target run's "
    "FLOPs and X the FLOPs `full` needs to reach the replay's final loss on the mean-over-seeds curve smoothed "
    "over 3 neighbouring snapshots; 'never' when `full` reaches it by T, 'beyond 64' when R* > 64.",
    "'Reaches `full`'s final loss' is read on the same smoothed mean-over-seeds curves, so one noisy snapshot "
    "cannot decide it; 'never' when it is not reached within the run.",
    "The only choices (BLADE's refresh setting, RHO-1's reference length) are made at equal compute on the dev "
    "split of GSM8K train (in no pool, no reference's training data, no evaluation set), before any evaluation set "
    "is scored.",
)


def direction(iv: Mapping[str, float], seeds: int) -> str:
    """``better`` / ``worse`` / ``no significant difference`` for an interval of ``seeds`` paired seeds, or
    ``undecided`` with fewer than :data:`MIN_SEEDS`."""
    if seeds < MIN_SEEDS:
        return "undecided"
    if iv["hi"] < 0:
        return "better"
    if iv["lo"] > 0:
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


def rules_md() -> list[str]:
    """The rules as a numbered Markdown list."""
    return [f"{i}. {rule}" for i, rule in enumerate(VERDICT_RULES, 1)]


def as_json() -> list[str]:
    """The rules for results.json (``verdict_rules``)."""
    return list(VERDICT_RULES)
