"""Pre-tokenized sources: llm-foundry's MDS token datasets and parquet / arrow token columns, prepared into our
candidate shards: exact round trips, resume after a kill, damaged shards and out-of-vocabulary ids named."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import curation.ingest.prepare as prep
import curation.ingest.units as units
from curation.ingest.corpus import BadRecordError
from curation.ingest.packing import pack_documents
from curation.ingest.token_sources import resolve_token_inputs
from curation.ingest.tokenizer import train_bpe_tokenizer
from curation.io.shards import read_column
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
from schemas.manifest import Manifest

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
L = 32  # llm-foundry's --concat_tokens in these datasets


def _texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe_tokenizer(iter(_texts(0, 300)), vocab_size=300, save_to=str(path))


def foundry_samples(docs, *, max_length=L, eos=(), bos=(), no_wrap=False):
    """llm-foundry's ``ConcatTokensDataset.__iter__`` (llmfoundry/data/data.py, v0.2.0 to v0.21.0) on already
    tokenized documents: ``buffer = buffer + bos_tokens + iids + eos_tokens``, cut into ``max_length`` pieces,
    the remainder after the last document dropped."""
    buffer: list[int] = []
    for iids in docs:
        buffer = buffer + list(bos) + list(iids) + list(eos)
        while len(buffer) >= max_length:
            yield buffer[:max_length]
            buffer = buffer[max_length:] if not no_wrap else []


def write_foundry_mds(out, samples, *, encoding="ndarray:int32", compression="zstd", hashes=None,
                      size_limit=1 << 12):
    """Write ``samples`` with streaming's MDSWriter as llm-foundry's converters do with --concat_tokens:
    ``columns={'tokens': 'ndarray:int32'}`` and ``np.asarray(sample, dtype=np.int32)`` (v0.9.0 and later), or
    ``columns={'tokens': 'bytes'}`` and ``np.asarray(sample).tobytes()`` (int64; v0.8.0 and before), with
    ``--compression zstd`` and no hashes. Only ``size_limit`` differs (theirs: the default 64 MiB): small
    here, so that a few hundred samples make several shards."""
    from streaming import MDSWriter

    with MDSWriter(columns={"tokens": encoding}, out=str(out), compression=compression, hashes=hashes,
                   size_limit=size_limit) as w:
        for s in samples:
            if encoding == "bytes":
                value = np.asarray(s).tobytes()
            else:  # ndarray[:dtype[:shape]]: the dtype named, int32 when it is not
                value = np.asarray(s, dtype=(encoding.split(":") + ["int32"])[1])
            w.write({"tokens": value})
    return str(out)


def _cfg(tmp_path, tok, sources, **kw):
    base = dict(sources=sources, validation=[], tokenizer=TokenizerConfig(path=tok.path),
                output_dir=str(tmp_path / "out"), seq_len=L, sequences_per_part=16, progress=False)
    return PrepareConfig(**{**base, **kw})


def _rows(directory):
    return [t.tolist() for t in read_column(directory, "tokens")], read_column(directory, "source")


def _shards(dataset):
    with open(os.path.join(dataset, "index.json")) as f:
        return [os.path.join(dataset, s["zip_data"]["basename"]) for s in json.load(f)["shards"]]


@pytest.fixture
def c4(tmp_path, tok):
    """An llm-foundry c4-like dataset (out_root/train, out_root/val) and the samples in it."""
    docs = tok.encode_batch(_texts(1, 250))
    train = list(foundry_samples(docs, eos=[tok.eos_id]))
    val = list(foundry_samples(tok.encode_batch(_texts(2, 40)), eos=[tok.eos_id]))
    write_foundry_mds(tmp_path / "c4" / "train", train)
    write_foundry_mds(tmp_path / "c4" / "val", val)
    return tmp_path / "c4", train, val


@pytest.mark.parametrize("encoding", ["ndarray:int32", "bytes", "ndarray:uint16:32", "ndarray"])
def test_llm_foundry_mds_round_trips_exactly(tmp_path, tok, encoding):
    """llm-foundry's two encodings (ndarray:int32 since v0.9.0, int64 bytes before), and other integer ndarray
    encodings (a static shape, a dtype stored per sample)."""
    docs = tok.encode_batch(_texts(1, 250))
    samples = list(foundry_samples(docs, eos=[tok.eos_id]))
    data = write_foundry_mds(tmp_path / "c4" / "train", samples, encoding=encoding)
    assert len(_shards(data)) >= 4
    val = list(foundry_samples(tok.encode_batch(_texts(2, 40)), eos=[tok.eos_id]))
    vdata = write_foundry_mds(tmp_path / "c4" / "val", val, encoding=encoding)
    cfg = _cfg(tmp_path, tok, [SourceConfig(name="c4", format="mds", paths=[data])],
               validation=[SourceConfig(name="c4_val", format="mds", paths=[vdata])])
    res = prep.prepare(cfg)
    rows, srcs = _rows(res.dirs["candidates"])
    assert set(srcs) == {"c4"}
    # seq_len equals the converter's --concat_tokens: every sample is one sequence, unchanged (parts are
    # shuffled within themselves by seed, as for every source)
    assert sorted(rows) == sorted(samples) and len(rows) == len(samples)
    c = Manifest.load(res.dirs["candidates"]).sources["c4"]
    assert (c.documents, c.tokens, c.sequences, c.dropped_tokens, c.bad_records) == (
        len(samples), len(samples) * L, len(samples), 0, 0)
    assert sum(r.count(tok.eos_id) for r in rows) == sum(s.count(tok.eos_id) for s in samples) > 0  # no EOS added
    assert sorted(_rows(res.dirs["validation"])[0]) == sorted(val)
    assert read_column(res.dirs["candidates"], "tokens")[0].dtype == np.uint16


def test_another_seq_len_recuts_the_stream(tmp_path, tok, c4):
    root, train, _ = c4
    res = prep.prepare(_cfg(tmp_path, tok, [SourceConfig(name="c4", format="mds", paths=[str(root / "train")])],
                            seq_len=48))
    stream = np.concatenate([np.asarray(s) for s in train])  # the samples joined as they are, no EOS added
    n = len(stream) // 48
    rows, _ = _rows(res.dirs["candidates"])
    assert sorted(rows) == sorted(stream[: n * 48].reshape(n, 48).tolist())
    c = Manifest.load(res.dirs["candidates"]).sources["c4"]
    assert (c.tokens, c.sequences, c.dropped_tokens) == (len(stream), n, len(stream) - n * 48)


def test_token_rows_documents_equals_preparing_the_text(tmp_path, tok):
    """Per-document id lists without EOS (`token_rows: documents`) prepare exactly as the text they encode."""
    texts = _texts(3, 120)
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"input_ids": tok.encode_batch(texts)}), tmp_path / "ids.parquet")
    as_text = prep.prepare(_cfg(tmp_path / "a", tok, [SourceConfig(name="s", paths=[str(tmp_path / "text.jsonl")])]))
    as_ids = prep.prepare(_cfg(tmp_path / "b", tok, [SourceConfig(
        name="s", paths=[str(tmp_path / "ids.parquet")], tokens_field="input_ids", token_rows="documents")]))
    assert _rows(as_ids.dirs["candidates"]) == _rows(as_text.dirs["candidates"])
    a, b = Manifest.load(as_text.dirs["candidates"]), Manifest.load(as_ids.dirs["candidates"])
    assert a.sources == b.sources and [s.state for s in a.shards] == [s.state for s in b.shards]


def _ipc(path, table, stream: bool):
    with pa.OSFile(str(path), "wb") as f:
        w = (pa.ipc.new_stream if stream else pa.ipc.new_file)(f, table.schema)
        for batch in table.to_batches(max_chunksize=7):
            w.write_batch(batch)
        w.close()


def test_parquet_and_arrow_token_columns(tmp_path, tok, c4):
    _, train, _ = c4
    thirds = [train[i::3] for i in range(3)]
    pq.write_table(pa.table({"ids": pa.array(thirds[0], pa.list_(pa.int32())), "n": list(range(len(thirds[0])))}),
                   tmp_path / "a.parquet", row_group_size=10)
    _ipc(tmp_path / "b.arrow", pa.table({"tokens": pa.array(thirds[1], pa.large_list(pa.uint16()))}), stream=False)
    _ipc(tmp_path / "c.arrow", pa.table({"tokens": pa.array(thirds[2], pa.list_(pa.int64()))}), stream=True)
    res = prep.prepare(_cfg(tmp_path, tok, [
        SourceConfig(name="pq", paths=[str(tmp_path / "a.parquet")], tokens_field="ids"),  # format from the name
        SourceConfig(name="feather", paths=[str(tmp_path / "b.arrow")], tokens_field="tokens"),
        SourceConfig(name="stream", format="arrow", paths=[str(tmp_path / "c.arrow")]),  # tokens_field: tokens
    ]))
    rows, srcs = _rows(res.dirs["candidates"])
    m = Manifest.load(res.dirs["candidates"])
    for name, part in zip(("pq", "feather", "stream"), thirds, strict=True):
        stream = np.concatenate([np.asarray(s) for s in part])  # records joined as they are (token_rows: stream)
        expect = stream[: len(stream) // L * L].reshape(-1, L).tolist()
        assert sorted(r for r, s in zip(rows, srcs, strict=True) if s == name) == sorted(expect), name
        assert m.sources[name].documents == len(part) and m.sources[name].tokens == len(stream)


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("kill_at", [2, 5])
def test_resume_after_a_kill_between_parts_is_identical(tmp_path, tok, c4, monkeypatch, kill_at):
    """Killed before writing part `kill_at` (seq_len 48 over 32-token samples: parts end inside samples, and
    across shards), then rerun: the same shards and manifest as an uninterrupted run."""
    root, _, _ = c4
    sources = [SourceConfig(name="c4", format="mds", paths=[str(root / "train")])]
    kw = dict(seq_len=48, sequences_per_part=5,
              validation=[SourceConfig(name="v", format="mds", paths=[str(root / "val")])])
    clean = prep.prepare(_cfg(tmp_path / "clean", tok, sources, **kw)).dirs
    real = units.write_part
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise _Killed()
        return real(*a, **k)

    monkeypatch.setattr(units, "write_part", dying)
    cfg = _cfg(tmp_path / "killed", tok, sources, **kw)
    with pytest.raises(_Killed):
        prep.prepare(cfg)
    m = Manifest.load(os.path.join(cfg.output_dir, "candidates"))
    assert len(m.shards) == kill_at - 1 and not m.complete
    assert m.shards[-1].state["skip"] > 0  # the last finished part ended inside a sample
    monkeypatch.setattr(units, "write_part", real)
    res = prep.prepare(cfg)
    for group in ("candidates", "validation"):
        assert _rows(res.dirs[group]) == _rows(clean[group]), group
        a, b = Manifest.load(res.dirs[group]), Manifest.load(clean[group])
        assert [s.model_dump() for s in a.shards] == [s.model_dump() for s in b.shards] and a.sources == b.sources
    assert prep.prepare(cfg).tokens_processed == 0


def test_truncated_input_shard_is_named_or_skipped(tmp_path, tok, c4):
    """llm-foundry records no hashes: a truncated shard fails its recorded size, named; skip_bad_records skips it."""
    root, train, _ = c4
    data = str(root / "train")
    shard = _shards(data)[-1]  # after the first encode batch (256 records): parts are finished before it
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 10)
    sources = [SourceConfig(name="c4", format="mds", paths=[data])]
    with pytest.raises(BadRecordError) as e:
        prep.prepare(_cfg(tmp_path / "a", tok, sources))
    assert str(e.value).startswith(f"{shard}: corrupt shard (") and "its index records" in str(e.value)
    assert "the input dataset is damaged" in str(e.value) and "\n" not in str(e.value)
    assert Manifest.load(os.path.join(tmp_path / "a" / "out", "candidates")).shards  # finished parts kept
    res = prep.prepare(_cfg(tmp_path / "b", tok, sources, skip_bad_records=True))
    m = Manifest.load(res.dirs["candidates"])
    assert [(b.file, b.line) for b in m.bad_records] == [(shard, 0)]
    with open(os.path.join(data, "index.json")) as f:
        lost = json.load(f)["shards"][-1]["samples"]
    assert m.sources["c4"].documents == len(train) - lost and m.sources["c4"].bad_records == 1
    assert sorted(_rows(res.dirs["candidates"])[0]) == sorted(train[:-lost])


@pytest.mark.parametrize("algo", ["xxh64", "sha1"])
def test_flipped_bit_in_a_hashed_input_shard_is_named(tmp_path, tok, flip_bit, algo):
    samples = list(foundry_samples(tok.encode_batch(_texts(4, 150)), eos=[tok.eos_id]))
    data = write_foundry_mds(tmp_path / "ds", samples, hashes=[algo])
    shard = _shards(data)[2]
    flip_bit(shard)
    with pytest.raises(BadRecordError, match=rf"^{shard}: corrupt shard \(\d+ bytes, {algo} \w+; its index records"):
        prep.prepare(_cfg(tmp_path, tok, [SourceConfig(name="s", format="mds", paths=[data])]))


def test_out_of_vocabulary_ids_are_refused_naming_the_record(tmp_path, tok):
    samples = list(foundry_samples(tok.encode_batch(_texts(5, 150)), eos=[tok.eos_id]))
    samples[40] = samples[40][:5] + [tok.vocab_size] + samples[40][6:]
    samples[70] = samples[70][:9] + [-3] + samples[70][10:]
    data = write_foundry_mds(tmp_path / "ds", samples)
    with open(os.path.join(data, "index.json")) as f:
        ends = np.cumsum([s["samples"] for s in json.load(f)["shards"]]).tolist()
    shard_i = int(np.searchsorted(ends, 40, side="right"))
    local = 40 - (ends[shard_i - 1] if shard_i else 0)
    src = [SourceConfig(name="s", format="mds", paths=[data])]
    with pytest.raises(BadRecordError) as e:
        prep.prepare(_cfg(tmp_path / "a", tok, src))
    assert str(e.value) == (
        f"{_shards(data)[shard_i]}:{local + 1}: token id {tok.vocab_size} (position 5) is outside the tokenizer's "
        f"vocabulary (ids 0 to {tok.vocab_size - 1}): was this data tokenized with another tokenizer?")
    res = prep.prepare(_cfg(tmp_path / "b", tok, src, skip_bad_records=True))
    m = Manifest.load(res.dirs["candidates"])
    assert [b.reason.split(" (")[0] for b in m.bad_records] == [f"token id {tok.vocab_size}", "token id -3"]
    assert m.sources["s"].documents == len(samples) - 2
    assert sorted(_rows(res.dirs["candidates"])[0]) == sorted(s for i, s in enumerate(samples) if i not in (40, 70))


def test_vocabulary_check_on_parquet_rows(tmp_path, tok):
    pq.write_table(pa.table({"ids": [[1, 2, 3], [4, 5, 70000], [7]]}), tmp_path / "x.parquet")
    src = [SourceConfig(name="s", paths=[str(tmp_path / "x.parquet")], tokens_field="ids")]
    with pytest.raises(BadRecordError, match=rf"^{tmp_path}/x.parquet:2: token id 70000 \(position 2\) is outside"):
        prep.prepare(_cfg(tmp_path, tok, src, seq_len=2))


def test_tokenizer_with_more_ids_accepts_them(tmp_path, tok):
    """The check is against the configured tokenizer (added tokens included), not a fixed bound."""
    big = train_bpe_tokenizer(iter(_texts(0, 300)), vocab_size=300, save_to=str(tmp_path / "t" / "tokenizer.json"))
    big.tokenizer.add_tokens([f"<x{i}>" for i in range(100)])
    (tmp_path / "big.json").write_text(big.tokenizer.to_str())
    pq.write_table(pa.table({"ids": [[tok.vocab_size + 50, 1, 2, 3]]}), tmp_path / "x.parquet")
    src = [SourceConfig(name="s", paths=[str(tmp_path / "x.parquet")], tokens_field="ids")]
    with pytest.raises(BadRecordError, match="token id 350"):
        prep.prepare(_cfg(tmp_path / "a", tok, src, seq_len=2))
    res = prep.prepare(_cfg(tmp_path / "b", tok, src, seq_len=2, tokenizer=TokenizerConfig(path=str(tmp_path / "big.json"))))
    assert _rows(res.dirs["candidates"])[0] == [[350, 1], [2, 3]]


def test_bad_inputs_are_one_line_naming_what_to_fix(tmp_path, tok, c4):
    root, _, _ = c4
    cases = [
        (SourceConfig(name="s", format="mds", paths=[str(root)]),
         f"{root}: has no index.json; it holds the MDS datasets train, val: give one of them, e.g. {root}/train"),
        (SourceConfig(name="s", format="mds", paths=[str(root / "nope")]), f"{root}/nope: no such directory"),
        (SourceConfig(name="s", format="mds", paths=[str(root / "train")], tokens_field="ids"),
         f"{root}/train/index.json: shard shard.00000.mds.zstd has no column 'ids' (columns: tokens)"),
    ]
    text = write_foundry_mds_text(tmp_path / "text")
    cases.append((SourceConfig(name="s", format="mds", paths=[text]),
                  f"{text}/index.json: shard shard.00000.mds.zstd has no column 'tokens' (columns: text): this "
                  "dataset holds text"))
    pq.write_table(pa.table({"ids": ["a", "b"]}), tmp_path / "s.parquet")
    cases.append((SourceConfig(name="s", paths=[str(tmp_path / "s.parquet")], tokens_field="ids"),
                  f"{tmp_path}/s.parquet: column 'ids' is string, expected a list of integer token ids"))
    for i, (src, msg) in enumerate(cases):
        with pytest.raises(BadRecordError) as e:
            prep.prepare(_cfg(tmp_path / f"o{i}", tok, [src]))
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)


def test_resolving_inputs_with_skip_missing(tmp_path):
    """The one resolver of every source's inputs: an MDS source's dataset directories, any other's files
    (``resolve_paths``); ``skip_missing`` skips a dataset or file that is gone instead of raising."""
    for name in ("d1", "d2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "index.json").write_text("{}")
    paths = [str(tmp_path / "d1"), str(tmp_path / "gone"), str(tmp_path / "x*"), str(tmp_path / "d2" / "index.json")]
    mds = SourceConfig(name="s", format="mds", paths=paths)
    with pytest.raises(BadRecordError, match=r"gone: no such directory \(source 's'\)"):
        resolve_token_inputs(mds)
    assert resolve_token_inputs(mds, skip_missing=True) == [str(tmp_path / "d1"), str(tmp_path / "d2")]
    (tmp_path / "f.txt").write_text("x")
    text = SourceConfig(name="t", paths=[str(tmp_path / "f.txt"), str(tmp_path / "gone.txt")])
    with pytest.raises(BadRecordError, match=r"gone\.txt: no such file \(source 't'\)"):
        resolve_token_inputs(text)
    assert resolve_token_inputs(text, skip_missing=True) == [str(tmp_path / "f.txt")]


def write_foundry_mds_text(out):
    """llm-foundry's converter without --concat_tokens: a `text` column."""
    from streaming import MDSWriter

    with MDSWriter(columns={"text": "str"}, out=str(out), compression="zstd") as w:
        w.write({"text": "hello"})
    return str(out)


