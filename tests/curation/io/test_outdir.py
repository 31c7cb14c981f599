"""Output-directory locks, config records (resume only with the same config) and OS-error messages."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from curation.io.atomic import atomic_write_text
from curation.io.outdir import (
    LOCK_NAME,
    ConfigMismatch,
    OutputDirBusy,
    OutputDirError,
    OutputDirLock,
    check_config_record,
    describe_os_error,
    open_output_dir,
)
from schemas.config import PrepareConfig
from schemas.engine_config import CurateAndTrainConfig
from schemas.records import config_diff, field_default, operational_keys
from schemas.train_config import TrainConfig

REPO = Path(__file__).resolve().parents[3]  # tests/curation/io/test_outdir.py → the checkout


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    out = str(tmp_path / "out")
    with OutputDirLock(out, "train"):
        with pytest.raises(OutputDirBusy) as err:
            OutputDirLock(out, "prepare")
        msg = str(err.value)
        assert f"pid {os.getpid()}" in msg and f"host {socket.gethostname()}" in msg
        assert "train" in msg and "started 20" in msg and out in msg
    with OutputDirLock(out, "prepare") as lock:  # released: the next run gets it
        assert json.loads(Path(lock.path).read_text())["job"] == "prepare"


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from curation.io.outdir import OutputDirLock
        lock = OutputDirLock({str(out)!r}, "train")
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirBusy, match=f"pid {proc.pid} on host"):
            OutputDirLock(str(out), "train")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    holder = json.loads((out / LOCK_NAME).read_text())
    assert holder["pid"] == proc.pid  # the file of the killed run is still there ...
    with OutputDirLock(str(out), "train") as lock:  # ... and does not block the resume
        assert lock.holder["pid"] == os.getpid()


def test_an_output_dir_inside_or_around_a_live_run_is_refused(tmp_path):
    """P18 (issue 55): a second job writing into a live run's folder (or a folder holding it) was accepted. A sibling
    is not refused, nor, in the same process, a directory inside its own run's (the main job's prepare); once the run
    ends, both are accepted."""
    run = tmp_path / "runs" / "live"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from curation.io.outdir import OutputDirLock
        lock = OutputDirLock({str(run)!r}, "train")
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirBusy) as inside:
            OutputDirLock(str(run / "selected" / "x"), "curate")
        assert str(inside.value).startswith(f"{run / 'selected' / 'x'} is inside {run}, the output directory of a "
                                            f"live run (train pid {proc.pid} on host ")
        assert str(inside.value).endswith("a job must not write into another run's directory or around it; use an "
                                          "output_dir outside it")
        with pytest.raises(OutputDirBusy, match=rf"^{tmp_path / 'runs'} holds {run}, the output directory of a live "
                                                rf"run \(train pid {proc.pid} on host "):
            OutputDirLock(str(tmp_path / "runs"), "prepare")
        assert not os.path.exists(tmp_path / "runs" / LOCK_NAME)  # (refused before it wrote its holder)
        with OutputDirLock(str(tmp_path / "runs" / "sibling"), "train"):
            with OutputDirLock(str(tmp_path / "runs" / "sibling" / "data"), "prepare"):  # this process's own
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    OutputDirLock(str(run / "selected" / "x"), "curate").release()
    OutputDirLock(str(tmp_path / "runs"), "prepare").release()


def test_config_diff_names_exactly_the_differing_leaf_keys():
    old = {"a": 1, "sel": {"gamma": 0.6, "lam": 1.0, "tau": 30}, "src": [{"name": "x", "p": ["a", "b"]}], "bar": True}
    new = {"a": 1, "sel": {"gamma": 0.6, "lam": 2.0, "tau": 30}, "src": [{"name": "x", "p": ["a", "c"]}],
           "bar": False, "extra": None}
    assert config_diff(old, new) == ['bar: true → false', 'extra: (absent) → null', 'sel.lam: 1.0 → 2.0',
                                     'src.0.p.1: "b" → "c"']
    assert config_diff(old, new, ignore={"bar", "extra", "src"}) == ["sel.lam: 1.0 → 2.0"]
    assert config_diff(old, json.loads(json.dumps(old))) == []


def test_a_record_naming_the_same_file_another_way_is_equal_and_another_file_is_not(tmp_path):
    """A run started from one checkout records ``<checkout>/../shared/x``; resumed from another (or with the path
    resolved) it names the same file differently: the same input, so not a mismatch. Another file, or a path that
    does not exist, still is."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "checkout").mkdir()
    data, other = tmp_path / "shared" / "a.jsonl", tmp_path / "shared" / "b.jsonl"
    data.write_text("{}")
    other.write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "shared")
    record = tmp_path / "run" / "config.yaml"
    record.parent.mkdir()
    recorded = str(tmp_path / "checkout" / ".." / "shared" / "a.jsonl")
    record.write_text(yaml.safe_dump({"paths": [recorded], "seed": 0}))
    for same in (str(data), str(tmp_path / "link" / "a.jsonl")):
        assert check_config_record(str(record), {"paths": [same], "seed": 0})
    for changed, key in (({"paths": [str(other)], "seed": 0}, "paths.0"), ({"paths": [recorded], "seed": 1}, "seed"),
                         ({"paths": [str(tmp_path / "gone.jsonl")], "seed": 0}, "paths.0"),
                         ({"paths": ["a.jsonl"], "seed": 0}, "paths.0")):  # relative: never taken as the same file
        with pytest.raises(ConfigMismatch, match=rf"differs in: {key}\)"):
            check_config_record(str(record), changed)


