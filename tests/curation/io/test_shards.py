"""Part names of step-indexed shard directories (one function for every writer); random access to a pool of shards."""

from __future__ import annotations

import os
import random
import re

import pytest

from curation.engine.plan import WorkUnit
from curation.io.shards import part_name


def test_part_name_layout():
    assert part_name(0, 4) == "steps-000000000-000000004"
    assert part_name(12, 345_678_901) == "steps-000000012-345678901"


def test_part_names_sort_in_step_order():
    # the manifests and the merged index list parts by name: the order must be the steps' order
    rng = random.Random(0)
    ranges = sorted({(a, a + rng.randint(1, 5000)) for a in (rng.randint(0, 10**8) for _ in range(200))})
    names = [part_name(a, b) for a, b in ranges]
    assert sorted(names) == names and len(set(names)) == len(names)


@pytest.mark.parametrize("first,stop", [(0, 1), (3, 7), (999, 1000)])
def test_engine_units_use_the_writers_part_names(first, stop):
    # an engine's selected part has the name the single-process trainer gives the same steps
    assert WorkUnit(first, stop, "selected").name == part_name(first, stop)
    assert WorkUnit(first, stop, "scored", 0).name == part_name(first, stop)


# ------------------------------------------------------------------------------------------------
# random access: each zstd shard decompressed once into the cache, then memory-mapped
# ------------------------------------------------------------------------------------------------
def _pool(root, parts=6, per=30):
    import numpy as np

    from curation.io.shards import merge_part_indexes, write_part
    from schemas.shards import CANDIDATE

    rows = [{"tokens": (np.arange(24, dtype=np.uint16) + i) % 1000, "source": f"s{i % 4}"} for i in range(parts * per)]
    names = [f"part-{p:05d}" for p in range(parts)]
    for p, name in enumerate(names):
        write_part(os.path.join(root, name), CANDIDATE, rows[p * per:(p + 1) * per], vocab_size=1000)
    merge_part_indexes(root, names)
    return rows


def test_a_random_order_over_many_shards_decompresses_each_once_and_reads_the_rest_mapped(tmp_path, monkeypatch):
    import numpy as np

    from curation.io import shards
    from curation.io.shards import ShardReader, raw_cache_dir

    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "cache"))
    rows = _pool(str(tmp_path / "pool"))
    loads = []
    real = shards.load_shard_file
    monkeypatch.setattr(shards, "load_shard_file", lambda d, s: loads.append(s.zip_data.basename) or real(d, s))
    reader = ShardReader(str(tmp_path / "pool"), mapped=True)
    order = np.random.default_rng(0).permutation(len(rows))
    for i in order:  # 6 shards, more than the 4 an in-memory cache holds: each was decompressed ~25 times
        assert np.array_equal(reader[int(i)]["tokens"], rows[i]["tokens"])
    assert len(loads) == 6
    cached = sorted(os.listdir(raw_cache_dir()))
    assert len(cached) == 6 and all(re.fullmatch(r"[0-9a-f]{16}-\d+\.mds", n) for n in cached)
    # another reader (another process, another job) maps the cached copies, checked, without decompressing
    got = ShardReader(str(tmp_path / "pool"), mapped=True).gather(order[:40])
    assert len(loads) == 6 and got["source"] == [rows[i]["source"] for i in order[:40]]
    # parts read once in order (a trainer's scored parts) are not copied
    ShardReader(str(tmp_path / "pool" / "part-00000"))[0]
    assert len(loads) == 7 and len(os.listdir(raw_cache_dir())) == 6


def test_a_step_over_more_shards_than_the_in_memory_cache_reads_each_shard_once(tmp_path, monkeypatch):
    """gather on a reader without the cache (4 shards in memory): a step whose samples alternate over 6 shards reads
    each of them once, and gives the samples in the order asked for."""
    import numpy as np

    from curation.io import shards
    from curation.io.shards import ShardReader

    rows = _pool(str(tmp_path / "pool"))
    loads = []
    real = shards.load_shard_file
    monkeypatch.setattr(shards, "load_shard_file", lambda d, s: loads.append(s.zip_data.basename) or real(d, s))
    ids = [p * 30 + k for k in range(3) for p in range(6)]  # shard 0, 1, ..., 5, 0, 1, ...
    got = ShardReader(str(tmp_path / "pool")).gather(ids)
    assert len(loads) == 6 and got["source"] == [rows[i]["source"] for i in ids]
    assert np.array_equal(got["tokens"], np.stack([rows[i]["tokens"] for i in ids]))


def test_a_damaged_cached_copy_is_made_again_from_the_shard(tmp_path, monkeypatch):
    import numpy as np

    from curation.io.shards import ShardReader, raw_cache_dir

    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "cache"))
    rows = _pool(str(tmp_path / "pool"), parts=1)
    ShardReader(str(tmp_path / "pool"), mapped=True)[0]
    (name,) = os.listdir(raw_cache_dir())
    path = os.path.join(raw_cache_dir(), name)
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0xFF  # a flipped byte in the last sample's tokens
    open(path, "wb").write(bytes(data))
    assert np.array_equal(ShardReader(str(tmp_path / "pool"), mapped=True)[29]["tokens"], rows[29]["tokens"])
    assert open(path, "rb").read() != bytes(data)  # replaced


