"""The inputs of a run identified by content (issue 55, P37): recorded when the run first writes, compared on every
resume or extension; a changed input is refused in one line naming it, a touched or moved one is not."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from curation.io.inputs import INPUTS_NAME, check_inputs, fingerprint, input_paths
from curation.io.outdir import InputsChanged
from curation.io.outputs import open_output
from schemas.engine_config import CurateAndTrainConfig, CurateConfig
from schemas.train_config import ReplayConfig, TrainConfig, demo_model_config


def _shards(path, content: str) -> str:
    """A shard directory: an index.json (which lists the shards' hashes) and one shard file."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump({"version": 2, "shards": [{"raw_data": {"basename": "shard.00000.mds", "hashes": {"xxh64": content}}}]},
                  f)
    with open(os.path.join(path, "shard.00000.mds"), "w") as f:
        f.write(content)
    return str(path)


def _file(path, content: str) -> str:
    with open(path, "w") as f:
        f.write(content)
    return str(path)


def _train(tmp_path, **data) -> TrainConfig:
    cfg = TrainConfig.demo_default(str(tmp_path)).model_dump(mode="json")
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["data"] = {"candidates": _shards(tmp_path / "cand", "c1"), "validation": _shards(tmp_path / "val", "v1"),
                   "tokenizer": _file(tmp_path / "tokenizer.json", "tok"), **data}
    return TrainConfig.model_validate(cfg)


def test_each_job_names_its_inputs():
    model = demo_model_config().model_dump(mode="json")
    train = TrainConfig.model_validate({**TrainConfig.demo_default().model_dump(mode="json"), "model": {
        **model, "weights": "/w.safetensors"}})
    assert input_paths({"config.yaml": train}) == {
        "data.candidates": train.data.candidates, "data.tokenizer": train.data.tokenizer,
        "data.validation": train.data.validation, "model.weights": "/w.safetensors"}
    main = CurateAndTrainConfig.demo_default()  # its train section twice (engine_config.yaml and config.yaml): once
    assert input_paths({"engine_config.yaml": main, "config.yaml": main.train}) == {
        "train.data.candidates": main.train.data.candidates, "train.data.tokenizer": main.train.data.tokenizer,
        "train.data.validation": main.train.data.validation}
    curate = CurateConfig(candidates="/c", tokenizer="/t.json", model=demo_model_config(), reference_weights="/r",
                          proxy_weights="/p", output_dir="/o")
    assert input_paths({"config.yaml": curate}) == {"candidates": "/c", "tokenizer": "/t.json",
                                                    "reference_weights": "/r", "proxy_weights": "/p"}
    replay = ReplayConfig(selected="/s", validation="/v", model=demo_model_config(), output_dir="/o")
    assert input_paths({"config.yaml": replay}) == {"selected": "/s", "validation": "/v"}


def test_a_shard_directory_is_identified_by_its_index_a_file_and_a_directory_by_their_bytes(tmp_path):
    shards = _shards(tmp_path / "s", "abc")
    a = fingerprint(shards)
    assert a["kind"] == "shards" and [s[0] for s in a["stat"]] == ["index.json"]
    with open(os.path.join(shards, "shard.00000.mds"), "w") as f:
        f.write("xyz")  # a shard changed without its index: its reader refuses it (hash check), not this
    assert fingerprint(shards)["xxh3"] == a["xxh3"]
    _shards(tmp_path / "s", "abd")
    assert fingerprint(shards)["xxh3"] != a["xxh3"]
    model = tmp_path / "model"
    model.mkdir()
    _file(model / "config.json", "{}")
    _file(model / "model.safetensors", "w1")
    b = fingerprint(str(model))
    assert b["kind"] == "directory" and [s[0] for s in b["stat"]] == ["config.json", "model.safetensors"]
    _file(model / "model.safetensors", "w2")
    assert fingerprint(str(model))["xxh3"] != b["xxh3"]
    f = fingerprint(_file(tmp_path / "w", "bytes"))
    assert f["kind"] == "file" and fingerprint(str(tmp_path / "w"), f) == f
    # the same size and mtime: the recorded hash is taken over (a large file is not read on every resume)
    assert fingerprint(str(tmp_path / "w"), {**f, "xxh3": "recorded"})["xxh3"] == "recorded"


def _open(cfg):
    lock = open_output(cfg.output_dir, "train", {"config.yaml": cfg})
    return lock