def test_operational_keys_cover_only_settings_that_cannot_change_outputs():
    # prepare's output is the same for any number of workers, on any Ray cluster and any node its tasks are
    # pinned to (tests/curation/engine/test_prepare_pool.py, tests/jobs/test_two_nodes.py); unit_bytes is not
    # operational (it places the units' cuts)
    assert operational_keys(PrepareConfig) == {"progress", "workers", "ray", "resources"}
    # the worker group's resources, collective backend, restarts and timeout change where and how robustly it
    # runs, not what it computes (parallel.workers and selection.scope do: they are not operational)
    assert operational_keys(TrainConfig) == {
        "progress_bar", "plots", "checkpoint.resume", "checkpoint.keep", "parallel.cpus_per_worker",
        "parallel.gpus_per_worker", "parallel.resources", "parallel.backend", "parallel.max_failures",
        "parallel.timeout_s", "loggers", "throughput"}
    keys = operational_keys(CurateAndTrainConfig)
    assert {"train.progress_bar", "ray", "workers.count", "engine.wait_timeout_s"} <= keys
    assert not keys & {"train.selection.gamma", "train.optim.lr", "engine.mode", "workers.range_steps"}


def test_a_rerun_with_another_config_is_refused_and_the_record_is_kept(tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig.demo_default(str(tmp_path))
    with open_output_dir(str(out), "train", {"config.yaml": cfg}) as lock:
        assert not (out / "config.yaml").exists()  # written only when the job acts
        lock.write_records()
    record = (out / "config.yaml").read_text()
    assert yaml.safe_load(record) == cfg.model_dump(mode="json")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "ep0-ba5-rank0.pt").write_bytes(b"x")  # an output the record protects
    other = cfg.model_copy(update={"batch_size": 32, "progress_bar": False,
                                   "optim": cfg.optim.model_copy(update={"lr": 3e-4})})
    with pytest.raises(ConfigMismatch) as err:
        open_output_dir(str(out), "train", {"config.yaml": other})
    assert err.value.keys == ["batch_size", "optim.lr"]  # not progress_bar (operational), nothing unchanged
    assert "batch_size: 16 → 32" in str(err.value) and "optim.lr: 0.001 → 0.0003" in str(err.value)
    assert (out / "config.yaml").read_text() == record
    # only an operational key differs: resumes, and the record is not rewritten
    quiet = cfg.model_copy(update={"progress_bar": False})
    with open_output_dir(str(out), "train", {"config.yaml": quiet}) as lock:
        assert lock.pending == {}
        lock.write_records()
    assert (out / "config.yaml").read_text() == record
    assert check_config_record(str(out / "config.yaml"), quiet)


