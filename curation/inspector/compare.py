"""Two runs on the same candidates, step by step: the overlap of their kept tokens (Jaccard per step and source) and
the sequences where they disagree most.

Rows are paired by their place in the step (the candidate stream gives both runs the same rows when they share its
seed, batch size and candidates); a pair whose tokens differ is not compared but counted (:attr:`Comparison.unpaired`),
so two runs of other candidates show that at once instead of a meaningless overlap.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from curation.inspector.scan import StepRows
from curation.inspector.stats import ViewRow

__all__ = ["Comparison", "Disagreement"]


@dataclass(order=True)
class Disagreement:
    """A row the two runs kept differently: ``a`` as the first run's view row, ``b_mask`` the second's kept
    positions."""

    differ: int
    a: ViewRow = field(compare=False)
    b_mask: np.ndarray = field(compare=False)
    b_score: np.ndarray = field(compare=False)


@dataclass
class Comparison:
    """Accumulates :meth:`add` over the steps both runs hold."""

    keep: int = 8
    positions: int = 256
    steps: list[int] = field(default_factory=list)
    jaccard: list[float] = field(default_factory=list)
    by_source: list[dict[str, float]] = field(default_factory=list)
    inter: dict[str, int] = field(default_factory=dict)
    union: dict[str, int] = field(default_factory=dict)
    paired: int = 0
    unpaired: int = 0
    scored_steps: int = 0  # compared steps where either run scored (not warm-up in both)
    top: list[Disagreement] = field(default_factory=list)
    _order: int = 0

    def add(self, a: StepRows, b: StepRows) -> None:
        """Compare one step's rows of the two runs."""
        n = min(len(a), len(b))
        self.unpaired += max(len(a), len(b)) - n
        same = (a.tokens[:n] == b.tokens[:n]).all(axis=1) if a.tokens.shape[1:] == b.tokens.shape[1:] else \
            np.zeros(n, dtype=bool)
        self.unpaired += int((~same).sum())
        self.paired += int(same.sum())
        idx = np.flatnonzero(same)
        cand = a.candidates[:n]
        ma, mb = a.mask[:n] & cand, b.mask[:n] & cand
        inter_rows, union_rows = (ma & mb).sum(axis=1), (ma | mb).sum(axis=1)
        step_inter = step_union = 0
        per: dict[str, list[int]] = {}
        for i in idx.tolist():
            src = a.sources[i]
            p = per.setdefault(src, [0, 0])
            p[0] += int(inter_rows[i])
            p[1] += int(union_rows[i])
            step_inter += int(inter_rows[i])
            step_union += int(union_rows[i])
        if not idx.size:
            return
        self.steps.append(a.step)
        self.jaccard.append(step_inter / step_union if step_union else math.nan)
        self.by_source.append({s: (i / u if u else math.nan) for s, (i, u) in per.items()})
        if not (a.scored.any() or b.scored.any()):
            return  # warm-up in both: every token kept by both, nothing chosen (left out of the overall overlap)
        self.scored_steps += 1
        for s, (i, u) in per.items():
            self.inter[s] = self.inter.get(s, 0) + i
            self.union[s] = self.union.get(s, 0) + u
        differ = (ma ^ mb).sum(axis=1)
        for i in idx.tolist():
            d = int(differ[i])
            if d == 0 or (len(self.top) >= self.keep and d <= self.top[0].differ):
                continue
            p = self.positions
            row = ViewRow(step=a.step, row=a.first + i, source=a.sources[i], episode=int(a.episode[i]),
                          tokens=a.tokens[i, :p].copy(), mask=a.mask[i, :p].copy(), score=a.score[i, :p].copy(),
                          length=int(a.tokens.shape[1]))
            item = Disagreement(d, row, b.mask[i, :p].copy(), b.score[i, :p].copy())
            if len(self.top) < self.keep:
                heapq.heappush(self.top, item)
            else:
                heapq.heapreplace(self.top, item)

    def overall(self) -> tuple[float, dict[str, float]]:
        """Jaccard of the kept tokens over the compared steps either run scored (warm-up steps, where both keep
        every token, are left out), and per source."""
        ti, tu = sum(self.inter.values()), sum(self.union.values())
        return (ti / tu if tu else math.nan), {s: (self.inter[s] / u if u else math.nan)
                                               for s, u in sorted(self.union.items())}

    def most_disagreeing(self) -> list[Disagreement]:
        """The rows kept most differently, the most first."""
        return sorted(self.top, key=lambda d: (-d.differ, d.a.step, d.a.row))