def test_pre_tokenized_source_needs_a_tokenizer_path(tmp_path):
    with pytest.raises(ValueError, match=r"sources.0 \('c4'\) is pre-tokenized: set tokenizer.path"):
        PrepareConfig(sources=[SourceConfig(name="c4", format="mds", paths=["x"])], output_dir=str(tmp_path))


def test_skip_and_max_documents_count_records(tmp_path, tok, c4):
    root, train, _ = c4
    src = SourceConfig(name="c4", format="mds", paths=[str(root / "train")], skip_documents=10, max_documents=60)
    rows, _ = _rows(prep.prepare(_cfg(tmp_path, tok, [src])).dirs["candidates"])
    assert sorted(rows) == sorted(train[10:70])


def test_packing_helper_agrees_with_documents_mode(tok):
    """`pack_documents` (EOS after each) over the documents = llm-foundry's samples with eos_text: the stream
    the converter cuts is the one our packer builds."""
    docs = tok.encode_batch(_texts(6, 80))
    ours, _ = pack_documents(docs, seq_len=L, eos_id=tok.eos_id)
    assert ours.tolist() == list(foundry_samples(docs, eos=[tok.eos_id]))


def _unpickled():
    raise RuntimeError("a pkl column was unpickled")


class _Trap:
    def __reduce__(self):
        return (_unpickled, ())


