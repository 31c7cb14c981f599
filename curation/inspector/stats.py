"""What the inspector accumulates over the steps it reads (pure numpy, one step at a time, memory independent of the
run's length but for one number per step and source):

* :class:`StepCurves`: per step and source the kept tokens and the candidates (their shares of the step's kept tokens
  and candidates), and the kept threshold of Δ (the smallest kept Δ of the step's scored rows);
* :class:`EpisodeDeltas`: Δ per episode in fine bins (0.02 nats), shown on an axis fitted to the data;
* :class:`TokenCounts`: per source how often each token id was a candidate and how often it was kept (scored rows);
* :class:`ViewRows`: the rows the token view shows: at a few steps, the first rows of every source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from curation.inspector.run import Part, Run
from curation.inspector.scan import StepRows

__all__ = ["Scanned", "StepCurves", "EpisodeDeltas", "TokenCounts", "ViewRows", "ViewRow", "FINE_EDGES", "shares_of"]

#: Fine Δ bins (nats): 0.02 wide over [-20, 20]; values beyond fall in the outer bins (16 KB per episode).
FINE_EDGES = np.round(np.linspace(-20.0, 20.0, 2001), 6)


@dataclass
class StepCurves:
    """Per step: kept tokens and candidates per source; the kept threshold of Δ."""

    steps: list[int] = field(default_factory=list)
    kept: list[dict[str, int]] = field(default_factory=list)
    candidates: list[dict[str, int]] = field(default_factory=list)
    threshold: list[float] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)

    def add(self, r: StepRows) -> None:
        cand = r.candidates
        kept_rows = (r.mask & cand).sum(axis=1)
        cand_rows = cand.sum(axis=1)
        kept: dict[str, int] = {}
        cands: dict[str, int] = {}
        for src, k, c in zip(r.sources, kept_rows.tolist(), cand_rows.tolist(), strict=True):
            kept[src] = kept.get(src, 0) + int(k)
            cands[src] = cands.get(src, 0) + int(c)
        self.sources.update(cands)
        scored = r.scored
        sel = r.mask[scored] & cand[scored]
        vals = r.score[scored][sel]
        vals = vals[np.isfinite(vals)]
        self.steps.append(r.step)
        self.kept.append(kept)
        self.candidates.append(cands)
        self.threshold.append(float(vals.min()) if vals.size else math.nan)

    def shares(self, window: int = 1) -> tuple[list[int], dict[str, list[float]], dict[str, list[float]]]:
        """``(first steps, kept share, candidate share)``: per source, per ``window`` consecutive steps read, its part
        of their kept tokens and of their candidates (NaN where they kept nothing)."""
        steps: list[int] = []
        kept: dict[str, list[float]] = {s: [] for s in sorted(self.sources)}
        cand: dict[str, list[float]] = {s: [] for s in sorted(self.sources)}
        for at in range(0, len(self.steps), max(window, 1)):
            k: dict[str, int] = {}
            c: dict[str, int] = {}
            for i in range(at, min(at + max(window, 1), len(self.steps))):
                for src, n in self.kept[i].items():
                    k[src] = k.get(src, 0) + n
                for src, n in self.candidates[i].items():
                    c[src] = c.get(src, 0) + n
            tk, tc = sum(k.values()), sum(c.values())
            steps.append(self.steps[at])
            for src in kept:
                kept[src].append(k.get(src, 0) / tk if tk else math.nan)
                cand[src].append(c.get(src, 0) / tc if tc else math.nan)
        return steps, kept, cand

    def totals(self) -> dict[str, tuple[int, int]]:
        """``source → (kept, candidates)`` over the steps read."""
        out: dict[str, tuple[int, int]] = {}
        for k, c in zip(self.kept, self.candidates, strict=True):
            for s, n in c.items():
                a, b = out.get(s, (0, 0))
                out[s] = (a + k.get(s, 0), b + n)
        return dict(sorted(out.items()))


@dataclass
class EpisodeDeltas:
    """Δ of the candidates of scored rows, per episode, in :data:`FINE_EDGES` bins."""

    counts: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, r: StepRows) -> None:
        scored = r.scored
        if not scored.any():
            return
        cand = r.candidates
        for e in np.unique(r.episode[scored]).tolist():
            rows = scored & (r.episode == e)
            v = r.score[rows][cand[rows]]
            v = v[np.isfinite(v)]
            idx = np.clip(np.searchsorted(FINE_EDGES, v, side="right") - 1, 0, len(FINE_EDGES) - 2)
            c = np.bincount(idx, minlength=len(FINE_EDGES) - 1).astype(np.int64)
            self.counts[int(e)] = self.counts.get(int(e), 0) + c

    def quantile(self, q: float) -> float:
        """A quantile of Δ over every episode (a bin's left edge; NaN when nothing was scored)."""
        if not self.counts:
            return math.nan
        total = sum(c.astype(np.int64) for c in self.counts.values())
        cum = np.cumsum(total)
        return float(FINE_EDGES[int(np.searchsorted(cum, q * cum[-1], side="left"))])

    def fitted_axis(self, lo_q: float = 0.002, hi_q: float = 0.998) -> tuple[float, float]:
        """The Δ range shown: from the ``lo_q`` to the ``hi_q`` quantile of all episodes, padded by 5%."""
        lo, hi = self.quantile(lo_q), self.quantile(hi_q) + 0.02
        pad = max((hi - lo) * 0.05, 0.01)
        return lo - pad, hi + pad

    def curves(self, bins: int = 60) -> tuple[list[float], dict[int, list[float]]]:
        """``(edges, episode → fraction of its tokens per bin)`` over :meth:`fitted_axis` in ``bins`` bins (the
        tokens outside the axis are not drawn; each episode's fractions are of all its tokens)."""
        lo, hi = self.fitted_axis()
        edges = np.linspace(lo, hi, bins + 1)
        centers = (FINE_EDGES[:-1] + FINE_EDGES[1:]) / 2
        where = np.searchsorted(edges, centers, side="right") - 1
        inside = (where >= 0) & (where < bins)
        out = {}
        for e, c in sorted(self.counts.items()):
            total = int(c.sum(dtype=np.int64))
            frac = np.bincount(where[inside], weights=c[inside], minlength=bins) / max(total, 1)
            out[e] = frac.tolist()
        return edges.tolist(), out


@dataclass
class TokenCounts:
    """Per source, per token id: how often it was a candidate and how often kept (scored rows only: in warm-up every
    token is kept)."""

    seen: dict[str, np.ndarray] = field(default_factory=dict)
    kept: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, r: StepRows) -> None:
        scored = r.scored
        if not scored.any():
            return
        cand = r.candidates
        size = int(r.tokens.max()) + 1
        for src in sorted(set(r.sources)):
            rows = scored & np.array([s == src for s in r.sources])
            if not rows.any():
                continue
            ids, m = r.tokens[rows][cand[rows]], r.mask[rows][cand[rows]]
            seen = np.bincount(ids, minlength=size)
            kept = np.bincount(ids[m], minlength=size)
            self.seen[src] = _add(self.seen.get(src), seen)
            self.kept[src] = _add(self.kept.get(src), kept)

    def top(self, source: str, n: int = 12, min_seen: int = 5) -> tuple[list[tuple[int, int, float]], list[
            tuple[int, int, float]]]:
        """``(most often kept, most often dropped)``: ``(token id, times a candidate, kept share)`` of the tokens seen
        at least ``min_seen`` times (fewer when too few are), by kept share (ties: the more frequent first)."""
        seen, kept = self.seen.get(source), self.kept.get(source)
        if seen is None or kept is None:
            return [], []
        ids = np.flatnonzero(seen >= min_seen)
        if ids.size < 2 * n:
            ids = np.flatnonzero(seen > 0)
        share = kept[ids] / seen[ids]
        order_kept = np.lexsort((-seen[ids], -share))
        order_drop = np.lexsort((-seen[ids], share))

        def rows(order: np.ndarray) -> list[tuple[int, int, float]]:
            return [(int(ids[i]), int(seen[ids[i]]), float(share[i])) for i in order[:n]]

        return rows(order_kept), rows(order_drop)


