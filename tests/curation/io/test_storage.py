"""Object storage against a real S3 server (SeaweedFS, ``s3`` fixture): cache paths, transfers, sync, shard reads
with their integrity checks, the bucket's lock object, failures (unreachable endpoint, credentials)."""

from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np
import pytest

from curation.io import objects, storage
from curation.io.outdir import ConfigMismatch, OutputDirBusy, OutputDirError
from curation.io.outputs import RemoteLock, localize, open_output, urls_in
from curation.io.shards import ShardIntegrityError, ShardReader, write_part
from schemas.config import PrepareConfig
from schemas.shards import CANDIDATE
from schemas.train_config import TrainConfig


# ------------------------------------------------------------------------------------------------
# paths (no server)
# ------------------------------------------------------------------------------------------------
def test_cache_paths_map_both_ways(tmp_path, monkeypatch):
    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "c"))
    assert storage.local_path("s3://bkt/a/b") == str(tmp_path / "c" / "s3" / "bkt" / "a" / "b")
    assert storage.local_path("runs/x") == "runs/x"
    assert storage.url_of(str(tmp_path / "c" / "s3" / "bkt" / "a" / "b" / "f.json")) == "s3://bkt/a/b/f.json"
    assert storage.url_of(str(tmp_path / "elsewhere")) is None
    assert storage.canonical(storage.local_path("s3://bkt/a")) == "s3://bkt/a"
    assert storage.canonical("runs/x") == os.path.abspath("runs/x")
    with pytest.raises(ValueError, match=r"s3://bkt/\.\./x: '\.' and '\.\.' are not allowed"):
        storage.local_path("s3://bkt/../x")
    with pytest.raises(ValueError, match="gs:// paths are not supported; use a local path or s3://bucket/prefix "
                                         r"\(Google Cloud Storage: use its S3-compatible API"):
        objects.check_scheme("gs://b/x")


