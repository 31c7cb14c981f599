"""Every name read back from disk or a bucket is untrusted (issue 32): the shared check (``safe_join``) and each
reader with hostile values (``../../victim``, absolute paths, ``.``, symbolic links leaving the directory, names
with NUL or a newline), locally and through the object store; nothing outside the directory is read or deleted."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from curation.engine.ledger import PartCache, PartLedger
from curation.engine.state import weights_on_disk
from curation.io import objects, storage
from curation.io.atomic import write_manifest
from curation.io.paths import UnsafeNameError, safe_join
from curation.io.shards import ShardReader, merge_part_indexes, verify_part, write_part
from schemas.manifest import Manifest, ShardRecord
from schemas.shards import CANDIDATE

HOSTILE = ["../../victim", "/abs/victim", ".", "..", "", "a/./b", "a//b", "ok/../../victim", "nul\x00x", "new\nline"]


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "precious.txt").write_text("keep me")
    return victim


# ------------------------------------------------------------------------------------------------
# the shared check
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", HOSTILE)
def test_safe_join_refuses_names_that_are_not_plain_relative_paths(tmp_path, name):
    with pytest.raises(UnsafeNameError) as e:
        safe_join(str(tmp_path), name, what="parts[0].name", source_file="rec.json")
    msg = str(e.value)
    assert msg.startswith(f"rec.json: parts[0].name {name!r} ") and "\n" not in msg and "refused" in msg


def test_safe_join_follows_symbolic_links_and_keeps_plain_names(tmp_path):
    root = tmp_path / "out"
    (root / "src").mkdir(parents=True)
    victim = _victim(tmp_path)
    assert safe_join(str(root), "src/part-00000-00001", what="w", source_file="f") == str(root / "src" /
                                                                                         "part-00000-00001")
    os.symlink(victim, root / "away")
    os.symlink(root / "src", root / "within")  # a link that stays inside is fine
    assert safe_join(str(root), "within/x", what="w", source_file="f") == str(root / "within" / "x")
    with pytest.raises(UnsafeNameError, match=rf"^f: w 'away/precious.txt' leads outside {root} \(through a "
                                              "symbolic link\\)"):
        safe_join(str(root), "away/precious.txt", what="w", source_file="f")
    # a link further down, a link as the last component (to a file outside), one under a missing folder
    os.symlink(victim, root / "src" / "away")
    os.symlink(victim / "precious.txt", root / "src" / "file")
    for name in ("src/away/precious.txt", "src/file"):
        with pytest.raises(UnsafeNameError, match="leads outside"):
            safe_join(str(root), name, what="w", source_file="f")
    assert safe_join(str(root), "missing/away/x", what="w", source_file="f") == str(root / "missing" / "away" / "x")
    os.symlink(root / "src" / "part-00000-00001", root / "src" / "ahead")  # dangling, inside
    assert safe_join(str(root), "src/ahead", what="w", source_file="f") == str(root / "src" / "ahead")
    with pytest.raises(UnsafeNameError, match="is not a string"):
        safe_join(str(root), 3, what="w", source_file="f")


# ------------------------------------------------------------------------------------------------
# manifests: part names
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", HOSTILE)
def test_a_manifest_naming_a_part_outside_is_refused_in_one_line(tmp_path, name):
    out = str(tmp_path / "out")
    m = Manifest(kind="scored", job="t", shards=[ShardRecord(name="steps-000000000-000000002", samples=1, tokens=1)])
    write_manifest(out, m)
    data = json.loads(open(Manifest.path_in(out)).read())
    data["shards"][0]["name"] = name
    open(Manifest.path_in(out), "w").write(json.dumps(data))
    with pytest.raises(ValueError) as e:
        Manifest.load(out)
    msg = str(e.value)
    assert msg.startswith(f"{Manifest.path_in(out)}: invalid manifest: shards.0.name: {name!r} is not a relative "
                          "path of ") and "\n" not in msg


# ------------------------------------------------------------------------------------------------
# MDS index.json: shard basenames
# ------------------------------------------------------------------------------------------------
def _part(path: str, n: int = 8) -> None:
    write_part(path, CANDIDATE, ({"tokens": np.arange(i, i + 4, dtype=np.uint16), "source": "s"} for i in range(n)),
               vocab_size=100)


def _edit_index(path: str, key: str, basename: str) -> None:
    with open(path) as f:
        index = json.load(f)
    index["shards"][0][key]["basename"] = basename
    with open(path, "w") as f:
        json.dump(index, f)


@pytest.mark.parametrize("key", ["zip_data", "raw_data"])
@pytest.mark.parametrize("name", ["../../victim/precious.txt", "/etc/hostname", ".", "sh\nard"])
def test_an_index_naming_a_shard_file_outside_is_refused_by_every_reader(tmp_path, key, name):
    _victim(tmp_path)
    root = tmp_path / "out"
    _part(str(root / "p" / "part-0"))
    index = str(root / "p" / "part-0" / "index.json")
    _edit_index(index, key, name)
    for read in (lambda: ShardReader(str(root / "p" / "part-0")), lambda: verify_part(str(root / "p" / "part-0")),
                 lambda: merge_part_indexes(str(root), ["p/part-0"])):
        with pytest.raises(UnsafeNameError) as e:
            read()
        assert str(e.value).startswith(f"{index}: {key}.basename {name!r} ") and "\n" not in str(e.value)
    assert (tmp_path / "victim" / "precious.txt").read_text() == "keep me"


def test_an_index_edited_in_the_bucket_reads_nothing_outside_the_cache(s3, tmp_path):
    root = storage.local_path(s3.url("data"))
    _part(os.path.join(root, "part-0"))  # written and uploaded
    key = "data/part-0/index.json"
    index = json.loads(objects.read_object(s3.url(key)).body)
    index["shards"][0]["zip_data"]["basename"] = "../../../../victim/precious.txt"
    objects.write_object(s3.url(key), json.dumps(index).encode())
    shutil.rmtree(s3.cache)
    with pytest.raises(UnsafeNameError, match=r"part-0/index\.json: zip_data\.basename '\.\./\.\./\.\./\.\./victim"):
        ShardReader(os.path.join(root, "part-0"))


# ------------------------------------------------------------------------------------------------
# the bucket: object keys and links (.symlinks.json)
# ------------------------------------------------------------------------------------------------
def test_a_bucket_link_table_leading_outside_is_refused_and_nothing_local_is_deleted(s3, tmp_path):
    victim = _victim(tmp_path)
    root = storage.local_path(s3.url("run"))
    os.makedirs(os.path.join(root, "ck"))
    with open(os.path.join(root, "ck", "ep0-ba4-rank0.pt"), "wb") as f:
        f.write(b"four")
    os.symlink("ep0-ba4-rank0.pt", os.path.join(root, "ck", "latest-rank0.pt"))
    storage.push(root)
    table_url = s3.url("run/ck/.symlinks.json")
    up = os.path.relpath(victim / "precious.txt", os.path.join(root, "ck"))  # ../../../victim/precious.txt
    for table, what in [({up: "ep0-ba4-rank0.pt"}, f"link name {up!r}"),  # the old pull unlinked victim/precious.txt
                        ({"latest-rank0.pt": str(victim)}, "target of link 'latest-rank0.pt'"),
                        ({"latest-rank0.pt": "../../../../victim"}, "target of link 'latest-rank0.pt'"),
                        ({"x\x00": "ep0-ba4-rank0.pt"}, "link name"),
                        (["not", "a", "table"], "not a table of link names")]:
        objects.write_object(table_url, json.dumps(table).encode())
        with pytest.raises(UnsafeNameError) as e:
            storage.pull(root)
        assert str(e.value).startswith(f"{table_url}: {what}") and "\n" not in str(e.value), str(e.value)
        assert victim.joinpath("precious.txt").read_text() == "keep me"
    # a link whose target is inside, through another folder, is made as before
    objects.write_object(table_url, json.dumps({"latest-rank0.pt": "ep0-ba4-rank0.pt"}).encode())
    storage.pull(root)
    assert open(os.path.join(root, "ck", "latest-rank0.pt"), "rb").read() == b"four"


# ------------------------------------------------------------------------------------------------
# the engine's part ledger and weights registry
# ------------------------------------------------------------------------------------------------
def test_the_ledger_refuses_a_worker_folder_linked_outside_and_deletes_nothing_there(tmp_path):
    victim = _victim(tmp_path)
    (victim / "steps-000000000-000000002").mkdir()
    out = tmp_path / "scored"
    PartLedger(str(out), kind="scored", job="t", run_key={"t": 1}, vocab_size=100)
    os.symlink(victim, out / "worker-00")  # the old ledger emptied it: its entries are not recorded parts
    with pytest.raises(UnsafeNameError, match=rf"^{out}: worker folder 'worker-00' leads outside"):
        PartLedger(str(out), kind="scored", job="t", run_key={"t": 1}, vocab_size=100)
    assert sorted(os.listdir(victim)) == ["precious.txt", "steps-000000000-000000002"]


def test_the_ledger_and_the_part_reader_refuse_a_part_linked_outside(tmp_path):
    _victim(tmp_path)
    out = tmp_path / "scored"
    ledger = PartLedger(str(out), kind="scored", job="t", run_key={"t": 1}, vocab_size=100)
    ledger.manifest.shards.append(ShardRecord(name="elsewhere", samples=1, tokens=4, state={"unit": "u"}))
    write_manifest(str(out), ledger.manifest)
    os.symlink(tmp_path / "victim", out / "elsewhere")
    with pytest.raises(UnsafeNameError, match=r"manifest\.json: part 'elsewhere' leads outside"):
        PartLedger(str(out), kind="scored", job="t", run_key={"t": 1}, vocab_size=100)
    with pytest.raises(UnsafeNameError, match=r"manifest\.json: part 'elsewhere' leads outside"):
        PartCache(str(out), 1).rows("elsewhere", 0, 0)


def test_weights_linked_outside_the_engine_folder_are_refused(tmp_path):
    victim = _victim(tmp_path)
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "reference-0000.safetensors").write_bytes(b"x")
    os.symlink(victim / "precious.txt", engine / "reference-0001.safetensors")
    with pytest.raises(UnsafeNameError, match=r"reference weights 'reference-0001\.safetensors' leads outside"):
        weights_on_disk(str(engine), "reference")
