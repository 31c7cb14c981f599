"""curation.io.progress: whole lines at intervals where a bar's ``\\r`` frames would pile up, and the one place that
shows a bar (no other module imports tqdm)."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest

from curation.io import progress as progress_module
from curation.io.progress import ProgressLines, progress, progress_iter

REPO = Path(__file__).resolve().parents[3]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_line_every_tenth_and_one_at_the_end_with_rate_and_eta_by_hand():
    out, clock = io.StringIO(), Clock()
    with ProgressLines(25, desc="prepare data", unit="unit", stream=out, clock=clock) as bar:
        for _ in range(25):
            clock.t += 2.0  # 0.5 units/s
            bar.update(1)
            if bar.n == 12:
                bar.set_postfix(tokens=1200)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # every ceil(25 / 10) = 3 units, the last (25) at the end only
    assert [int(line.split(": ")[1].split("/")[0]) for line in lines] == [3, 6, 9, 12, 15, 18, 21, 24, 25]
    assert lines[0] == "prepare data: 3/25 units (12%) | 0.5 units/s | eta 44s"
    assert lines[4] == "prepare data: 15/25 units (60%) | 0.5 units/s | eta 20s | tokens=1200"
    assert lines[-1] == "prepare data: 25/25 units (100%) | 0.5 units/s | 50s in all | tokens=1200"


def test_a_count_set_from_outside_prints_once_per_interval_passed():
    """The engine's batch curation sets ``n`` from its coordinator's count, polled: a jump over several intervals is
    one line; polls without progress print nothing."""
    out = io.StringIO()
    bar = ProgressLines(100, desc="curate", unit="part", stream=out, clock=Clock())
    for n in (0, 5, 9, 35, 35, 35, 36, 100):
        bar.n = n
        bar.refresh()
    bar.close()
    assert [line.split(" |")[0] for line in out.getvalue().splitlines()] == [
        "curate: 35/100 parts (35%)", "curate: 100/100 parts (100%)"]


def test_an_empty_loop_and_a_loop_stopped_early_still_end_with_a_line():
    out = io.StringIO()
    ProgressLines(0, desc="a", unit="unit", stream=out, clock=Clock()).close()
    with pytest.raises(KeyError), ProgressLines(10, desc="b", unit="unit", stream=out, clock=Clock()) as bar:
        bar.update(4)
        raise KeyError("stopped")
    assert out.getvalue().splitlines() == ["a: 0/0 units", "b: 4/10 units (40%)"]


def test_progress_is_a_bar_on_a_terminal_lines_elsewhere_and_nothing_when_off(monkeypatch, capsys):
    from tqdm import tqdm

    monkeypatch.setattr(progress_module, "interactive", lambda: True)
    bar = progress(3, desc="x", enabled=True)
    assert isinstance(bar, tqdm)
    bar.close()
    monkeypatch.setattr(progress_module, "interactive", lambda: False)
    assert isinstance(progress(3, desc="x"), ProgressLines)
    assert list(progress_iter(range(3), total=3, desc="off", enabled=False)) == [0, 1, 2]
    assert list(progress_iter(range(3), total=3, desc="on", unit="batch")) == [0, 1, 2]
    out = capsys.readouterr().out
    assert "off" not in out and out.splitlines()[-1].startswith("on: 3/3 batches (100%)")


def test_no_module_but_curation_io_progress_imports_tqdm():
    """A bar made anywhere else writes ``\\r`` frames into a piped log: every loop goes through curation.io.progress."""
    found = []
    for path in sorted(p for pkg in ("curation", "training", "bench", "jobs", "schemas") for p in (REPO / pkg).rglob("*.py")):
        if path == REPO / "curation" / "io" / "progress.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "tqdm" for n in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"tqdm imported outside curation/io/progress.py (use curation.io.progress): {found}"
