"""llm-foundry's blade_selected loader, the part that runs without llm-foundry (which cannot share this environment:
its real code is exercised by ``python .ci/foundry_check.py`` in its own virtualenv)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from training.blocks.foundry import NAME, build_selected_dataloader


def test_an_unknown_dataset_key_is_named_before_anything_is_read():
    with pytest.raises(ValueError, match=r"^train_loader\.dataset\.eos_token_id: not an argument of the "
                                         r"blade_selected loader \(streaming\.StreamingDataset's, or max_seq_len\)$"):
        build_selected_dataloader(None, 8, {"remote": "/nowhere", "local": "/tmp/x", "eos_token_id": 0})


def test_the_entry_point_names_the_builder():
    """What llm-foundry's registry (catalogue, group ``llmfoundry_dataloaders``) loads when this package is installed."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["llmfoundry_dataloaders"][NAME]
    module, _, attr = target.partition(":")
    assert module == build_selected_dataloader.__module__ and attr == build_selected_dataloader.__name__
