"""Work units of prepare, in-process (world size 1): the unit rule, spans read every record once with its file
line, a unit's output is its own packing, per-unit resume never redoes a finished unit, bad input names file:line."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import curation.ingest.prepare as prep
import curation.ingest.units as units
from curation.ingest.corpus import (
    BadRecordError,
    Document,
    FileSpan,
    iter_documents,
    parquet_row_groups,
    resolve_paths,
)
from curation.ingest.packing import pack_documents
from curation.ingest.tokenizer import train_bpe_tokenizer
from curation.ingest.units import plan_units
from curation.io.atomic import write_manifest
from curation.io.shards import read_column
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
from schemas.manifest import Manifest, UnitRecord
from tests.curation.ingest.test_prepare import WORDS, _Killed, _rows, _texts

LINE = 40  # every jsonl line of these tests is exactly this long (with its newline)


def _fixed_lines(path, n, first=0):
    """``n`` jsonl lines of exactly LINE bytes: {"text": "<words> <index>"}."""
    rows = []
    for i in range(first, first + n):
        body = f"{WORDS[i % len(WORDS)]} {WORDS[(i * 7) % len(WORDS)]} {i}"
        row = json.dumps({"text": body})
        rows.append(row + " " * (LINE - 1 - len(row)) + "\n")
    path.write_text("".join(rows))
    return str(path)


def _texts_of(units_, skip_bad=True):
    out = []
    for u in units_:
        out += [d.text for d in units.read_documents(u.source, list(u.spans), skip_bad) if isinstance(d, Document)]
    return out


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
def test_small_files_share_a_unit_and_a_large_jsonl_is_cut_at_bytes(tmp_path):
    a = _fixed_lines(tmp_path / "a.jsonl", 3)  # 120 bytes
    b = _fixed_lines(tmp_path / "b.jsonl", 25, first=3)  # 1000 bytes
    c = _fixed_lines(tmp_path / "c.jsonl", 2, first=28)  # 80 bytes
    src = SourceConfig(name="s", paths=[str(tmp_path / "*.jsonl")])
    plan = plan_units("out", 0, src, [a, b, c], 400)
    spans = [[(os.path.basename(s.path), s.start, s.stop) for s in u.spans] for u in plan]
    assert spans == [
        [("a.jsonl", 0, None), ("b.jsonl", 0, 280)],
        [("b.jsonl", 280, 680)],
        [("b.jsonl", 680, None), ("c.jsonl", 0, None)],
    ]
    assert [u.bytes for u in plan] == [400, 400, 400] and [u.index for u in plan] == [0, 1, 2]
    # every record once, in order: a line belongs to the unit its first byte is in (280 = 7 lines of b)
    assert _texts_of(plan) == _texts_of(plan_units("out", 0, src, [a, b, c], 10**9))
    assert len(_texts_of(plan[:1])) == 3 + 7


@pytest.mark.parametrize("unit_bytes", [1, 39, 40, 41, 79, 123, 400, 999, 5000])
def test_spans_read_every_record_exactly_once_with_its_file_line(tmp_path, unit_bytes):
    rng = np.random.default_rng(unit_bytes)
    rows = [json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(1, 30)))}) for _ in range(60)]
    rows[17] = "{broken"
    rows[41] = ""  # a blank line
    (tmp_path / "v.jsonl").write_text("\n".join(rows) + "\n")
    src = SourceConfig(name="s", paths=[str(tmp_path / "v.jsonl")])
    whole = list(iter_documents(src))
    plan = plan_units("out", 0, src, [str(tmp_path / "v.jsonl")], unit_bytes)
    cut = [item for u in plan for item in iter_documents(src, spans=list(u.spans))]
    def key(items):
        return [(x.text, x.line) if isinstance(x, Document) else str(x) for x in items]

    assert key(cut) == key(whole) and len(whole) == 59
    assert any(isinstance(x, BadRecordError) and x.line == 18 for x in cut)


def test_resume_inside_a_span_continues_after_the_record(tmp_path):
    path = _fixed_lines(tmp_path / "r.jsonl", 30)
    src = SourceConfig(name="s", paths=[path])
    span = FileSpan(path, 400, 800)  # lines 11..20
    docs = list(iter_documents(src, spans=[span]))
    assert [d.line for d in docs] == list(range(11, 21))
    rest = list(iter_documents(src, spans=[span], start_record=docs[3].next_record))
    assert [d.text for d in rest] == [d.text for d in docs[4:]] and rest[0].line == 15


def test_parquet_is_cut_at_row_groups_and_other_files_are_read_whole(tmp_path):
    table = pa.table({"text": [f"{WORDS[i % 12]:>7} row {i:03d}" for i in range(120)]})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=20, compression="none", use_dictionary=False,
                   write_statistics=False)  # 6 row groups of equal size
    zst = tmp_path / "z.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x y"}\n' * 5000))
    src = SourceConfig(name="s", paths=[str(tmp_path / "*")])
    files = [str(tmp_path / "p.parquet"), str(zst)]
    data = sum(nbytes for _, nbytes in parquet_row_groups(files[0]))  # the row groups' compressed bytes
    plan = plan_units("out", 0, src, files, data // 3)
    spans = [[(os.path.basename(s.path), s.start, s.stop) for s in u.spans] for u in plan]
    assert all(len(u) == 1 for u in spans[:-1]) and spans[-1][-1] == ("z.jsonl.zst", 0, None)
    groups = [s for u in spans for s in u if s[0] == "p.parquet"]
    assert groups == [("p.parquet", 0, 2), ("p.parquet", 2, 4), ("p.parquet", 4, None)]  # row-group ranges
    assert all(a[2] == b[1] for a, b in zip(groups, groups[1:], strict=False))
    docs = [d for u in plan for d in iter_documents(src, spans=list(u.spans)) if d.file.endswith(".parquet")]
    assert [d.text for d in docs] == table.column("text").to_pylist() and [d.line for d in docs] == list(range(1, 121))


def test_a_source_that_counts_documents_is_one_unit(tmp_path):
    paths = [_fixed_lines(tmp_path / f"{n}.jsonl", 30, first=30 * i) for i, n in enumerate("ab")]
    for kw in ({"skip_documents": 3}, {"max_documents": 40}):
        src = SourceConfig(name="s", paths=paths, **kw)
        (unit,) = plan_units("out", 0, src, paths, 100)
        assert [s.whole for s in unit.spans] == [True, True] and unit.bytes == 2400


# ------------------------------------------------------------------------------------------------
# prepare with several units per source (in-process)
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def units_corpus(tmp_path):
    """One 3-file jsonl source of varied documents, a tokenizer, a config of small units."""
    d = tmp_path / "raw"
    d.mkdir()
    texts = _texts(11, 400)
    for i in range(3):
        (d / f"f{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[i::3]))
    tok = train_bpe_tokenizer(iter(_texts(12, 200)), vocab_size=300, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    src = SourceConfig(name="s", paths=[str(d / "*.jsonl")])

    def cfg(out, **kw):
        base = dict(sources=[src], tokenizer=TokenizerConfig(path=tok.path), output_dir=str(tmp_path / out),
                    seq_len=32, sequences_per_part=20, unit_bytes=6000, progress=False, workers=1)
        return PrepareConfig(**{**base, **kw})

    return cfg, tok, src


def test_each_unit_is_packed_on_its_own_and_its_remainder_counted(units_corpus):
    cfg, tok, src = units_corpus
    res = prep.prepare(cfg("out"))
    out = res.dirs["candidates"]
    m = Manifest.load(out)
    plan = plan_units(out, 0, src, resolve_paths(src), 6000)
    assert len(plan) >= 4 and m.extra["units"] == {"s": len(plan)}
    rows = _rows(out)[0]
    expect, dropped, start = [], 0, 0
    for unit in plan:
        ids = tok.encode_batch(_texts_of([unit]))
        seqs, rest = pack_documents(ids, seq_len=32, eos_id=tok.eos_id)
        unit_rows = rows[start:start + len(seqs)]
        assert sorted(unit_rows) == sorted(seqs.tolist())  # the unit's parts hold exactly its own packing
        start += len(seqs)
        expect.append(len(seqs))
        dropped += len(rest)
    assert start == len(rows)
    c = m.sources["s"]
    assert c.dropped_tokens == dropped and c.sequences == sum(expect) and c.tokens == c.sequences * 32 + dropped
    assert [r.name for r in m.shards][:2] == ["s/part-00000-00000", "s/part-00000-00001"]
    records = [UnitRecord.load(u.record_path) for u in plan]
    assert all(r.done for r in records) and [r.counts.sequences for r in records] == expect


def test_n1_with_one_unit_per_source_equals_the_per_source_rule(units_corpus):
    """Sources smaller than a unit pack exactly as before units (the demo's case): one stream per source."""
    cfg, tok, src = units_corpus
    res = prep.prepare(cfg("big_units", unit_bytes=10**9))
    texts = [json.loads(x)["text"] for f in sorted(os.listdir(os.path.dirname(src.paths[0])))
             for x in open(os.path.join(os.path.dirname(src.paths[0]), f))]
    seqs, rest = pack_documents(tok.encode_batch(texts), seq_len=32, eos_id=tok.eos_id)
    m = Manifest.load(res.dirs["candidates"])
    assert sorted(_rows(res.dirs["candidates"])[0]) == sorted(seqs.tolist()) and m.sources["s"].dropped_tokens == len(rest)
    # part k of unit 0 is shuffled with the seed parts had before units: (seed, source index, k)
    first = read_column(os.path.join(res.dirs["candidates"], "s/part-00000-00000"), "tokens")
    order = np.random.default_rng([0, 0, 0]).permutation(20)
    assert [t.tolist() for t in first] == [seqs[i].tolist() for i in order]


def test_a_killed_run_resumes_each_unit_and_never_redoes_a_finished_one(units_corpus, monkeypatch):
    cfg, tok, src = units_corpus
    clean = prep.prepare(cfg("clean"))
    first = UnitRecord.load(os.path.join(clean.dirs["candidates"], "s", "unit-00000.json"))
    calls = {"n": 0}
    real_write = units.write_part

    def dying_write(part_dir, spec, samples, **kw):
        calls["n"] += 1
        if calls["n"] == len(first.parts) + 3:  # dies writing the 3rd part of unit 1 (its 2 first are finished)
            raise _Killed()
        return real_write(part_dir, spec, samples, **kw)

    monkeypatch.setattr(units, "write_part", dying_write)
    c = cfg("killed")
    with pytest.raises(_Killed):
        prep.prepare(c)
    out = os.path.join(c.output_dir, "candidates")
    records = {f: UnitRecord.load(os.path.join(out, "s", f)) for f in sorted(os.listdir(os.path.join(out, "s")))
               if f.endswith(".json")}
    done = [f for f, r in records.items() if r.done]
    cut = [f for f, r in records.items() if not r.done]
    assert done and len(cut) == 1 and records[cut[0]].parts  # the killed unit had finished parts
    stamps = {p.name: os.stat(os.path.join(out, p.name)).st_mtime_ns for r in records.values() for p in r.parts
              if p.samples}
    monkeypatch.setattr(units, "write_part", real_write)
    ran = []
    real_run = units.run_unit
    monkeypatch.setattr(prep, "run_unit", lambda unit, *a, **k: ran.append(unit.index) or real_run(unit, *a, **k))
    res = prep.prepare(c)
    assert _rows(res.dirs["candidates"]) == _rows(clean.dirs["candidates"])
    assert not {f"unit-{i:05d}.json" for i in ran} & set(done)  # a finished unit is never run again
    assert all(os.stat(os.path.join(out, name)).st_mtime_ns == t for name, t in stamps.items())  # nor rewritten
    a, b = Manifest.load(out), Manifest.load(clean.dirs["candidates"])
    assert a.shards == b.shards and a.sources == b.sources
    with open(os.path.join(out, "index.json")) as f1, open(os.path.join(clean.dirs["candidates"], "index.json")) as f2:
        assert json.load(f1) == json.load(f2)


def test_bad_input_in_a_later_unit_names_its_file_line_and_keeps_the_finished_units(units_corpus):
    cfg, tok, src = units_corpus
    f1 = os.path.join(os.path.dirname(src.paths[0]), "f1.jsonl")
    good = open(f1).read()
    lines = good.splitlines(keepends=True)
    lines[100] = '{"text": 7}\n'
    open(f1, "w").write("".join(lines))
    c = cfg("bad")
    with pytest.raises(BadRecordError, match=rf"^{f1}:101: field 'text' is int, expected a string$"):
        prep.prepare(c)
    out = os.path.join(c.output_dir, "candidates")
    m = Manifest.load(out)
    assert not m.complete and any(r.state.get("done") for r in m.shards)  # the units before it are kept
    skipped = prep.prepare(c.model_copy(update={"skip_bad_records": True, "output_dir": c.output_dir + "2"}))
    (bad,) = Manifest.load(skipped.dirs["candidates"]).bad_records
    assert (bad.file, bad.line) == (f1, 101)
    open(f1, "w").write(good)
    assert Manifest.load(prep.prepare(c).dirs["candidates"]).complete


def test_changed_input_and_old_directories(units_corpus):
    cfg, tok, src = units_corpus
    c = cfg("changed")
    prep.prepare(c)
    out = os.path.join(c.output_dir, "candidates")
    m = Manifest.load(out)
    # a complete directory written before work units (no unit_bytes in its group key) is used as it is
    del m.extra["group_key"]["unit_bytes"]
    write_manifest(out, m)
    assert prep.prepare(c).tokens_processed == 0
    m.complete = False  # ... but an unfinished one cannot be continued
    write_manifest(out, m)
    with pytest.raises(ValueError, match="started by an older version .* delete the directory and rerun"):
        prep.prepare(c)
    # input that changed under an unfinished directory (a bad line fixed, a line added): the units whose input
    # moved are prepared again, the others kept; the output is the one of the new input
    c2 = cfg("changed2")
    prep.prepare(c2)
    out2 = os.path.join(c2.output_dir, "candidates")
    m2 = Manifest.load(out2)
    m2.complete = False
    write_manifest(out2, m2)
    plan = plan_units(out2, 0, src, resolve_paths(src), c2.unit_bytes)
    stamps = {u.index: os.stat(u.record_path).st_mtime_ns for u in plan}
    f0 = os.path.join(os.path.dirname(src.paths[0]), "f0.jsonl")
    with open(f0, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.warns(UserWarning, match=r"unit-000\d\d\.json: its input changed since it was written"):
        res = prep.prepare(c2)
    fresh = prep.prepare(cfg("fresh"))
    assert _rows(res.dirs["candidates"]) == _rows(fresh.dirs["candidates"])
    assert Manifest.load(out2).shards == Manifest.load(fresh.dirs["candidates"]).shards
    moved = [u.index for u in plan_units(out2, 0, src, resolve_paths(src), c2.unit_bytes)
             if os.stat(u.record_path).st_mtime_ns != stamps.get(u.index)]
    assert moved and min(moved) > 0  # the units before f0's end were kept


def test_config_records_written_before_unit_bytes_still_resume(tmp_path):
    """unit_bytes is left out of the record at its default: a record without it equals the current config."""
    cfg = PrepareConfig.demo_default(str(tmp_path))
    dumped = cfg.model_dump(mode="json")
    assert "unit_bytes" not in dumped and dumped["workers"] is None
    assert cfg.model_copy(update={"unit_bytes": 100}).model_dump(mode="json")["unit_bytes"] == 100


# ------------------------------------------------------------------------------------------------
# a huge line first in a unit, stopped inside it, and cut into many small units (issue 55: P22, P23)
# ------------------------------------------------------------------------------------------------
def _huge_first(tmp_path, monkeypatch, *, short_before: int):
    """A jsonl whose huge line (streamed: the threshold lowered) comes after ``short_before`` short lines, then 8
    more; a tokenizer; the texts."""
    import curation.ingest.jsonstream as jsonstream

    monkeypatch.setattr(jsonstream, "STREAM_LINE_BYTES", 300)
    monkeypatch.setattr(jsonstream, "STREAM_CHUNK", 64)
    monkeypatch.setattr(units, "PIECE_CHARS", 200)
    rng = np.random.default_rng(5)
    texts = [" ".join(rng.choice(WORDS, 8)) for _ in range(short_before)] + [" ".join(rng.choice(WORDS, 600))]
    texts += [" ".join(rng.choice(WORDS, 8)) for _ in range(8)]
    path = tmp_path / "huge.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = train_bpe_tokenizer(iter(_texts(12, 200)), vocab_size=300, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    return path, tok, texts


def _direct(tok, texts, seq_len):
    seqs, rest = pack_documents(tok.encode_batch(texts), seq_len=seq_len, eos_id=tok.eos_id)
    return sorted(seqs.tolist()), len(rest)


@pytest.mark.parametrize("short_before", [0, 3])
def test_a_huge_line_first_in_a_unit_and_a_stop_inside_it_give_the_direct_encoding(tmp_path, monkeypatch,
                                                                                    short_before):
    """P22: the huge line first (it crashed on an unset `ends`); P23: killed after a part that ends inside it, the
    rerun resumes there; a damaged part whose state is inside it is regenerated the same."""
    path, tok, texts = _huge_first(tmp_path, monkeypatch, short_before=short_before)
    src = SourceConfig(name="s", paths=[str(path)])

    def cfg(out):
        return PrepareConfig(sources=[src], tokenizer=TokenizerConfig(path=tok.path), output_dir=str(tmp_path / out),
                             seq_len=32, sequences_per_part=5, progress=False, workers=1)

    clean = prep.prepare(cfg("clean")).dirs["candidates"]
    want, dropped = _direct(tok, texts, 32)
    assert sorted(_rows(clean)[0]) == want and Manifest.load(clean).sources["s"].dropped_tokens == dropped
    real, calls = units.write_part, {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Killed()
        return real(*a, **k)

    monkeypatch.setattr(units, "write_part", dying)
    with pytest.raises(_Killed):
        prep.prepare(cfg("killed"))
    monkeypatch.setattr(units, "write_part", real)
    out = str(tmp_path / "killed" / "candidates")
    state = Manifest.load(out).shards[-1].state
    assert state["record"] == short_before and state["skip"] > 0  # the last finished part ends inside the huge line
    prep.prepare(cfg("killed"))
    assert _rows(out) == _rows(clean)
    inside = next(p for p in Manifest.load(out).shards if p.state.get("record") == short_before)
    index = os.path.join(out, inside.name, "index.json")
    os.remove(index)  # a part whose state is inside the huge line, damaged: regenerated exactly
    assert prep.prepare(cfg("killed")).regenerated == [os.path.join(out, inside.name)]
    assert _rows(out) == _rows(clean)


def test_a_long_line_cut_into_many_units_makes_units_only_where_lines_start_and_is_read_once(tmp_path, monkeypatch):
    """unit_bytes far below a line's length: no unit for a stretch inside the line (there were ~5,000 for a 5 MB line,
    each reading to the line's end), and the plan reads the file at most once."""
    path, tok, texts = _huge_first(tmp_path, monkeypatch, short_before=2)
    size = os.path.getsize(path)
    read = {"bytes": 0}
    real_skip = units.skip_line

    def counting_skip(f):
        before = f.tell()
        real_skip(f)
        read["bytes"] += f.tell() - before

    monkeypatch.setattr(units, "skip_line", counting_skip)
    src = SourceConfig(name="s", paths=[str(path)])
    plan = plan_units("out", 0, src, [str(path)], 50)
    assert read["bytes"] <= size  # each byte at most once (it was once per unit inside the line)
    assert len(plan) < size // 50 / 4 and [u.index for u in plan] == list(range(len(plan)))
    per_unit = [[d.text for d in iter_documents(src, spans=list(u.spans))] for u in plan]
    assert all(per_unit) and [t for docs in per_unit for t in docs] == texts  # every unit has a line; all, once
    monkeypatch.setattr(units, "skip_line", real_skip)
    out = prep.prepare(PrepareConfig(sources=[src], tokenizer=TokenizerConfig(path=tok.path), unit_bytes=50,
                                     output_dir=str(tmp_path / "o"), seq_len=32, progress=False, workers=1))
    assert Manifest.load(out.dirs["candidates"]).extra["units"] == {"s": len(plan)}
