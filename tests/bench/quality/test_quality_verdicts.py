"""bench.quality.verdicts: the rules applied to hand-made intervals (the report may only say what they say)."""

from __future__ import annotations

import pytest

from bench.quality.verdicts import (
    VERDICT_RULES,
    blade_vs_rho1_verdict,
    direction,
    native_verdict,
    reuse_summary,
    reuse_verdict,
    rules_md,
)

BELOW = {"mean": -0.03, "lo": -0.05, "hi": -0.01}
ABOVE = {"mean": 0.03, "lo": 0.01, "hi": 0.05}
ACROSS = {"mean": -0.02, "lo": -0.05, "hi": 0.01}


def test_direction_needs_the_whole_interval_on_one_side_and_three_seeds():
    assert direction(BELOW, 3) == "better" and direction(ABOVE, 3) == "worse"
    assert direction(ACROSS, 3) == "no significant difference"
    assert direction({"mean": 0.0, "lo": -0.01, "hi": 0.0}, 3) == "no significant difference"  # touching 0
    assert direction(BELOW, 2) == direction(BELOW, 1) == "undecided"  # one or two seeds decide nothing


def test_question_verdicts():
    assert blade_vs_rho1_verdict(BELOW, 3) == "BLADE is better"
    assert blade_vs_rho1_verdict(ABOVE, 3) == "RHO-1 is better"
    assert native_verdict(BELOW, 3) == "pays" and native_verdict(ABOVE, 3) == "full wins"
    assert native_verdict(ACROSS, 3) == "no significant difference"


def test_reuse_verdict_beyond_fulls_run_can_only_say_does_not_pay():
    assert reuse_verdict(BELOW, 3) == "pays" and reuse_verdict(ABOVE, 3) == "does not pay"
    # full's last snapshot stood in (it had less compute than the equal-compute point): "worse" still holds
    assert reuse_verdict(ABOVE, 3, bound=True) == "does not pay"
    assert reuse_verdict(BELOW, 3, bound=True) == "undecided (beyond full's run)"
    assert reuse_verdict(BELOW, 2) == "undecided"


def test_reuse_summary_lists_every_r_and_never_only_the_favourable_one():
    per_r = {"1": "does not pay", "4": "pays", "16": "pays"}
    assert reuse_summary(per_r, (1, 4, 16)) == (
        "pays at R ∈ {4, 16} of {1, 4, 16} (R = 1: does not pay, R = 4: pays, R = 16: pays)")
    assert reuse_summary({"1": "does not pay", "4": "no significant difference"}, (1, 4)) == (
        "pays at no R (R = 1: does not pay, R = 4: no significant difference)")


def test_rules_are_stated_with_the_charged_accounting_deciding():
    assert len(rules_md()) == len(VERDICT_RULES) and rules_md()[0].startswith("1. ")
    text = " ".join(VERDICT_RULES)
    assert "base pretraining charged" in text and "decides nothing" in text and "dev split" in text
    assert "beyond 64" in text and "smoothed" in text


def test_t975_matches_the_table_and_the_normal_limit():
    from bench.quality.verdicts import t975

    assert t975(2) == 4.303 and t975(10) == 2.228
    # exact values: 2.0860 (20), 2.0423 (30), 2.0211 (40), 1.9840 (100)
    for df, exact in ((20, 2.0860), (30, 2.0423), (40, 2.0211), (100, 1.9840)):
        assert abs(t975(df) - exact) < 5e-4, df
    assert 1.96 < t975(10_000) < 1.961


