"""Charts as inline SVG text (no plotting library, no network): line charts and step histograms with axes, ticks,
a legend and dashed markers (e.g. refresh moments).

Every curve is one ``<path class="curve" data-series="NAME">`` with at least two points drawn, so a page's curves can
be found and counted (the browser test does); NaN or None values break a curve into pieces. Axes are fitted to the
finite data (:func:`fitted_range`), with a small margin.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Series", "line_chart", "nice_ticks", "fitted_range", "PALETTE"]

#: Colours of the series, in order (colour-blind-safe, Okabe–Ito first).
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7", "#56b4e9", "#f0e442", "#000000", "#999999",
           "#7f3c8d", "#11a579", "#3969ac", "#f2b701", "#e73f74", "#80ba5a", "#e68310")


@dataclass
class Series:
    """One curve: ``y`` over ``x`` (equal lengths; NaN/None break the curve).

    Attributes:
        name: legend entry (and the path's ``data-series``).
        x, y: the points.
        color: stroke colour (default: the palette by position).
        dashed: drawn dashed (e.g. the candidates' share beside the kept share).
        steps: drawn as a step function, each ``x`` the left edge of its bin (histograms: ``x`` holds the edges,
            ``y`` one value fewer and a ``None``).
        width: stroke width.
        dots: points drawn as dots, not joined.
    """

    name: str
    x: Sequence[float]
    y: Sequence[float | None]
    color: str | None = None
    dashed: bool = False
    steps: bool = False
    width: float = 1.6
    dots: bool = False  # each point a dot, not joined (events, e.g. the trainer's waits)
    legend: bool = True
    points: list[tuple[float, float]] = field(default_factory=list, init=False, repr=False)


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def fitted_range(values: Sequence[float | None], *, margin: float = 0.05, include: Sequence[float] = ()) -> tuple[
        float, float]:
    """``(lo, hi)`` spanning the finite ``values`` (and ``include``) with ``margin`` of the span on each side; a single
    value gets ±0.5 (or ±10% of it)."""
    vals = [float(v) for v in [*values, *include] if _finite(v)]
    if not vals:
        return 0.0, 1.0
    lo, hi = min(vals), max(vals)
    if hi == lo:
        pad = abs(lo) * 0.1 or 0.5
        return lo - pad, hi + pad
    pad = (hi - lo) * margin
    return lo - pad, hi + pad


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 × 10^k apart) inside ``[lo, hi]``, about ``count`` of them."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(0.0 if abs(t) < step * 1e-9 else t)
        t += step
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
        return f"{v:.1e}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def line_chart(series: Sequence[Series], *, title: str, xlabel: str, ylabel: str, chart_id: str,
               width: int = 580, height: int = 260, xlim: tuple[float, float] | None = None,
               ylim: tuple[float, float] | None = None, markers: Sequence[float] = (), marker_label: str = "",
               note: str = "") -> str:
    """A ``<figure>`` holding the SVG chart of ``series`` (``markers``: dashed vertical lines at these ``x``)."""
    left, right, top, bottom = 58, 12, 26, 40
    legend = [s for s in series if s.legend]
    rows = math.ceil(len(legend) / 4) if legend else 0
    h = height + 16 * rows + (8 if rows else 0)
    pw, ph = width - left - right, height - top - bottom
    xs = [x for s in series for x in s.x]
    ys = [y for s in series for y in s.y]
    x0, x1 = xlim or fitted_range(xs, margin=0.0)
    y0, y1 = ylim or fitted_range(ys)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [f'<figure class="chart" id="{html.escape(chart_id)}">',
           f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {h}" width="{width}" height="{h}" '
           f'role="img" aria-label="{html.escape(title)}">',
           f'<text x="{left}" y="16" class="title">{html.escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>']
    for t in nice_ticks(x0, x1, 6):
        out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{top}" y2="{top + ph}" class="grid"/>'
                   f'<text x="{sx(t):.1f}" y="{top + ph + 14}" class="tick" text-anchor="middle">{_fmt(t)}</text>')
    for t in nice_ticks(y0, y1, 5):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{left - 4}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph + 32}" class="label" text-anchor="middle">'
               f'{html.escape(xlabel)}</text>')
    out.append(f'<text transform="translate(14 {top + ph / 2:.1f}) rotate(-90)" class="label" '
               f'text-anchor="middle">{html.escape(ylabel)}</text>')
    for m in markers:
        if x0 <= m <= x1:
            out.append(f'<line x1="{sx(m):.1f}" x2="{sx(m):.1f}" y1="{top}" y2="{top + ph}" class="marker">'
                       f'<title>{html.escape(marker_label)} {_fmt(m)}</title></line>')
    out.append(f'<clipPath id="{html.escape(chart_id)}-clip"><rect x="{left}" y="{top}" width="{pw}" '
               f'height="{ph}"/></clipPath><g clip-path="url(#{html.escape(chart_id)}-clip)">')
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        for piece in _pieces(s):
            if len(piece) == 1 or s.dots:  # a lone point, or events: dots
                out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{color}" class="dot" '
                        f'data-series="{html.escape(s.name)}"><title>{_fmt(x)}: {_fmt(y)}</title></circle>'
                        for x, y in piece]
                continue
            d = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(piece))
            dash = ' stroke-dasharray="5,3"' if s.dashed else ""
            out.append(f'<path class="curve" data-series="{html.escape(s.name)}" d="{d}" fill="none" '
                       f'stroke="{color}" stroke-width="{s.width}"{dash}><title>{html.escape(s.name)}</title></path>')
    out.append("</g>")
    for i, s in enumerate(legend):
        color = s.color or PALETTE[series.index(s) % len(PALETTE)]
        lx, ly = left + (i % 4) * (pw / 4), height + 12 + 16 * (i // 4)
        dash = ' stroke-dasharray="5,3"' if s.dashed else ""
        out.append(f'<line x1="{lx:.1f}" x2="{lx + 18:.1f}" y1="{ly - 4}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2"{dash}/><text x="{lx + 22:.1f}" y="{ly}" class="legend">'
                   f'{html.escape(s.name)}</text>')
    out.append("</svg>")
    if note:
        out.append(f"<figcaption>{html.escape(note)}</figcaption>")
    out.append("</figure>")
    return "".join(out)


def _pieces(s: Series) -> list[list[tuple[float, float]]]:
    """The finite runs of ``s``'s points (a step series: each bin's left and right edge at its height)."""
    if len(s.x) != len(s.y):
        raise ValueError(f"series {s.name!r}: {len(s.x)} x values for {len(s.y)} y values")
    pts: list[tuple[float, float]] = []
    out: list[list[tuple[float, float]]] = []
    for j, (x, y) in enumerate(zip(s.x, s.y, strict=True)):
        if not (_finite(x) and _finite(y)):
            if pts:
                out.append(pts)
            pts = []
            continue
        pts.append((float(x), float(y)))
        if s.steps:
            right = s.x[j + 1] if j + 1 < len(s.x) else None
            if _finite(right):
                pts.append((float(right), float(y)))
    if pts:
        out.append(pts)
    return out
