"""The inspector's page: one self-contained HTML file (inline CSS, SVG and a little JS; nothing loaded from elsewhere).

Sections: the run (what was read of it), the kept tokens per source (exact, from the manifest), the curves (kept share
per source against the candidates' share, the kept threshold of Δ, Δ per episode, validation loss, ‖u − w̃‖, the
engine's workers and waits), the token view (filters by source and step; hover a token for its Δ), the tokens each
source keeps and drops most often, and for two runs their comparison (overlap, shares, the rows they disagree on most).
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from curation.inspector import figures
from curation.inspector.compare import Comparison
from curation.inspector.stats import Scanned, shares_of
from curation.inspector.tokens import CSS as TOKEN_CSS
from curation.inspector.tokens import TokenText, pair_html, row_html, shade_scale

__all__ = ["render"]

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1f2328;background:#fafbfc}
main{max-width:1320px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.meta{color:#57606a}.note{color:#9a6700}
table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 10px;border-bottom:1px solid #eaeef2;text-align:right}
th{background:#f0f3f6}td:first-child,th:first-child{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:12px}
figure.chart{margin:0;background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:6px}
figure.chart figcaption{font-size:11px;color:#57606a;max-width:570px}
svg .title{font:600 13px sans-serif}svg .tick,svg .legend{font:10px sans-serif;fill:#444}
svg .label{font:11px sans-serif;fill:#333}svg .plot{fill:#fff;stroke:#d0d7de}
svg .grid{stroke:#eef1f4}svg .marker{stroke:#888;stroke-dasharray:3,3}
.filters{position:sticky;top:0;background:#fafbfc;padding:6px 0;z-index:2;border-bottom:1px solid #eaeef2}
.filters select{margin-right:12px}.legend-box span{margin-right:10px}
#tip{position:fixed;pointer-events:none;background:#24292f;color:#fff;font:11px monospace;padding:2px 6px;
border-radius:3px;display:none;z-index:5}
.tops{display:flex;flex-wrap:wrap;gap:18px}.tops td{font-family:ui-monospace,monospace}
"""

_JS = """
(function(){
  var rows=document.querySelectorAll('.tokenview .row');
  function apply(){
    var s=document.getElementById('f-source').value, t=document.getElementById('f-step').value, n=0;
    rows.forEach(function(r){
      var ok=(s===''||r.dataset.source===s)&&(t===''||r.dataset.step===t);
      r.hidden=!ok; if(ok){n++;}
    });
    document.getElementById('f-count').textContent=n+' rows shown';
  }
  ['f-source','f-step'].forEach(function(id){document.getElementById(id).addEventListener('change',apply);});
  apply();
  var tip=document.getElementById('tip');
  document.addEventListener('mouseover',function(e){
    var d=e.target.dataset?e.target.dataset.d:undefined;
    if(d===undefined||!e.target.closest('.toks')){tip.style.display='none';return;}
    var c=e.target.classList, what=c.contains('k')?'kept':(c.contains('n')?'no candidate':'dropped');
    tip.textContent='\\u0394 = '+d+' \\u00b7 '+what; tip.style.display='block';
  });
  document.addEventListener('mousemove',function(e){tip.style.left=(e.clientX+12)+'px';tip.style.top=(e.clientY+12)+'px';});
})();
"""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "–" if not math.isfinite(v) else (f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.0f}")
    if isinstance(v, int):
        return f"{v:,}"
    return html.escape(str(v))


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _pct(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.1%}"