def test_other_columns_are_not_decoded(tmp_path, tok):
    """Only the token column is decoded: a pickled column of someone else's dataset is never unpickled."""
    from streaming import MDSWriter

    samples = list(foundry_samples(tok.encode_batch(_texts(7, 40)), eos=[tok.eos_id]))
    with MDSWriter(columns={"id": "str", "extra": "pkl", "tokens": "ndarray:int32"}, out=str(tmp_path / "ds"),
                   compression="zstd") as w:
        for i, s in enumerate(samples):
            w.write({"id": f"doc{i}", "extra": _Trap(), "tokens": np.asarray(s, dtype=np.int32)})
    res = prep.prepare(_cfg(tmp_path, tok, [SourceConfig(name="s", format="mds", paths=[str(tmp_path / "ds")])]))
    assert sorted(_rows(res.dirs["candidates"])[0]) == sorted(samples)


def test_a_damaged_output_part_is_regenerated_from_the_mds_input(tmp_path, tok, c4, flip_bit):
    root, _, _ = c4
    cfg = _cfg(tmp_path, tok, [SourceConfig(name="c4", format="mds", paths=[str(root / "train")])], seq_len=48)
    out = prep.prepare(cfg).dirs["candidates"]
    before = _rows(out)
    part = Manifest.load(out).shards[3].name
    flip_bit(os.path.join(out, part, "shard.00000.mds.zstd"))
    with pytest.warns(UserWarning, match=f"{out}/{part} is damaged"):
        res = prep.prepare(cfg)
    assert res.regenerated == [os.path.join(out, part)] and _rows(out) == before


