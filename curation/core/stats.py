"""Per-batch selection statistics for run summaries (docs/DESIGN.md §6, usability).

* :class:`SourceCounts`: valid and kept tokens per source (mergeable with ``+``).
* :class:`Histogram`: fixed-edge histogram of Δ with under/overflow bins (mergeable with ``+``;
  approximate quantiles of merged data).
* :func:`delta_quantiles`: exact quantiles of Δ over the valid positions of one batch.
* :func:`param_distance_tensor`: ``‖u − w‖₂`` between two models or state dicts, on their device (no read);
  :func:`param_distance`: the same as a Python float.
* :func:`batch_stats`: all of the per-batch ones at once.
* :class:`SelectionRecord`: what one proxy step trained on (the input of the above in a run).
* :class:`IntervalStats`: the steps of one log interval: each source's share of the kept tokens and of the
  candidates, Δ quantiles from a fine histogram (the loggers' per-interval scalars).

Everything returns plain Python numbers (``to_dict()`` is JSON-ready). Pure torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "DEFAULT_DELTA_EDGES",
    "DEFAULT_QUANTILES",
    "FINE_DELTA_EDGES",
    "INTERVAL_QUANTILES",
    "BatchStats",
    "IntervalStats",
    "Histogram",
    "SelectionRecord",
    "SourceCounts",
    "batch_stats",
    "delta_quantiles",
    "param_distance",
    "param_distance_tensor",
]

#: Quantile levels reported for Δ.
DEFAULT_QUANTILES: tuple[float, ...] = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
#: Default Δ bin edges (nats): -8 to 8 in steps of 0.25, plus under/overflow bins.
DEFAULT_DELTA_EDGES: tuple[float, ...] = tuple(-8.0 + 0.25 * i for i in range(65))
#: Fine Δ bin edges (nats) of the per-interval quantiles: -16 to 16 in steps of 0.02, plus under/overflow bins.
FINE_DELTA_EDGES: tuple[float, ...] = tuple(round(-16.0 + 0.02 * i, 2) for i in range(1601))
#: Δ quantile levels logged per log interval.
INTERVAL_QUANTILES: tuple[float, ...] = (0.01, 0.1, 0.5, 0.9, 0.99)


@dataclass
class SourceCounts:
    """Valid and kept token counts per source.

    Attributes:
        valid: source → number of valid (candidate) tokens.
        kept: source → number of kept (selected) tokens.
    """

    valid: dict[str, int] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_batch(cls, mask: Tensor, valid: Tensor, sources: Sequence[str]) -> SourceCounts:
        """Count a ``(b, L)`` batch; ``sources[i]`` labels row ``i``. Kept = ``mask & valid``."""
        if mask.shape != valid.shape or mask.dim() != 2:
            raise ValueError(
                f"mask {tuple(mask.shape)} and valid {tuple(valid.shape)} must be the same (b, L)"
            )
        if len(sources) != mask.shape[0]:
            raise ValueError(f"got {len(sources)} source labels for {mask.shape[0]} sequences")
        valid = valid.bool()
        n_valid = valid.sum(1).tolist()
        n_kept = (mask.bool() & valid).sum(1).tolist()
        out = cls()
        for src, nv, nk in zip(sources, n_valid, n_kept, strict=True):
            out.valid[src] = out.valid.get(src, 0) + int(nv)
            out.kept[src] = out.kept.get(src, 0) + int(nk)
        return out

    def __add__(self, other: SourceCounts) -> SourceCounts:
        out = SourceCounts(dict(self.valid), dict(self.kept))
        for src, n in other.valid.items():
            out.valid[src] = out.valid.get(src, 0) + n
        for src, n in other.kept.items():
            out.kept[src] = out.kept.get(src, 0) + n
        return out

    def kept_fraction(self) -> dict[str, float]:
        """source → kept / valid (NaN for a source with no valid token)."""
        return {s: (self.kept.get(s, 0) / n if n else math.nan) for s, n in self.valid.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"valid": dict(self.valid), "kept": dict(self.kept), "kept_fraction": self.kept_fraction()}


@dataclass
class Histogram:
    """Fixed-edge histogram with an underflow and an overflow bin.

    ``counts`` has ``len(edges) + 1`` entries: ``counts[0]`` counts values ``< edges[0]``,
    ``counts[i]`` values in ``[edges[i-1], edges[i])``, ``counts[-1]`` values ``>= edges[-1]``.

    Attributes:
        edges: strictly increasing finite bin edges (at least one).
        counts: bin counts.
    """

    edges: tuple[float, ...] = DEFAULT_DELTA_EDGES
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.edges = tuple(float(e) for e in self.edges)
        if not self.edges or not all(math.isfinite(e) for e in self.edges):
            raise ValueError(
                f"histogram edges must be a non-empty sequence of finite numbers, got {self.edges}"
            )
        if any(b <= a for a, b in zip(self.edges, self.edges[1:], strict=False)):
            raise ValueError("histogram edges must be strictly increasing")
        if not self.counts:
            self.counts = [0] * (len(self.edges) + 1)
        elif len(self.counts) != len(self.edges) + 1:
            raise ValueError(
                f"{len(self.edges)} edges need {len(self.edges) + 1} counts, got {len(self.counts)}"
            )

    @classmethod
    def from_values(cls, values: Tensor, edges: Sequence[float] = DEFAULT_DELTA_EDGES) -> Histogram:
        """Histogram of the (finite) entries of ``values``; non-finite entries are not counted."""
        hist = cls(tuple(edges))
        v = values.detach().reshape(-1).float()
        v = v[torch.isfinite(v)]
        e = torch.tensor(hist.edges, dtype=torch.float32, device=v.device)
        idx = torch.bucketize(v, e, right=True)  # number of edges <= value
        hist.counts = torch.bincount(idx, minlength=len(hist.edges) + 1).tolist()
        return hist

    @property
    def total(self) -> int:
        """Number of values counted."""
        return sum(self.counts)

    def __add__(self, other: Histogram) -> Histogram:
        if self.edges != other.edges:
            raise ValueError("cannot add histograms with different edges")
        return Histogram(self.edges, [a + b for a, b in zip(self.counts, other.counts, strict=True)])

    def quantile(self, q: float) -> float:
        """Approximate quantile, linear within a bin (clamped to the edges in the outer bins)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile level must be in [0, 1], got {q!r}")
        total = self.total
        if total == 0:
            return math.nan
        target = q * total
        cum = 0
        for i, c in enumerate(self.counts):
            if c and cum + c >= target:
                if i == 0:
                    return self.edges[0]
                if i == len(self.edges):
                    return self.edges[-1]
                lo, hi = self.edges[i - 1], self.edges[i]
                return lo + (hi - lo) * (target - cum) / c
            cum += c
        return self.edges[-1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``edges`` and ``counts``, under/overflow included)."""
        return {"edges": list(self.edges), "counts": list(self.counts)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Histogram:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(data["edges"]), list(data["counts"]))


def delta_quantiles(
    delta: Tensor, valid: Tensor, quantiles: Sequence[float] = DEFAULT_QUANTILES
) -> dict[float, float]:
    """Exact quantiles (linear interpolation) of ``delta`` over the valid positions.

    Returns NaN for every level when no position is valid.
    """
    if delta.shape != valid.shape:
        raise ValueError(f"delta {tuple(delta.shape)} and valid {tuple(valid.shape)} differ in shape")
    v = delta.detach()[valid.bool()].float()
    if v.numel() == 0:
        return {float(q): math.nan for q in quantiles}
    qs = torch.tensor([float(q) for q in quantiles], dtype=torch.float32, device=v.device)
    if v.numel() > 1 << 24:  # torch.quantile's input limit; sorting gives the same values
        v = v.sort().values
    return dict(zip((float(q) for q in quantiles), torch.quantile(v, qs).tolist(), strict=True))


def _named_tensors(x: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    if isinstance(x, nn.Module):
        return dict(x.named_parameters())  # deduplicates tied weights
    return dict(x)


#: Tensors per group of :func:`param_distance_tensor` (bounds its temporaries: one group's differences).
DISTANCE_GROUP = 32


def param_distance_tensor(a: nn.Module | Mapping[str, Tensor], b: nn.Module | Mapping[str, Tensor]) -> Tensor:
    """``‖a − b‖₂`` over all floating-point tensors (e.g. ``‖u − w‖``) as a 0-d float32 tensor on ``a``'s device:
    nothing is read on the host (on a GPU the host does not wait for it).

    One pass over the tensors in groups of :data:`DISTANCE_GROUP` (``torch._foreach_sub`` and ``_foreach_norm``: a few
    kernels per group, one group's differences at a time, in ``a``'s dtype; ``b`` is cast to it, and copied to ``a``'s
    device when it lives elsewhere, e.g. a compact bfloat16 reference on the host); the squared group norms are summed
    in float64. Modules contribute their named parameters (tied weights once); mappings (state dicts) every floating
    entry. Both sides must have the same names and shapes. Sharded on both sides (``DTensor``, FSDP), each rank sums
    its shards and the sums are added over the ranks: a collective, on the device.

    Raises:
        ValueError: on mismatched names or shapes.
    """
    ta, tb = _named_tensors(a), _named_tensors(b)
    ta = {k: v for k, v in ta.items() if v.is_floating_point()}
    tb = {k: v for k, v in tb.items() if v.is_floating_point()}
    if ta.keys() != tb.keys():
        only_a, only_b = sorted(ta.keys() - tb.keys()), sorted(tb.keys() - ta.keys())
        raise ValueError(f"parameter names differ: only in a {only_a[:5]}, only in b {only_b[:5]}")
    group = None  # sharded weights (DTensor, FSDP): local squares, summed over the shards' process group
    pairs: list[tuple[Tensor, Tensor]] = []
    for k, va in ta.items():
        vb = tb[k]
        if va.shape != vb.shape:
            raise ValueError(f"{k}: shape {tuple(va.shape)} vs {tuple(vb.shape)}")
        if isinstance(va, DTensor) and isinstance(vb, DTensor):
            group = va.device_mesh.get_group()
            va, vb = va.to_local(), vb.to_local()
        pairs.append((va.detach(), vb.detach()))
    device = pairs[0][0].device if pairs else torch.device("cpu")
    squares = []
    with torch.no_grad():
        for i in range(0, len(pairs), DISTANCE_GROUP):
            chunk = pairs[i:i + DISTANCE_GROUP]
            xs = [x for x, _ in chunk]
            ys = [y.to(device=x.device, dtype=x.dtype, non_blocking=True) for x, y in chunk]
            norms = torch._foreach_norm(torch._foreach_sub(xs, ys))
            squares.append(torch.stack(norms).double().square().sum())
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    if group is not None:
        torch.distributed.all_reduce(total, group=group)
    return total.sqrt().float()


def param_distance(a: nn.Module | Mapping[str, Tensor], b: nn.Module | Mapping[str, Tensor]) -> float:
    """:func:`param_distance_tensor` as a Python float (one read on the host)."""
    return float(param_distance_tensor(a, b))


@dataclass
class BatchStats:
    """Statistics of one scored and selected candidate batch.

    Attributes:
        counts: valid / kept tokens per source.
        histogram: Δ histogram over valid positions.
        quantiles: exact Δ quantiles over valid positions (level → value).
    """

    counts: SourceCounts
    histogram: Histogram
    quantiles: dict[float, float]

    @property
    def n_valid(self) -> int:
        """Valid tokens in the batch."""
        return sum(self.counts.valid.values())

    @property
    def n_kept(self) -> int:
        """Kept tokens in the batch."""
        return sum(self.counts.kept.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "n_valid": self.n_valid,
            "n_kept": self.n_kept,
            "counts": self.counts.to_dict(),
            "delta_quantiles": {str(q): v for q, v in self.quantiles.items()},
            "delta_histogram": self.histogram.to_dict(),
        }


def batch_stats(
    delta: Tensor,
    valid: Tensor,
    mask: Tensor,
    sources: Sequence[str],
    *,
    edges: Sequence[float] = DEFAULT_DELTA_EDGES,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
) -> BatchStats:
    """Per-source counts, Δ quantiles and a Δ histogram for one ``(b, L)`` batch.

    Accumulate over batches with ``total.counts + s.counts`` and ``total.histogram + s.histogram``.

    Args:
        delta: scores Δ (values at invalid positions are ignored).
        valid: validity of loss positions.
        mask: selection α (bool).
        sources: one label per sequence.
        edges: histogram edges.
        quantiles: quantile levels.
    """
    if delta.shape != valid.shape:
        raise ValueError(f"delta {tuple(delta.shape)} and valid {tuple(valid.shape)} differ in shape")
    valid = valid.bool()
    return BatchStats(
        counts=SourceCounts.from_batch(mask, valid, sources),
        histogram=Histogram.from_values(delta.detach()[valid], edges),
        quantiles=delta_quantiles(delta, valid, quantiles),
    )


@dataclass
class SelectionRecord:
    """What one proxy step trained on (CPU numpy, full batch).

    Attributes:
        step: proxy step.
        episode: schedule episode (-1 during warm-up).
        ref_version: reference version that scored it (-1: none).
        tokens: ``(b, L)`` token ids.
        mask: ``(b, L)`` bool α (kept loss positions).
        valid: ``(b, L)`` bool validity of loss positions.
        scores: ``(b, L)`` float32 policy scores (Δ for excess-loss policies; NaN when unscored).
        sources: one label per row.
        sample_ids: ``(b,)`` candidate ids.
        distance: ``‖u − w‖₂`` after the step (``None`` when not measured).
        loss: the step's training loss (``None`` when not known).
    """

    step: int
    episode: int
    ref_version: int
    tokens: np.ndarray
    mask: np.ndarray
    valid: np.ndarray
    scores: np.ndarray
    sources: list[str]
    sample_ids: np.ndarray
    distance: float | None = None
    loss: float | None = None

    @property
    def n_kept(self) -> int:
        return int(self.mask.sum())

    @property
    def n_valid(self) -> int:
        return int(self.valid.sum())


@dataclass
class IntervalStats:
    """The steps since the last log: valid and kept tokens per source, and Δ of the scored steps in
    :data:`FINE_DELTA_EDGES` bins. :meth:`scalars` gives the loggers' values and starts the next interval.

    Everything is added from host data (a step's :class:`SelectionRecord`, already read): nothing here reads a device.
    """

    counts: SourceCounts = field(default_factory=SourceCounts)
    histogram: Histogram = field(default_factory=lambda: Histogram(FINE_DELTA_EDGES))
    steps: int = 0

    def add(self, counts: SourceCounts, delta: Tensor | None = None, valid: Tensor | None = None) -> None:
        """One step: its counts, and (a scored step) its Δ at the valid positions."""
        self.counts = self.counts + counts
        if delta is not None and valid is not None:
            self.histogram = self.histogram + Histogram.from_values(delta[valid.bool()], FINE_DELTA_EDGES)
        self.steps += 1

    def scalars(self, prefix: str = "blade/") -> dict[str, float]:
        """``kept_share/<source>`` and ``candidate_share/<source>`` (each source's part of the interval's kept tokens
        and candidates), and ``interval_delta_qNN`` for :data:`INTERVAL_QUANTILES` when Δ was added (to 0.02 nats:
        linear within a bin); then the counts start again."""
        out: dict[str, float] = {}
        kept, valid = sum(self.counts.kept.values()), sum(self.counts.valid.values())
        for src in sorted(self.counts.valid):
            out[f"{prefix}kept_share/{src}"] = self.counts.kept.get(src, 0) / kept if kept else math.nan
            out[f"{prefix}candidate_share/{src}"] = self.counts.valid[src] / valid if valid else math.nan
        if self.histogram.total:
            for q in INTERVAL_QUANTILES:
                out[f"{prefix}interval_delta_q{round(q * 100):02d}"] = self.histogram.quantile(q)
        self.counts, self.histogram, self.steps = SourceCounts(), Histogram(FINE_DELTA_EDGES), 0
        return out