def _add(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    if a is None:
        return b.astype(np.int64)
    if len(a) < len(b):
        a = np.pad(a, (0, len(b) - len(a)))
    elif len(b) < len(a):
        b = np.pad(b, (0, len(a) - len(b)))
    return a + b


@dataclass
class ViewRow:
    """One row of the token view (its first ``positions``)."""

    step: int
    row: int  # its index in the whole selected directory
    source: str
    episode: int
    tokens: np.ndarray
    mask: np.ndarray
    score: np.ndarray
    length: int  # the row's length (more than shown when cut)


@dataclass
class ViewRows:
    """The token view's rows: at each of ``steps``, the first ``per_source`` rows of every source."""

    steps: set[int]
    per_source: int = 2
    positions: int = 256
    rows: list[ViewRow] = field(default_factory=list)

    def add(self, r: StepRows) -> None:
        if r.step not in self.steps:
            return
        taken: dict[str, int] = {}
        for i, src in enumerate(r.sources):
            if taken.get(src, 0) >= self.per_source:
                continue
            taken[src] = taken.get(src, 0) + 1
            p = self.positions
            self.rows.append(ViewRow(step=r.step, row=r.first + i, source=src, episode=int(r.episode[i]),
                                     tokens=r.tokens[i, :p].copy(), mask=r.mask[i, :p].copy(),
                                     score=r.score[i, :p].copy(), length=int(r.tokens.shape[1])))


def shares_of(totals: dict[str, tuple[int, int]]) -> dict[str, tuple[float, float]]:
    """``source → (share of the kept tokens, share of the candidates)`` from ``source → (kept, candidates)``."""
    tk = sum(k for k, _ in totals.values()) or 1
    tc = sum(c for _, c in totals.values()) or 1
    return {s: (k / tk, c / tc) for s, (k, c) in totals.items()}


@dataclass
class Scanned:
    """One run and what was gathered from the steps read of it."""

    run: Run
    parts: list[Part]  # every recorded part
    read: list[Part]  # the parts read
    view_steps: list[int]
    curves: StepCurves = field(default_factory=StepCurves)
    deltas: EpisodeDeltas = field(default_factory=EpisodeDeltas)
    tokens: TokenCounts = field(default_factory=TokenCounts)
    view: ViewRows | None = None
    tokens_read: int = 0

    def add(self, r: StepRows) -> None:
        self.curves.add(r)
        self.deltas.add(r)
        self.tokens.add(r)
        if self.view is not None:
            self.view.add(r)

    @property
    def steps_total(self) -> int:
        return sum(p.stop - p.first for p in self.parts)
