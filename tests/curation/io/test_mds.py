"""Our MDS writer writes the bytes of ``streaming.MDSWriter`` (every file, every shard spec, shard cuts), without
importing ``streaming``."""

import os
import subprocess
import sys

import numpy as np
import pytest
from streaming import MDSWriter

from curation.io.mds import write_mds
from schemas.shards import CANDIDATE, SCORED, SELECTED
from tests import timing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _samples(spec, vocab, n, rng):
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    for i in range(n):
        length = int(rng.integers(1, 300))
        row = {"tokens": rng.integers(0, vocab, length).astype(dtype), "source": ["a", "wiki", "é—x"][i % 3]}
        if spec is SCORED:
            row.update(ref_loss=rng.random(length).astype(np.float16), episode=int(rng.integers(0, 9)))
        if spec is SELECTED:
            row.update(loss_mask=(rng.random(length) < 0.5).astype(np.uint8), score=rng.random(length).astype(np.float16),
                       step=int(rng.integers(0, 1 << 40)), episode=int(rng.integers(-3, 9)))
        yield row


def _files(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("spec", [CANDIDATE, SCORED, SELECTED], ids=lambda s: s.name)
@pytest.mark.parametrize(("vocab", "size_limit"), [(2048, 1 << 26), (2048, 3000), (70_000, 1 << 12)])
def test_every_file_equals_mdswriters(tmp_path, spec, vocab, size_limit):
    columns = spec.mds_columns(vocab_size=vocab)
    rows = list(_samples(spec, vocab, 60, np.random.default_rng(vocab + size_limit)))
    with MDSWriter(out=str(tmp_path / "theirs"), columns=columns, compression="zstd", hashes=["xxh64"],
                   size_limit=size_limit, progress_bar=False) as w:
        for row in rows:
            w.write(row)
    assert write_mds(str(tmp_path / "ours"), columns, iter(rows), size_limit=size_limit) == 60
    theirs, ours = _files(tmp_path / "theirs"), _files(tmp_path / "ours")
    assert len(ours) > (2 if size_limit < 1 << 20 else 1)  # several shards where the limit is small
    assert ours == theirs


def test_a_shape_and_an_encoding_it_does_not_write_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported MDS column encodings \{'x': 'pkl'\}"):
        write_mds(str(tmp_path / "a"), {"x": "pkl"}, [], size_limit=1 << 20)
    with pytest.raises(ValueError, match="wrong dtype: expected uint16, got int64"):
        write_mds(str(tmp_path / "b"), {"t": "ndarray:uint16"}, [{"t": np.arange(3)}], size_limit=1 << 20)
    with pytest.raises(ValueError, match=r"at least one element, got shape \(0,\)"):
        write_mds(str(tmp_path / "c"), {"t": "ndarray:uint16"}, [{"t": np.zeros(0, np.uint16)}], size_limit=1 << 20)


def test_writing_a_part_does_not_import_streaming_or_torch(tmp_path):
    code = ("import sys, numpy as np\n"
            "from curation.io.shards import write_part\nfrom schemas.shards import CANDIDATE\n"
            f"write_part({str(tmp_path / 'p')!r}, CANDIDATE, [{{'tokens': np.arange(8, dtype=np.uint16), "
            "'source': 's'}], vocab_size=100)\n"
            "print(sorted(m for m in ('streaming', 'torch', 'transformers') if m in sys.modules))")
    out = timing.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("spec", [CANDIDATE, SCORED, SELECTED], ids=lambda s: s.name)
def test_the_sample_decoder_gives_what_streamings_reader_gives(tmp_path, spec):
    from curation.io.mds import sample_decoder
    from curation.io.shards import ShardReader

    rows = list(_samples(spec, 2048, 40, np.random.default_rng(5)))
    long = {**rows[0], "tokens": np.arange(70_000, dtype=np.uint16) % 2048}  # a shape stored as uint32
    if spec is not CANDIDATE:
        long.update({k: np.resize(v, 70_000) for k, v in long.items() if isinstance(v, np.ndarray) and k != "tokens"})
    rows.append(long)
    columns = spec.mds_columns(vocab_size=2048)
    write_mds(str(tmp_path), columns, iter(rows), size_limit=1 << 26)
    ours = ShardReader(str(tmp_path))
    assert all(d is not None for d in ours._decoders)  # the fast path is the one tested
    theirs = ShardReader(str(tmp_path))
    theirs._decoders = [None] * len(theirs._decoders)  # streaming's reader
    for i in range(len(rows)):
        a, b = ours[i], theirs[i]
        assert a.keys() == b.keys() == rows[i].keys()
        for k in a:
            assert type(a[k]) is type(b[k]), k
            if isinstance(a[k], np.ndarray):
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(a[k], b[k])
                assert not a[k].flags.writeable  # a view of the shard's bytes, as streaming gives
            else:
                assert a[k] == b[k]
    assert sample_decoder(["x", "y"], ["ndarray:uint16", "jpeg"], [None, None]) is None  # not ours: streaming's


def test_the_sample_decoder_reads_the_bytes_columns_of_streamings_writer_as_its_reader_does(tmp_path):
    """`bytes` (written by streaming, not by us: llm-foundry's older token datasets; the columns a pre-tokenized
    source leaves undecoded) decodes to the column's raw bytes, beside the other encodings, as streaming's reader
    gives them."""
    from curation.io.shards import ShardReader

    rng = np.random.default_rng(3)
    columns = {"tokens": "bytes", "ids": "ndarray:int32", "text": "str", "n": "int64", "empty": "bytes"}
    rows = [{"tokens": rng.integers(0, 1 << 40, int(rng.integers(1, 50))).tobytes(),
             "ids": rng.integers(-9, 9, int(rng.integers(1, 20))).astype(np.int32), "text": "é" * (i % 4),
             "n": i, "empty": b""} for i in range(30)]
    with MDSWriter(columns=columns, out=str(tmp_path), compression="zstd", size_limit=1 << 10) as w:
        for r in rows:
            w.write(r)
    ours, theirs = ShardReader(str(tmp_path)), ShardReader(str(tmp_path))
    assert len(ours.shards) > 1 and all(d is not None for d in ours._decoders)  # the fast path is the one tested
    theirs._decoders = [None] * len(theirs._decoders)
    for i, row in enumerate(rows):
        a, b = ours[i], theirs[i]
        assert a.keys() == b.keys() == row.keys()
        for k in a:
            assert type(a[k]) is type(b[k]), k
            assert np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] == row[k], k


