"""The inputs of a run identified by content (issue 55, P37): recorded when the run first writes, compared on every
resume or extension; a changed input is refused in one line naming it, a touched or moved one is not."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from curation.io.bad_shards import blame
from curation.io.inputs import INPUTS_NAME, check_inputs, fingerprint, input_paths
from curation.io.models import check_token_range
from curation.io.outdir import InputsChanged
from curation.io.outputs import open_output
from curation.io.shards import ShardReader, merge_part_indexes, write_part
from schemas.engine_config import CurateAndTrainConfig, CurateConfig
from schemas.shards import CANDIDATE
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


# ------------------------------------------------------------------------------------------------
# a run that stopped on bad data in an input's shard: the fix of that shard is accepted, nothing else
# ------------------------------------------------------------------------------------------------
PARTS = ("part-a", "part-b")


def _rows(bad: int | None = None, n: int = 4) -> list[dict]:
    rows = [{"tokens": np.arange(i, i + 8, dtype=np.uint16), "source": "web"} for i in range(n)]
    if bad is not None:
        rows[1]["tokens"][3] = bad  # (600: outside a 512-id model's vocabulary)
    return rows


def _write(root, part: str, rows: list[dict]) -> None:
    """(Re)write one part of the real shard directory ``root`` and its merged index, as a user fixing it does."""
    write_part(os.path.join(root, part), CANDIDATE, rows, vocab_size=512)
    merge_part_indexes(str(root), list(PARTS))


def _real_shards(root, bad_part: str | None = "part-b") -> str:
    """A shard directory of two parts (one shard each) whose ``bad_part`` holds a token id of 600 in its second row."""
    for part in PARTS:
        _write(root, part, _rows(600 if part == bad_part else None))
    return str(root)


def _fail_on(cfg, path: str, sample: int) -> None:
    """A resumed run that stops on the bad record ``sample`` of the input at ``path`` (a finished part kept), as the
    trainer's loaders stop: the error blames the sample's shard file."""
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        with _open(cfg) as lock:
            lock.write_records()
            os.makedirs(os.path.join(cfg.output_dir, "selected"), exist_ok=True)
            _file(os.path.join(cfg.output_dir, "selected", "part"), "an output")
            reader = ShardReader(path)
            try:  # (what the trainer's loaders do: training.blocks.data)
                check_token_range(np.asarray(reader[sample]["tokens"]), 512, f"{path} (sample {sample})")
            except ValueError as e:
                raise blame(e, reader.shard_path(sample)) from None
            raise AssertionError("the sample was to be bad")  # pragma: no cover


def _failed(cfg) -> dict:
    with open(os.path.join(cfg.output_dir, INPUTS_NAME)) as f:
        return json.load(f).get("failed", {})


@pytest.mark.parametrize("key", ["candidates", "validation"])
def test_a_change_confined_to_the_shard_the_run_failed_on_is_accepted_and_recorded(tmp_path, capsys, key):
    """The documented recovery (docs/FAILURES.md): a run stops on a bad record naming its shard, the user fixes that
    shard (its part rewritten, the index merged again), the rerun resumes with one note; the same input again is
    plain. Candidates and validation alike."""
    path = _real_shards(tmp_path / key)
    cfg = _train(tmp_path, **{key: path})
    with _open(cfg) as lock:
        lock.write_records()
    recorded = json.load(open(os.path.join(cfg.output_dir, INPUTS_NAME)))["inputs"][f"data.{key}"]
    _fail_on(cfg, path, 5)  # part-b's second row
    failed = _failed(cfg)
    assert list(failed) == [f"data.{key}"]
    assert failed[f"data.{key}"]["shards"] == ["part-b/shard.00000.mds.zstd"]
    assert failed[f"data.{key}"]["xxh3"] == recorded["xxh3"]  # bound to the fingerprint it failed with

    _write(path, "part-b", _rows())  # fixed: the same rows, the bad id replaced
    assert fingerprint(path)["xxh3"] != recorded["xxh3"]
    capsys.readouterr()
    with _open(cfg) as lock:
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(
            f"note: data.{key} ({path}) changed only in the shards this run failed on, accepted: "
            "part-b/shard.00000.mds.zstd; every other entry of its index.json is as "), err
        with open(os.path.join(cfg.output_dir, INPUTS_NAME)) as f:
            now = json.load(f)
        assert now["inputs"][f"data.{key}"]["xxh3"] == fingerprint(path)["xxh3"]  # recorded at once
        assert "failed" not in now  # spent
        lock.write_records()
    with _open(cfg) as lock:  # the same input again: a plain resume
        lock.write_records()
    assert capsys.readouterr().err == ""


def test_a_change_to_another_shard_than_the_failed_one_is_refused(tmp_path):
    path = _real_shards(tmp_path / "real")
    cfg = _train(tmp_path, candidates=path)
    with _open(cfg) as lock:
        lock.write_records()
    _fail_on(cfg, path, 5)
    before = open(os.path.join(cfg.output_dir, INPUTS_NAME)).read()
    refused = f"data.candidates ({path}) is not the input this run was started with (its index.json, which lists"
    good_a = _rows()
    good_a[0]["tokens"][0] = 7
    for change in ({"part-a": good_a}, {"part-a": good_a, "part-b": _rows()},  # the other shard, or it as well
                   {"part-b": _rows(n=5)}):  # the failed shard with another sample count: the stream moves
        for part, rows in change.items():
            _write(path, part, rows)
        with pytest.raises(InputsChanged) as e:
            _open(cfg)
        assert str(e.value).startswith(refused)
        assert open(os.path.join(cfg.output_dir, INPUTS_NAME)).read() == before  # nothing recorded
        for part in PARTS:
            _write(path, part, _rows(600 if part == "part-b" else None))  # as recorded again
    with _open(cfg) as lock:  # (restored: resumes)
        lock.write_records()


def test_a_change_with_no_recorded_failure_is_refused(tmp_path):
    """A run that stopped on another error (none that blames a shard of this input), or never stopped: fixing a
    shard is a changed input like any other."""
    path = _real_shards(tmp_path / "real")
    cfg = _train(tmp_path, candidates=path)
    with _open(cfg) as lock:
        lock.write_records()
    with pytest.raises(RuntimeError):
        with _open(cfg) as lock:
            raise blame(RuntimeError("a shard outside every input"), str(tmp_path / "elsewhere" / "shard.00000.mds"),
                        os.path.join(path, "..", "other", "shard.00000.mds"))  # (leaves the input: not its shard)
    assert _failed(cfg) == {}
    _write(path, "part-b", _rows())
    with pytest.raises(InputsChanged, match=r"^data\.candidates \(.*\) is not the input this run was started with"):
        _open(cfg)


def _failure_naming(tmp_path, name):  # noqa: ANN001, ANN202 - a test helper
    """A run that failed on a real shard, its record then rewritten to blame ``name``: (cfg, the input's path, the
    record's path, the record as written)."""
    path = _real_shards(tmp_path / "real")
    cfg = _train(tmp_path, candidates=path)
    with _open(cfg) as lock:
        lock.write_records()
    _fail_on(cfg, path, 5)
    record_path = os.path.join(cfg.output_dir, INPUTS_NAME)
    record = json.load(open(record_path))
    failure = record["failed"]["data.candidates"]
    failure["shards"] = [name]
    failure["entries"] = {str(name): "0" * 32}
    _file(record_path, json.dumps(record))
    return cfg, path, record_path, record


@pytest.mark.parametrize("name", ["../val/shard.00000.mds", "/etc/passwd", "part-b/../../val/shard.00000.mds",
                                  "part-b/.hidden", "", 7])
def test_a_tampered_failure_record_naming_a_shard_outside_the_input_is_refused(tmp_path, name):
    """The record is read back from the output directory: untrusted. A failed shard named by a path that leaves the
    input, or by no plain name, refuses the rerun in one line (also with the input unchanged); one the index does not
    list accepts nothing."""
    cfg, path, record_path, record = _failure_naming(tmp_path, name)
    with pytest.raises(InputsChanged) as e:
        _open(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        f"{cfg.output_dir}/{INPUTS_NAME}: the shard data.candidates failed on {name!r} is ") and "; refused" in msg
    _write(path, "part-b", _rows())  # the fix of the shard it really failed on does not help: the record is refused
    with pytest.raises(InputsChanged):
        _open(cfg)
    assert json.load(open(record_path)) == record  # nothing rewritten


def test_a_failure_record_naming_a_shard_the_index_does_not_list_accepts_nothing(tmp_path):
    cfg, path, record_path, record = _failure_naming(tmp_path, "part-c/shard.00000.mds.zstd")  # a plain name, in no index
    with _open(cfg) as lock:  # the input as recorded: the failure is not consulted
        lock.write_records()
    _write(path, "part-b", _rows())
    with pytest.raises(InputsChanged, match=r"^data\.candidates \(.*\) is not the input this run was started with"):
        _open(cfg)
    assert json.load(open(record_path)) == record


def test_failures_add_up_against_one_fingerprint_and_a_failure_of_a_changed_input_is_not_recorded(tmp_path):
    """Two stops on two shards of the same recorded input (say a rerun that did not fix the first) name both; a
    fix of both is accepted. A stop after the input changed under the run records nothing: the rerun compares it
    as it is."""
    path = str(tmp_path / "real")
    for part in PARTS:
        _write(path, part, _rows(600))
    cfg = _train(tmp_path, candidates=path)
    with _open(cfg) as lock:
        lock.write_records()
    _fail_on(cfg, path, 1)  # part-a
    _fail_on(cfg, path, 5)  # part-b
    assert _failed(cfg)["data.candidates"]["shards"] == ["part-a/shard.00000.mds.zstd", "part-b/shard.00000.mds.zstd"]
    before = _failed(cfg)
    _write(path, "part-a", _rows())  # changed under the run
    with pytest.raises(ValueError, match="vocabulary"):
        with _open(cfg):  # (accepted: confined to the failed shards) ...
            _write(path, "part-a", _rows(601))  # ... changed again while it runs
            reader = ShardReader(path)
            try:
                check_token_range(np.asarray(reader[1]["tokens"]), 512, "x")
            except ValueError as e:
                raise blame(e, reader.shard_path(1)) from None
    assert _failed(cfg) == {}  # the accepted fix spent the failures; the failure under a changed input added none
    assert before  # (they were recorded)


def test_a_failure_blamed_by_url_from_another_node_is_recorded_against_this_machines_copy(tmp_path, s3):
    """A scoring worker or the refresh actor on another Ray node blames the shard by its URL (that node's cache paths
    mean nothing here): the record names the shard of the input's copy in this machine's cache all the same."""
    from curation.io import objects, storage

    src = _real_shards(tmp_path / "pool")
    for d, _, names in os.walk(src):
        for n in names:
            objects.upload(os.path.join(d, n), s3.url(os.path.relpath(os.path.join(d, n), src)))
    path = storage.local_path(s3.url())  # the input as the job names it: its copy in this machine's cache
    storage.pull(path)
    cfg = _train(tmp_path, candidates=path)
    with _open(cfg) as lock:
        lock.write_records()
    url = storage.url_of(ShardReader(path).shard_path(5))
    assert url == s3.url("part-b/shard.00000.mds.zstd")
    with pytest.raises(ValueError, match="a bad record"):
        with _open(cfg) as lock:
            lock.write_records()
            os.makedirs(os.path.join(cfg.output_dir, "selected"), exist_ok=True)
            _file(os.path.join(cfg.output_dir, "selected", "part"), "an output")
            raise blame(ValueError("a bad record"), url)
    assert _failed(cfg)["data.candidates"]["shards"] == ["part-b/shard.00000.mds.zstd"]
