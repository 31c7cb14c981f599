"""Shared fixtures: paths to ../shared/data (skipped with a reason when absent) and small corpora."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` next to the checkout; tests using it skip when it is absent (a user's clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real-data test needs ../shared/data next to the checkout ({SHARED_DATA} is absent)")
    return SHARED_DATA


@pytest.fixture
def gpt2_tokenizer(shared_data: Path) -> str:
    return str(shared_data / "tokenizer_gpt2" / "gpt2_tokenizer.json")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONHASHSEED", "0")


def pytest_addoption(parser):
    parser.addoption(
        "--all", action="store_true", default=False,
        help="also run tests marked slow or ray (CI and README's test command use this)",
    )


def pytest_collection_modifyitems(config, items):
    """Plain `pytest` is the fast CPU subset; `pytest --all` (or an explicit -m) runs everything."""
    if config.getoption("--all") or config.getoption("markexpr"):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("slow") or item.get_closest_marker("ray") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
