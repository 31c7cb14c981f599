"""The quality benchmark's accounting, against hand-computed values: FLOPs of a tiny setting, the selector's
compute, amortization over target runs, reading loss-versus-compute curves (equal-compute interpolation and
the compute to reach a loss), the refresh choice at equal compute, and the Δ-distribution summaries."""

from __future__ import annotations

import numpy as np
import pytest

from bench.quality.analysis import delta_over_time, interpolate_scores, passed_at, share_above
from bench.quality.compute import (
    RunShape,
    amortized_total,
    equal_compute_steps,
    flops_to_reach,
    loss_at,
    run_flops,
    selection_flops,
)
from bench.quality.experiment import sweep_choice
from curation.core.stats import Histogram
from curation.evaluation.flops import ModelShape, forward_flops_per_token, train_flops
from curation.evaluation.heldout import DocScores

# hidden 4, 1 layer, MLP 8, vocabulary 10, context 8: per layer q,k,v,o 4·4² = 64, MLP 3·4·8 = 96; head 4·10 = 40
# forward per token: 2·(160 + 40) + attention 2·1·8·4 = 464
TINY_SHAPE = ModelShape(hidden=4, layers=1, intermediate=8, vocab=10, context=8)
TINY = RunShape(forward_flops=464.0, batch=2, seq_len=8, warmup=2, tau=3, rho1_steps=5)


def test_forward_flops_by_hand():
    assert forward_flops_per_token(TINY_SHAPE) == 464
    assert train_flops(TINY_SHAPE, 1) == 3 * 464
    # grouped-query attention: 2 heads of 2, 1 kv head: k and v project to 2 dims (2·4·2 = 16 instead of 32)
    hf = {"model_type": "llama", "hidden_size": 4, "num_hidden_layers": 1, "intermediate_size": 8,
          "vocab_size": 10, "num_attention_heads": 1}
    assert ModelShape.of_hf_config(hf, 8) == ModelShape(hidden=4, layers=1, intermediate=8, vocab=10, context=8,
                                                        q_width=4, kv_width=4)
    gqa = ModelShape.of_hf_config({**hf, "num_attention_heads": 2, "num_key_value_heads": 1}, 8)
    assert forward_flops_per_token(gqa) == 464 - 2 * 16
    assert ModelShape.of_hf_config(hf, 4).context == 4
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        ModelShape.of_hf_config({k: v for k, v in hf.items() if k != "intermediate_size"}, 8)


def test_run_flops_by_hand():
    tokens = 2 * 8
    full = run_flops(TINY, "full", 10)
    assert (full.proxy, full.scoring, full.refresh) == (3 * 464 * tokens * 10, 0, 0)
    assert run_flops(TINY, "random", 10) == full
    rho1 = run_flops(TINY, "rho1", 10)  # scoring after W = 2 steps; static reference: 5 steps of b/4 = 1 sequence
    assert (rho1.scoring, rho1.refresh) == (464 * tokens * 8, 3 * 464 * 1 * 8 * 5)
    sel = {"refresh_steps": 2, "lam": 1.0, "refresh_batch_size": 2}
    blade = run_flops(TINY, "blade", 10, sel)  # refreshes before steps 2, 5, 8: 3 × 2 steps × (2 val + 2 cand) × 8
    assert blade.refresh == 3 * 464 * (2 * 8 * 2) * 2 * 3
    assert run_flops(TINY, "blade", 10, {**sel, "lam": 0.0}).refresh == blade.refresh / 2  # no candidate batch
    assert run_flops(TINY, "blade-nosync", 10, sel) == blade
    assert blade.total == blade.proxy + blade.scoring + blade.refresh == blade.as_dict()["total"]
    assert equal_compute_steps(TINY, "blade", 10, sel) == round(blade.total / (3 * 464 * tokens))
    assert equal_compute_steps(TINY, "full", 10) == equal_compute_steps(TINY, "random", 10) == 10
    with pytest.raises(ValueError, match="unknown policy"):
        run_flops(TINY, "oracle", 10)


def test_selection_compute_and_amortization_by_hand():
    sel = {"refresh_steps": 2, "lam": 1.0, "refresh_batch_size": 2}
    assert selection_flops(TINY, "random", 10) == selection_flops(TINY, "full", 10) == 0
    blade = run_flops(TINY, "blade", 10, sel).total  # the selector's whole run: proxy + scoring + refreshes
    assert selection_flops(TINY, "blade", 10, sel) == blade
    # a target run of 1,000 FLOPs reusing a 600-FLOP selection: alone 1,600; shared by 4 runs 1,150
    assert amortized_total(1000.0, 600.0, 1) == 1600.0
    assert amortized_total(1000.0, 600.0, 4) == 1150.0
    with pytest.raises(ValueError, match="runs must be >= 1"):
        amortized_total(1000.0, 600.0, 0)


