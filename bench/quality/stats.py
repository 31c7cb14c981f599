"""The quality benchmark's paired comparisons over seeds (t intervals, pooled per family before any verdict is
read) and per-document scores read off a loss-versus-compute curve."""

from __future__ import annotations

from typing import Any

from bench.quality.report import seed_interval
from bench.quality.setting import GENERAL_SETS
from bench.quality.verdicts import pool
from curation.evaluation.heldout import DocScores, paired_difference

__all__ = ["compare_seeds", "interpolate_scores", "Intervals", "value_mean", "general_only"]


def value_mean(x: Any) -> float:
    return x.mean if isinstance(x, DocScores) else float(x)


def general_only(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k in GENERAL_SETS}


def compare_seeds(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per set: mean of a − b over seeds with a 95% interval (t over seeds; one seed: document bootstrap). The
    scores are DocScores or, for arms taken from a recorded report, their means (enough for the t interval)."""
    out = {}
    for name in a[0]:
        diffs = [value_mean(x[name]) - value_mean(y[name]) for x, y in zip(a, b, strict=True)]
        if len(diffs) > 1:
            iv, method = seed_interval(diffs), f"t over {len(diffs)} seeds"
        elif isinstance(a[0][name], DocScores) and isinstance(b[0][name], DocScores):
            iv, method = paired_difference(a[0][name], b[0][name], rounds=1000, seed=0), "document bootstrap, 1 seed"
        else:
            raise ValueError(f"{name}: one seed of recorded means has no interval (a document bootstrap needs "
                             "per-document scores)")
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


class Intervals:
    """The paired intervals of one analysis, by family (level, setting, evaluation set, kind), pooled at the end
    (:func:`bench.quality.verdicts.pool`)."""

    def __init__(self) -> None:
        self.families: dict[str, list[dict[str, Any]]] = {}

    def compare(self, family: str, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        out = compare_seeds(a, b)
        for name, iv in out.items():
            self.families.setdefault(f"{family}/{name}", []).append(iv)
        return out

    def pool(self) -> None:
        for fam, ivs in self.families.items():
            pool(ivs, fam)