def _block_of(rows):
    """The rows (all of one length) as a RowBlock, column by column as a scoring worker hands a step over."""
    from curation.io.mds import RowBlock

    cols = {k: (np.stack([r[k] for r in rows]) if isinstance(rows[0][k], np.ndarray) else [r[k] for r in rows])
            for k in rows[0]}
    cols = {k: (np.asarray(v) if k in ("step", "episode") else v) for k, v in cols.items()}
    return RowBlock(cols, len(rows))


@pytest.mark.parametrize("spec", [CANDIDATE, SCORED, SELECTED], ids=lambda s: s.name)
def test_a_block_of_rows_writes_the_bytes_of_the_rows_one_by_one(tmp_path, spec):
    from curation.io.mds import RowBlock

    rng = np.random.default_rng(11)
    steps = []
    for _ in range(7):  # steps of 5 rows, each step one length, shards cut mid-step by the small size limit
        length = int(rng.integers(1, 300))
        rows = list(_samples(spec, 70_000, 5, rng))
        for r in rows:
            r.update({k: np.resize(v, length) for k, v in r.items() if isinstance(v, np.ndarray)})
        steps.append(rows)
    columns = spec.mds_columns(vocab_size=70_000)
    flat = [r for rows in steps for r in rows]
    assert write_mds(str(tmp_path / "rows"), columns, iter(flat), size_limit=1 << 12) == 35
    blocks = [_block_of(rows) for rows in steps]
    again = [r for b in blocks for r in b]  # iterating a block gives its rows
    assert len(again) == 35 and all(a.keys() == r.keys() and all(np.array_equal(a[k], r[k]) for k in r)
                                    for a, r in zip(again, flat, strict=True))
    if spec is not CANDIDATE:  # one Python int for every row of a block (the worker's step and episode)
        blocks[0] = RowBlock({**blocks[0].columns, "episode": int(steps[0][0]["episode"])}, 5)
        for r in steps[0]:
            r["episode"] = steps[0][0]["episode"]
        write_mds(str(tmp_path / "rows"), columns, iter(flat), size_limit=1 << 12)
    assert write_mds(str(tmp_path / "blocks"), columns, [blocks[0], *flat[5:10], *blocks[2:]],
                     size_limit=1 << 12) == 35
    ours = _files(tmp_path / "blocks")
    assert len(ours) > 3 and ours == _files(tmp_path / "rows")