def test_loss_at_interpolates_within_the_curve_only():
    curve = [(0.0, 5.0), (10.0, 4.0), (30.0, 3.0)]
    assert loss_at(curve, 0.0) == 5.0 and loss_at(curve, 30.0) == 3.0
    assert loss_at(curve, 5.0) == pytest.approx(4.5)
    assert loss_at(curve, 20.0) == pytest.approx(3.5)
    assert loss_at(curve, 31.0) is None and loss_at(curve, -1.0) is None
    with pytest.raises(ValueError, match="strictly increasing"):
        loss_at([(0.0, 5.0), (0.0, 4.0)], 0.0)


def test_flops_to_reach_a_loss():
    curve = [(2.0, 5.0), (10.0, 4.0), (30.0, 3.0)]
    assert flops_to_reach(curve, 4.0) == 10.0
    assert flops_to_reach(curve, 3.5) == pytest.approx(20.0)  # halfway through the last segment
    assert flops_to_reach(curve, 6.0) == 2.0  # already there at the first point (the selection's cost alone)
    assert flops_to_reach(curve, 2.9) is None  # never
    # a curve that goes up before it comes down: the first crossing counts
    assert flops_to_reach([(0.0, 5.0), (1.0, 5.5), (3.0, 4.5)], 4.9) == pytest.approx(2.2)


def test_sweep_choice_at_the_cheapest_budget():
    cheap = [(1.0, 5.0), (2.0, 4.0)]  # budget = 2.0 (the cheapest whole run)
    costly_better_per_step = [(1.5, 4.6), (3.0, 3.5)]  # at 2.0: 4.6 − 1.1·(0.5/1.5) = 4.2333
    costly_best = [(1.0, 4.5), (4.0, 3.0)]  # at 2.0: 4.0
    chosen, budget, losses = sweep_choice([cheap, costly_better_per_step, costly_best])
    assert budget == 2.0 and losses == pytest.approx([4.0, 4.6 - 1.1 / 3, 4.0])
    assert chosen == 0  # ties go to the first (cheapest-listed) candidate
    chosen, _, _ = sweep_choice([cheap, [(1.0, 4.4), (4.0, 2.9)]])
    assert chosen == 1  # 3.9 at the budget beats 4.0
    with pytest.raises(ValueError, match="does not reach back"):
        sweep_choice([cheap, [(2.5, 4.0), (5.0, 3.0)]])


def test_interpolated_scores_keep_documents_paired():
    a = DocScores(np.array([10.0, 20.0]), np.array([5, 10]))
    b = DocScores(np.array([6.0, 12.0]), np.array([5, 10]))
    mid = interpolate_scores([(0.0, a), (4.0, b)], 1.0)  # a quarter of the way: sums 9, 18
    assert mid.sums.tolist() == [9.0, 18.0] and mid.counts.tolist() == [5, 10]
    assert mid.mean == pytest.approx(loss_at([(0.0, a.mean), (4.0, b.mean)], 1.0))
    assert interpolate_scores([(0.0, a), (4.0, b)], 5.0) is None


def test_delta_distribution_summaries():
    h = Histogram((-1.0, 0.0, 1.0), [1, 2, 3, 4])  # <-1: 1, [-1,0): 2, [0,1): 3, >=1: 4
    assert share_above(h, 0.0) == pytest.approx(0.7)
    assert share_above(h, 0.5) == pytest.approx((1.5 + 4) / 10)
    assert share_above(Histogram((0.0,)), 0.0) != share_above(Histogram((0.0,)), 0.0)  # empty: nan
    seed0 = {"delta_histograms": {"0": h.to_dict(), "1": Histogram((-1.0, 0.0, 1.0), [4, 0, 0, 0]).to_dict()}}
    seed1 = {"delta_histograms": {"0": Histogram((-1.0, 0.0, 1.0), [0, 0, 0, 10]).to_dict()}}
    rows = delta_over_time([seed0, seed1])  # pooled over seeds, per episode
    assert [r["episode"] for r in rows] == [0, 1] and [r["tokens"] for r in rows] == [20, 4]
    assert rows[0]["positive"] == pytest.approx(17 / 20) and rows[1]["positive"] == 0.0
    assert passed_at([(0, 5.0), (500, 4.5), (1000, 4.2)], 4.6, 0.1) == 1000
    assert passed_at([(0, 5.0)], 4.6, 0.1) is None


def test_base_charged_versus_free_accounting():
    from bench.quality.compute import base_flops, charged_selection

    # a proxy of forward 464 FLOPs/token pretrained on 1,000 tokens: 3 · 464 · 1000
    base = base_flops(464.0, 1000)
    assert base == 1_392_000.0
    assert charged_selection("rho1", 600.0, base, charged=True) == 600.0 + base
    assert charged_selection("blade", 600.0, base, charged=False) == 600.0
    # random draws its masks without a model, full selects nothing: nothing to charge either way
    assert charged_selection("random", 0.0, base, charged=True) == 0.0
    assert charged_selection("full", 0.0, base, charged=True) == 0.0
    # amortized over R = 4 target runs of 1,000 FLOPs: 1,000 + (600 + 1,392,000) / 4 vs 1,000 + 600 / 4
    assert amortized_total(1000.0, charged_selection("rho1", 600.0, base, charged=True), 4) == 1000.0 + 1_392_600.0 / 4
    assert amortized_total(1000.0, charged_selection("rho1", 600.0, base, charged=False), 4) == 1150.0


