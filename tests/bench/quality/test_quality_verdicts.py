"""bench.quality.verdicts: the rules applied to hand-made intervals (the report may only say what they say)."""

from __future__ import annotations

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
