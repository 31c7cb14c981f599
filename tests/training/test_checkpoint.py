"""Checkpoints whose content is refused (a pickled object that would run code, a foreign file): resume falls
back to the previous intact checkpoint, or stops with one line naming each file; the object never runs."""

from __future__ import annotations

import os
import shlex

import pytest
import torch

from curation.io.outdir import report_job_errors
from curation.io.shards import read_column
from training.blocks.checkpoint import (
    CheckpointRefused,
    checkpoint_damage,
    resume_checkpoint,
    weights_only_loading,
)
from training.runs.train_job import train


class _Marker:
    """Unpickled by a loader that runs code, it creates ``path`` (through ``os.system``, as in issue #24)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.path)}",))


def _plant(path: str, marker: str) -> None:
    """Replace the checkpoint file at ``path`` (not the ``latest-rank0.pt`` link) by a code-running pickle."""
    torch.save({"state": {"x": _Marker(marker)}}, os.path.realpath(path))


def test_an_unsafe_latest_checkpoint_falls_back_to_the_previous_one_and_never_runs(make_config, tmp_path):
    cfg = make_config("blade", "unsafe", max_steps=8)
    full = train(cfg)
    weights = open(full.final_weights, "rb").read()
    folder = os.path.join(cfg.output_dir, "checkpoints")
    latest = os.path.join(folder, "ep0-ba8-rank0.pt")
    assert os.path.realpath(os.path.join(folder, "latest-rank0.pt")) == latest
    marker = str(tmp_path / "ran")
    _plant(os.path.join(folder, "latest-rank0.pt"), marker)
    with pytest.warns(UserWarning, match=r"the latest checkpoint .*ep0-ba8-rank0.pt is refused: it holds pickled "
                                         r"objects that are not plain data \(posix.system\).*previous intact "
                                         r"checkpoint .*ep0-ba4-rank0.pt"):
        again = train(cfg)
    assert not os.path.exists(marker)
    assert again.run.resumed_from == os.path.join(folder, "ep0-ba4-rank0.pt")
    assert open(again.final_weights, "rb").read() == weights  # steps 4..8 redone exactly
    assert read_column(again.selected, "step") == [t for t in range(8) for _ in range(cfg.batch_size)]
    assert checkpoint_damage(latest) is None  # rewritten as a real checkpoint
    assert not os.path.exists(marker)


def test_no_intact_checkpoint_left_is_one_line_naming_the_refused_file(make_config, tmp_path, capsys):
    cfg = make_config("full", "unsafe-only", max_steps=4)
    train(cfg)
    folder = os.path.join(cfg.output_dir, "checkpoints")
    path = os.path.join(folder, "ep0-ba4-rank0.pt")
    marker = str(tmp_path / "ran")
    _plant(path, marker)
    with pytest.raises(ValueError, match=rf"{folder}: no intact checkpoint to resume from \({path}: refused: it "
                                         r"holds pickled objects that are not plain data \(posix.system\), whose "
                                         r"loading could run code \(nothing in it was run\)\); delete "):
        train(cfg)
    assert report_job_errors(lambda: train(cfg), f"training into {cfg.output_dir} failed") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {folder}: no intact checkpoint") and path in err
    assert not os.path.exists(marker)


def test_foreign_and_unsafe_files_are_refused_without_running_anything(tmp_path):
    marker = str(tmp_path / "ran")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    ok = folder / "ep0-ba2-rank0.pt"
    torch.save({"state": {"w": torch.ones(2)}, "rng": []}, ok)
    foreign = folder / "ep0-ba4-rank0.pt"
    torch.save({"weights": torch.ones(2)}, foreign)  # weights-only data, but no Composer checkpoint
    unsafe = folder / "ep0-ba6-rank0.pt"
    _plant(str(unsafe), marker)
    assert checkpoint_damage(str(ok)) is None
    assert checkpoint_damage(str(foreign)) == "refused: not a Composer checkpoint (no 'state' entry)"
    assert checkpoint_damage(str(unsafe)).startswith("refused: it holds pickled objects that are not plain data")
    os.symlink(unsafe.name, folder / "latest-rank0.pt")
    with pytest.warns(UserWarning) as warned:
        assert resume_checkpoint(str(folder)) == str(ok)  # skips the foreign one as well
    assert len(warned) == 1 and str(unsafe) in str(warned[0].message)
    assert str(warned[0].message).endswith(f"skipped as well: {foreign}: refused: not a Composer checkpoint (no "
                                           "'state' entry)")
    # a file changed after that check still never runs: Composer's load is refused in one line
    with pytest.raises(CheckpointRefused, match=r"^a checkpoint was refused by torch.load\(weights_only=True\): "
                                                r"[^\n]*GLOBAL posix.system[^\n]*$"):
        with weights_only_loading():
            torch.load(unsafe, map_location="cpu", weights_only=False)  # what Composer calls
    assert not os.path.exists(marker)


@pytest.mark.parametrize("target", ["/elsewhere/ep0-ba2-rank0.pt", "../other/ep0-ba2-rank0.pt", "../../victim",
                                    ".", "ep0-ba2-rank0.pt\n", "sub/ep0-ba2-rank0.pt"])
def test_a_latest_link_leading_outside_its_folder_is_refused_in_one_line(tmp_path, target):
    """``latest-rank0.pt`` is read back from disk (or restored from a bucket's ``.symlinks.json``): a target that is
    not a checkpoint file beside it is refused before anything is read through it (issue 32)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (tmp_path / "other").mkdir()
    outside = tmp_path / "other" / "ep0-ba2-rank0.pt"
    torch.save({"state": {"w": torch.ones(2)}}, outside)  # intact: the old reader resumed from it
    os.symlink(target, folder / "latest-rank0.pt")
    with pytest.raises(ValueError) as e:
        resume_checkpoint(str(folder))
    assert str(e.value) == (f"{folder}/latest-rank0.pt: its target {target!r} is not a checkpoint file beside it "
                            "(ep<e>-ba<b>-rank0.pt); refused: delete the link to resume from the newest intact "
                            "checkpoint")


def test_a_latest_link_to_a_link_leading_outside_is_refused(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"state": {"w": torch.ones(2)}}, tmp_path / "ep0-ba2-rank0.pt")
    os.symlink(tmp_path / "ep0-ba2-rank0.pt", folder / "ep0-ba2-rank0.pt")
    os.symlink("ep0-ba2-rank0.pt", folder / "latest-rank0.pt")
    with pytest.raises(ValueError, match="is not a checkpoint file beside it"):
        resume_checkpoint(str(folder))


