import json

import numpy as np
import pytest

from curation.io.atomic import write_manifest
from schemas.manifest import Manifest, ShardRecord, SourceCounts
from schemas.shards import (
    CANDIDATE,
    SCHEMA_VERSION,
    SCORED,
    SELECTED,
    ShardSchemaError,
    token_dtype,
    validate_shard_dir,
)


def _write(path, columns, samples):
    from streaming import MDSWriter

    with MDSWriter(out=str(path), columns=columns, compression="zstd") as w:
        for s in samples:
            w.write(s)


def test_token_dtype_boundary():
    assert token_dtype(50257) == "uint16"
    assert token_dtype(65536) == "uint16"  # ids 0..65535 fit
    assert token_dtype(65537) == "uint32"
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


def test_specs_match_design():
    assert CANDIDATE.mds_columns(vocab_size=100) == {"tokens": "ndarray:uint16", "source": "str"}
    assert SCORED.mds_columns(vocab_size=100_000) == {
        "tokens": "ndarray:uint32", "source": "str", "ref_loss": "ndarray:float16", "episode": "int32"}
    assert set(SELECTED.columns) == {"tokens", "loss_mask", "score", "source", "step", "episode"}
    assert all(enc != "pkl" for spec in (CANDIDATE, SCORED, SELECTED) for enc in spec.columns.values())


@pytest.mark.parametrize("spec,vocab", [(CANDIDATE, 300), (SCORED, 70_000), (SELECTED, 300)])
def test_round_trip_through_mdswriter_and_streaming_dataset(tmp_path, spec, vocab):
    from streaming import StreamingDataset

    rng = np.random.default_rng(0)
    dtype = np.dtype(token_dtype(vocab))
    samples = []
    for i in range(10):
        s = {"tokens": rng.integers(0, vocab, 16).astype(dtype), "source": f"src{i % 3}"}
        if spec is SCORED:
            s |= {"ref_loss": rng.random(16).astype(np.float16), "episode": i // 4}
        if spec is SELECTED:
            s |= {"loss_mask": (rng.random(16) < 0.5).astype(np.uint8), "score": rng.random(16).astype(np.float16),
                  "step": i // 2, "episode": 0}
        samples.append(s)
    out = tmp_path / spec.name
    _write(out, spec.mds_columns(vocab_size=vocab), samples)
    assert validate_shard_dir(str(out), spec.name)["tokens"] == f"ndarray:{dtype.name}"
    ds = StreamingDataset(local=str(out), shuffle=False, batch_size=2)
    got = [ds[i] for i in range(len(ds))]
    assert len(got) == 10
    for a, b in zip(samples, got, strict=True):
        for k, v in a.items():
            if isinstance(v, np.ndarray):
                assert b[k].dtype == v.dtype and np.array_equal(b[k], v)
            else:
                assert b[k] == v


def test_validate_names_offending_column(tmp_path):
    out = tmp_path / "bad"
    _write(out, {"tokens": "ndarray:int64", "source": "str"}, [{"tokens": np.zeros(4, np.int64), "source": "a"}])
    with pytest.raises(ShardSchemaError, match=r"column 'tokens' has encoding 'ndarray:int64'"):
        validate_shard_dir(str(out), CANDIDATE)
    with pytest.raises(ShardSchemaError, match=r"missing column 'ref_loss'"):
        validate_shard_dir(str(out), SCORED)
    pkl = tmp_path / "pkl"
    _write(pkl, {"tokens": "ndarray:uint16", "source": "str", "meta": "pkl"},
           [{"tokens": np.zeros(4, np.uint16), "source": "a", "meta": {"x": 1}}])
    with pytest.raises(ShardSchemaError, match=r"unexpected column 'meta'"):
        validate_shard_dir(str(pkl), CANDIDATE)


def test_validate_missing_index(tmp_path):
    with pytest.raises(ShardSchemaError, match="no MDS index.json"):
        validate_shard_dir(str(tmp_path), CANDIDATE)
    with pytest.raises(ShardSchemaError, match="not a directory"):
        validate_shard_dir(str(tmp_path / "nope"), CANDIDATE)


def test_manifest_round_trip_and_atomic_save(tmp_path):
    m = Manifest(kind="candidate", job="prepare", config={"a": 1}, tokenizer_fingerprint="ab" * 32)
    m.counts("x").documents += 3
    m.shards.append(ShardRecord(name="x/part-00000", source="x", samples=5, tokens=50, state={"carry": [1, 2]}))
    write_manifest(str(tmp_path), m)
    back = Manifest.load(str(tmp_path))
    assert back == m and back.completed() == {"x/part-00000"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    data["schema_version"] = "0.1"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema_version '0.1'"):
        Manifest.load(str(tmp_path))


def test_source_counts_add():
    a = SourceCounts(documents=1, tokens=10, sequences=2, bad_records=1)
    b = SourceCounts(documents=2, tokens=5, dropped_tokens=3)
    assert (a + b).model_dump() == {"documents": 3, "tokens": 15, "sequences": 2, "bad_records": 1,
                                    "dropped_tokens": 3, "kept_tokens": 0}
