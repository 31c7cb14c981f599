"""``show_selection``: read one run (or two on the same candidates) and write its page.

Bounded on a large run: the selected shards are read part by part within ``max_tokens`` (parts spread evenly over
the run when it holds more), one shard file in memory at a time; what is kept per source over the whole run comes from
the manifest, exactly. A progress bar counts the tokens read (:mod:`curation.io.progress`: a bar on a terminal, a line every 10% otherwise).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from curation.inspector.compare import Comparison
from curation.inspector.page import render
from curation.inspector.run import Part, Run, open_run
from curation.inspector.scan import choose_parts, part_offsets, read_steps, spread
from curation.inspector.stats import Scanned, ViewRows
from curation.io import storage
from curation.io.atomic import atomic_write_text
from curation.io.progress import progress as progress_bar

__all__ = ["Shown", "show_selection", "scan_runs", "DEFAULT_MAX_TOKENS", "PAGE"]

#: Tokens read per run by default (the demo's ≈ 0.2M are all read).
DEFAULT_MAX_TOKENS = 8_000_000
#: The page, under the (first) run's directory.
PAGE = os.path.join("selection", "index.html")


@dataclass
class Shown:
    """What :func:`show_selection` did: the page, its size, the runs and the one-line summary."""

    page: str
    shown: str
    bytes: int
    seconds: float
    runs: list[Scanned]
    comparison: Comparison | None
    line: str


def _steps_of(parts: list[Part]) -> list[int]:
    return [s for p in parts for s in range(p.first, p.stop)]


def scan_runs(runs: list[Run], *, max_tokens: int = DEFAULT_MAX_TOKENS, view_steps: int = 6, rows_per_source: int = 2,
              positions: int = 256, keep_pairs: int = 8, progress: bool = True) -> tuple[list[Scanned],
                                                                                         Comparison | None]:
    """Read the first run's parts within ``max_tokens`` (and the second run's parts holding the same steps),
    gathering each run's curves, Δ, token counts and view rows, and (two runs) their comparison."""
    a = runs[0]
    parts_a = a.parts()
    if not parts_a:
        raise ValueError(f"{a.shown}: no selected-token shards recorded yet (selected/manifest.json lists no part)")
    read_a = choose_parts(parts_a, max_tokens)
    steps = _steps_of(read_a)
    view = [steps[i] for i in spread(len(steps), view_steps)]
    sa = Scanned(a, parts_a, read_a, view, view=ViewRows(set(view), rows_per_source, positions))
    scanned = [sa]
    sb = cmp = None
    if len(runs) > 1:
        b = runs[1]
        parts_b = b.parts()
        want = set(steps)
        read_b = [p for p in parts_b if any(s in want for s in range(p.first, p.stop))]
        sb = Scanned(b, parts_b, read_b, view, view=ViewRows(set(view), rows_per_source, positions))
        scanned.append(sb)
        cmp = Comparison(keep=keep_pairs, positions=positions)
    total = sum(p.tokens for s in scanned for p in s.read)
    bar = progress_bar(total, desc="show_selection", unit="token", enabled=progress, leave=False,
                       stream=sys.stderr)
    try:
        it_a = read_steps(read_a, part_offsets(parts_a), done=bar.update)
        it_b = None
        if sb is not None:
            want = set(steps)
            it_b = read_steps(sb.read, part_offsets(sb.parts), wanted=want.__contains__, done=bar.update)
        rb = next(it_b, None) if it_b is not None else None
        for ra in it_a:
            sa.add(ra)
            while it_b is not None and rb is not None and rb.step < ra.step:
                sb.add(rb)  # type: ignore[union-attr]
                rb = next(it_b, None)
            if it_b is not None and rb is not None and rb.step == ra.step:
                sb.add(rb)  # type: ignore[union-attr]
                cmp.add(ra, rb)  # type: ignore[union-attr]
                rb = next(it_b, None)
        while it_b is not None and rb is not None:
            sb.add(rb)  # type: ignore[union-attr]
            rb = next(it_b, None)
    finally:
        bar.close()
    for s in scanned:
        s.tokens_read = sum(p.tokens for p in s.read)
    return scanned, cmp


def show_selection(paths: list[str], *, out: str | None = None, tokenizer: str | None = None,
                   max_tokens: int = DEFAULT_MAX_TOKENS, view_steps: int = 6, rows_per_source: int = 2,
                   positions: int = 256, progress: bool = True) -> Shown:
    """Write the page of the run ``paths[0]`` (and its comparison with ``paths[1]``); ``out`` defaults to
    ``<run>/selection/index.html`` (an ``s3://`` run's page is uploaded beside its outputs too).

    Raises:
        ValueError: a path holds no run, or no selected shards yet; a record or shard is unreadable (named).
    """
    if not 1 <= len(paths) <= 2:
        raise ValueError(f"give one run directory, or two to compare (got {len(paths)})")
    start = time.perf_counter()
    runs = [open_run(p, tokenizer=tokenizer) for p in paths]
    scanned, cmp = scan_runs(runs, max_tokens=max_tokens, view_steps=view_steps, rows_per_source=rows_per_source,
                             positions=positions, progress=progress)
    text = render(scanned, cmp)
    page = storage.local_path(out) if out else os.path.join(runs[0].path, PAGE)
    os.makedirs(os.path.dirname(os.path.abspath(page)), exist_ok=True)
    atomic_write_text(page, text)
    storage.publish(page)  # (an object-store run's page goes to its bucket; a local path: nothing)
    size = os.path.getsize(page)
    seconds = time.perf_counter() - start
    shown = storage.display(page)
    return Shown(page, shown, size, seconds, scanned, cmp, summary_line(scanned, cmp, shown, size, seconds))


def summary_line(scanned: list[Scanned], cmp: Comparison | None, shown: str, size: int, seconds: float) -> str:
    """The one line printed on the terminal."""
    s = scanned[0]
    totals = s.run.kept_by_source()
    kept, cand = sum(k for k, _ in totals.values()), sum(c for _, c in totals.values())
    steps_read = sum(p.stop - p.first for p in s.read)
    parts = [f"{s.run.name} ({s.run.job}, {s.steps_total} steps): kept {kept:,} of {cand:,} candidates"
             + (f" ({kept / cand:.1%})" if cand else "")]
    if totals and kept:
        top = max(totals, key=lambda k: totals[k][0] / kept - totals[k][1] / max(cand, 1))
        parts.append(f"most favoured {top} ({totals[top][0] / kept:.1%} of kept, {totals[top][1] / max(cand, 1):.1%} "
                     "of candidates)")
    if cmp is not None:
        j, _ = cmp.overall()
        parts.append(f"vs {scanned[1].run.name}: Jaccard {j:.3f} over {cmp.scored_steps} scored steps")
    parts.append(f"{steps_read} of {s.steps_total} steps read")
    parts.append(f"page {shown} ({size / 1024:.0f} KiB, {seconds:.1f} s)")
    return "; ".join(parts)