def test_an_s3_scheme_in_another_case_is_refused_not_written_as_a_local_folder(tmp_path, monkeypatch, capsys):
    """P7 (issue 55): output_dir=S3://… wrote a local folder ``S3:/…`` and exited 0."""
    from tests.conftest import load_job

    monkeypatch.chdir(tmp_path)
    assert load_job("prepare").main(["--set", "output_dir=S3://bkt/x", "--set", "workers=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: S3://bkt/x: write the scheme in lower case (s3://bkt/x): S3:// is not read as the object "
                   "store"]
    assert not os.path.exists(tmp_path / "S3:") and not os.path.exists(tmp_path / "runs")
    cfg = TrainConfig.demo_default("runs/demo")
    with pytest.raises(ValueError, match=r"^S3://b/c: write the scheme in lower case \(s3://b/c\)"):
        localize(cfg.model_copy(update={"data": cfg.data.model_copy(update={"candidates": "S3://b/c"})}))
    with pytest.raises(ValueError, match=r"^S3://b/run: write the scheme in lower case"):
        open_output("S3://b/run", "train")
    assert not objects.is_url("S3://b/x") and objects.is_url("s3://b/x")


def test_a_cache_dir_that_cannot_hold_directories_is_one_line_naming_the_variable(tmp_path, monkeypatch, capsys):
    """P40 (issue 55): a BLADE_CACHE_DIR that is a file, or /proc/self, gave 16-line NotADirectoryError /
    FileNotFoundError tracebacks on s3:// reads, not naming the variable. Local paths never need the cache."""
    from tests.conftest import load_job

    (tmp_path / "a-file").write_text("x")
    for bad, why in ((str(tmp_path / "a-file"), "Not a directory"), ("/proc/self", "No such file or directory")):
        monkeypatch.setenv("BLADE_CACHE_DIR", bad)
        with pytest.raises(ValueError) as e:
            storage.local_path("s3://bkt/data")
        assert str(e.value).startswith(f"BLADE_CACHE_DIR={bad} cannot hold the object-store cache ({why}: ")
        assert str(e.value).endswith("; set BLADE_CACHE_DIR to a directory this user can write")
        assert storage.local_path("runs/x") == "runs/x" and storage.url_of("runs/x") is None
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert load_job("train").main(["--set", "data.candidates=s3://bkt/data/candidates", "--set",
                                   "data.tokenizer=null", "--set", "output_dir=out"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: BLADE_CACHE_DIR=/proc/self cannot hold the object-store cache (No such file or directory: "
        "/proc/self/s3); set BLADE_CACHE_DIR to a directory this user can write"]
    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "cache"))  # a usable one
    assert storage.local_path("s3://bkt/data") == str(tmp_path / "cache" / "s3" / "bkt" / "data")


def test_localize_resolves_directory_urls_only(tmp_path, monkeypatch):
    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "c"))
    cfg = TrainConfig.demo_default("s3://bkt").model_copy(update={"output_dir": "s3://bkt/run"})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"tokenizer": None})})
    local = localize(cfg)
    assert local.output_dir == str(tmp_path / "c" / "s3" / "bkt" / "run")
    assert local.data.candidates == str(tmp_path / "c" / "s3" / "bkt" / "data" / "candidates")
    assert urls_in(local.model_dump(mode="json")) == cfg.model_dump(mode="json")
    plain = TrainConfig.demo_default("runs/demo")
    assert localize(plain) is plain
    prep = PrepareConfig.demo_default("runs/demo")
    inputs = prep.model_copy(update={"sources": [prep.sources[0].model_copy(
        update={"paths": ["s3://bkt/raw/*.jsonl", "local.jsonl"]})], "stage_inputs": "s3://bkt/staged"})
    local = localize(inputs)  # a source's paths (each item, globs too) and the staging prefix: their cache paths
    assert local.sources[0].paths == [str(tmp_path / "c" / "s3" / "bkt" / "raw" / "*.jsonl"), "local.jsonl"]
    assert local.stage_inputs == "s3://bkt/staged"
    assert urls_in(local.model_dump(mode="json")) == inputs.model_dump(mode="json")
    bad = prep.model_copy(update={"tokenizer": prep.tokenizer.model_copy(update={"path": "s3://bkt/tok.json"})})
    with pytest.raises(ValueError, match=r"^tokenizer.path: object-store URLs are supported for shard and output "
                                         r"directories and inputs only \(candidates, output_dir, paths, "
                                         r"proxy_weights, reference_weights, scored, selected, stage_inputs, "
                                         r"tokenizer, validation\); got s3://bkt/tok.json"):
        localize(bad)


# ------------------------------------------------------------------------------------------------
# transfers and sync
# ------------------------------------------------------------------------------------------------
def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_push_pull_mirror_files_and_links(s3):
    root = storage.local_path(s3.url("run"))
    _write(f"{root}/ck/ep0-ba4-rank0.pt", b"four" * 100)
    _write(f"{root}/ck/ep0-ba8-rank0.pt", b"eight" * 100)
    os.symlink("ep0-ba8-rank0.pt", f"{root}/ck/latest-rank0.pt")
    _write(f"{root}/logs/metrics.jsonl", b'{"step": 1}\n')
    assert storage.push(root, "ck", delete=True) == ["ck/ep0-ba4-rank0.pt", "ck/ep0-ba8-rank0.pt"]
    assert storage.push(root, "ck", delete=True) == []  # unchanged: nothing sent
    os.unlink(f"{root}/ck/ep0-ba4-rank0.pt")  # pruned (checkpoint.keep)
    storage.push(root, "ck", delete=True)
    storage.push(root)
    stored = objects.list_objects(s3.url("run"))
    assert sorted(stored) == ["ck/.symlinks.json", "ck/ep0-ba8-rank0.pt", "logs/metrics.jsonl"]
    assert stored["ck/ep0-ba8-rank0.pt"].etag == objects.file_etag(f"{root}/ck/ep0-ba8-rank0.pt")

    shutil.rmtree(storage.cache_root())  # another machine: an empty cache
    assert storage.pull(root) == ["ck/ep0-ba8-rank0.pt", "logs/metrics.jsonl"]
    assert os.readlink(f"{root}/ck/latest-rank0.pt") == "ep0-ba8-rank0.pt"
    assert open(f"{root}/ck/latest-rank0.pt", "rb").read() == b"eight" * 100

    # a stale cache: a changed object (same size) is downloaded again, a file the bucket lacks is deleted
    _write(f"{root}/ck/ep0-ba8-rank0.pt", b"EIGHT" * 100)
    _write(f"{root}/extra/leftover.bin", b"x")
    _write(f"{root}/.lock", b"held")
    assert storage.pull(root) == ["ck/ep0-ba8-rank0.pt"]
    assert open(f"{root}/ck/ep0-ba8-rank0.pt", "rb").read() == b"eight" * 100
    assert not os.path.exists(f"{root}/extra/leftover.bin") and os.path.exists(f"{root}/.lock")
    assert not storage.fetch(f"{root}/nothing/here.json")