def _without(record: dict, *keys: str) -> dict:
    record = json.loads(json.dumps(record))
    for key in keys:
        *path, leaf = key.split(".")
        node = record
        for p in path:
            node = node[p]
        del node[leaf]
    return record


#: keys added to TrainConfig after runs were recorded (issue 22)
NEW_KEYS = ("loggers", "throughput", "model.activation_checkpointing", "model.compile")


def test_field_defaults_through_nested_sections():
    assert field_default(TrainConfig, "model.compile") is False
    assert field_default(TrainConfig, "loggers.tensorboard") is None
    assert field_default(TrainConfig, "throughput") == {"peak_flops": None, "window": 20, "log_interval": 10}
    assert field_default(TrainConfig, "selection.gamma") == 0.6
    assert field_default(CurateAndTrainConfig, "train.model.activation_checkpointing") is False
    # a required key, a dict item or an unknown key has no default: absent from a record, it differs
    cfg = TrainConfig.demo_default()
    new = cfg.model_dump(mode="json")
    new["model"]["hf_config"]["rope_theta"] = 10000.0
    old = _without(cfg.model_dump(mode="json"), "output_dir", "data.candidates", *NEW_KEYS)
    assert config_diff(old, new, model=TrainConfig) == [
        f'data.candidates: (absent) → "{cfg.data.candidates}"', "model.hf_config.rope_theta: (absent) → 10000.0",
        f'output_dir: (absent) → "{cfg.output_dir}"']


def test_a_run_recorded_before_new_keys_resumes_at_their_defaults(tmp_path):
    """A record written before a key existed resumes when the key holds its default; any other value is a change
    of the recorded behaviour and is refused naming the key."""
    cfg = TrainConfig.demo_default(str(tmp_path))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_without(cfg.model_dump(mode="json"), *NEW_KEYS)))
    assert check_config_record(str(path), cfg)
    # the loggers and throughput sections are operational: turning one on still resumes
    on = TrainConfig.model_validate({**cfg.model_dump(), "loggers": {"tensorboard": {"log_dir": "tb"}}})
    assert check_config_record(str(path), on)
    compiled = TrainConfig.model_validate({**cfg.model_dump(), "model": {**cfg.model.model_dump(), "compile": True}})
    with pytest.raises(ConfigMismatch) as err:
        check_config_record(str(path), compiled)
    assert err.value.keys == ["model.compile"] and "model.compile: (absent) → true" in str(err.value)
    # the main job records the same TrainConfig inside its own: the same rule, one level down
    job = CurateAndTrainConfig.demo_default(str(tmp_path))
    old = job.model_dump(mode="json")
    old["train"] = _without(old["train"], *NEW_KEYS)
    path.write_text(yaml.safe_dump(old))
    assert check_config_record(str(path), job)
    # a plain mapping has no defaults to go by: an absent key differs
    path.write_text(yaml.safe_dump(_without(cfg.model_dump(mode="json"), "model.compile")))
    with pytest.raises(ConfigMismatch, match=r"model.compile: \(absent\) → false"):
        check_config_record(str(path), cfg.model_dump(mode="json"))


def test_a_refused_rerun_releases_the_lock(tmp_path):
    out = tmp_path / "run"
    cfg = PrepareConfig.demo_default(str(tmp_path))
    open_output_dir(str(out), "prepare", {"config.yaml": cfg}).write_records()
    (out / "tokenizer.json").write_text("{}")  # an output the record protects
    with pytest.raises(ConfigMismatch, match=r"differs in: seq_len\)"):
        open_output_dir(str(out), "prepare", {"config.yaml": cfg.model_copy(update={"seq_len": 64})})
    open_output_dir(str(out), "prepare", {"config.yaml": cfg}).release()


def test_an_unwritable_output_dir_is_named(tmp_path, monkeypatch):
    out = str(tmp_path / "ro")
    if os.geteuid() != 0:  # a real read-only directory (root writes through permissions)
        os.makedirs(out)
        os.chmod(out, 0o555)
    else:
        def refuse(path, *a, **k):
            raise PermissionError(errno.EACCES, "Permission denied", path)

        monkeypatch.setattr("curation.io.outdir.os.open", refuse)
    with pytest.raises(OutputDirError) as err:
        OutputDirLock(out, "train")
    msg = str(err.value)
    assert f"cannot open the output directory {out}" in msg and os.path.join(out, LOCK_NAME) in msg
    assert "Permission denied" in msg and "make the directory writable" in msg


