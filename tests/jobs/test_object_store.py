"""The jobs end to end on a real S3 server (SeaweedFS, the ``s3`` fixture): prepare into ``s3://``, train and the Ray
main job reading from and writing to the bucket, a kill and a resume from the bucket with the local cache wiped in
between (the outputs equal a local run's bit for bit), and a bit flip in a stored shard detected by name and
repaired by a rerun of prepare. The killed runs are fresh job processes; the reruns run in the test process."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import yaml

from curation.io import objects, storage
from curation.io.shards import ShardReader
from schemas.config import PrepareConfig
from schemas.manifest import Manifest
from tests import timing
from tests.conftest import ENGINE_VOCAB, load_job
from tests.jobs.test_curate_and_train import JOB as MAIN_JOB
from tests.jobs.test_curate_and_train import assert_same_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # minutes each on a loaded 2-core machine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_JOB = os.path.join(REPO, "jobs", "train.py")


def _prepare_into(s3, engine_demo: str, prefix: str = "data") -> PrepareConfig:
    """The engine demo's corpus prepared into ``s3://<bucket>/<prefix>`` (the same settings as ``engine_demo``)."""
    from curation.ingest.prepare import prepare

    cfg = PrepareConfig.demo_default(engine_demo)
    cfg = cfg.model_copy(update={"progress": False, "output_dir": s3.url(prefix),
                                 "tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": ENGINE_VOCAB})})
    result = prepare(cfg)
    # issue 34: an object-store prepare confirms what the bucket holds, counted from the bucket itself
    held = len(objects.list_objects(s3.url(prefix)))
    assert result.uploaded is not None and result.uploaded.startswith("uploaded ") and \
        f" to {s3.url(prefix)}; it holds {held} objects (" in result.uploaded, result.uploaded
    return cfg


def _s3_data(s3, prefix: str = "data") -> dict:
    return {"candidates": s3.url(f"{prefix}/candidates"), "validation": s3.url(f"{prefix}/validation"),
            "tokenizer": s3.url(f"{prefix}/tokenizer/tokenizer.json")}


