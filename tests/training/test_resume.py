"""Checkpoint / resume: a run killed mid-episode and resumed equals an uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
from composer.core import Callback
from safetensors.torch import load_file

from curation.io.outdir import ConfigMismatch, OutputDirBusy, OutputDirLock
from curation.io.shards import read_column
from schemas.manifest import Manifest
from training.blocks.checkpoint import (
    checkpoint_damage,
    load_checkpoint,
    rng_state,
    set_rng_state,
    weights_only_loading,
)
from training.runs.train_job import train


class Kill(Callback):
    """Raise (like a kill) at the end of step ``at - 1``: after its selected part, before its checkpoint. (A step's
    record is delivered a step later, or when a checkpoint's state is taken: the kill comes right after that
    delivery, as a kill between the writer's flush and Composer's write of the checkpoint file would.)"""

    def __init__(self, at: int) -> None:
        self.at = at

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.at:
            for algorithm in state.algorithms:
                if hasattr(algorithm, "drain"):
                    algorithm.drain()
            raise KeyboardInterrupt(f"killed after {self.at} steps")


def _columns(path: str) -> dict[str, list]:
    return {c: read_column(path, c) for c in ("step", "episode", "tokens", "loss_mask", "score", "source")}


@pytest.mark.parametrize("policy", ["blade", "blade-nosync", "random"])
def test_resume_mid_episode_gives_the_same_masks_and_weights(make_config, policy):
    # W=2, τ=3: refreshes before steps 2, 5, 8. Checkpoints every 4 steps; the kill comes after step 8's
    # selected part was written but before its checkpoint, so the rerun resumes at step 4, mid-episode
    # (reference and the episode's remaining scores restored from the checkpoint), and must drop and redo
    # part [4, 8).
    full = train(make_config(policy, "uninterrupted"))
    cfg = make_config(policy, "killed")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, callbacks=[Kill(8)])
    sel = os.path.join(cfg.output_dir, "selected")
    assert "steps-000000004-000000008" in os.listdir(sel)  # written after the last checkpoint
    assert sorted(os.listdir(os.path.join(cfg.output_dir, "checkpoints"))) == ["ep0-ba4-rank0.pt", "latest-rank0.pt"]
    resumed = train(cfg)
    assert resumed.run.resumed_from.endswith("latest-rank0.pt")

    a, b = _columns(full.selected), _columns(resumed.selected)
    assert a["step"] == b["step"] == [t for t in range(cfg.max_steps) for _ in range(cfg.batch_size)]
    for col in ("tokens", "loss_mask", "episode", "source"):
        assert all(np.array_equal(x, y) for x, y in zip(a[col], b[col], strict=True)), col
    assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a["score"], b["score"], strict=True))
    wa, wb = load_file(full.final_weights), load_file(resumed.final_weights)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # bitwise on CPU
    ma, mb = Manifest.load(full.selected), Manifest.load(resumed.selected)
    assert ma.sources == mb.sources and [s.name for s in ma.shards] == [s.name for s in mb.shards]
    sa, sb = (x.run.stats.summary_data() for x in (full, resumed))
    assert [s["kept"] for s in sa["steps"]] == [s["kept"] for s in sb["steps"]]
    assert sa["refreshes"] == sb["refreshes"]
    if policy != "random":  # step 4's scores came from the checkpoint: nothing was scored twice
        assert full.run.algorithm.counts["score_steps"] == resumed.run.algorithm.counts["score_steps"]


def test_checkpoint_holds_the_blade_state_and_loads_weights_only(make_config):
    cfg = make_config("blade-nosync", max_steps=6)
    train(cfg)
    path = os.path.join(cfg.output_dir, "checkpoints", "ep0-ba4-rank0.pt")
    ckpt = load_checkpoint(path)  # torch.load(weights_only=True)
    algos = dict(ckpt["state"]["algorithms"])
    blade = algos["BladeAlgorithm"]
    assert blade["next_step"] == 4 and blade["ref_version"] == 0 and blade["policy"] == "blade-nosync"
    assert isinstance(blade["reference"]["model.embed_tokens.weight"], torch.Tensor)
    # W=2, τ=3: episode 0 is steps 2-4; its last step's reference scores travel with the checkpoint
    assert list(blade["scores"]) == [4] and blade["scores"][4].dtype == torch.float16
    assert tuple(blade["scores"][4].shape) == (cfg.batch_size, blade["recent_masks"].shape[-1])
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
    assert read_column(out.selected, "step") == [t for t in range(6) for _ in range(8)]
    # another policy is refused by the config record, naming only the key that differs ...
    other = make_config("random", "early", max_steps=6, checkpoint={"interval": 4})
    record = open(os.path.join(cfg.output_dir, "config.yaml")).read()
    with pytest.raises(ConfigMismatch, match=r"differs in: selection.policy\)") as err:
        train(other)
    assert err.value.keys == ["selection.policy"]
    assert open(os.path.join(cfg.output_dir, "config.yaml")).read() == record  # not rewritten
    # ... and, in a directory without that record (older runs), by the checkpoint ...
    os.remove(os.path.join(cfg.output_dir, "config.yaml"))
    with pytest.raises(ValueError, match="written by policy 'blade'"):
        train(make_config("random", "early", max_steps=6))
    # ... and so is another run writing into its shards once the checkpoints are gone
    shutil.rmtree(os.path.join(cfg.output_dir, "checkpoints"))
    assert not os.path.exists(os.path.join(cfg.output_dir, "config.yaml"))  # the refused run wrote no record
    with pytest.raises(ValueError, match="another run"):
        train(make_config("random", "early", max_steps=6))


def test_a_rerun_with_other_settings_is_refused_instead_of_mixing_them(make_config):
    cfg = make_config("blade", "mixed", max_steps=6)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, callbacks=[Kill(5)])  # checkpoint at step 4, killed after step 5
    ckpts = sorted(os.listdir(os.path.join(cfg.output_dir, "checkpoints")))
    record = open(os.path.join(cfg.output_dir, "config.yaml")).read()
    changed = make_config("blade", "mixed", max_steps=6, optim={"lr": 3e-3}, selection={"lam": 0.5},
                          progress_bar=True)
    with pytest.raises(ConfigMismatch) as err:
        train(changed)
    assert err.value.keys == ["optim.lr", "selection.lam"]  # progress_bar may differ; unchanged keys unnamed
    assert "optim.lr: 0.001 → 0.003" in str(err.value) and "selection.lam: 1.0 → 0.5" in str(err.value)
    assert open(os.path.join(cfg.output_dir, "config.yaml")).read() == record
    assert sorted(os.listdir(os.path.join(cfg.output_dir, "checkpoints"))) == ckpts
    assert train(cfg).run.resumed_from.endswith("latest-rank0.pt")  # the same config resumes


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(make_config):
    cfg = make_config("blade", "truncated", max_steps=8)
    full = train(cfg)
    weights = open(full.final_weights, "rb").read()
    folder = os.path.join(cfg.output_dir, "checkpoints")
    latest = os.path.join(folder, "ep0-ba8-rank0.pt")
    assert os.path.realpath(os.path.join(folder, "latest-rank0.pt")) == latest
    size = os.path.getsize(latest)
    with open(latest, "r+b") as f:  # cut as by a full disk or a kill while it was written
        f.truncate(size // 2)
    with pytest.warns(UserWarning, match=r"ep0-ba8-rank0.pt is unreadable, probably truncated.*previous intact "
                                         r"checkpoint .*ep0-ba4-rank0.pt"):
        again = train(cfg)
    assert again.run.resumed_from == os.path.join(folder, "ep0-ba4-rank0.pt")
    assert open(again.final_weights, "rb").read() == weights  # steps 4..8 redone exactly
    assert read_column(again.selected, "step") == [t for t in range(8) for _ in range(cfg.batch_size)]
    assert checkpoint_damage(latest) is None  # rewritten whole


def _relink_killed(cfg, *, drop: tuple[int, ...] = (), cut: tuple[int, ...] = ()) -> str:
    """Leave ``cfg``'s finished run as a kill inside Composer's save would: ``latest-rank0.pt`` removed (Composer
    removes it, then links the new file), the checkpoints of steps ``drop`` gone, those of ``cut`` half written."""
    folder = os.path.join(cfg.output_dir, "checkpoints")
    os.remove(os.path.join(folder, "latest-rank0.pt"))
    for step in drop:
        os.remove(os.path.join(folder, f"ep0-ba{step}-rank0.pt"))
    for step in cut:
        path = os.path.join(folder, f"ep0-ba{step}-rank0.pt")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    return folder


def test_a_kill_while_composer_relinks_the_latest_checkpoint_resumes_from_the_newest_file(make_config):
    cfg = make_config("blade", "relink", max_steps=8)
    full = train(cfg)
    weights = open(full.final_weights, "rb").read()
    folder = _relink_killed(cfg, drop=(8,))  # killed after step 8's file was created (and removed: as if unwritten)
    with pytest.warns(UserWarning, match=rf"{folder}/latest-rank0.pt is missing \(the job was stopped while it saved a "
                                         rf"checkpoint\); resuming from the newest intact checkpoint "
                                         rf"{folder}/ep0-ba4-rank0.pt$"):
        again = train(cfg)
    assert again.run.resumed_from == os.path.join(folder, "ep0-ba4-rank0.pt")  # not a new run: steps 0..3 kept
    assert open(again.final_weights, "rb").read() == weights  # steps 4..8 redone exactly
    assert read_column(again.selected, "step") == [t for t in range(8) for _ in range(cfg.batch_size)]
    assert os.path.realpath(os.path.join(folder, "latest-rank0.pt")) == os.path.join(folder, "ep0-ba8-rank0.pt")

    _relink_killed(cfg)  # killed between the removal of the link and the new one: step 8's file is whole
    with pytest.warns(UserWarning, match=r"resuming from the newest intact checkpoint .*ep0-ba8-rank0.pt$"):
        assert train(cfg).run.resumed_from == os.path.join(folder, "ep0-ba8-rank0.pt")


def test_a_cut_file_without_the_link_falls_back_to_the_previous_one(make_config):
    cfg = make_config("full", "relink-cut", max_steps=8)
    weights = open(train(cfg).final_weights, "rb").read()
    folder = _relink_killed(cfg, cut=(8,))
    with pytest.warns(UserWarning, match=r"latest-rank0.pt is missing .*resuming from the newest intact checkpoint "
                                         r".*ep0-ba4-rank0.pt \(the steps after it are redone; skipped: "
                                         r".*ep0-ba8-rank0.pt: unreadable, probably truncated"):
        again = train(cfg)
    assert again.run.resumed_from == os.path.join(folder, "ep0-ba4-rank0.pt")
    assert open(again.final_weights, "rb").read() == weights


def test_a_kill_while_the_first_checkpoint_was_written_starts_the_run_over_with_a_warning(make_config):
    cfg = make_config("blade", "first-cut", max_steps=4)
    full = train(cfg)
    weights = open(full.final_weights, "rb").read()
    folder = _relink_killed(cfg, cut=(4,))
    with pytest.warns(UserWarning, match=rf"latest-rank0.pt is missing .* and no checkpoint in it is intact "
                                         rf"\({folder}/ep0-ba4-rank0.pt: unreadable, probably truncated .*\): the "
                                         r"job was stopped while it wrote its first checkpoint; starting the run over"):
        again = train(cfg)
    assert again.run.resumed_from is None
    assert open(again.final_weights, "rb").read() == weights
    assert read_column(again.selected, "step") == [t for t in range(4) for _ in range(cfg.batch_size)]
    assert checkpoint_damage(os.path.join(folder, "ep0-ba4-rank0.pt")) is None  # written anew


def test_checkpoint_files_without_the_link_are_an_earlier_run_when_resume_is_off(make_config):
    cfg = make_config("full", "relink-off", max_steps=4)
    train(cfg)
    folder = _relink_killed(cfg)
    with pytest.raises(ValueError, match=rf"{folder} holds checkpoints of an earlier run; set checkpoint.resume=true"):
        train(cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": False})}))


def test_no_intact_checkpoint_is_an_error_naming_each_file(make_config):
    cfg = make_config("full", "damaged", max_steps=4)
    train(cfg)
    path = os.path.join(cfg.output_dir, "checkpoints", "ep0-ba4-rank0.pt")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=rf"no intact checkpoint to resume from \({path}: unreadable.*delete "):
        train(cfg)


def test_a_second_run_into_the_same_directory_is_refused_at_start(make_config):
    cfg = make_config("blade", "busy", max_steps=4)
    with OutputDirLock(cfg.output_dir, "train") as holder:
        with pytest.raises(OutputDirBusy, match=rf"in use by another run: train pid {os.getpid()} on host "):
            train(cfg)
        assert os.listdir(cfg.output_dir) == [os.path.basename(holder.path)]  # nothing written, nothing read
    assert train(cfg).run.resumed_from is None  # once released, the run goes ahead


def test_a_full_disk_while_saving_a_checkpoint_names_the_folder_and_a_rerun_resumes(make_config, monkeypatch):
    import errno

    from curation.io.outdir import describe_os_error

    cfg = make_config("full", "diskfull", max_steps=8)
    real_save = torch.save

    def save(obj, f, *a, **k):  # what torch reports when the file's writes fail (the disk is full)
        if str(getattr(f, "name", "")).endswith("ep0-ba8-rank0.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:659] . unexpected pos 704 vs 598")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr("training.blocks.checkpoint.shutil.disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    folder = os.path.join(cfg.output_dir, "checkpoints")
    with pytest.raises(OSError) as err:
        train(cfg)
    assert err.value.errno == errno.ENOSPC and err.value.filename == folder
    msg = describe_os_error(err.value, f"training into {cfg.output_dir} failed")
    assert msg.startswith(f"training into {cfg.output_dir} failed ({folder}): No space left on device while "
                          "writing a checkpoint (0 MiB free; torch: [enforce fail")
    assert "the disk is full: free space" in msg
    assert os.path.realpath(os.path.join(folder, "latest-rank0.pt")) == os.path.join(folder, "ep0-ba4-rank0.pt")
    assert checkpoint_damage(os.path.join(folder, "ep0-ba8-rank0.pt"))  # the partial file is left behind
    monkeypatch.undo()  # space freed
    out = train(cfg)
    assert out.run.resumed_from == os.path.join(folder, "latest-rank0.pt")  # → step 4, intact
    assert checkpoint_damage(os.path.join(folder, "ep0-ba8-rank0.pt")) is None
    assert read_column(out.selected, "step") == [t for t in range(8) for _ in range(cfg.batch_size)]


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    def draw():
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]

    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    draw()  # move every generator off its seed state
    path = str(tmp_path / "rng.pt")
    torch.save(rng_state(), path)
    first = draw()
    set_rng_state(torch.load(path, weights_only=True))
    assert draw() == first


def test_a_run_resumed_or_extended_on_candidates_replaced_under_it_is_refused(make_config, demo_root, tmp_path):
    """P37 (issue 55): the candidate shards re-prepared with another seed (the same tokenizer and sizes) under a
    stopped run; the same command, and an extension, were trained on the other pool silently. Refused now, before
    anything is loaded or written, naming the input; restored, the run resumes."""
    from curation.ingest.prepare import prepare
    from curation.io.inputs import INPUTS_NAME
    from curation.io.outdir import InputsChanged
    from schemas.config import PrepareConfig, TokenizerConfig

    data = tmp_path / "data"
    shutil.copytree(os.path.join(demo_root, "data"), data)
    kw = {"data": {"candidates": str(data / "candidates"), "validation": str(data / "validation"),
                   "tokenizer": str(data / "tokenizer" / "tokenizer.json")}}
    cfg = make_config("blade", max_steps=4, **kw)
    train(cfg)
    assert json.load(open(os.path.join(cfg.output_dir, INPUTS_NAME)))["inputs"].keys() == {
        "data.candidates", "data.validation", "data.tokenizer"}
    again = PrepareConfig.demo_default(demo_root).model_copy(update={
        "seed": 1, "demo": False, "output_dir": str(tmp_path / "seed1"), "progress": False, "validation": [],
        "tokenizer": TokenizerConfig(path=kw["data"]["tokenizer"])})
    prepare(again)  # the same corpus, tokenizer and sizes: only the shuffle differs
    os.rename(data / "candidates", tmp_path / "seed0")
    shutil.copytree(tmp_path / "seed1" / "candidates", data / "candidates")
    for extended in (cfg, make_config("blade", max_steps=8, **kw)):
        with pytest.raises(InputsChanged, match=r"^data\.candidates \(.*\) is not the input this run was started "
                                                r"with .* use a new output_dir for the new ones$"):
            train(extended)
    shutil.rmtree(data / "candidates")
    os.rename(tmp_path / "seed0", data / "candidates")  # restored: the run goes ahead (finished: it only reports)
    assert train(cfg).run.resumed_from is not None


@pytest.mark.parametrize("key", ["candidates", "validation"])
def test_a_run_stopped_on_a_bad_record_resumes_once_its_shard_is_fixed(make_config, demo_root, tmp_path, capsys, key):
    """docs/FAILURES.md: a run stops on a token id outside the vocabulary in one shard of its candidates (read by the
    loader) or validation (read by the refresh and the evaluation), the user fixes that shard, and the same command
    resumes from the run's checkpoint: the input changed only in the shard the run failed on (curation.io.inputs).
    Issue 55's input check refused it."""
    from curation.core.stream import CandidateStream
    from curation.io.inputs import INPUTS_NAME
    from curation.io.shards import ShardReader, merge_part_indexes, write_part
    from schemas.shards import CANDIDATE

    data = tmp_path / "data"
    shutil.copytree(os.path.join(demo_root, "data"), data)
    kw = {"data": {"candidates": str(data / "candidates"), "validation": str(data / "validation"),
                   "tokenizer": str(data / "tokenizer" / "tokenizer.json")}}
    cfg = make_config("blade", max_steps=8, **kw)
    target = str(data / key)
    reader = ShardReader(target)
    stream = CandidateStream(len(reader), cfg.batch_size, cfg.seed)  # (candidates: a row of step 6, after the
    sample = len(reader) - 1 if key == "validation" else int(stream.batch_ids(6)[3])  # checkpoint at step 4)
    shard, record = reader.locate(sample)
    part = os.path.dirname(shard)
    parts = [s.name for s in Manifest.load(target).shards]
    backup = str(tmp_path / "backup")
    shutil.copytree(os.path.join(target, part), backup)
    part_reader = ShardReader(os.path.join(target, part))
    rows = [part_reader[i] for i in range(len(part_reader))]
    rows[record]["tokens"] = rows[record]["tokens"].copy()
    rows[record]["tokens"][5] = 65000  # outside the model's vocabulary
    vocab = Manifest.load(target).vocab_size
    write_part(os.path.join(target, part), CANDIDATE, rows, vocab_size=vocab)
    merge_part_indexes(target, parts)
    with pytest.raises(ValueError, match="token id 65000 .* outside the model's vocabulary"):
        train(cfg)
    with open(os.path.join(cfg.output_dir, INPUTS_NAME)) as f:
        assert json.load(f)["failed"][f"data.{key}"]["shards"] == [shard]
    assert "ep0-ba4-rank0.pt" in os.listdir(os.path.join(cfg.output_dir, "checkpoints"))

    shutil.rmtree(os.path.join(target, part))
    shutil.copytree(backup, os.path.join(target, part))  # the fix: the shard as it was prepared
    merge_part_indexes(target, parts)
    capsys.readouterr()
    resumed = train(cfg)
    assert resumed.run.resumed_from is not None and os.path.exists(resumed.final_weights)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: data.")]
    assert notes == [notes[0]] and notes[0].startswith(f"note: data.{key} ({target}) changed only in the shards "
                                                       f"this run failed on, accepted: {shard};")