def test_real_c4_converted_by_llm_foundry_equals_preparing_its_text(tmp_path, shared_data, gpt2_tokenizer):
    """c4 text tokenized with GPT-2 and converted as `convert_dataset_json.py --concat_tokens 256 --eos_text
    '<|endoftext|>' --compression zstd` would (default shard size) prepares into the very sequences that
    preparing the text itself gives, in the same order."""
    from curation.ingest.tokenizer import load_tokenizer

    gpt2 = load_tokenizer(gpt2_tokenizer)
    c4 = str(shared_data / "c4_sample" / "c4_sample.jsonl")
    with open(c4, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(150), strict=False)]
    samples = list(foundry_samples(gpt2.encode_batch(texts), max_length=256, eos=[gpt2.eos_id]))
    data = write_foundry_mds(tmp_path / "my-copy-c4" / "train", samples, size_limit=1 << 26)
    kw = dict(seq_len=256, sequences_per_part=64)
    from_mds = prep.prepare(_cfg(tmp_path / "a", gpt2, [SourceConfig(name="c4", format="mds", paths=[data])], **kw))
    from_text = prep.prepare(_cfg(tmp_path / "b", gpt2, [SourceConfig(name="c4", paths=[c4], max_documents=150)],
                                  **kw))
    rows = _rows(from_mds.dirs["candidates"])
    assert rows == _rows(from_text.dirs["candidates"]) and len(rows[0]) == len(samples) > 100
    assert max(max(r) for r in rows[0]) > 40_000  # GPT-2 ids, stored as uint16
    m = Manifest.load(from_mds.dirs["candidates"])
    assert m.vocab_size == 50257 and m.sources["c4"].tokens == 256 * len(samples)