def test_a_block_that_does_not_fit_its_columns_is_refused(tmp_path):
    from curation.io.mds import RowBlock

    columns = SELECTED.mds_columns(vocab_size=100)
    good = {"tokens": np.zeros((2, 4), np.uint16), "loss_mask": np.zeros((2, 4), np.uint8),
            "score": np.zeros((2, 4), np.float16), "source": ["a", "b"], "step": 3, "episode": 0}
    for change, message in [({"tokens": np.zeros((2, 4), np.int64)}, "column 'tokens': wrong dtype: expected uint16, got int64"),
                            ({"score": np.zeros(4, np.float16)}, r"needs an array of shape \(2, \.\.\.\), got \(4,\)"),
                            ({"source": ["a"]}, r"column 'source' \(str\) got 1 values for a block of 2 rows"),
                            ({"source": ["a", 7]}, r"column 'source' \(str\) got int"),
                            ({"episode": 2**31}, r"column 'episode' \(int32\): 2147483648 is out of its range"),
                            ({"step": np.array([1, 2, 3])}, r"column 'step' \(int64\): \(3,\) values"),
                            ({"episode": np.array([0, 2**40])}, r"column 'episode' \(int32\): 1099511627776 is out of its range")]:
        with pytest.raises(ValueError, match=message):
            write_mds(str(tmp_path / "x"), columns, [RowBlock({**good, **change}, 2)], size_limit=1 << 20)
    assert write_mds(str(tmp_path / "ok"), columns, [RowBlock(good, 2)], size_limit=1 << 20) == 2


@pytest.mark.parametrize("spec", [CANDIDATE, SCORED, SELECTED], ids=lambda s: s.name)
def test_a_batch_of_samples_decodes_to_the_rows_stacked(tmp_path, spec):
    """ShardReader.gather: any samples, from any shards, in the order asked, equal to indexing them one by one."""
    from curation.io.shards import ShardReader

    rng = np.random.default_rng(3)
    rows = [{**r, **{k: np.resize(v, 40) for k, v in r.items() if isinstance(v, np.ndarray)}}
            for r in _samples(spec, 2048, 90, rng)]
    write_mds(str(tmp_path), spec.mds_columns(vocab_size=2048), iter(rows), size_limit=1 << 11)
    reader = ShardReader(str(tmp_path))
    assert len(reader.shards) >= 3
    for ids in ([5], [89, 0, 44, 44, 3], rng.permutation(90)[:31], np.arange(10, 20)):
        got = reader.gather(ids)
        assert got.keys() == rows[0].keys()
        for k, v in got.items():
            want = [reader[int(i)][k] for i in ids]
            if isinstance(v, list):
                assert v == want
            else:
                assert v.dtype == want[0].dtype and v.shape == (len(ids), *np.shape(want[0]))
                assert np.array_equal(v, np.stack(want))
    assert reader.gather([3, 90]) is None and reader.gather([-1]) is None and reader.gather([]) is None