def test_a_full_disk_names_the_file_being_written(tmp_path, full_disk):
    full_disk()
    path = str(tmp_path / "manifest.json")
    with pytest.raises(OSError) as err:
        atomic_write_text(path, "{}")
    assert err.value.errno == errno.ENOSPC and err.value.filename == path
    assert os.listdir(tmp_path) == []  # no temporary file left
    msg = describe_os_error(err.value, "preparing into /data failed")
    assert msg.startswith(f"preparing into /data failed ({path}): No space left on device; the disk is full")


def test_report_job_errors_prints_one_line_and_lets_bugs_through(capsys):
    import errno

    from curation.io.outdir import report_job_errors

    assert report_job_errors(lambda: {"ok": 1}, "x failed") == {"ok": 1}

    def bad_input():
        raise ValueError("data.yaml:3: gamma must be in (0, 1]")

    assert report_job_errors(bad_input, "training into runs/x failed") is None
    assert capsys.readouterr().err == "error: data.yaml:3: gamma must be in (0, 1]\n"

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device", "runs/x/part.tmp")

    assert report_job_errors(full_disk, "training into runs/x failed") is None
    err = capsys.readouterr().err
    assert err.startswith("error: training into runs/x failed (runs/x/part.tmp): No space left on device; ")

    class EngineDown(RuntimeError):
        pass

    def engine():
        raise EngineDown("worker 1: bad record in shard 3")

    assert report_job_errors(engine, "w", expected=(EngineDown,)) is None
    assert capsys.readouterr().err == "error: worker 1: bad record in shard 3\n"
    with pytest.raises(EngineDown):  # not expected by this job: a bug, with its traceback
        report_job_errors(engine, "w")


def test_the_output_dir_is_compared_as_the_directory_it_names_and_a_copied_run_resumes(tmp_path, monkeypatch):
    """issue 32: a trailing '/', a relative path, or a copy of the run directory got ``differs in: output_dir``, and
    the suggested ``--config <copy>/config.yaml`` pointed back at the original."""
    import shutil

    out = tmp_path / "run"
    cfg = TrainConfig.demo_default(str(tmp_path)).model_copy(update={"output_dir": str(out)})
    with open_output_dir(str(out), "train", {"config.yaml": cfg}) as lock:
        lock.write_records()
    record = (out / "config.yaml").read_text()
    monkeypatch.chdir(tmp_path)
    for spelled in (str(out) + "/", "run", "./run/", os.path.join("..", tmp_path.name, "run")):
        with open_output_dir(spelled, "train", {"config.yaml": cfg.model_copy(update={"output_dir": spelled})}):
            pass  # resumes (the record is rewritten only when the job acts: write_records)
    assert (out / "config.yaml").read_text() == record

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    moved = cfg.model_copy(update={"output_dir": str(copy)})
    with open_output_dir(str(copy), "train", {"config.yaml": moved}) as lock:
        assert list(lock.pending) == ["config.yaml"]  # the record will name where the run is now
        lock.write_records()
    assert yaml.safe_load((copy / "config.yaml").read_text())["output_dir"] == str(copy)
    assert (out / "config.yaml").read_text() == record  # the original is untouched

    shutil.rmtree(copy)
    shutil.copytree(out, copy)
    with pytest.raises(ConfigMismatch) as err:
        open_output_dir(str(copy), "train", {"config.yaml": moved.model_copy(update={"batch_size": 32})})
    assert err.value.keys == ["batch_size"]
    assert f"rerun with the config recorded in {copy / 'config.yaml'} and --set output_dir={copy} to resume" in str(
        err.value)