def test_smoothing_decides_reaches_not_one_noisy_point():
    from bench.quality.compute import mean_curve, smooth

    # one snapshot dips to 3.0 by noise, its neighbours are at 3.6 and 3.5
    noisy = [(0.0, 5.0), (1.0, 4.0), (2.0, 3.6), (3.0, 3.0), (4.0, 3.5), (5.0, 3.4)]
    assert flops_to_reach(noisy, 3.1) == pytest.approx(2.0 + 0.5 / 0.6)  # the raw curve "reaches" at the dip
    sm = smooth(noisy, 3)
    assert [y for _, y in sm] == pytest.approx([5.0, 4.2, 3.5333333, 3.3666667, 3.3, 3.4])  # ends kept
    assert [x for x, _ in sm] == [x for x, _ in noisy]
    assert flops_to_reach(sm, 3.1) is None  # smoothed: never
    assert smooth(noisy, 1) == noisy
    with pytest.raises(ValueError, match="window must be odd"):
        smooth(noisy, 2)
    # the mean over seeds, pointwise
    assert mean_curve([[(0.0, 4.0), (1.0, 3.0)], [(0.0, 5.0), (1.0, 2.0)]]) == [(0.0, 4.5), (1.0, 2.5)]
    with pytest.raises(ValueError, match="share their compute"):
        mean_curve([[(0.0, 4.0)], [(1.0, 4.0)]])


def test_break_even_runs_on_a_hand_made_curve():
    from bench.quality.compute import break_even_runs

    # full's curve (window 1: no smoothing): loss falls 0.1 per 100 FLOPs from 4.0 at 1,000 to 3.5 at 1,500
    full = [(0.0, 6.0), (1000.0, 4.0), (1100.0, 3.9), (1200.0, 3.8), (1300.0, 3.7), (1400.0, 3.6), (1500.0, 3.5)]
    # a replay that ends at 3.85 after the target's 1,000 FLOPs: full needs X = 1,150 to get there, so
    # R* = C / (X − T) = 600 / 150 = 4
    be = break_even_runs(600.0, 1000.0, full, 3.85, window=1)
    assert be["runs"] == pytest.approx(4.0) and be["label"] == "4" and be["full_flops_to_match"] == pytest.approx(1150)
    assert break_even_runs(6000.0, 1000.0, full, 3.85, window=1)["label"] == "40"
    assert break_even_runs(60_000.0, 1000.0, full, 3.85, window=1)["label"] == "beyond 64"  # R* = 400
    # no better than full at equal steps (full passes 4.05 at 975 on its way from 6 to 4): reuse never pays
    assert break_even_runs(600.0, 1000.0, full, 4.05, window=1) == {"runs": None, "label": "never",
                                                                     "full_flops_to_match": pytest.approx(975.0)}
    # a free selection (random) that beats full at equal steps pays from any R
    assert break_even_runs(0.0, 1000.0, full, 3.85, window=1)["label"] == "any R"
    # better than full's whole run: R* is at most selection / (end − T) = 600 / 500
    be = break_even_runs(600.0, 1000.0, full, 3.2, window=1)
    assert be["upper_bound"] and be["runs"] == pytest.approx(1.2) and be["label"] == "≤ 1.2"
    # a noisy dip to 3.5 at 1,100 decides R* on the raw curve; smoothed (window 3), its neighbours outvote it
    dip = [*full[:2], (1100.0, 3.5), *full[3:]]
    # raw: full passes 3.85 at 1,000 + 100 · 0.15/0.5 = 1,030, so R* = 600 / 30 = 20 on one snapshot's say-so
    assert break_even_runs(600.0, 1000.0, dip, 3.85, window=1)["runs"] == pytest.approx(20.0)
    smoothed = break_even_runs(600.0, 1000.0, dip, 3.85, window=3)
    # smoothed: 0 stays 6 (an end), 1,000 → (6 + 4 + 3.5)/3 = 4.5, 1,100 → (4 + 3.5 + 3.8)/3 = 3.7667: crossing at
    # 1,000 + 100 · 0.65/0.7333
    assert smoothed["full_flops_to_match"] == pytest.approx(1000 + 100 * 0.65 / (4.5 - 11.3 / 3))
    assert smoothed["runs"] == pytest.approx(600 / (100 * 0.65 / (4.5 - 11.3 / 3)))  # ≈ 6.77
