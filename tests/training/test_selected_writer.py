"""The selected-token shard writer on resume: the parts named by the checkpoint's manifest are untrusted names."""

from __future__ import annotations

import os

import numpy as np
import pytest

from curation.io.paths import UnsafeNameError
from curation.io.shards import part_name, write_part
from schemas.manifest import Manifest, ShardRecord
from schemas.shards import SELECTED
from training.blocks.callbacks import SelectedShardWriter


class _NoSelection:
    last = None

    def subscribe(self, fn):
        pass

    def drain(self):
        pass


def _rows(first: int, stop: int) -> list[dict]:
    return [{"tokens": np.arange(8, dtype=np.uint16), "loss_mask": np.ones(8, dtype=np.uint8),
             "score": np.zeros(8, dtype=np.float16), "source": "s", "step": t, "episode": 0} for t in range(first, stop)]


def test_a_recorded_part_that_is_a_link_leading_out_of_the_run_is_refused(tmp_path):
    """A resumed run finds its parts by the names in the checkpoint's manifest, through ``safe_join``: a part that is
    a symbolic link to a directory outside the run is refused before anything is read through it (here a short
    last part, which a resumed run extended past it would otherwise read back into its pending rows)."""
    out = tmp_path / "run" / "selected"
    out.mkdir(parents=True)
    name = part_name(0, 2)  # flushed short (max_steps 2) by the run the checkpoint is of
    elsewhere = tmp_path / "elsewhere" / name
    write_part(str(elsewhere), SELECTED, _rows(0, 2), vocab_size=512)  # an intact part: it passes verify_part
    os.symlink(elsewhere, out / name)
    writer = SelectedShardWriter(str(out), algorithm=_NoSelection(), vocab_size=512, seq_len=8, max_steps=8,
                                 flush_every=4)
    recorded = Manifest(kind=SELECTED.name, job="train", vocab_size=512, seq_len=8, shards=[
        ShardRecord(name=name, samples=2, tokens=16, state={"first_step": 0, "stop_step": 2, "kept_tokens": 16})])
    writer.load_state_dict({"manifest": recorded.model_dump(mode="json"), "pending_counts": {}, "pending": None})
    with pytest.raises(UnsafeNameError, match=rf"^{out} \(the manifest recorded in the checkpoint\): selected part "
                                              rf"'{name}' leads outside {out} \(through a symbolic link\); refused"):
        writer.fit_start(None, None)
    assert writer.pending == [] and os.path.islink(out / name)  # nothing read back, the link left as it was
    assert os.path.isfile(elsewhere / "index.json") and not os.path.exists(out / "manifest.json")