def _run_header(s: Scanned) -> str:
    r = s.run
    steps_read = sum(p.stop - p.first for p in s.read)
    cover = ("every step read" if len(s.read) == len(s.parts) else
             f"{steps_read} of {s.steps_total} steps read ({len(s.read)} of {len(s.parts)} parts, spread over the run)")
    policy = r.policy or "–"
    gamma = (r.manifest.extra.get("gamma") if r.manifest is not None else None) or (r.summary or {}).get("gamma")
    bits = [f"job <b>{html.escape(r.job)}</b>", f"policy <b>{html.escape(policy)}</b>"]
    if gamma is not None:
        bits.append(f"γ {gamma}")
    if r.warmup:
        bits.append(f"warm-up {r.warmup} steps")
    bits += [f"{s.steps_total} steps", cover, f"{s.tokens_read:,} tokens read"]
    note = f'<p class="note">{html.escape(r.tokenizer_note)}</p>' if r.tokenizer_note else ""
    replay = (f'<p class="meta">a replay: the selected shards below are the ones it trained on '
              f'({html.escape(r.selected or "")})</p>') if r.job == "replay" else ""
    return (f'<p class="meta"><code>{html.escape(r.shown)}</code> · ' + " · ".join(bits) + f"</p>{replay}{note}")


def _sources_table(s: Scanned) -> str:
    totals = s.run.kept_by_source()
    shares = shares_of(totals)
    rows = [[src, c, k, _pct(k / c if c else math.nan), _pct(shares[src][0]), _pct(shares[src][1])]
            for src, (k, c) in totals.items()]
    return _table(["source", "candidates", "kept", "kept fraction", "share of kept", "share of candidates"], rows)


def _tops(s: Scanned, text: TokenText) -> str:
    out = []
    for src in sorted(s.tokens.seen):
        kept, dropped = s.tokens.top(src)

        def rows(items: list[tuple[int, int, float]]) -> list[list[Any]]:
            return [[repr(text(t))[1:-1], n, _pct(share)] for t, n, share in items]

        out.append(f'<div><h3>{html.escape(src)}</h3><div class="tops"><div>most often kept'
                   + _table(["token", "seen", "kept"], rows(kept)) + "</div><div>most often dropped"
                   + _table(["token", "seen", "kept"], rows(dropped)) + "</div></div></div>")
    if not out:
        return "<p>No scored rows were read (warm-up only, or a policy without scores).</p>"
    return ('<p class="meta">Over the scored rows read (warm-up rows keep every token), among tokens seen at least 5 '
            'times.</p><div class="tops">' + "".join(out) + "</div>")


def _token_view(scanned: list[Scanned], text: TokenText, scale: float) -> str:
    s = scanned[0]
    assert s.view is not None
    sources = sorted({r.source for r in s.view.rows})
    steps = sorted({r.step for r in s.view.rows})
    opts_src = "".join(f'<option value="{html.escape(x)}">{html.escape(x)}</option>' for x in sources)
    opts_step = "".join(f'<option value="{x}">{x}</option>' for x in steps)
    filters = (f'<div class="filters">source <select id="f-source"><option value="">all</option>{opts_src}</select>'
               f'step <select id="f-step"><option value="">all</option>{opts_step}</select>'
               f'<span id="f-count" class="meta"></span> <span class="legend-box toks">'
               f'<span class="k">kept</span><span class="d">dropped</span><span class="k p4">Δ &gt; 0</span>'
               f'<span class="k m4">Δ &lt; 0</span></span></div>')
    rows = "".join(row_html(r, text, scale) for r in s.view.rows)
    kept = sum(int(r.mask[1:].sum()) for r in s.view.rows)
    return (f'<p class="meta">{len(s.view.rows)} rows: at steps {", ".join(map(str, steps))}, the first '
            f'{s.view.per_source} rows of every source; {kept} tokens kept among them. Shade: Δ (darkest at '
            f'|Δ| ≥ {scale:.2f} nats); hover a token for its Δ.</p>{filters}'
            f'<div class="tokenview" id="tokenview" data-kept="{kept}">{rows}</div>')