def test_pull_never_replaces_the_held_lock_nor_syncs_temporary_files(s3):
    """The bucket's lock object is not downloaded over the local ``.lock`` (a new inode would free the ``flock``
    held on the old one), at the top or deeper; temporary objects (``.tmp-*``, ``.dl-*``, ``*.tmp/`` folders) are
    not downloaded, and the local ones are neither deleted by a pull nor uploaded by a push."""
    import fcntl

    root = storage.local_path(s3.url("run"))
    for key in (".lock", "ck/.lock", ".tmp-manifest.json", "ck/.dl-x1y2", "steps-0-4.tmp/index.json",
                ".tmp-dir/a.bin"):
        objects.write_object(s3.url(f"run/{key}"), b"bucket")
    objects.write_object(s3.url("run/data.bin"), b"data")
    objects.write_object(s3.url("run/ck/.symlinks.json"), json.dumps({".lock": "ep0-ba4-rank0.pt"}).encode())
    _write(f"{root}/.lock", b"held")
    _write(f"{root}/.tmp-local/half.bin", b"being written")
    _write(f"{root}/.dl-local", b"being downloaded")
    with open(f"{root}/.lock", "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        inode = os.stat(f"{root}/.lock").st_ino
        assert storage.pull(root) == ["data.bin"]
        assert os.stat(f"{root}/.lock").st_ino == inode and open(f"{root}/.lock", "rb").read() == b"held"
    for key in ("ck/.lock", ".tmp-manifest.json", "ck/.dl-x1y2", "steps-0-4.tmp", ".tmp-dir"):
        assert not os.path.lexists(f"{root}/{key}"), key
    assert open(f"{root}/.tmp-local/half.bin", "rb").read() == b"being written"  # not deleted: not the bucket's
    assert open(f"{root}/.dl-local", "rb").read() == b"being downloaded"
    storage.push(root)
    assert not any(k.startswith((".tmp-local", ".dl-local")) for k in objects.list_objects(s3.url("run")))


def test_push_with_delete_leaves_lock_and_temporary_objects_at_any_depth(s3):
    """``push(delete=True)`` deletes the objects whose file is gone, never a lock object or a temporary one, at the
    top of the prefix or deeper (a job's lock in a sub-directory, a part being written by another machine)."""
    root = storage.local_path(s3.url("run"))
    kept = [".lock", "ck/.lock", "ck/.tmp-manifest.json", "ck/.dl-x1y2", "ck/steps-0-4.tmp/index.json",
            "eval/.lock"]
    for key in [*kept, "ck/ep0-ba4-rank0.pt", "gone.json"]:
        objects.write_object(s3.url(f"run/{key}"), b"bucket")
    _write(f"{root}/ck/ep0-ba8-rank0.pt", b"eight")
    assert storage.push(root, delete=True) == ["ck/ep0-ba8-rank0.pt"]
    assert sorted(objects.list_objects(s3.url("run"))) == sorted([*kept, "ck/ep0-ba8-rank0.pt"])
    storage.push(root, "ck", delete=True)  # a sub-directory's keys are relative to it: the same rule
    assert sorted(objects.list_objects(s3.url("run"))) == sorted([*kept, "ck/ep0-ba8-rank0.pt"])


def test_push_skips_folders_other_processes_write_and_upload_themselves(s3):
    """A run's driver pushes what it wrote, never its stale copies of the folders a Ray engine's actors on other nodes
    write (``skip``): a file replaced in the bucket since this cache read it stays the bucket's, one deleted there
    (a pruned snapshot) is not uploaded again; a skipped folder is not deleted by ``delete`` either."""
    root = storage.local_path(s3.url("run"))
    _write(f"{root}/engine/proxy-000000002.safetensors", b"pruned elsewhere")
    _write(f"{root}/scored/index.json", b"old")
    objects.write_object(s3.url("run/scored/index.json"), b"new, written by the coordinator on another node")
    _write(f"{root}/final/model.safetensors", b"weights")
    assert storage.push(root, skip=["engine", "scored/"], delete=True) == ["final/model.safetensors"]
    stored = objects.list_objects(s3.url("run"))
    assert sorted(stored) == ["final/model.safetensors", "scored/index.json"]
    assert objects.read_object(s3.url("run/scored/index.json")).body.startswith(b"new")
    assert "uploaded 1 file" in storage.push_all(root, skip=["engine", "scored"])
    assert sorted(objects.list_objects(s3.url("run"))) == ["final/model.safetensors", "scored/index.json"]
    storage.push(root)  # (without skip: every folder, the stale copy included)
    assert objects.read_object(s3.url("run/scored/index.json")).body == b"old"


def _part(path: str, n: int = 40) -> list[np.ndarray]:
    rows = [np.arange(i, i + 16, dtype=np.uint16) for i in range(n)]
    write_part(path, CANDIDATE, ({"tokens": r, "source": "s"} for r in rows), vocab_size=512, size_limit=1 << 9)
    return rows


def test_shards_are_read_through_the_cache_and_checked(s3, flip_bit):
    part = storage.local_path(s3.url("data/candidates/s/part-00000"))
    rows = _part(part)  # written into the cache and uploaded (index.json last)
    names = sorted(objects.list_objects(s3.url("data/candidates/s/part-00000")))
    assert "index.json" in names and len(names) > 2
    shutil.rmtree(storage.cache_root())
    reader = ShardReader(part)
    assert [r["tokens"].tolist() for r in (reader[i] for i in range(len(reader)))] == [r.tolist() for r in rows]

    # a damaged cached copy is downloaded again; the bucket's copy is intact
    shard = reader.shards[1].zip_data.basename
    flip_bit(os.path.join(part, shard))
    assert ShardReader(part)[reader.locate(0)[1] + 3]["tokens"].tolist() == rows[3].tolist()

    # a bit flip in the stored object: detected on download, named by its URL
    c, key = s3.server.client(), f"data/candidates/s/part-00000/{shard}"
    body = bytearray(c.get_object(Bucket=s3.name, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x10
    c.put_object(Bucket=s3.name, Key=key, Body=bytes(body))
    shutil.rmtree(storage.cache_root())
    reader = ShardReader(part)
    first = next(i for i in range(len(reader)) if reader.locate(i)[0] == shard)
    with pytest.raises(ShardIntegrityError, match=rf"^{s3.url(key)}: corrupt shard \(\d+ bytes, xxh64 [0-9a-f]+; "
                                                  r"its index records \d+ bytes, xxh64 [0-9a-f]+\)"):
        reader[first]


# ------------------------------------------------------------------------------------------------
# the lock object and output directories
# ------------------------------------------------------------------------------------------------
def _holder(pid: int, host: str | None = None) -> dict:
    return {"pid": pid, "host": host or socket.gethostname(), "job": "train", "started": "t0", "command": "x"}


def test_remote_lock_refuses_a_live_holder_and_takes_over_a_dead_one(s3):
    url = s3.url("run")
    first = RemoteLock(url, _holder(os.getpid()))
    with pytest.raises(OutputDirBusy, match=rf"^{url} is in use by another run: train pid {os.getpid()} on host "
                                            rf"{socket.gethostname()}, started t0 \(x\); its lock was renewed \d+ s ago"):
        RemoteLock(url, _holder(os.getpid()))
    first.release()
    assert objects.read_object(f"{url}/.lock") is None
    second = RemoteLock(url, _holder(os.getpid()))
    second.release()

    # a holder on this host whose process is gone (kill -9): taken over at once
    dead = 2 ** 22 + 12345
    objects.write_object(f"{url}/.lock", json.dumps({**_holder(dead), "lease_s": 3600}).encode())
    third = RemoteLock(url, _holder(os.getpid()))
    assert json.loads(objects.read_object(f"{url}/.lock").body)["pid"] == os.getpid()
    third.release()

    # another host's holder: taken over once its lease ran out (by the server's clock), never before
    objects.write_object(f"{url}/.lock", json.dumps({**_holder(1, "elsewhere"), "lease_s": 3600}).encode())
    with pytest.raises(OutputDirBusy, match="pid 1 on host elsewhere"):
        RemoteLock(url, _holder(os.getpid()))
    objects.write_object(f"{url}/.lock", json.dumps({**_holder(1, "elsewhere"), "lease_s": 0}).encode())
    import time

    time.sleep(1.1)
    fourth = RemoteLock(url, _holder(os.getpid()))
    # ... and a run whose lock was taken over stops uploading
    objects.write_object(f"{url}/.lock", json.dumps(_holder(2, "elsewhere")).encode())
    fourth.lost = "another run took it over"
    path = storage.local_path(f"{url}/f.txt")
    _write(path, b"x")
    with pytest.raises(OutputDirError, match=rf"^{url}: this run lost its lock \(another run took it over\)"):
        storage.publish(path)
    fourth.release()
    assert json.loads(objects.read_object(f"{url}/.lock").body)["pid"] == 2  # not deleted: not ours


def test_open_output_resumes_from_the_bucket_with_an_empty_cache(s3, tmp_path, monkeypatch):
    # the demo config's inputs are relative paths: from an empty directory none exists, so the run records none
    # (from a checkout where the main job ran they exist, and inputs.json would be written beside config.yaml)
    monkeypatch.chdir(tmp_path)
    url = s3.url("runs/a")
    cfg = TrainConfig.demo_default("runs/demo").model_copy(update={"output_dir": url})
    with open_output(url, "train", {"config.yaml": cfg}) as lock:
        lock.write_records()
        _write(os.path.join(lock.directory, "checkpoints", "x.pt"), b"ck")
        storage.push(lock.directory)
        with pytest.raises(OutputDirBusy, match=f"^{url} is in use by another run"):
            open_output(url, "train", {"config.yaml": cfg})
    assert sorted(objects.list_objects(url)) == ["checkpoints/x.pt", "config.yaml"]  # the lock object is gone
    shutil.rmtree(storage.cache_root())
    other = cfg.model_copy(update={"seed": 7})
    with pytest.raises(ConfigMismatch, match=rf"^{url} was written with a different config \(differs in: seed\)"
                                             rf":\n  seed: 0 → 7\nrerun with the config recorded in {url}/config.yaml"):
        open_output(url, "train", {"config.yaml": other})
    with open_output(url, "train", {"config.yaml": cfg}) as lock:  # same config: resumes, the cache filled
        assert not lock.pending
        assert open(os.path.join(lock.directory, "checkpoints", "x.pt"), "rb").read() == b"ck"


# ------------------------------------------------------------------------------------------------
# failures: one line naming the URL and what to do
# ------------------------------------------------------------------------------------------------
def test_unreachable_endpoint_missing_and_refused_credentials(s3, monkeypatch, tmp_path):
    url = s3.url("x/manifest.json")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    objects.forget_clients()
    assert objects.client().meta.config.retries == {"mode": "standard", "total_max_attempts": 5}  # the default
    # the user's botocore retry settings are honoured (here: no retry, no backoff of seconds before the message)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    objects.forget_clients()
    assert objects.client().meta.config.retries == {"mode": "standard", "total_max_attempts": 1}
    with pytest.raises(objects.StorageError, match=rf"^cannot read {url}: the object store at http://127.0.0.1:"
                                                   rf"{closed} cannot be reached \(.*\); check S3_ENDPOINT_URL and the "
                                                   "network, then rerun"):
        objects.read_object(url)

    monkeypatch.setenv("S3_ENDPOINT_URL", s3.server.endpoint)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    objects.forget_clients()
    with pytest.raises(objects.StorageError, match=rf"^cannot read {url}: no object-store credentials found: set "
                                                   "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        objects.read_object(url)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    objects.forget_clients()
    with pytest.raises(objects.StorageError) as e:
        objects.read_object(url)
    assert str(e.value).startswith(f"cannot read {url}: the object store refused the credentials (InvalidAccessKeyId)")
    assert "wrong-secret" not in str(e.value)


def test_a_missing_bucket_on_read_is_named_and_an_invalid_bucket_name_is_one_line(s3):
    """Issue 32: reading from a bucket that does not exist said '<cache path>: not a directory' (a missing object
    and a missing bucket looked alike); a bucket name boto refuses printed its regular expressions."""
    from curation.io.shards import shard_dir_info

    url = f"s3://{s3.name}-gone/data/candidates"
    with pytest.raises(objects.StorageError, match=rf"^cannot read {url}/index.json: the bucket {s3.name}-gone does "
                                                   "not exist at http://[^ ]+; create it or fix the URL$"):
        shard_dir_info(storage.local_path(url), "candidate")
    assert storage.fetch(storage.local_path(s3.url("data/none.json"))) is False  # a missing object: still just absent
    with pytest.raises(ValueError) as e:
        storage.local_path("s3://my bucket!/data")
    assert str(e.value) == ("s3://my bucket!/data: 'my bucket!' is not a valid bucket name (1 to 255 letters, digits, "
                            "'.', '-', '_'; S3 itself wants 3 to 63 lowercase letters, digits, '.' and '-')")


def test_an_object_store_prepare_counts_the_files_it_uploaded_as_it_went(s3, tmp_path):
    """P41 (issue 55): an s3:// prepare ended `uploaded 0 files to s3://…` although it had uploaded every part as it
    was written. A rerun of the finished preparation uploads nothing, and says so."""
    import json as _json

    from curation.ingest.prepare import prepare
    from curation.ingest.tokenizer import train_bpe_tokenizer
    from schemas.config import SourceConfig, TokenizerConfig

    texts = [" ".join(["alpha beta gamma delta"] * (3 + i % 7)) for i in range(200)]
    (tmp_path / "a.jsonl").write_text("".join(_json.dumps({"text": t}) + "\n" for t in texts))
    tok = train_bpe_tokenizer(iter(texts), vocab_size=260, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    cfg = PrepareConfig(sources=[SourceConfig(name="s", paths=[str(tmp_path / "a.jsonl")])], seq_len=16,
                        tokenizer=TokenizerConfig(path=tok.path), output_dir=s3.url("prep"), sequences_per_part=20,
                        unit_bytes=4000, progress=False, workers=1)
    first = prepare(cfg).uploaded
    held = objects.list_objects(s3.url("prep"))
    assert len(held) > 10 and first == f"uploaded {len(held)} files to {s3.url('prep')}; it holds {len(held)} " \
                                       f"objects ({sum(o.size for o in held.values()) / 2**20:.1f} MiB)"
    again = prepare(cfg).uploaded
    assert again.startswith(f"uploaded 0 files to {s3.url('prep')}; it holds {len(held)} objects")


def test_the_request_after_an_empty_object_is_answered_at_once(s3, tmp_path):
    """An empty file's upload asked for ``100 Continue`` (botocore does for every file-like body) and left
    SeaweedFS's connection so that the next request waited the client's whole read timeout, 120 s, and was sent
    again: a data-parallel run's upload after Ray Train's empty marker file took two minutes."""
    empty, small = tmp_path / "empty", tmp_path / "small"
    empty.write_bytes(b"")
    small.write_bytes(b"x" * 100)
    sent = []
    objects.client().meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request))
    objects.upload(str(empty), s3.url("a/empty"))
    answer = objects.client().put_object(Bucket=s3.name, Key="a/next", Body=small.read_bytes())
    assert "Expect" not in sent[0].headers and sent[0].headers["Content-Length"] in ("0", b"0")
    assert answer["ResponseMetadata"]["RetryAttempts"] == 0  # answered, not timed out and sent again
    assert {k: o.size for k, o in objects.list_objects(s3.url("a")).items()} == {"empty": 0, "next": 100}


def test_pyarrows_folder_markers_are_not_objects_of_a_directory_and_its_filesystem_writes_the_same_bucket(s3):
    """Ray Train writes a data-parallel run's state through ``objects.arrow_filesystem`` (pyarrow's S3 filesystem on
    the project's endpoint, credentials from the environment, none in its pickle); its ``create_dir`` leaves empty
    ``…/`` objects, which a listing, and so a pull, leaves out (a pull refused the run's directory over them)."""
    import pickle

    fs, path = objects.arrow_filesystem(s3.url("run/parallel/ray_train"))
    assert path == f"{s3.name}/run/parallel/ray_train"
    assert os.environ["AWS_SECRET_ACCESS_KEY"].encode() not in pickle.dumps(fs)
    fs.create_dir(f"{path}/train")
    with fs.open_output_stream(f"{path}/train/state.json") as f:
        f.write(b"{}")
    objects.client().put_object(Bucket=s3.name, Key="run/logs/", Body=b"")  # (a console's "folder")
    raw = {o["Key"] for o in objects.client().list_objects_v2(Bucket=s3.name, Prefix="run/")["Contents"]}
    assert any(k.endswith("/") for k in raw)  # the markers are there ...
    assert sorted(objects.list_objects(s3.url("run"))) == ["parallel/ray_train/train/state.json"]  # ... not listed
    root = storage.local_path(s3.url("run"))
    assert storage.pull(root) == ["parallel/ray_train/train/state.json"]
    assert open(f"{root}/parallel/ray_train/train/state.json", "rb").read() == b"{}"


def test_local_paths_are_the_settings_a_node_elsewhere_would_need_on_a_shared_filesystem(tmp_path, monkeypatch):
    from curation.io.outputs import local_paths

    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig.demo_default("s3://bkt").model_copy(update={"output_dir": "s3://bkt/run"})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"tokenizer": None})})
    assert local_paths(localize(cfg)) == {}  # everything in the bucket: nothing to share
    mixed = cfg.model_copy(update={"output_dir": "runs/here", "data": cfg.data.model_copy(
        update={"validation": "/mnt/shared/val"})})
    assert local_paths(localize(mixed)) == {"output_dir": str(tmp_path / "runs" / "here"),
                                            "data.validation": "/mnt/shared/val"}
