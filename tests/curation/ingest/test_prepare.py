"""End-to-end preparation: formats, packing exactness, determinism, resume after a kill, bad input."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import curation.ingest.prepare as prep
import curation.ingest.units as units
from curation.ingest.corpus import BadRecordError
from curation.ingest.packing import pack_documents
from curation.ingest.tokenizer import train_bpe_tokenizer
from curation.io.shards import read_column
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
from schemas.manifest import Manifest
from schemas.shards import CANDIDATE, validate_shard_dir
from tests import timing

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _texts(seed, n):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 60))) for _ in range(n)]


@pytest.fixture
def corpus(tmp_path):
    """Four sources, one per input format."""
    d = tmp_path / "raw"
    d.mkdir()
    t1, t2, t3, t4 = _texts(1, 120), _texts(2, 90), _texts(3, 60), _texts(4, 40)
    (d / "a.jsonl").write_text("".join(json.dumps({"q": t, "a": t[::-1]}) + "\n" for t in t1))
    (d / "b.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("".join(json.dumps({"text": t}) + "\n" for t in t2).encode()))
    pq.write_table(pa.table({"body": t3}), d / "c.parquet")
    (d / "d.txt").write_text("\n\n".join(t4) + "\n")
    texts = {"qa": [f"{t}\n{t[::-1]}" for t in t1], "zst": t2, "pq": t3, "txt": t4}
    sources = [
        SourceConfig(name="qa", paths=[str(d / "a.jsonl")], template="{q}\n{a}"),
        SourceConfig(name="zst", paths=[str(d / "*.zst")]),
        SourceConfig(name="pq", paths=[str(d / "c.parquet")], text_field="body"),
        SourceConfig(name="txt", paths=[str(d / "d.txt")]),
    ]
    return sources, texts


def _cfg(tmp_path, sources, **kw):
    base = dict(sources=sources, validation=[sources[-1].model_copy(update={"name": "val"})],
                tokenizer=TokenizerConfig(vocab_size=300), output_dir=str(tmp_path / "out"), seq_len=32,
                sequences_per_part=7, progress=False)
    return PrepareConfig(**{**base, **kw})


def _rows(directory):
    toks = read_column(directory, "tokens")
    return [t.tolist() for t in toks], read_column(directory, "source")


def test_every_format_packs_exactly(tmp_path, corpus):
    sources, texts = corpus
    res = prep.prepare(_cfg(tmp_path, sources))
    out = res.dirs["candidates"]
    assert validate_shard_dir(out, CANDIDATE)["tokens"] == "ndarray:uint16"
    rows, srcs = _rows(out)
    m = Manifest.load(out)
    assert m.complete and m.tokenizer_fingerprint == res.tokenizer.fingerprint and m.seq_len == 32
    tok = res.tokenizer
    for name, docs in texts.items():
        ids = tok.encode_batch(docs)
        expect, rest = pack_documents(ids, seq_len=32, eos_id=tok.eos_id)
        got = [r for r, s in zip(rows, srcs, strict=True) if s == name]  # no sequence mixes sources
        assert sorted(got) == sorted(expect.tolist()), name  # same sequences (shuffled within parts)
        c = m.sources[name]
        assert c.documents == len(docs)
        assert c.tokens == sum(len(i) + 1 for i in ids) == c.sequences * 32 + c.dropped_tokens
        assert c.dropped_tokens == len(rest) < 32
    # EOS follows every document: count of EOS == documents, minus those in the dropped remainder
    n_eos = sum(r.count(tok.eos_id) for r in rows)
    assert n_eos == sum(c.documents for c in m.sources.values()) - sum(
        pack_documents(tok.encode_batch(d), seq_len=32, eos_id=tok.eos_id)[1].count(tok.eos_id)
        for d in texts.values())
    val = Manifest.load(res.dirs["validation"])
    assert val.sources["val"].documents == 40 and val.complete


def test_streaming_dataset_reads_output(tmp_path, corpus):
    from streaming import StreamingDataset

    res = prep.prepare(_cfg(tmp_path, corpus[0]))
    ds = StreamingDataset(local=res.dirs["candidates"], shuffle=False, batch_size=4)
    total = Manifest.load(res.dirs["candidates"]).totals().sequences
    assert len(ds) == total
    sample = ds[0]
    assert sample["tokens"].dtype == np.uint16 and sample["tokens"].shape == (32,)


def test_deterministic_given_seed(tmp_path, corpus):
    sources = corpus[0]
    a = _rows(prep.prepare(_cfg(tmp_path / "a", sources)).dirs["candidates"])
    b = _rows(prep.prepare(_cfg(tmp_path / "b", sources)).dirs["candidates"])
    c = _rows(prep.prepare(_cfg(tmp_path / "c", sources, seed=1)).dirs["candidates"])
    assert a == b
    assert a != c and sorted(a[0]) == sorted(c[0])  # the seed only changes the order


def test_uint32_when_vocabulary_exceeds_uint16(tmp_path, corpus):
    sources = corpus[0][:1]
    tok = train_bpe_tokenizer(iter(corpus[1]["qa"]), vocab_size=300, save_to=str(tmp_path / "t" / "tokenizer.json"))
    tok.tokenizer.add_tokens([f"<extra_{i}>" for i in range(70_000)])
    big = tmp_path / "big.json"
    big.write_text(tok.tokenizer.to_str())
    docs = tmp_path / "x.jsonl"
    docs.write_text("".join(json.dumps({"text": f"alpha <extra_{i}> beta"}) + "\n" for i in range(69_990, 70_000)))
    cfg = _cfg(tmp_path, [sources[0].model_copy(update={"paths": [str(docs)], "template": None})], validation=[],
               tokenizer=TokenizerConfig(path=str(big)), seq_len=8)
    res = prep.prepare(cfg)
    assert validate_shard_dir(res.dirs["candidates"], CANDIDATE)["tokens"] == "ndarray:uint32"
    rows, _ = _rows(res.dirs["candidates"])
    assert max(max(r) for r in rows) >= 2**16


class _Killed(BaseException):
    pass


def test_resume_after_kill_mid_part(tmp_path, corpus, monkeypatch):
    sources = corpus[0]
    clean = _rows(prep.prepare(_cfg(tmp_path / "clean", sources)).dirs["candidates"])

    real_write = units.write_part
    calls = {"n": 0}

    def dying_write(part_dir, spec, samples, **kw):
        calls["n"] += 1
        if calls["n"] == 5:  # die in the middle of writing the 5th part
            def half():
                for i, s in enumerate(samples):
                    if i == 3:
                        raise _Killed()
                    yield s
            return real_write(part_dir, spec, half(), **kw)
        return real_write(part_dir, spec, samples, **kw)

    monkeypatch.setattr(units, "write_part", dying_write)
    cfg = _cfg(tmp_path / "killed", sources)
    with pytest.raises(_Killed):
        prep.prepare(cfg)
    out = os.path.join(cfg.output_dir, "candidates")
    m = Manifest.load(out)
    assert not m.complete and len(m.shards) == 4
    assert any(n.endswith(".tmp") for n in os.listdir(os.path.join(out, m.shards[-1].source)))  # partial part
    monkeypatch.setattr(units, "write_part", real_write)
    res = prep.prepare(cfg)  # rerun: resumes
    assert _rows(res.dirs["candidates"]) == clean
    m2 = Manifest.load(out)
    assert m2.sources == Manifest.load(os.path.join(tmp_path / "clean" / "out", "candidates")).sources
    names = [s.name for s in m2.shards]
    assert len(names) == len(set(names))
    assert prep.prepare(cfg).tokens_processed == 0  # complete: a third run does nothing


def test_resume_after_sigkill_of_the_job(tmp_path, corpus):
    """A real kill of `jobs/prepare.py` (SIGKILL after the first finished part), then a rerun."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    sources = corpus[0]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    clean = _rows(prep.prepare(_cfg(tmp_path / "clean", sources, sequences_per_part=2)).dirs["candidates"])
    cfg = _cfg(tmp_path / "job", sources, sequences_per_part=2)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    cmd = [sys.executable, os.path.join(repo, "jobs", "prepare.py"), "--config", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = os.path.join(cfg.output_dir, "candidates", "manifest.json")
    deadline = timing.Deadline(120)
    while not os.path.exists(manifest) and not deadline.expired() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = timing.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout
    assert _rows(os.path.join(cfg.output_dir, "candidates")) == clean


def test_bad_record_fails_with_file_and_line_and_keeps_finished_work(tmp_path, corpus):
    sources, _ = corpus
    bad = tmp_path / "raw" / "d.txt"
    good_txt = bad.read_bytes()
    bad.write_bytes(good_txt + b"\n\nbroken \xfe line\n")
    cfg = _cfg(tmp_path, sources, validation=[])
    tok_dir = tmp_path / "tok"
    # tokenizer training also reads the inputs: give a tokenizer so the failure happens while packing
    train_bpe_tokenizer(iter(_texts(9, 50)), vocab_size=300, save_to=str(tok_dir / "tokenizer.json"))
    cfg = cfg.model_copy(update={"tokenizer": TokenizerConfig(path=str(tok_dir))})
    with pytest.raises(BadRecordError, match=rf"{bad}:\d+: not valid UTF-8 \(byte 0xfe"):
        prep.prepare(cfg)
    out = os.path.join(cfg.output_dir, "candidates")
    before = Manifest.load(out)
    assert {s.source for s in before.shards} >= {"qa", "zst", "pq"}  # finished sources kept
    kept = {s.name: os.path.getmtime(os.path.join(out, s.name)) for s in before.shards if s.samples}
    bad.write_bytes(good_txt)  # fix the input, rerun
    res = prep.prepare(cfg)
    after = Manifest.load(res.dirs["candidates"])
    assert after.complete
    for name, mtime in kept.items():  # finished parts were not rewritten
        assert os.path.getmtime(os.path.join(out, name)) == mtime


def test_skip_bad_records_counts_them(tmp_path, corpus):
    sources, texts = corpus
    raw = tmp_path / "raw"
    with open(raw / "a.jsonl", "ab") as f:
        f.write(b'{"q": "x"\n{"q": "caf\xe9", "a": "b"}\n{"a": "no q"}\n')
    cfg = _cfg(tmp_path, [*sources, SourceConfig(name="gone", paths=[str(raw / "missing.jsonl")])],
               skip_bad_records=True, validation=[])
    res = prep.prepare(cfg)
    m = Manifest.load(res.dirs["candidates"])
    assert m.sources["qa"].bad_records == 3 and m.sources["qa"].documents == len(texts["qa"])
    assert m.sources["gone"].bad_records == 1
    reasons = {(os.path.basename(b.file), b.line): b.reason for b in m.bad_records}
    n = len(texts["qa"])
    assert reasons[("a.jsonl", n + 1)].startswith("malformed JSON")
    assert reasons[("a.jsonl", n + 2)].startswith("not valid UTF-8")
    assert reasons[("a.jsonl", n + 3)].startswith("missing field 'q'")
    assert "no such file" in reasons[("missing.jsonl", 0)]


def test_different_config_in_same_output_dir_is_refused(tmp_path, corpus):
    sources = corpus[0]
    prep.prepare(_cfg(tmp_path, sources))
    with pytest.raises(ValueError, match=r"different config \(differs in: seq_len\)"):
        prep.prepare(_cfg(tmp_path, sources, seq_len=16))


def test_too_small_for_seq_len(tmp_path, corpus):
    sources = corpus[0]
    with pytest.raises(ValueError, match="no sequence of 100000 tokens was produced"):
        prep.prepare(_cfg(tmp_path, sources[3:], validation=[], seq_len=100_000))


def test_demo_default_prepares(tmp_path):
    from streaming import StreamingDataset

    cfg = PrepareConfig.demo_default(str(tmp_path)).model_copy(update={"progress": False})
    res = prep.prepare(cfg)
    cand = Manifest.load(res.dirs["candidates"])
    assert set(cand.sources) == {"target", "general", "noise"} and all(c.sequences > 100 for c in cand.sources.values())
    assert Manifest.load(res.dirs["validation"]).sources["target_val"].sequences > 50
    ds = StreamingDataset(local=res.dirs["validation"], shuffle=False, batch_size=1)
    assert ds[0]["source"] == "target_val"


def test_real_corpus_with_gpt2_tokenizer(tmp_path, shared_data, gpt2_tokenizer):
    from streaming import StreamingDataset

    cfg = PrepareConfig(
        sources=[
            SourceConfig(name="gsm8k", paths=[str(shared_data / "gsm8k" / "train.jsonl")],
                         template="{question}\n{answer}", max_documents=400),
            SourceConfig(name="c4", paths=[str(shared_data / "c4_sample" / "c4_sample.jsonl")], max_documents=150),
            SourceConfig(name="wikitext2", paths=[str(shared_data / "wikitext2" / "valid.txt")], max_documents=300),
        ],
        validation=[SourceConfig(name="aqua", paths=[str(shared_data / "aqua_rat" / "dev.json")],
                                 template="{question}\n{rationale}")],
        tokenizer=TokenizerConfig(path=gpt2_tokenizer), output_dir=str(tmp_path / "out"), seq_len=256,
        progress=False,
    )
    res = prep.prepare(cfg)
    m = Manifest.load(res.dirs["candidates"])
    assert m.vocab_size == 50257 and m.sources["gsm8k"].documents == 400 and m.sources["c4"].documents == 150
    assert m.sources["wikitext2"].sequences > 10
    ds = StreamingDataset(local=res.dirs["candidates"], shuffle=False, batch_size=8)
    assert len(ds) == m.totals().sequences
    rows = [ds[i] for i in range(len(ds))]
    assert all(r["tokens"].dtype == np.uint16 and r["tokens"].shape == (256,) for r in rows)
    gsm = [res.tokenizer.tokenizer.decode(r["tokens"].tolist()) for r in rows if r["source"] == "gsm8k"]
    assert sum("####" in text for text in gsm) > len(gsm) // 2  # GSM8K answers end with "#### n"
    assert Manifest.load(res.dirs["validation"]).sources["aqua"].documents == 254


def test_skip_documents_makes_a_disjoint_slice(tmp_path, corpus):
    sources, texts = corpus
    held = sources[1].model_copy(update={"name": "held", "max_documents": 30})
    pool = sources[1].model_copy(update={"skip_documents": 30})
    res = prep.prepare(_cfg(tmp_path, [pool], validation=[held], sequences_per_part=3))
    m, v = Manifest.load(res.dirs["candidates"]), Manifest.load(res.dirs["validation"])
    assert v.sources["held"].documents == 30 and m.sources["zst"].documents == len(texts["zst"]) - 30
    ids = res.tokenizer.encode_batch(texts["zst"][30:])
    assert m.sources["zst"].tokens == sum(len(i) + 1 for i in ids)


# ------------------------------------------------------------------------------------------------
# large documents: bounded memory, a small manifest, exact resume inside a document (issue 14)
# ------------------------------------------------------------------------------------------------
def _big_corpus(tmp_path, big_words, *, bad_line=False):
    """Small documents, one huge single-line document, more small documents (and a bad line)."""
    rng = np.random.default_rng(7)
    d = tmp_path / "raw"
    d.mkdir(exist_ok=True)
    big = " ".join(rng.choice(WORDS, big_words).tolist())
    rows = [json.dumps({"text": t}) for t in _texts(5, 30)] + [json.dumps({"text": big})]
    for i, t in enumerate(_texts(6, 30)):
        rows += ["{not json"] if bad_line and i % 3 == 0 else []
        rows.append(json.dumps({"text": t}))
    path = d / "big.jsonl"
    path.write_text("\n".join(rows) + "\n")
    tok = train_bpe_tokenizer(_texts(8, 200), vocab_size=300, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    return path, tok


@pytest.mark.parametrize("kill_at", [3, 7, 11, 14])
def test_resume_inside_a_large_document_is_exact(tmp_path, monkeypatch, kill_at):
    """Kills before, while and after the big document is packed (it fills parts 5–11); reruns equal a clean run."""
    path, tok = _big_corpus(tmp_path, 1500, bad_line=True)
    monkeypatch.setattr(units, "PIECE_CHARS", 500)  # the big document (~9k characters) is read in pieces
    src = SourceConfig(name="big", paths=[str(path), str(tmp_path / "nope.jsonl")])  # + a missing path
    kw = dict(validation=[], tokenizer=TokenizerConfig(path=tok.path), skip_bad_records=True, seq_len=128,
              sequences_per_part=2)
    clean_res = prep.prepare(_cfg(tmp_path / "clean", [src], **kw))
    clean = _rows(clean_res.dirs["candidates"])
    clean_m = Manifest.load(clean_res.dirs["candidates"])
    # the clean run packs exactly what a whole-document encoding packs
    docs = [json.loads(x)["text"] for x in path.read_text().splitlines() if x.startswith("{\"")]
    ids = tok.encode_batch(docs)
    expect, rest = pack_documents(ids, seq_len=128, eos_id=tok.eos_id)
    assert sorted(clean[0]) == sorted(expect.tolist()) and clean_m.sources["big"].dropped_tokens == len(rest)
    assert clean_m.sources["big"].bad_records == 11 and len(clean_m.shards) > 14  # counted once, also on resume

    real_write = units.write_part
    calls = {"n": 0}

    def dying_write(part_dir, spec, samples, **kw):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise _Killed()
        return real_write(part_dir, spec, samples, **kw)

    monkeypatch.setattr(units, "write_part", dying_write)
    cfg = _cfg(tmp_path / "killed", [src], **kw)
    with pytest.raises(_Killed):
        prep.prepare(cfg)
    out = os.path.join(cfg.output_dir, "candidates")
    state = Manifest.load(out).shards[-1].state
    assert set(state) == {"file", "record", "skip"}  # no tokens in the manifest
    if kill_at in (7, 11):  # the last finished part ends inside the big document (record 30)
        assert state["record"] == 30 and state["skip"] > 0
    monkeypatch.setattr(units, "write_part", real_write)
    res = prep.prepare(cfg)
    assert _rows(res.dirs["candidates"]) == clean
    m = Manifest.load(out)
    assert m.sources == clean_m.sources and m.bad_records == clean_m.bad_records
    assert [s.name for s in m.shards] == [s.name for s in clean_m.shards]


@pytest.mark.slow
def test_large_document_prepares_in_bounded_memory(tmp_path):
    """A 20 MB single-line document: peak RSS of the job under 2 GB, a manifest under 1 MB (issue 14: the
    resume state kept every pending token in the manifest, and the document was tokenized whole)."""
    import resource
    import sys

    import yaml

    path, tok = _big_corpus(tmp_path, 3_600_000)
    assert os.path.getsize(path) > 20e6
    cfg = _cfg(tmp_path, [SourceConfig(name="big", paths=[str(path)])], validation=[],
               tokenizer=TokenizerConfig(path=tok.path), seq_len=512, sequences_per_part=1024)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = timing.run([sys.executable, os.path.join(repo, "jobs", "prepare.py"), "--config",
                           str(tmp_path / "job.yaml")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert peak_mb < 2048 or before / 1024 >= 2048, f"peak RSS {peak_mb:.0f} MB"
    out = os.path.join(cfg.output_dir, "candidates")
    assert os.path.getsize(Manifest.path_in(out)) < 1e6
    m = Manifest.load(out)
    assert m.complete and m.sources["big"].documents == 61
    assert m.sources["big"].tokens == m.sources["big"].sequences * 512 + m.sources["big"].dropped_tokens > 4e6


def test_truncated_zst_stops_prepare_or_is_a_counted_bad_record(tmp_path, corpus):
    sources, texts = corpus
    zst = tmp_path / "raw" / "b.jsonl.zst"
    cobj, data, ends = zstandard.ZstdCompressor().compressobj(), b"", []
    for block in range(3):  # one frame of three blocks, 30 documents each, cut after the second block
        data += cobj.compress("".join(json.dumps({"text": t}) + "\n" for t in texts["zst"][30 * block:][:30]).encode())
        data += cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        ends.append(len(data))
    zst.write_bytes(data[:ends[1]])  # a valid-looking prefix: it used to pack 60 of 90 documents, no error
    with pytest.raises(BadRecordError, match=r"b\.jsonl\.zst:\d+: truncated zstd file"):
        prep.prepare(_cfg(tmp_path / "strict", sources[1:2], validation=[]))
    res = prep.prepare(_cfg(tmp_path / "skip", sources[1:2], validation=[], skip_bad_records=True))
    m = Manifest.load(res.dirs["candidates"])
    (bad,) = m.bad_records
    assert bad.file == str(zst) and "truncated zstd file" in bad.reason and m.sources["zst"].bad_records == 1
    assert m.sources["zst"].documents == bad.line - 1 == 60  # the complete lines before it


# ------------------------------------------------------------------------------------------------
# shard integrity: hashes in the index, checked on read; a rerun regenerates damaged parts (issue 14)
# ------------------------------------------------------------------------------------------------
def test_damaged_candidate_shard_is_refused_naming_it_and_a_rerun_regenerates_it(tmp_path, corpus, flip_bit):
    from curation.io.shards import ShardIntegrityError, ShardReader

    sources = corpus[0]
    cfg = _cfg(tmp_path, sources)
    res = prep.prepare(cfg)
    out = res.dirs["candidates"]
    clean = _rows(out)
    index = json.load(open(os.path.join(out, "index.json")))
    assert all(s["zip_data"]["hashes"].keys() == {"xxh64"} and s["raw_data"]["hashes"] for s in index["shards"])
    part = next(r.name for r in Manifest.load(out).shards if r.source == "zst" and r.part == 2)
    shard = tmp_path / "out" / "candidates" / part / "shard.00000.mds.zstd"
    flip_bit(shard)
    reader = ShardReader(out)
    with pytest.raises(ShardIntegrityError) as e:
        [reader[i] for i in range(len(reader))]
    msg = str(e.value)
    assert msg.startswith(f"{shard}: corrupt shard") and f"part {part} can be regenerated: rerun jobs/prepare.py" in msg
    # a rerun with the same config rewrites exactly that part (also when it is gone altogether)
    with pytest.warns(UserWarning, match=f"{part} is damaged"):
        again = prep.prepare(cfg)
    assert again.regenerated == [os.path.join(out, part)] and again.tokens_processed == 0
    assert _rows(out) == clean
    import shutil

    shutil.rmtree(shard.parent)
    with pytest.warns(UserWarning, match="missing or unreadable index"):
        assert prep.prepare(cfg).regenerated == [os.path.join(out, part)]
    assert _rows(out) == clean and prep.prepare(cfg).regenerated == []


def test_regenerating_a_part_from_changed_input_is_refused(tmp_path, corpus):
    sources = corpus[0]
    cfg = _cfg(tmp_path, sources[:1], validation=[])
    out = prep.prepare(cfg).dirs["candidates"]
    part = Manifest.load(out).shards[1].name
    import shutil

    shutil.rmtree(os.path.join(out, part))
    src = tmp_path / "raw" / "a.jsonl"
    src.write_text(src.read_text().replace("alpha", "omega"))
    # refused before anything is regenerated, naming the file (its fingerprint in the unit record: issue 32)
    with pytest.raises(ValueError, match=rf"^{src}: changed since {out} was prepared from it"):
        prep.prepare(cfg)
    assert not os.path.exists(os.path.join(out, part))


def test_shards_without_hashes_stay_readable_and_garbage_is_named(tmp_path, flip_bit):
    """Directories written before hashes were recorded are read unchecked; undecodable bytes still name the file."""
    from streaming import MDSWriter

    from curation.io.shards import ShardIntegrityError, ShardReader

    d = tmp_path / "old"
    with MDSWriter(out=str(d), columns={"tokens": "ndarray:uint16", "source": "str"}, compression="zstd") as w:
        for i in range(5):
            w.write({"tokens": np.arange(i, i + 8, dtype=np.uint16), "source": "s"})
    reader = ShardReader(str(d))
    assert [reader[i]["tokens"].tolist()[0] for i in range(5)] == [0, 1, 2, 3, 4]
    shard = d / "shard.00000.mds.zstd"
    flip_bit(shard, offset=len(shard.read_bytes()) - 6)
    with pytest.raises(ShardIntegrityError, match=rf"^{shard}: corrupt shard"):
        [ShardReader(str(d))[i] for i in range(5)]


# ------------------------------------------------------------------------------------------------
# text the tokenizer refuses (issue 55, P25)
# ------------------------------------------------------------------------------------------------
def _refusing_corpus(tmp_path):
    tok = train_bpe_tokenizer(iter(_texts(9, 50)), vocab_size=300, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    good = _texts(5, 12)
    long_bad = " ".join(["alpha beta"] * 60) + " lone \ud800 end"  # a long text: encoded in pieces, refused late
    rows = [*good[:4], "short lone \ud800 one", *good[4:8], long_bad, *good[8:]]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))  # the surrogates escaped: valid JSON
    src = SourceConfig(name="s", paths=[str(path)])
    return tok, src, good, path


def test_a_lone_surrogate_is_a_counted_bad_record_or_one_line_naming_file_and_line(tmp_path):
    """P25: it ended in a 30-line TypeError from the tokenizer, also with skip_bad_records."""
    tok, src, good, path = _refusing_corpus(tmp_path)
    kw = dict(sources=[src], validation=[], tokenizer=TokenizerConfig(path=tok.path), seq_len=32, progress=False)
    res = prep.prepare(PrepareConfig(output_dir=str(tmp_path / "skip"), skip_bad_records=True, **kw))
    m = Manifest.load(res.dirs["candidates"])
    assert m.sources["s"].bad_records == 2 and m.sources["s"].documents == len(good)
    assert [(b.line, b.reason.split(" (")[0]) for b in m.bad_records] == [
        (5, "the text holds the lone surrogate \\ud800"), (10, "the text holds the lone surrogate \\ud800")]
    expect, _ = pack_documents(tok.encode_batch(good), seq_len=32, eos_id=tok.eos_id)
    assert sorted(_rows(res.dirs["candidates"])[0]) == sorted(expect.tolist())
    with pytest.raises(BadRecordError, match=rf"^{path}:5: the text holds the lone surrogate \\ud800 \(character 12\)"):
        prep.prepare(PrepareConfig(output_dir=str(tmp_path / "strict"), **kw))


def test_text_the_tokenizer_itself_refuses_is_a_bad_record_or_stops_the_unit_when_partly_packed(tmp_path,
                                                                                                 monkeypatch):
    """With the readers' check off, the tokenizer's own refusal (a TypeError) is caught: in a batch of short texts, or
    in the first piece of a long one, a bad record naming file:line; in a later piece, once some of the text's tokens
    are packed, the unit stops on it, naming it, also with skip_bad_records (the packed tokens cannot be taken
    back)."""
    import curation.ingest.jsonstream as jsonstream

    tok, src, good, path = _refusing_corpus(tmp_path)
    monkeypatch.setattr(jsonstream, "find_surrogate", lambda text: None)
    monkeypatch.setattr(units, "PIECE_CHARS", 100)
    kw = dict(sources=[src], validation=[], tokenizer=TokenizerConfig(path=tok.path), seq_len=32, progress=False,
              skip_bad_records=True, sequences_per_part=2)
    with pytest.raises(BadRecordError) as e:
        prep.prepare(PrepareConfig(output_dir=str(tmp_path / "late"), **kw))
    assert str(e.value).startswith(f"{path}:10: the tokenizer cannot encode it (TypeError: ")
    assert str(e.value).endswith(" of its tokens were packed (it cannot be skipped then): fix the text")
    m = Manifest.load(os.path.join(tmp_path / "late", "candidates"))
    assert [(b.line, b.reason.split(" (")[0]) for b in m.bad_records] == [(5, "the tokenizer cannot encode it")]
    monkeypatch.setattr(units, "PIECE_CHARS", 10_000)  # the long text in one piece: refused before any is packed
    res = prep.prepare(PrepareConfig(output_dir=str(tmp_path / "early"), **kw))
    m = Manifest.load(res.dirs["candidates"])
    assert [b.line for b in m.bad_records] == [5, 10] and m.sources["s"].documents == len(good)