def _comparison(scanned: list[Scanned], cmp: Comparison, text: TokenText, scale: float,
                colors: dict[str, str]) -> str:
    a, b = scanned
    j, per = cmp.overall()
    ta, tb = shares_of(a.run.kept_by_source()), shares_of(b.run.kept_by_source())
    rows = [[src, _pct(per.get(src, math.nan)), _pct(ta.get(src, (math.nan,))[0]), _pct(tb.get(src, (math.nan,))[0]),
             _pct((ta.get(src) or tb.get(src) or (0, math.nan))[1])] for src in sorted(set(ta) | set(tb))]
    names = (a.run.name, b.run.name)
    head = (f'<p class="meta">A = <code>{html.escape(a.run.shown)}</code>, B = <code>{html.escape(b.run.shown)}'
            f'</code>: {len(cmp.steps)} steps compared, {cmp.paired:,} rows paired'
            + (f', <b>{cmp.unpaired:,} rows whose tokens differ (other candidates?) left out</b>' if cmp.unpaired
               else "") + f"; Jaccard of the kept tokens {_pct(j)} over the {cmp.scored_steps} steps either run scored "
            "(in warm-up both keep every token).</p>")
    table = _table(["source", "Jaccard", f"share of kept: {names[0]}", f"share of kept: {names[1]}",
                    "share of candidates"], rows)
    charts = ('<div class="charts">' + figures.jaccard_chart(cmp, colors, "chart-jaccard")
              + figures.share_chart(b.curves, colors, "chart-share-b", f"Kept share per source: {names[1]}")
              + "</div>")
    pairs = "".join(pair_html(d.a, d.b_mask, d.differ, text, scale, ("A", "B")) for d in cmp.most_disagreeing())
    return (head + table + charts + f"<h3>Where they disagree most</h3><div class='tokenview-pairs'>{pairs or 'none'}"
            "</div>")


def render(scanned: list[Scanned], cmp: Comparison | None) -> str:
    """The page's HTML."""
    s = scanned[0]
    r = s.run
    text = TokenText(r.tokenizer)
    view_scores = [v for row in (s.view.rows if s.view else []) for v in row.score[1:].tolist()]
    scale = shade_scale(view_scores)
    colors = figures.source_colors(sorted(r.kept_by_source() or s.curves.sources))
    markers = figures.refresh_steps(r)
    charts = [figures.share_chart(s.curves, colors, "chart-share", "Kept share per source"),
              figures.threshold_chart(s.curves, markers, "chart-threshold"),
              figures.delta_chart(s.deltas, "chart-delta"),
              figures.validation_chart(r, "chart-validation"),
              figures.distance_chart(r, "chart-distance")]
    engine_html, engine_facts = figures.engine_charts(r, "chart-engine")
    title = f"Selection of {r.name}" + (f" vs {scanned[1].run.name}" if cmp is not None else "")
    parts = [f"<h1>{html.escape(title)}</h1>", _run_header(s)]
    if cmp is not None:
        parts.append(_run_header(scanned[1]))
    parts += ["<h2>Kept tokens per source (whole run)</h2>", _sources_table(s),
              "<h2>Curves</h2>", '<div class="charts">' + "".join(c for c in charts if c) + "</div>"]
    if engine_html or engine_facts:
        parts += ["<h2>Engine</h2>", _table(["", "value"], [[k, v] for k, v in engine_facts.items()]),
                  f'<div class="charts">{engine_html}</div>']
    parts += ["<h2>Token view</h2>", _token_view(scanned, text, scale),
              "<h2>Tokens kept and dropped most often</h2>", _tops(s, text)]
    if cmp is not None:
        parts += [f"<h2>Two runs: {html.escape(scanned[0].run.name)} (A) vs {html.escape(scanned[1].run.name)} (B)"
                  "</h2>", _comparison(scanned, cmp, text, scale, colors)]
    facts = {"runs": [x.run.shown for x in scanned], "steps_read": [len(x.curves.steps) for x in scanned],
             "view_rows": len(s.view.rows) if s.view else 0}
    if cmp is not None:
        j = cmp.overall()[0]
        facts.update(jaccard=j if math.isfinite(j) else None, compared_steps=len(cmp.steps),
                     scored_steps=cmp.scored_steps, paired_rows=cmp.paired,
                     unpaired_rows=cmp.unpaired)
    facts_json = json.dumps(facts).replace("<", "\\u003c")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}{TOKEN_CSS}</style></head><body><main>{''.join(parts)}</main><div id='tip'></div>"
            f"<script type='application/json' id='facts'>{facts_json}</script>"
            f"<script>{_JS}</script></body></html>")