def test_a_resumed_run_whose_inputs_changed_is_refused_in_one_line_and_a_touch_is_not(tmp_path):
    cfg = _train(tmp_path)
    with _open(cfg) as lock:
        assert not os.path.exists(os.path.join(cfg.output_dir, INPUTS_NAME))  # recorded when the run first writes
        lock.write_records()
    recorded = json.load(open(os.path.join(cfg.output_dir, INPUTS_NAME)))["inputs"]
    assert sorted(recorded) == ["data.candidates", "data.tokenizer", "data.validation"]
    assert recorded["data.candidates"]["kind"] == "shards" and recorded["data.tokenizer"]["kind"] == "file"
    os.utime(cfg.data.tokenizer, ns=(1, 1))  # touched: the same bytes
    with _open(cfg) as lock:
        lock.write_records()
    _shards(tmp_path / "cand", "c2")  # re-prepared under the run (another seed: other shard hashes)
    with pytest.raises(InputsChanged) as e:
        _open(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"data.candidates ({tmp_path / 'cand'}) is not the input this run was "
                                              "started with (its index.json, which lists every shard's hash, differs")
    assert msg.endswith("restore them, or use a new output_dir for the new ones")
    with open(os.path.join(cfg.output_dir, INPUTS_NAME)) as f:
        assert json.load(f)["inputs"]["data.candidates"]["xxh3"] == recorded["data.candidates"]["xxh3"]  # kept


def test_a_changed_tokenizer_or_weights_file_is_refused_and_a_missing_input_is_left_to_the_job(tmp_path):
    cfg = _train(tmp_path)
    with _open(cfg) as lock:
        lock.write_records()
    _file(cfg.data.tokenizer, "another tokenizer")
    with pytest.raises(InputsChanged, match=r"^data\.tokenizer \(.*tokenizer\.json\) is not the input this run was "
                                            r"started with \(its bytes differ"):
        _open(cfg)
    _file(cfg.data.tokenizer, "tok")  # restored: resumes
    shutil.rmtree(cfg.data.validation)  # gone: the job reports it where it reads it
    with _open(cfg) as lock:
        lock.write_records()


def test_an_unreadable_inputs_record_is_one_line(tmp_path):
    cfg = _train(tmp_path)
    with _open(cfg) as lock:
        lock.write_records()
    _file(os.path.join(cfg.output_dir, INPUTS_NAME), "{not json")
    with pytest.raises(InputsChanged, match=r"inputs\.json: cannot read the record of this run's inputs \(.*\); "
                                            "restore it, or use a new output_dir$"):
        _open(cfg)


def test_a_run_recorded_before_inputs_were_recorded_records_them_on_resume(tmp_path):
    cfg = _train(tmp_path)
    with _open(cfg) as lock:
        lock.write_records()
    os.remove(os.path.join(cfg.output_dir, INPUTS_NAME))
    with _open(cfg) as lock:
        check_inputs(lock, {"data.candidates": cfg.data.candidates}, record=False)  # nothing to compare with
        lock.write_records()
    assert os.path.exists(os.path.join(cfg.output_dir, INPUTS_NAME))


def test_a_record_that_produced_no_output_is_replaced_with_its_inputs(tmp_path):
    """A run that failed before its first output (its config and inputs recorded) is replaced by the corrected rerun
    (curation.io.outdir): so is its record of inputs, which would otherwise refuse the corrected input."""
    cfg = _train(tmp_path)
    with _open(cfg) as lock:
        lock.write_records()
    fixed = cfg.model_copy(update={"data": cfg.data.model_copy(update={"candidates": _shards(tmp_path / "c2", "x")})})
    with _open(fixed) as lock:
        assert lock.replaced
        lock.write_records()
    recorded = json.load(open(os.path.join(cfg.output_dir, INPUTS_NAME)))["inputs"]
    assert recorded["data.candidates"]["path"] == str(tmp_path / "c2")


def test_an_input_made_before_the_first_write_is_recorded_then(tmp_path):
    """The main job prepares its corpus (the demo) after it opened its output directory: an input missing when the
    directory is opened is not compared, and is recorded when the job first writes."""
    cfg = _train(tmp_path)
    shutil.rmtree(cfg.data.candidates)
    with _open(cfg) as lock:
        _shards(tmp_path / "cand", "c1")  # prepared now
        lock.write_records()
    assert "data.candidates" in json.load(open(os.path.join(cfg.output_dir, INPUTS_NAME)))["inputs"]
