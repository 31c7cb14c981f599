"""The inspector's arithmetic on hand-made steps (no run, no browser): parts chosen within the budget, kept and
candidate shares, the kept threshold of Δ, Δ per episode on a fitted axis, the tokens kept and dropped most often,
the comparison of two runs, and the charts' axes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from curation.core.stats import FINE_DELTA_EDGES, IntervalStats, SourceCounts
from curation.inspector.compare import Comparison
from curation.inspector.run import Part
from curation.inspector.scan import StepRows, choose_parts, spread
from curation.inspector.stats import EpisodeDeltas, StepCurves, TokenCounts, ViewRows
from curation.inspector.svg import Series, fitted_range, line_chart, nice_ticks


def _rows(step, tokens, mask, score, sources, episode=0, first=0) -> StepRows:
    tokens = np.asarray(tokens, dtype=np.int64)
    return StepRows(step=step, first=first, tokens=tokens, mask=np.asarray(mask, dtype=bool),
                    score=np.asarray(score, dtype=np.float32), sources=list(sources),
                    episode=np.full(len(tokens), episode, dtype=np.int64))


@pytest.mark.parametrize(("n", "k"), [(10, 3), (10, 10), (10, 20), (7, 2), (1, 1), (100, 7)])
def test_spread_takes_k_distinct_indices_first_and_last_included(n, k):
    got = spread(n, k)
    assert got == sorted(set(got)) and len(got) == min(n, k)
    assert got[0] == 0 and (got[-1] == n - 1 or k == 1)


def test_parts_are_all_read_within_the_budget_else_spread_over_the_run():
    parts = [Part(f"p{i}", 10 * i, 10 * (i + 1), 40, 1000) for i in range(20)]
    assert choose_parts(parts, 20_000) == parts
    got = choose_parts(parts, 5_000)
    assert [p.path for p in got] == ["p0", "p5", "p10", "p14", "p19"]  # 5 of 20, the first and the last included
    assert choose_parts(parts, 10) == [parts[0]]  # at least one


def test_shares_threshold_and_totals_by_hand():
    # 3 rows of 4 positions: position 0 is never a candidate (9 candidates); Δ NaN only in warm-up rows
    r = _rows(5, [[1, 2, 3, 4], [1, 5, 6, 7], [1, 2, 2, 2]],
              [[0, 1, 1, 0], [0, 0, 1, 0], [0, 1, 0, 1]],
              [[0, 0.9, 0.5, 0.1], [0, 0.2, 0.7, -1.0], [0, 0.6, 0.3, 0.55]], ["a", "b", "a"])
    c = StepCurves()
    c.add(r)
    steps, kept, cand = c.shares()
    assert steps == [5]
    assert kept == {"a": [4 / 5], "b": [1 / 5]} and cand == {"a": [6 / 9], "b": [3 / 9]}
    assert c.threshold == [pytest.approx(0.5)]  # the smallest kept Δ
    assert c.totals() == {"a": (4, 6), "b": (1, 3)}
    warm = _rows(0, [[1, 2]], [[0, 1]], [[math.nan, math.nan]], ["a"], episode=-1)
    c.add(warm)
    assert math.isnan(c.threshold[-1])
    steps, kept, _ = c.shares(window=2)  # both steps in one window: (4 + 1) of a among 5 + 1 kept
    assert steps == [5] and kept["a"] == [pytest.approx(5 / 6)]


def test_episode_deltas_fit_the_axis_to_the_data_and_sum_to_one():
    rng = np.random.default_rng(0)
    d = EpisodeDeltas()
    for e, centre in ((0, 0.5), (1, -0.2)):
        score = np.concatenate([np.zeros((50, 1)), rng.normal(centre, 0.3, (50, 63))], axis=1)
        d.add(_rows(e, np.ones((50, 64)), np.ones((50, 64)), score, ["s"] * 50, episode=e))
    lo, hi = d.fitted_axis()
    assert -1.5 < lo < -0.9 and 1.2 < hi < 1.8  # 0.2% … 99.8% of N(0.5, 0.3) ∪ N(-0.2, 0.3), padded: not -8…8
    edges, curves = d.curves(bins=40)
    assert len(edges) == 41 and sorted(curves) == [0, 1]
    for frac in curves.values():
        assert 0.98 < sum(frac) <= 1.0 + 1e-9  # the tokens outside the axis are a fraction of a percent
    assert sum(int(c.sum()) for c in d.counts.values()) == 2 * 50 * 63  # every scored candidate once


def test_token_counts_rank_by_kept_share_over_scored_rows_only():
    tokens = [[9, 1, 2, 3], [9, 1, 2, 3], [9, 1, 2, 4]]
    mask = [[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0]]
    score = [[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]]
    t = TokenCounts()
    t.add(_rows(3, tokens, mask, score, ["a"] * 3))
    t.add(_rows(0, tokens, [[1] * 4] * 3, [[math.nan] * 4] * 3, ["a"] * 3, episode=-1))  # warm-up: not counted
    kept, dropped = t.top("a", n=2, min_seen=1)
    assert kept == [(1, 3, 1.0), (2, 3, pytest.approx(1 / 3))]
    assert dropped == [(3, 2, 0.0), (4, 1, 0.0)]  # ties: the more frequent first


def test_view_rows_take_the_first_rows_of_every_source_at_the_chosen_steps():
    v = ViewRows({7}, per_source=1, positions=2)
    r = _rows(7, [[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[0, 1, 1]] * 3, [[0, 1, 1]] * 3, ["a", "a", "b"], first=70)
    v.add(r)
    v.add(_rows(8, [[1, 2, 3]], [[0, 1, 1]], [[0, 1, 1]], ["a"], first=73))
    assert [(x.row, x.source, x.tokens.tolist(), x.length) for x in v.rows] == [(70, "a", [1, 2], 3),
                                                                                 (72, "b", [7, 8], 3)]


def test_comparison_jaccard_per_source_and_the_rows_that_differ_most():
    tokens = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]]
    a = _rows(4, tokens, [[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 1]], np.zeros((3, 4)), ["x", "y", "x"])
    b = _rows(4, tokens, [[0, 1, 0, 1], [0, 1, 1, 1], [0, 0, 0, 1]], np.zeros((3, 4)), ["x", "y", "x"])
    cmp = Comparison(keep=1)
    cmp.add(a, b)
    # x: rows 0 and 2: ∩ = {0:1} + {2:3} = 2, ∪ = {0:1,2,3} + {2:3} = 4; y: 3 / 3
    assert cmp.jaccard == [pytest.approx(5 / 7)] and cmp.by_source == [{"x": 0.5, "y": 1.0}]
    assert cmp.overall() == (pytest.approx(5 / 7), {"x": 0.5, "y": 1.0})
    (top,) = cmp.most_disagreeing()
    assert top.differ == 2 and top.a.row == 0 and top.b_mask.tolist() == [False, True, False, True]
    warm = _rows(3, tokens, np.ones((3, 4)), np.full((3, 4), np.nan), ["x", "y", "x"])
    cmp.add(warm, warm)  # warm-up in both: a point of the curve, not part of the overall overlap
    assert cmp.jaccard[-1] == 1.0 and cmp.scored_steps == 1 and cmp.overall()[0] == pytest.approx(5 / 7)
    other = _rows(5, [[9, 9, 9, 9]] * 3, a.mask, a.score, a.sources)  # other candidates: not paired
    cmp.add(_rows(5, tokens, a.mask, a.score, a.sources), other)
    assert cmp.unpaired == 3 and cmp.paired == 6 and cmp.steps == [4, 3]


def test_interval_stats_shares_and_quantiles_then_a_new_interval():
    import torch

    s = IntervalStats()
    delta = torch.linspace(-1.0, 1.0, 201).reshape(1, -1)
    s.add(SourceCounts({"a": 150, "b": 50}, {"a": 30, "b": 90}), delta, torch.ones_like(delta, dtype=torch.bool))
    s.add(SourceCounts({"a": 50}, {"a": 0}))  # a warm-up step: counts only
    got = s.scalars()
    assert got["blade/kept_share/a"] == 30 / 120 and got["blade/kept_share/b"] == 90 / 120
    assert got["blade/candidate_share/a"] == 200 / 250 and got["blade/candidate_share/b"] == 50 / 250
    step = FINE_DELTA_EDGES[1] - FINE_DELTA_EDGES[0]
    for q in (0.01, 0.1, 0.5, 0.9, 0.99):
        assert abs(got[f"blade/interval_delta_q{round(q * 100):02d}"] - (-1 + 2 * q)) <= step + 1e-9
    assert s.scalars() == {}  # the next interval starts empty


def test_charts_fit_their_axes_and_draw_each_finite_run_of_points():
    assert fitted_range([1.0, None, float("nan"), 3.0], margin=0.0) == (1.0, 3.0)
    assert nice_ticks(0, 1, 5) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ticks = nice_ticks(-1.55, 2.12, 6)
    assert ticks[0] >= -1.55 and ticks[-1] <= 2.12 and len(ticks) >= 4
    svg = line_chart([Series("s", [0, 1, 2, 3, 4], [1, 2, None, 3, 4]), Series("e", [1, 2], [5, 6], dots=True)],
                     title="t", xlabel="x", ylabel="y", chart_id="c")
    assert svg.count('class="curve" data-series="s"') == 2  # NaN/None break the curve
    assert svg.count('class="dot" data-series="e"') == 2
    with pytest.raises(ValueError, match="series 'z'"):
        line_chart([Series("z", [0, 1], [1])], title="t", xlabel="x", ylabel="y", chart_id="c")