@pytest.mark.parametrize("latest", [False, True])
def test_a_checkpoint_file_that_is_a_link_is_never_loaded(tmp_path, latest):
    """An ``ep*-rank0.pt`` read back from disk that is a symbolic link (Composer writes none) could lead outside the
    run: it is skipped with a warning naming it, as a damaged one, and the previous intact checkpoint resumed."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (tmp_path / "other").mkdir()
    ok = folder / "ep0-ba2-rank0.pt"
    torch.save({"state": {"w": torch.ones(2)}}, ok)
    outside = tmp_path / "other" / "ep0-ba8-rank0.pt"
    torch.save({"state": {"w": torch.zeros(2)}}, outside)  # intact: the old reader resumed from it
    link = folder / "ep0-ba8-rank0.pt"
    if latest:  # a link beside it (inside the folder: latest-rank0.pt's own check lets it pass)
        os.symlink(ok.name, link)
        os.symlink(link.name, folder / "latest-rank0.pt")
    else:  # no latest-rank0.pt (a kill while Composer re-linked it): the newest file would be resumed from
        os.symlink(outside, link)
    with pytest.warns(UserWarning) as warned:
        assert resume_checkpoint(str(folder)) == str(ok)
    assert len(warned) == 1
    message = str(warned[0].message)
    assert f"{link}: refused: a symbolic link" in message or f"checkpoint {link} is refused: a symbolic link" in message
    assert f"resuming from the {'previous' if latest else 'newest'} intact checkpoint {ok}" in message
