"""The recent trained steps and their masks on disk (the engine's refresh inputs)."""

from __future__ import annotations

import numpy as np
import pytest

from curation.core.refresh_data import RecentMasks
from curation.io.recent import load_recent, save_recent


def test_recent_masks_round_trip_empty_and_missing_file(tmp_path):
    m = np.random.default_rng(0).integers(0, 2, (2, 3, 4)).astype(np.uint8)
    path = str(tmp_path / "recent.safetensors")
    save_recent(RecentMasks.from_pairs([(7, m[0]), (8, m[1])]), path)
    back = load_recent(path)
    assert back.steps == [7, 8] and np.array_equal(back.masks, m) and not (tmp_path / "recent.safetensors.tmp").exists()
    save_recent(RecentMasks(), path)
    assert load_recent(path) == RecentMasks()
    empty = load_recent(str(tmp_path / "absent.safetensors"), missing_ok=True)
    assert empty.steps == [] and empty.masks is None
    with pytest.raises(Exception, match="absent"):
        load_recent(str(tmp_path / "absent.safetensors"))