def test_the_batch_decoder_leaves_what_it_cannot_decode_whole_to_the_rows(tmp_path):
    """None (decode row by row, which names the record) for rows of different shapes, bytes that are not UTF-8,
    offsets or sizes past the end, indices past the shard; never values made of the wrong bytes."""
    import struct

    from curation.io.mds import batch_decoder
    from curation.io.shards import ShardReader, load_shard_file

    rows = [{"tokens": np.arange(i, i + 6, dtype=np.uint16), "source": "ab"} for i in range(4)]
    rows[3]["tokens"] = rows[3]["tokens"][:5]
    write_mds(str(tmp_path), CANDIDATE.mds_columns(vocab_size=100), iter(rows), size_limit=1 << 20)
    reader = ShardReader(str(tmp_path))
    shard = reader.shards[0]
    decode = batch_decoder(shard.column_names, shard.column_encodings, shard.column_sizes)
    data = load_shard_file(str(tmp_path), shard)
    assert decode([(data, 0), (data, 2)])["tokens"].tolist() == [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]]
    assert decode([(data, 0), (data, 3)]) is None  # rows of different lengths
    assert decode([(data, 4)]) is None and decode([(data, -1)]) is None
    assert decode([(data[:-3], 3)]) is None  # the last record runs past the end
    begin = struct.unpack_from("=I", data, 4 + 4 * 1)[0]
    name_at = begin + 8  # the source's bytes (sizes first, columns in name order)
    assert decode([(data[:name_at] + b"\xff\xfe" + data[name_at + 2:], 1)]) is None  # not UTF-8
    size_too_big = data[:begin] + struct.pack("=I", 1 << 30) + data[begin + 4:]
    assert decode([(size_too_big, 1)]) is None and decode([(b"", 0)]) is None


@pytest.mark.parametrize("full", ["shard.00000.mds.zstd", "index.json"])
def test_a_full_disk_names_the_shard_file_being_written(tmp_path, full):
    """P36 (issue 55): a full disk while writing selected shards named no file (write() and close() errors carry
    none), though docs/FAILURES.md promises one. The file is a link to /dev/full: the kernel's own ENOSPC."""
    import errno

    from curation.io.outdir import describe_os_error

    out = tmp_path / "part"
    out.mkdir()
    os.symlink("/dev/full", out / full)
    rows = list(_samples(SELECTED, 512, 5, np.random.default_rng(0)))
    with pytest.raises(OSError) as e:
        write_mds(str(out), SELECTED.mds_columns(vocab_size=512), rows, size_limit=1 << 20)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(out / full)
    assert describe_os_error(e.value, "training into runs/x failed").startswith(
        f"training into runs/x failed ({out / full}): No space left on device; the disk is full: free space")


@pytest.mark.parametrize("spec", [CANDIDATE, SELECTED], ids=lambda s: s.name)
def test_our_shards_are_read_without_importing_streaming_or_torch(tmp_path, spec):
    """An index entry of the kind write_mds writes is read by the project's own reader (the run inspector reads shards
    without torch): the same fields as streaming's reader, the same samples, and neither streaming nor torch imported
    in a fresh interpreter; any other entry is still streaming's."""
    from streaming.base.format import reader_from_json

    from curation.io.shard_files import ShardEntry, shard_entries

    rows = list(_samples(spec, 2048, 30, np.random.default_rng(3)))
    write_mds(str(tmp_path), spec.mds_columns(vocab_size=2048), iter(rows), size_limit=1 << 12)
    import json

    with open(tmp_path / "index.json", encoding="utf-8") as f:
        infos = json.load(f)["shards"]
    ours, theirs = shard_entries(str(tmp_path), infos), [reader_from_json(str(tmp_path), None, i) for i in infos]
    assert len(ours) > 1 and all(isinstance(e, ShardEntry) for e in ours)
    for a, b in zip(ours, theirs, strict=True):
        for k in ("column_names", "column_encodings", "column_sizes", "compression", "hashes", "samples"):
            assert getattr(a, k) == getattr(b, k), k
        for k in ("raw_data", "zip_data"):
            assert vars(getattr(a, k)) == vars(getattr(b, k)), k
    other = [{**infos[0], "compression": "gz"}]
    assert not isinstance(shard_entries(str(tmp_path), other)[0], ShardEntry)  # streaming's own reader
    probe = ("import sys; from curation.io.shards import ShardReader; r = ShardReader(sys.argv[1]); "
             "n = sum(int(r[i]['tokens'].sum()) for i in range(len(r))); "
             "print(n, sorted(m for m in ('streaming', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))})
    assert out.stdout.split() == [str(sum(int(r["tokens"].sum()) for r in rows)), "[]"], out.stderr