def test_a_record_that_protects_no_output_is_replaced_by_the_corrected_rerun(tmp_path, capsys):
    """issue 32: a run that failed before its first output (a token id outside the vocabulary) left a record that
    refused the corrected rerun. With nothing but the lock, the record and a manifest listing no shard, the rerun
    replaces the record (one note); one other file, and it is refused as before."""
    out = tmp_path / "run"
    cfg = TrainConfig.demo_default(str(tmp_path))
    with open_output_dir(str(out), "train", {"config.yaml": cfg}) as lock:
        lock.write_records()
    (out / "candidates").mkdir()
    (out / "candidates" / "manifest.json").write_text(json.dumps({"shards": [], "complete": False}))
    other = cfg.model_copy(update={"batch_size": 32})
    with open_output_dir(str(out), "train", {"config.yaml": other}) as lock:
        assert capsys.readouterr().err == (f"note: {out / 'config.yaml'} records a config that produced no output yet "
                                           "(differs in: batch_size): replacing it with this run's\n")
        lock.write_records()
    assert yaml.safe_load((out / "config.yaml").read_text())["batch_size"] == 32
    (out / "candidates" / "manifest.json").write_text(json.dumps({"shards": [{"name": "a/part-00000"}]}))
    with pytest.raises(ConfigMismatch):
        open_output_dir(str(out), "train", {"config.yaml": cfg})
    (out / "candidates" / "manifest.json").unlink()
    (out / "log.txt").write_text("")
    with pytest.raises(ConfigMismatch):
        open_output_dir(str(out), "train", {"config.yaml": cfg})
    assert yaml.safe_load((out / "config.yaml").read_text())["batch_size"] == 32


def test_a_failed_first_run_removes_what_it_wrote_and_a_started_one_keeps_it(tmp_path):
    """issue 57: a first run that fails before its first output leaves no record, lock or directory (it would look
    started); one that wrote an output, or a failed rerun of a directory that held a run, keeps everything."""
    cfg = TrainConfig.demo_default(str(tmp_path))
    out = tmp_path / "new"
    with pytest.raises(ValueError, match="bad input"), open_output_dir(str(out), "train", {"config.yaml": cfg}) as lock:
        lock.write_records()
        (out / "candidates").mkdir()
        (out / "candidates" / "manifest.json").write_text(json.dumps({"shards": [], "complete": False}))
        raise ValueError("bad input")
    assert not out.exists()
    with pytest.raises(ValueError), open_output_dir(str(out), "train", {"config.yaml": cfg}) as lock:
        lock.write_records()
        (out / "tokenizer.json").write_text("{}")  # an output: the record protects it
        raise ValueError("later")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "config.yaml", "tokenizer.json"]
    (out / "tokenizer.json").unlink()
    with pytest.raises(ValueError), open_output_dir(str(out), "train", {"config.yaml": cfg}):
        raise ValueError("a rerun fails")  # the directory held a record when this run took it: not its to remove
    assert (out / "config.yaml").exists()
    with open_output_dir(str(tmp_path / "ok"), "train", {"config.yaml": cfg}) as lock:
        lock.write_records()  # no failure: nothing is removed
    assert (tmp_path / "ok" / "config.yaml").exists()


def test_a_lock_file_removed_while_another_run_opened_it_is_opened_again(tmp_path, monkeypatch):
    """A run that discards its directory removes the lock file while holding it: another run that opened the old
    file in between (and locks it once released) must not hold that orphan while a third locks the new file; it
    sees the path names another file and opens it again."""
    from curation.io import outdir

    out = tmp_path / "run"
    out.mkdir()
    real = outdir.OutputDirLock._open
    orphans = []

    def first_an_orphan(self):
        if not orphans:  # the old lock file: opened and locked, then removed by its owner
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            outdir.fcntl.flock(fd, outdir.fcntl.LOCK_EX | outdir.fcntl.LOCK_NB)
            orphans.append(os.fstat(fd))
            os.unlink(self.path)
            return fd
        orphans.append(None)
        return real(self)

    monkeypatch.setattr(outdir.OutputDirLock, "_open", first_an_orphan)
    with open_output_dir(str(out), "train") as lock:
        assert len(orphans) == 2  # the orphan seen (closed: its inode number may be the new file's) and opened again
        assert os.path.samestat(os.fstat(lock._fd), os.stat(out / ".lock"))
