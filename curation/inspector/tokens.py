"""The token view: rows decoded with the run's tokenizer, each token shaded by its Δ and marked kept or dropped.

Each token is one ``<span>``: class ``k`` (kept), ``d`` (a dropped candidate) or ``n`` (position 0: no candidate),
a shade class ``p0``…``p5`` / ``m1``…``m5`` for Δ above or below 0 (the scale is the page's, :func:`shade_scale`), and
``data-d`` holding Δ to 3 decimals (shown on hover). A row is a ``<div class="row">`` with ``data-step``,
``data-source``, ``data-row`` (its index in the selected directory) and ``data-kept`` (its kept tokens shown), so the
page's filters and a test can find rows and count kept tokens.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import numpy as np

from curation.inspector.stats import ViewRow

__all__ = ["TokenText", "shade_scale", "row_html", "pair_html", "SHADES"]

#: Shade classes on each side of 0.
SHADES = 5


class TokenText:
    """Token id → its text (decoded alone with the tokenizer; its vocabulary entry when that is not readable text;
    ``#id`` without a tokenizer). Cached per id."""

    def __init__(self, path: str | None) -> None:
        self.tok = None
        if path is not None:
            from tokenizers import Tokenizer

            try:
                self.tok = Tokenizer.from_file(path)
            except Exception as e:  # tokenizers raises a plain Exception with the serde message
                raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        token = int(token)
        if token in self.cache:
            return self.cache[token]
        text = f"#{token}"
        if self.tok is not None:
            decoded = self.tok.decode([token], skip_special_tokens=False)
            if decoded and "\ufffd" not in decoded:
                text = decoded
            else:
                text = self.tok.id_to_token(token) or text
        self.cache[token] = text
        return text


def shade_scale(values: Sequence[float] | np.ndarray) -> float:
    """The |Δ| that gets the darkest shade: the 95th percentile of |Δ| of the shown tokens (at least 1e-3)."""
    v = np.abs(np.asarray(values, dtype=np.float64))
    v = v[np.isfinite(v)]
    return max(float(np.percentile(v, 95)) if v.size else 1.0, 1e-3)


def _shade(d: float, scale: float) -> str:
    if not math.isfinite(d):
        return ""
    level = min(SHADES, int(math.ceil(abs(d) / scale * SHADES)))
    return "" if level == 0 else f" {'p' if d > 0 else 'm'}{level}"


def _visible(text: str) -> str:
    """Whitespace made visible where it would vanish (a newline keeps its line break)."""
    return html.escape(text.replace("\n", "↵\n").replace("\t", "→\t"))


def _span(text: str, cls: str, d: float, scale: float, extra: str = "") -> str:
    dd = f' data-d="{d:.3f}"' if math.isfinite(d) else ""
    return f'<span class="{cls}{_shade(d, scale)}{extra}"{dd}>{_visible(text)}</span>'


def row_html(r: ViewRow, text: TokenText, scale: float) -> str:
    """One row of the token view."""
    kept = int(r.mask[1:].sum())
    spans = []
    for pos, (t, m, d) in enumerate(zip(r.tokens.tolist(), r.mask.tolist(), r.score.tolist(), strict=True)):
        cls = "n" if pos == 0 else ("k" if m else "d")
        spans.append(_span(text(t), cls, d, scale))
    shown = len(r.tokens)
    cut = f" · first {shown} of {r.length} positions" if shown < r.length else ""
    warm = " · warm-up: every token kept, no Δ" if not np.isfinite(r.score[1:]).any() else ""
    head = (f'<div class="rowhead">step {r.step} · {html.escape(r.source)} · episode {r.episode} · row {r.row} · '
            f'kept {kept} of {shown - 1}{cut}{warm}</div>')
    return (f'<div class="row" data-step="{r.step}" data-source="{html.escape(r.source)}" data-row="{r.row}" '
            f'data-kept="{kept}">{head}<div class="toks">{"".join(spans)}</div></div>')


def pair_html(r: ViewRow, b_mask: np.ndarray, differ: int, text: TokenText, scale: float, names: tuple[str, str]
              ) -> str:
    """A row two runs kept differently: kept by both (``k``), by the first only (``k a``), by the second only
    (``d b``), by neither (``d``); shaded by the first run's Δ."""
    spans = []
    for pos, (t, ma, mb, d) in enumerate(zip(r.tokens.tolist(), r.mask.tolist(), b_mask.tolist(), r.score.tolist(),
                                            strict=True)):
        if pos == 0:
            spans.append(_span(text(t), "n", d, scale))
            continue
        cls, extra = ("k", "" if mb else " a") if ma else ("d", " b" if mb else "")
        spans.append(_span(text(t), cls, d, scale, extra))
    a, b = (html.escape(n) for n in names)
    head = (f'<div class="rowhead">step {r.step} · {html.escape(r.source)} · row {r.row} · {differ} tokens kept by '
            f'one run only (<span class="k a">{a} only</span> <span class="d b">{b} only</span>)</div>')
    return (f'<div class="row pair" data-step="{r.step}" data-source="{html.escape(r.source)}" data-row="{r.row}" '
            f'data-differ="{differ}">{head}<div class="toks">{"".join(spans)}</div></div>')


#: The token view's style (shades: red for Δ > 0, the proxy's excess loss that selection favours; blue below 0).
CSS = """
.toks{font:12px/1.9 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all}
.toks span{border-radius:2px;padding:0 1px}
.toks .k{border-bottom:2px solid #1a7f37}
.toks .d{color:#8a8a8a;text-decoration:line-through;text-decoration-color:#c0c0c0}
.toks .n{color:#b0b0b0}
.toks .k.a{border-bottom:2px solid #8250df;outline:1px solid #8250df}
.toks .d.b{color:#444;text-decoration:none;border-bottom:2px dashed #bf3989}
.p1{background:#fde0dc}.p2{background:#f9bdbb}.p3{background:#f69988}.p4{background:#f36c60}.p5{background:#e84e40}
.m1{background:#e3f2fd}.m2{background:#bbdefb}.m3{background:#90caf9}.m4{background:#64b5f6}.m5{background:#42a5f5}
.rowhead{font:11px sans-serif;color:#555;margin-top:8px}
.row{border-left:3px solid #ddd;padding-left:6px;margin:4px 0}
"""