def test_pooled_interval_by_hand_and_a_verdict_needs_both_intervals():
    """Two comparisons of 3 seeds: per-seed SDs 0.01 and 0.03 → s_p² = (2·0.0001 + 2·0.0009) / 4 = 0.0005, df 4,
    half-width t975(4) · √0.0005 / √3; the narrow one (a razor-thin t interval below 0) is no longer 'better'."""
    import math

    from bench.quality.verdicts import pool

    narrow = {"mean": -0.02, "lo": -0.0448, "hi": -0.0152, "per_seed": [-0.01, -0.02, -0.03]}
    wide = {"mean": 0.0, "lo": -0.07, "hi": 0.07, "per_seed": [0.03, 0.0, -0.03]}
    pool([narrow, wide, {"mean": 1.0, "per_seed": [1.0]}], "proxy/x/gsm8k_test")  # one seed: left out
    half = 2.776 * math.sqrt(0.0005) / math.sqrt(3)
    assert narrow["pooled"]["lo"] == pytest.approx(-0.02 - half) and narrow["pooled"]["hi"] == pytest.approx(-0.02 + half)
    assert narrow["pooled"]["sd"] == pytest.approx(math.sqrt(0.0005)) and narrow["pooled"]["df"] == 4
    assert narrow["pooled"]["comparisons"] == 2 and wide["pooled"]["family"] == "proxy/x/gsm8k_test"
    assert direction({k: narrow[k] for k in ("mean", "lo", "hi")}, 3) == "better"  # alone, its t interval decides
    assert direction(narrow, 3) == "no significant difference"  # the pooled one crosses 0
    both_below = {**BELOW, "pooled": {"lo": -0.06, "hi": -0.001}}
    assert direction(both_below, 3) == "better" and native_verdict(both_below, 3) == "pays"
    assert direction({**ABOVE, "pooled": {"lo": -0.01, "hi": 0.07}}, 3) == "no significant difference"


def test_goal_met_needs_the_reach_and_every_general_set():
    from bench.quality.verdicts import GOAL, goal_met

    assert GOAL == {"runs": 4, "reach": 0.6, "forgetting": 0.05}
    ok = {"c4_heldout": 0.01, "wikitext2_heldout": 0.05, "lambada_heldout": -0.2}
    assert goal_met(0.6, ok) and not goal_met(0.61, ok) and not goal_met(None, ok)
    assert not goal_met(0.4, {**ok, "lambada_heldout": 0.051})


def _iv3(mean, half=0.01):
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "per_seed": [mean] * 3}


def test_outcomes_are_decided_by_their_stated_rules():
    from bench.quality.verdicts import OUTCOMES, outcomes

    general = ("c4_heldout", "wikitext2_heldout", "lambada_heldout")

    def paper(target, forget, rho1=0.0, lam1=0.0, lam=0.0):
        bf = {"gsm8k_test": _iv3(target), **{k: _iv3(forget) for k in general}}
        return {"blade_vs_fullval": bf, "fullval_vs_blade": {k: _iv3(-v["mean"]) for k, v in bf.items()},
                "blade_vs_rho1": {"gsm8k_test": _iv3(rho1)}, "lam1_vs_blade": {"gsm8k_test": _iv3(lam1)},
                "best": {"blade": {"lam": lam}, "rho1": {"rho1_steps": 800}}}

    held = lambda res: {o["id"]: o["held"] for o in res}  # noqa: E731
    # full+val better on GSM8K (blade − full+val > 0) and blade forgets more: mix
    assert held(outcomes({"paper": paper(+0.2, +0.1)}, 3)) == {"mix": True, "select": False, "tie-rho1": True,
                                                                "lambda": None}
    # full+val better on GSM8K but forgets more than blade: neither 'mix' nor 'select'
    assert held(outcomes({"paper": paper(+0.2, -0.1)}, 3))["mix"] is False
    # blade better with less forgetting: select; RHO-1 significantly behind: no tie
    res = outcomes({"paper": paper(-0.2, -0.1, rho1=-0.3)}, 3)
    assert held(res)["select"] is True and held(res)["mix"] is False and held(res)["tie-rho1"] is False
    assert held(outcomes({"paper": paper(-0.2, +0.1)}, 3))["select"] is False  # blade better but forgets more
    # λ: per setting; where the dev split chose λ = 1 the arms are one run
    lam = {o["id"]: o for o in outcomes({"gsm8k-in-pool": paper(0, 0, lam1=-0.05), "paper": paper(0, 0, lam=1.0)}, 3)}
    assert lam["lambda"]["finding"]["gsm8k-in-pool"].startswith("helps")
    assert "chose λ = 1" in lam["lambda"]["finding"]["paper"]
    assert held(outcomes({"paper": {}}, 3)) == {o["id"]: None for o in OUTCOMES}  # arms not run: not decided
    assert held(outcomes({"paper": paper(+0.2, +0.1)}, 2)) == {o["id"]: None for o in OUTCOMES}  # 2 seeds: undecided
