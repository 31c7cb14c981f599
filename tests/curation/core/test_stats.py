"""Per-batch selection statistics."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from curation.core.stats import (
    DEFAULT_QUANTILES,
    Histogram,
    SourceCounts,
    batch_stats,
    delta_quantiles,
    param_distance,
)


def test_kept_fraction_per_source_by_hand():
    valid = torch.tensor([[False, True, True, True], [False, True, True, False], [False, True, True, True]])
    mask = torch.tensor([[False, True, False, False], [True, True, True, False], [False, True, True, True]])
    counts = SourceCounts.from_batch(mask, valid, ["web", "code", "web"])
    assert counts.valid == {"web": 6, "code": 2}
    assert counts.kept == {"web": 4, "code": 2}  # mask outside valid is not counted
    assert counts.kept_fraction() == {"web": 4 / 6, "code": 1.0}
    merged = counts + SourceCounts({"math": 4, "web": 2}, {"math": 1, "web": 0})
    assert merged.valid == {"web": 8, "code": 2, "math": 4} and merged.kept == {
        "web": 4,
        "code": 2,
        "math": 1,
    }
    assert counts.valid == {"web": 6, "code": 2}  # + does not mutate
    with pytest.raises(ValueError, match="source labels"):
        SourceCounts.from_batch(mask, valid, ["web"])


def test_histogram_bins_with_under_and_overflow():
    h = Histogram.from_values(
        torch.tensor([-5.0, -1.0, -0.5, 0.0, 0.99, 1.0, 7.0, float("nan")]), [-1.0, 0.0, 1.0]
    )
    # bins: (<-1), [-1,0), [0,1), (>=1)
    assert h.counts == [1, 2, 2, 2]
    assert h.total == 7
    both = h + Histogram.from_values(torch.tensor([0.5]), [-1.0, 0.0, 1.0])
    assert both.counts == [1, 2, 3, 2]
    with pytest.raises(ValueError, match="different edges"):
        h + Histogram.from_values(torch.tensor([0.5]), [0.0, 1.0])
    with pytest.raises(ValueError, match="increasing"):
        Histogram((1.0, 0.0))
    assert Histogram.from_dict(json.loads(json.dumps(h.to_dict()))) == h


def test_histogram_quantile_approximation():
    values = torch.linspace(-0.999, 0.999, 1000)
    h = Histogram.from_values(values, [x / 10 for x in range(-10, 11)])
    assert h.quantile(0.5) == pytest.approx(0.0, abs=0.01)
    assert h.quantile(0.9) == pytest.approx(0.8, abs=0.01)
    assert math.isnan(Histogram((0.0, 1.0)).quantile(0.5))


def test_delta_quantiles_exact_over_valid_only():
    delta = torch.tensor([[100.0, 1.0, 2.0], [3.0, 4.0, float("nan")]])
    valid = torch.tensor([[False, True, True], [True, True, False]])
    q = delta_quantiles(delta, valid, (0.0, 0.5, 1.0, 0.25))
    assert q == {0.0: 1.0, 0.5: 2.5, 1.0: 4.0, 0.25: 1.75}
    empty = delta_quantiles(delta, torch.zeros_like(valid), DEFAULT_QUANTILES)
    assert list(empty) == list(DEFAULT_QUANTILES) and all(math.isnan(v) for v in empty.values())


def test_param_distance_modules_and_state_dicts():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with torch.no_grad():
        a.weight.fill_(1.0)
        a.bias.fill_(0.0)
        b.weight.copy_(torch.tensor([[1.0, 1.0], [1.0, 4.0]]))
        b.bias.copy_(torch.tensor([4.0, 0.0]))
    assert param_distance(a, b) == pytest.approx(5.0)  # sqrt(3^2 + 4^2)
    assert param_distance(a.state_dict(), b) == pytest.approx(5.0)
    assert param_distance(a, a) == 0.0
    with pytest.raises(ValueError, match="names differ"):
        param_distance(a, nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="shape"):
        param_distance(a, nn.Linear(2, 3))


def test_batch_stats_to_json():
    delta = torch.tensor([[0.0, -2.0, 1.0, 3.0], [0.0, 0.5, float("nan"), 0.1]])
    valid = torch.tensor([[False, True, True, True], [False, True, False, True]])
    mask = torch.tensor([[False, False, True, True], [False, True, False, False]])
    s = batch_stats(delta, valid, mask, ["a", "b"], edges=(-1.0, 0.0, 1.0), quantiles=(0.5,))
    assert s.n_valid == 5 and s.n_kept == 3
    assert s.counts.kept_fraction() == {"a": 2 / 3, "b": 0.5}
    assert s.histogram.counts == [1, 0, 2, 2]
    assert s.quantiles == {0.5: 0.5}
    out = json.loads(json.dumps(s.to_dict()))
    assert out["delta_quantiles"] == {"0.5": 0.5} and out["n_kept"] == 3