def test_a_hostile_hash_in_the_index_names_no_cache_file_and_the_read_fails_named(tmp_path, monkeypatch):
    import json

    from curation.io.shards import ShardIntegrityError, ShardReader

    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "cache"))
    _pool(str(tmp_path / "pool"), parts=1)
    index = tmp_path / "pool" / "part-00000" / "index.json"
    meta = json.loads(index.read_text())
    meta["shards"][0]["raw_data"]["hashes"]["xxh64"] = "../../../outside"
    index.write_text(json.dumps(meta))
    with pytest.raises(ShardIntegrityError, match=r"part-00000/shard.00000.mds.zstd: corrupt shard .*xxh64 "
                                                  r"\.\./\.\./\.\./outside"):
        ShardReader(str(tmp_path / "pool" / "part-00000"), mapped=True)[0]
    assert not (tmp_path / "outside").exists() and not os.path.exists(tmp_path / "cache" / "raw-shards")


def test_a_cache_that_cannot_be_written_still_reads(tmp_path, monkeypatch):
    import numpy as np

    from curation.io.shards import ShardReader

    monkeypatch.setenv("BLADE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    rows = _pool(str(tmp_path / "pool"), parts=2)
    reader = ShardReader(str(tmp_path / "pool"), mapped=True)
    assert np.array_equal(reader[45]["tokens"], rows[45]["tokens"]) and reader[3]["source"] == rows[3]["source"]


def test_merging_again_reads_a_rewritten_part_index_and_checks_it(tmp_path):
    """Each part's index is parsed once per process (a long run merges after every part), keyed by its bytes: an
    index rewritten in place, even to the same size within the file clock's tick, is read and checked anew."""
    import json

    from curation.io.paths import UnsafeNameError
    from curation.io.shards import merge_part_indexes

    root = str(tmp_path / "pool")
    _pool(root, parts=3, per=4)
    names = [f"part-{p:05d}" for p in range(3)]
    merged = json.load(open(os.path.join(root, "index.json")))
    assert [s["zip_data"]["basename"].split("/")[0] for s in merged["shards"]] == names
    path = os.path.join(root, names[1], "index.json")
    index = json.load(open(path))
    old_hash = index["shards"][0]["zip_data"]["hashes"]["xxh64"]
    new_hash = old_hash[::-1] if old_hash[::-1] != old_hash else "0" * len(old_hash)
    index["shards"][0]["zip_data"]["hashes"]["xxh64"] = new_hash  # same size
    size = os.path.getsize(path)
    with open(path, "w") as f:
        json.dump(index, f)
    merge_part_indexes(root, names)
    merged = json.load(open(os.path.join(root, "index.json")))
    assert merged["shards"][1]["zip_data"]["hashes"]["xxh64"] == new_hash
    assert merged["shards"][0]["zip_data"]["hashes"]["xxh64"] != new_hash or size != os.path.getsize(path)
    index["shards"][0]["zip_data"]["basename"] = "../part-00000/shard.00000.mds.zstd"  # leaves its part
    with open(path, "w") as f:
        json.dump(index, f)
    with pytest.raises(UnsafeNameError, match=r"part-00001/index\.json: zip_data\.basename"):
        merge_part_indexes(root, names)


# ------------------------------------------------------------------------------------------------
# an index that is not what an MDS index records (issue 55, P31)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit,reason", [
    (lambda s: s["raw_data"].pop("hashes"), "shards[0].raw_data has no 'hashes' key (an MDS index records basename, "
                                            "bytes, hashes); restore the index or write the dataset again"),
    (lambda s: s["zip_data"].pop("bytes"), "shards[0].zip_data has no 'bytes' key"),
    (lambda s: s.pop("samples"), "shards[0] has no 'samples' key"),
    (lambda s: s.__setitem__("raw_data", ["x"]), "shards[0].raw_data is list, not what an MDS index records"),
    (lambda s: s.__setitem__("version", 3), "shards[0] is version 3 in format 'mds'; only MDS shards of version 2"),
])
def test_an_index_missing_a_key_is_one_schema_line_in_every_reader(tmp_path, edit, reason):
    """P31: a selected-shard index without the `hashes` key gave a raw `TypeError: FileInfo.__init__() missing ...`
    (through SelectedTokens and prepare's MDS reader); a part whose index is so damaged is regenerated by prepare."""
    import json

    from curation.ingest.corpus import BadRecordError
    from curation.ingest.token_sources import iter_token_records
    from curation.io.shards import ShardIndexError, ShardReader, verify_part
    from schemas.config import SourceConfig

    _pool(str(tmp_path), parts=1)
    index = tmp_path / "part-00000" / "index.json"
    data = json.loads(index.read_text())
    edit(data["shards"][0])
    index.write_text(json.dumps(data))
    with pytest.raises(ShardIndexError) as e:
        ShardReader(str(tmp_path / "part-00000"))
    assert str(e.value).startswith(f"{index}: {reason}") and "\n" not in str(e.value)
    assert verify_part(str(tmp_path / "part-00000")) == f"{index}: missing or unreadable index ({e.value})"
    src = SourceConfig(name="s", format="mds", paths=[str(tmp_path / "part-00000")])
    (bad,) = list(iter_token_records(src, files=[str(tmp_path / "part-00000")], vocab_size=1000))
    assert isinstance(bad, BadRecordError) and str(bad).startswith(f"{index}: {reason}")
