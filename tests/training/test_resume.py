"""Checkpoint / resume: a run killed mid-episode and resumed equals an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from composer.core import Callback
from safetensors.torch import load_file

from curation.shards import read_column
from schemas.manifest import Manifest
from training.checkpoint import load_checkpoint, weights_only_loading
from training.run import train


class Kill(Callback):
    """Raise (like a kill) at the end of step ``at - 1``: after its selected part, before its checkpoint."""

    def __init__(self, at: int) -> None:
        self.at = at

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.at:
            raise KeyboardInterrupt(f"killed after {self.at} steps")


def _columns(path: str) -> dict[str, list]:
    return {c: read_column(path, c) for c in ("step", "episode", "tokens", "loss_mask", "score", "source")}


@pytest.mark.parametrize("policy", ["blade", "blade-nosync", "random"])
def test_resume_mid_episode_gives_the_same_masks_and_weights(make_config, policy):
    # W=2, τ=3: refreshes before steps 2, 5, 8. Checkpoints every 4 steps; the kill comes after step 8's
    # selected part was written but before its checkpoint, so the rerun resumes at step 4, mid-episode
    # (reference restored from the checkpoint, scores recomputed), and must drop and redo part [4, 8).
    full = train(make_config(policy, "uninterrupted"))
    cfg = make_config(policy, "killed")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, callbacks=[Kill(8)])
    sel = os.path.join(cfg.output_dir, "selected")
    assert "steps-000000004-000000008" in os.listdir(sel)  # written after the last checkpoint
    assert sorted(os.listdir(os.path.join(cfg.output_dir, "checkpoints"))) == ["ep0-ba4-rank0.pt", "latest-rank0.pt"]
    resumed = train(cfg)
    assert resumed["run"].resumed_from.endswith("latest-rank0.pt")

    a, b = _columns(full["selected"]), _columns(resumed["selected"])
    assert a["step"] == b["step"] == [t for t in range(cfg.max_steps) for _ in range(cfg.batch_size)]
    for col in ("tokens", "loss_mask", "episode", "source"):
        assert all(np.array_equal(x, y) for x, y in zip(a[col], b[col], strict=True)), col
    assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a["score"], b["score"], strict=True))
    wa, wb = load_file(full["final_weights"]), load_file(resumed["final_weights"])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # bitwise on CPU
    ma, mb = Manifest.load(full["selected"]), Manifest.load(resumed["selected"])
    assert ma.sources == mb.sources and [s.name for s in ma.shards] == [s.name for s in mb.shards]
    sa, sb = (x["run"].stats.summary_data() for x in (full, resumed))
    assert [s["kept"] for s in sa["steps"]] == [s["kept"] for s in sb["steps"]]
    assert sa["refreshes"] == sb["refreshes"]


def test_checkpoint_holds_the_blade_state_and_loads_weights_only(make_config):
    cfg = make_config("blade-nosync", max_steps=6)
    train(cfg)
    path = os.path.join(cfg.output_dir, "checkpoints", "ep0-ba4-rank0.pt")
    ckpt = load_checkpoint(path)  # torch.load(weights_only=True)
    algos = dict(ckpt["state"]["algorithms"])
    blade = algos["BladeAlgorithm"]
    assert blade["next_step"] == 4 and blade["ref_version"] == 0 and blade["policy"] == "blade-nosync"
    assert isinstance(blade["reference"]["model.embed_tokens.weight"], torch.Tensor)
    assert blade["ref_optimizer"]["state"]  # reference AdamW moments (carried by blade-nosync)
    assert blade["recent_masks"].dtype == torch.uint8 and blade["recent_steps"].tolist() == [2, 3]
    assert set(blade["rng"]) >= {"torch", "numpy_keys", "python"}
    assert ckpt["state"]["dataset_state"]["train"]["step"] == 4
    writer = ckpt["state"]["callbacks"]["SelectedShardWriter"]
    assert [s["name"] for s in writer["manifest"]["shards"]] == ["steps-000000000-000000004"]


def test_a_checkpoint_with_a_pickled_object_is_refused(make_config, tmp_path):
    cfg = make_config("full", max_steps=4)
    train(cfg)
    path = os.path.join(cfg.output_dir, "checkpoints", "latest-rank0.pt")
    ckpt = load_checkpoint(path)
    ckpt["state"]["callbacks"]["SelectionStats"]["evil"] = _Evil()
    bad = str(tmp_path / "bad.pt")
    torch.save(ckpt, bad)
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        with weights_only_loading():
            torch.load(bad, map_location="cpu", weights_only=False)  # what Composer calls
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(bad)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_run_killed_before_its_first_checkpoint_restarts_cleanly(make_config):
    cfg = make_config("blade", "early", max_steps=6, checkpoint={"interval": 4})
    with pytest.raises(KeyboardInterrupt):
        train(cfg, callbacks=[Kill(4)])  # part [0, 4) written, its checkpoint not
    sel = os.path.join(cfg.output_dir, "selected")
    assert "steps-000000000-000000004" in os.listdir(sel)
    assert not os.path.exists(os.path.join(cfg.output_dir, "checkpoints", "latest-rank0.pt"))
    out = train(cfg)
    assert read_column(out["selected"], "step") == [t for t in range(6) for _ in range(8)]
    # another policy resuming this run's checkpoint is refused ...
    with pytest.raises(ValueError, match="written by policy 'blade'"):
        train(make_config("random", "early", max_steps=6))
    # ... and so is another run writing into its shards once the checkpoints are gone
    shutil.rmtree(os.path.join(cfg.output_dir, "checkpoints"))
    with pytest.raises(ValueError, match="another run"):
        train(make_config("random", "early", max_steps=6))