def test_unusable_records_are_named_and_counted(tmp_path, tok):
    from streaming import MDSWriter

    pq.write_table(pa.table({"ids": pa.array([[1, 2, 3], None, [], [4, None], [5, 6]], pa.list_(pa.int64()))}),
                   tmp_path / "x.parquet")
    with MDSWriter(columns={"tokens": "bytes"}, out=str(tmp_path / "ds"), compression="zstd") as w:
        for value in (np.arange(1, 9).tobytes(), b"\x01\x02\x03", np.arange(9, 13).tobytes()):
            w.write({"tokens": value})
    res = prep.prepare(_cfg(tmp_path, tok, [
        SourceConfig(name="pq", paths=[str(tmp_path / "x.parquet")], tokens_field="ids"),
        SourceConfig(name="mds", format="mds", paths=[str(tmp_path / "ds")]),
    ], seq_len=4, skip_bad_records=True))
    m = Manifest.load(res.dirs["candidates"])
    shard = str(tmp_path / "ds" / "shard.00000.mds.zstd")
    assert [(os.path.basename(b.file), b.line, b.reason) for b in m.bad_records] == [
        ("x.parquet", 2, "column 'ids' is null"),
        ("x.parquet", 3, "column 'ids' holds no token (empty record)"),
        ("x.parquet", 4, "column 'ids' holds a null token id"),
        (os.path.basename(shard), 2, "sample 1 of the dataset cannot be decoded (ValueError: 3 bytes are no whole "
                                     "number of int64 ids (token_encoding_type))"),
    ]
    rows, srcs = _rows(res.dirs["candidates"])
    assert sorted(zip(srcs, rows, strict=True)) == [("mds", [1, 2, 3, 4]), ("mds", [5, 6, 7, 8]),
                                                    ("mds", [9, 10, 11, 12]), ("pq", [1, 2, 3, 5])]


@pytest.mark.slow  # two job processes
def test_sigkill_of_the_job_between_parts_then_a_rerun_is_identical(tmp_path, tok, c4):
    import signal

    from tests.curation.ingest.test_prepare_stop import _rerun, _start, _wait_for_a_part

    root, _, _ = c4
    sources = [SourceConfig(name="c4", format="mds", paths=[str(root / "train")])]
    kw = dict(seq_len=48, sequences_per_part=5)
    clean = prep.prepare(_cfg(tmp_path / "clean", tok, sources, **kw)).dirs["candidates"]
    cfg = _cfg(tmp_path / "job", tok, sources, **kw)
    proc = _start(tmp_path / "job", cfg, delay=0.3)  # every part write slowed down: the kill lands mid-run
    _wait_for_a_part(cfg, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = os.path.join(cfg.output_dir, "candidates")
    assert not Manifest.load(out).complete
    _rerun(cfg)
    assert _rows(out) == _rows(clean)
    a, b = Manifest.load(out), Manifest.load(clean)
    assert [s.model_dump() for s in a.shards] == [s.model_dump() for s in b.shards] and a.sources == b.sources