def _start(job: str, config: dict, path, s3) -> subprocess.Popen:
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    env = {k: v for k, v in s3.env(PYTHONUNBUFFERED="1").items() if k != "RAY_ADDRESS"}  # a local Ray instance
    return subprocess.Popen([sys.executable, job, "--config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _kill_after_first_checkpoint(proc: subprocess.Popen, s3, run: str, killer) -> None:
    """SIGKILL the job's whole session once its first checkpoint is in the bucket (not only on disk)."""
    deadline = timing.Deadline(300)
    while proc.poll() is None and not deadline.expired():
        if "checkpoints/.symlinks.json" in objects.list_objects(s3.url(run)):
            break
        time.sleep(0.2)
    killer(proc.pid)
    out = timing.communicate(proc, timeout=60)[0]
    assert proc.returncode == -9, "the job ended before it could be killed:\n" + out[-3000:]


def _finish_here(job: str, config: dict, path, capfd) -> str:  # noqa: ANN001 - pytest's capfd
    """The rerun of a job, in this test process (its environment points at the test server: the s3 fixture):
    ``jobs/<job>.py``'s ``main`` on ``config``; returns its stdout and stderr. A Ray job here starts a local instance
    of its own (fixture ``own_ray``), whose workers see this environment."""
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    capfd.readouterr()
    rc = load_job(job, "_s3_here").main(["--config", str(path)])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    return out + err


def _pulled(s3, run: str) -> str:
    """The run's outputs from the bucket, in a fresh cache."""
    path = storage.local_path(s3.url(run))
    storage.pull(path)
    return path


@pytest.fixture
def local_run(single_run) -> str:
    """The tiny blade run of ``tiny_train`` on the local copy of the data, uninterrupted (what the bucket's runs
    must equal bit for bit)."""
    return single_run["out"]


def test_prepare_train_resume_and_a_bit_flip_on_s3(s3, engine_demo, tiny_train, local_run, tmp_path, session_killer,
                                                   capfd):
    # prepare into the bucket: the same shards as a local prepare, readable by StreamingDataset from the bucket
    cfg = _prepare_into(s3, engine_demo)
    stored = objects.list_objects(s3.url("data"))
    assert {"config.yaml", "tokenizer/tokenizer.json", "candidates/index.json", "candidates/manifest.json",
            "validation/index.json"} <= set(stored) and ".lock" not in stored
    local_index = os.path.join(engine_demo, "data", "candidates", "index.json")
    assert objects.read_object(s3.url("data/candidates/index.json")).body == open(local_index, "rb").read()
    from streaming import StreamingDataset

    ds = StreamingDataset(remote=s3.url("data/candidates"), local=str(tmp_path / "sd"), shuffle=False, batch_size=8,
                          validate_hash="xxh64")
    local = ShardReader(os.path.join(engine_demo, "data", "candidates"))
    assert len(ds) == len(local) and np.array_equal(ds[7]["tokens"], local[7]["tokens"])

    # train.py from and into the bucket, killed after its first checkpoint; the cache wiped; the rerun resumes
    train_cfg = tiny_train(s3.url("run"), data=_s3_data(s3))
    _kill_after_first_checkpoint(_start(TRAIN_JOB, train_cfg, tmp_path / "train.yaml", s3), s3, "run", session_killer)
    shutil.rmtree(s3.cache)
    out = _finish_here("train", train_cfg, tmp_path / "train.yaml", capfd)  # the rerun, in this process
    assert "took over the lock" in out and "resumed from" in out, out[-3000:]
    assert ".lock" not in objects.list_objects(s3.url("run"))
    # issue 34: the run's outputs named by their URLs, never by cache paths, and the upload confirmed by the bucket
    assert f"final weights: {s3.url('run/final/model.safetensors')}" in out and s3.cache not in out, out[-3000:]
    assert f"selected-token shards: {s3.url('run/selected')}" in out
    uploaded = re.search(r"^uploaded (\d+) files? to (\S+); it holds (\d+) objects \(", out, re.MULTILINE)
    stored = objects.list_objects(s3.url("run"))
    assert uploaded and uploaded.group(2) == s3.url("run") and int(uploaded.group(3)) == len(stored)
    assert 0 < int(uploaded.group(1)) and "final/model.safetensors" in stored and "summary.json" in stored

    # bit for bit the run of the same config on the local copy of the data, uninterrupted
    shutil.rmtree(s3.cache)
    assert_same_run(local_run, _pulled(s3, "run"))

    # a bit flip in a stored shard: a reader names the object; a rerun of prepare (its cache still holding the
    # intact copy) finds it by its ETag, rewrites the part, and the object is whole again
    storage.pull(storage.local_path(s3.url("data")))  # a warm cache: intact copies
    key = "data/candidates/target/part-00000-00000/shard.00000.mds.zstd"
    c = s3.server.client()
    good = c.get_object(Bucket=s3.name, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x10
    c.put_object(Bucket=s3.name, Key=key, Body=bytes(bad))
    cold = str(tmp_path / "cold")
    os.environ["BLADE_CACHE_DIR"] = cold  # (restored by the s3 fixture's monkeypatch)
    rc = load_job("train", "_s3").main(["--config", str(tmp_path / "train.yaml"), "--set",
                                        f"output_dir={s3.url('run2')}"])
    err = capfd.readouterr().err
    assert rc == 1
    assert f"error: {s3.url(key)}: corrupt shard (" in err
    assert ("part target/part-00000-00000 can be regenerated: rerun jobs/prepare.py with the same config and "
            "output_dir") in err
    os.environ["BLADE_CACHE_DIR"] = s3.cache
    from curation.ingest.prepare import prepare

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = prepare(cfg)
    assert result.regenerated == [os.path.join(storage.local_path(s3.url("data/candidates")),
                                               "target/part-00000-00000")]
    assert any("target/part-00000-00000 is damaged" in str(w.message) for w in caught)
    assert hashlib.sha256(c.get_object(Bucket=s3.name, Key=key)["Body"].read()).digest() == \
        hashlib.sha256(good).digest()


@pytest.mark.ray
def test_the_main_job_on_s3_killed_and_resumed_from_the_bucket(s3, engine_demo, tiny_train, local_run, tmp_path,
                                                              session_killer, own_ray, capfd):
    _prepare_into(s3, engine_demo)
    config = {"train": tiny_train(s3.url("run"), data=_s3_data(s3)), "workers": {"count": 2, "range_steps": 2},
              "engine": {"lookahead": 4}}
    _kill_after_first_checkpoint(_start(MAIN_JOB, config, tmp_path / "main.yaml", s3), s3, "run", session_killer)
    assert not Manifest.load(_pulled(s3, "run/scored")).complete
    shutil.rmtree(s3.cache)
    # the rerun and jobs/curate.py below in this process, on one local Ray instance started here (its workers see
    # the fixture's endpoint, keys and cache; the jobs join it rather than each starting one)
    from curation.engine.ray_backend import ray_session

    with ray_session("local", num_cpus=4):
        _main_job_resumed_then_curate(s3, engine_demo, config, local_run, tmp_path, capfd)


def _main_job_resumed_then_curate(s3, engine_demo: str, config: dict, local_run: str, tmp_path, capfd) -> None:  # noqa: ANN001
    out = _finish_here("curate_and_train", config, tmp_path / "main.yaml", capfd)  # the rerun, in this process
    assert "took over the lock" in out and "resuming from" in out, out[-3000:]
    stored = objects.list_objects(s3.url("run"))
    assert {"engine_config.yaml", "config.yaml", "scored/manifest.json", "selected/manifest.json",
            "final/model.safetensors", "final/reference.safetensors", "summary.json",
            "engine/reference-0002.safetensors", "checkpoints/.symlinks.json"} <= set(stored)
    assert ".lock" not in stored

    # exact mode on Ray equals the single-process trainer, here on the local copy of the data
    shutil.rmtree(s3.cache)
    run = _pulled(s3, "run")
    assert Manifest.load(os.path.join(run, "scored")).complete
    assert_same_run(local_run, run)

    # jobs/curate.py: the candidates and the run's final weights from the bucket, its selected tokens into it
    architecture = {k: v for k, v in config["train"]["model"].items() if k not in ("activation_checkpointing", "compile")}
    curate_cfg = {"candidates": s3.url("data/candidates"), "tokenizer": None, "model": architecture, "gamma": 0.5,
                  "batch_size": 8, "reference_weights": s3.url("run/final/reference.safetensors"),
                  "proxy_weights": s3.url("run/final/model.safetensors"), "output_dir": s3.url("curate"),
                  "progress": False, "workers": {"count": 1, "range_steps": 10}}
    _finish_here("curate", curate_cfg, tmp_path / "curate.yaml", capfd)
    shutil.rmtree(s3.cache)
    selected = os.path.join(_pulled(s3, "curate"), "selected")
    manifest, rows = Manifest.load(selected), ShardReader(selected)
    assert manifest.complete and len(rows) == len(ShardReader(os.path.join(engine_demo, "data", "candidates")))
    assert sum(int(rows[i]["loss_mask"].sum()) for i in range(len(rows))) == manifest.totals().kept_tokens > 0


@pytest.mark.ray
def test_prepare_on_ray_workers_into_the_bucket_equals_a_local_prepare(s3, engine_demo, tmp_path):
    """jobs/prepare.py with 2 Ray workers into s3:// (small units: each source cut in several): the workers upload
    their parts and unit records, the driver the manifests and indexes; the bucket then holds, object for object,
    what one process writes into a local directory with the same settings."""
    from curation.ingest.prepare import prepare

    base = PrepareConfig.demo_default(engine_demo)
    base = base.model_copy(update={"progress": False, "unit_bytes": 20_000, "workers": 1,
                                   "tokenizer": base.tokenizer.model_copy(update={"vocab_size": ENGINE_VOCAB})})
    local = str(tmp_path / "local")
    prepare(base.model_copy(update={"output_dir": local}))
    config = tmp_path / "prepare.yaml"
    config.write_text(yaml.safe_dump(base.model_copy(update={"output_dir": s3.url("ray"), "workers": 2})
                                     .model_dump(mode="json")))
    env = {k: v for k, v in s3.env(PYTHONUNBUFFERED="1").items() if k != "RAY_ADDRESS"}
    done = timing.run([sys.executable, os.path.join(REPO, "jobs", "prepare.py"), "--config", str(config)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(2 workers)" in done.stdout
    stored = objects.list_objects(s3.url("ray"))
    files = {os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/")
             for d, _, names in os.walk(local) for f in names if f != ".lock"}
    assert set(stored) == files and any("/unit-00001.json" in k for k in stored)
    for key in sorted(files - {"config.yaml", "candidates/manifest.json", "validation/manifest.json"}):
        assert objects.read_object(s3.url(f"ray/{key}")).body == open(os.path.join(local, key), "rb").read(), key
    for group in ("candidates", "validation"):  # the manifests differ in the config and the tokenizer's place only
        ours = json.loads(objects.read_object(s3.url(f"ray/{group}/manifest.json")).body)
        theirs = json.loads(open(os.path.join(local, group, "manifest.json"), "rb").read())
        assert ours["extra"].pop("tokenizer_path") == s3.url("ray/tokenizer/tokenizer.json")
        theirs["extra"].pop("tokenizer_path")
        assert {k: v for k, v in ours.items() if k != "config"} == {k: v for k, v in theirs.items() if k != "config"}


def test_s3_data_given_with_set_is_read_from_the_bucket_by_train_py_and_replay_py(s3, engine_demo, tiny_train,
                                                                                    tmp_path, monkeypatch, capsys):
    """``--set data.candidates=s3://...`` on the embedded default (README's example) and ``--set selected=s3://...``:
    read from the bucket, not refused as a missing local directory (issue 32: jobs/train.py:66, jobs/replay.py:26)."""
    from schemas.train_config import ReplayConfig, TrainConfig

    train_job, replay_job = load_job("train", "_s3set"), load_job("replay", "_s3set")
    _prepare_into(s3, engine_demo)
    local = TrainConfig.model_validate(tiny_train(str(tmp_path / "unused"), max_steps=4))
    monkeypatch.setattr(train_job.TrainConfig, "demo_default", classmethod(lambda cls, **_: local))
    data = _s3_data(s3)
    assert train_job.main([*(f"--set=data.{k}={v}" for k, v in data.items()),
                           "--set", f"output_dir={s3.url('run')}"]) == 0, capsys.readouterr().err
    assert "selected/index.json" in objects.list_objects(s3.url("run"))

    rcfg = ReplayConfig.demo_default(engine_demo).model_copy(update={
        "validation": None, "tokenizer": None, "model": local.model, "batch_size": 8, "max_steps": 2,
        "progress_bar": False, "threads": 1})
    monkeypatch.setattr(replay_job.ReplayConfig, "demo_default", classmethod(lambda cls, **_: rcfg))
    assert replay_job.main(["--set", f"selected={s3.url('run/selected')}", "--set",
                            f"output_dir={tmp_path / 'replay'}"]) == 0, capsys.readouterr().err
    assert os.path.isfile(os.path.join(tmp_path, "replay", "final", "model.safetensors"))
