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
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
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
