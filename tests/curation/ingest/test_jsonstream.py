"""Huge JSONL lines streamed (curation.ingest.jsonstream): the same documents, line numbers, errors, token ids and
prepare output as the whole-line path, with thresholds made tiny so that small lines are "huge"."""

import json
import os
import random

import numpy as np
import pytest
import zstandard

import curation.ingest.corpus as corpus
import curation.ingest.jsonstream as jsonstream
import curation.ingest.prepare as prep
import curation.ingest.units as units
from curation.ingest.corpus import BadRecordError, iter_documents
from curation.ingest.tokenizer import load_tokenizer, train_bpe_tokenizer
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig

LONG = 24  # bytes: a longer line is streamed in these tests


@pytest.fixture
def tiny(monkeypatch):
    """Lines over 24 bytes streamed in chunks of 3 bytes (splitting escapes and UTF-8 characters); strings over 5
    characters left out of the skeleton."""
    monkeypatch.setattr(jsonstream, "STREAM_LINE_BYTES", LONG)
    monkeypatch.setattr(jsonstream, "STREAM_CHUNK", 3)
    monkeypatch.setattr(jsonstream, "LONG_STRING_CHARS", 5)
    return monkeypatch


def _read(path, stream, **kw):
    """(line, next record, text) or the error's one line, of each item; and how many documents were streamed."""
    items, streamed = [], 0
    for d in iter_documents(SourceConfig(name="s", paths=[str(path)], **kw), stream=stream):
        if isinstance(d, BadRecordError):
            items.append(str(d))
        else:
            items.append((d.line, d.next_record, "".join(d.pieces())))
            streamed += d.stream is not None
    return items, streamed


TEXTS = [
    "plain words and more words here",
    'escapes \\n\\t\\"quoted\\" back\\\\slash \\/ \\b\\f\\r é € 😀 \\u00e9\\u20ac \\ud83d\\ude00 end',
    "\\ud83d\\ude00\\ud83d\\ude00\\ud83d\\ude00\\ud83d\\ude00 pairs in a row, and \\ud83d\\ude00 one more",
    "ünïcödé wörds ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 3,
    "\\\\\\\\\\\\\\\\\\\"\\\\ backslash runs \\\\\\u0041",
]


def _lines():
    """Records (as JSON text, escapes written out) that exercise the scanner: nested values before and after the
    text, a long other string, a duplicate text key (json.loads keeps the last), a short text on a long line."""
    out = []
    for i, t in enumerate(TEXTS):
        out.append(f'{{"id": {i}, "meta": {{"a": [1, 2.5e3, null, true, {{"x": "yyyyyyyy\\"y"}}]}}, "text": "' + t
                   + '", "after": ["zzzzzzzzzzzz", -0.5]}')
    out.append('{"text": "first value, dropped", "text": "' + TEXTS[1] + '"}')
    out.append('{"note": "' + "n" * 40 + '", "text": "short"}')
    out.append('  \t  ' + " " * 40)  # a blank huge line: skipped, as a blank line is
    out.append('{"text": "tiny"}')
    return out


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_streamed_lines_give_the_same_documents_as_whole_lines(tmp_path, tiny, chunk):
    tiny.setattr(jsonstream, "STREAM_CHUNK", chunk)
    lines = _lines()
    for t in TEXTS:  # the decoded text is json.loads's
        assert json.loads('"' + t + '"')
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    whole, none = _read(path, stream=False)
    streamed, n = _read(path, stream=True)
    assert none == 0 and n == 6  # the five texts and the duplicate key's; the short text on a long line is not
    assert streamed == whole
    assert [x[0] for x in whole] == [1, 2, 3, 4, 5, 6, 7, 9] and whole[5][2] == json.loads('"' + TEXTS[1] + '"')
    zst = tmp_path / "a.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(path.read_bytes()))
    assert _read(zst, stream=True) == (whole, 6)


def test_streamed_spans_keep_their_lines_and_record_positions(tmp_path, tiny):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(_lines()) + "\n", encoding="utf-8")
    src = SourceConfig(name="s", paths=[str(path)])
    size = os.path.getsize(path)
    for cut in (0, 100, 333, size // 2, size - 20):
        spans = [corpus.FileSpan(str(path), 0, cut), corpus.FileSpan(str(path), cut, None)]
        got = [[(d.file_index, d.line, d.next_record, "".join(d.pieces())) for d in iter_documents(src, spans=spans, stream=s)]
               for s in (False, True)]
        assert got[0] == got[1] and len(got[0]) == 8
        # resuming after the third record of the second span
        again = [[(d.line, d.next_record, "".join(d.pieces()))
                  for d in iter_documents(src, spans=spans, start_file=1, start_record=3, stream=s)] for s in (False, True)]
        assert again[0] == again[1]


# hostile and malformed huge lines: one line naming file:line, the same message as the whole-line path
HOSTILE = {
    "truncated inside the text": ('{"id": 1, "text": "abcdefghijklmnopqrstuvwxyz', "malformed JSON (Invalid control "
                                  "character at column 46)"),
    "bad escape": ('{"text": "abcdefghijklmnop\\qrstuvwxyz"}', "malformed JSON (Invalid \\escape at column 27)"),
    "bad \\u escape": ('{"text": "abcdefghijklmnop\\u12zz rstuvwxyz"}', "malformed JSON (Invalid \\uXXXX escape at "
                                                                         "column 28)"),
    "invalid UTF-8 in the text": (b'{"text": "abcdefghijklmnop\xc3\x28 qrstuvwxyz"}', "not valid UTF-8 (byte 0xc3 at "
                                                                                     "column 27)"),
    "text field missing": ('{"title": "abcdefghijklmnopqrstuvwxyz", "id": 3}', "missing text field 'text' (fields "
                                                                               "present: id, title)"),
    "text field a number": ('{"title": "abcdefghijklmnopqrstuvwxyz", "text": 12}', "field 'text' is int, expected a "
                                                                                  "string"),
    "text twice, the last a number": ('{"text": "abcdefghijklmnopqrstuvwxyz", "text": 1}', "field 'text' is int, "
                                                                                          "expected a string"),
    "trailing garbage": ('{"text": "abcdefghijklmnopqrstuvwxyz"} x', "malformed JSON (Extra data at column 40)"),
    "an error before the text comes first": ('{"a" 1, "text": "abcdefghijklmnop\\qrstuvwxyz"}',
                                            "malformed JSON (Expecting ':' delimiter at column 6)"),
    "invalid UTF-8 after a JSON error comes first": (b'{"a" 1, "text": "abcdefghijklmnopqrstuvwxyz\xff"}',
                                                     "not valid UTF-8 (byte 0xff at column 44)"),
    "empty document": ('{"text": "  \\n\\t \\u0020 \\r\\n        "}', "empty document"),
    "not an object": ('["abcdefghijklmnopqrstuvwxyz"]', "expected a JSON object, got list"),
    # a lone surrogate is valid JSON but no text: a bad record (issue 55), found also in the streamed pieces of a pair
    "a lone low surrogate": ('{"text": "abcdefghijklmnopqrstuvwxyz \\ud83d\\ude00 \\udc80 end"}', "the text holds the "
                             "lone surrogate \\udc80 (character 30), which is not Unicode text: no tokenizer can encode it"),
    "a lone high surrogate before another escape": ('{"text": "abcdefghijklmnopqrstuvwxyz\\ud83d\\n"}', "the text holds the "
                                                    "lone surrogate \\ud83d (character 27), which is not Unicode text: "
                                                    "no tokenizer can encode it"),
    "a high surrogate cut at the line's end": ('{"text": "abcdefghijklmnopqrstuvwxyz\\ud83d', "malformed JSON (Invalid "
                                               "\\uXXXX escape at column 38)"),
}


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_malformed_huge_lines_fail_like_whole_lines(tmp_path, tiny, chunk):
    tiny.setattr(jsonstream, "STREAM_CHUNK", chunk)
    for name, (line, reason) in HOSTILE.items():
        data = line if isinstance(line, bytes) else line.encode()
        last = name.endswith("line's end")  # the file's last line, without a newline
        path = tmp_path / f"{abs(hash(name))}.jsonl"
        path.write_bytes(b'{"text": "ok"}\n' + data + (b"" if last else b'\n{"text": "after"}\n'))
        whole, _ = _read(path, stream=False)
        streamed, n = _read(path, stream=True)
        assert streamed == whole, name
        assert whole[1] == f"{path}:2: {reason}", name
        assert len(whole) == (2 if last else 3) and n == 0


def test_a_huge_text_field_appearing_twice_keeps_the_last(tmp_path, tiny):
    """json.loads keeps a duplicate key's last value; so does the streamed path (here both are long strings)."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "the first long value", "id": 1, "text": "the second long value"}\n')
    assert _read(path, stream=True) == ([(1, 1, "the second long value")], 1)


def test_a_template_source_reads_huge_lines_whole(tmp_path, tiny):
    """A template needs the whole record: such a source never streams."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"q": "a question that is long", "a": "an answer that is long too"}\n')
    assert _read(path, stream=True, template="{q} / {a}") == ([(1, 1, "a question that is long / an answer that is "
                                                                      "long too")], 0)


def _cut(text, rng):
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 2, 3, 17, 500, 5000])
        out.append(text[i:i + n])
        i += n
    return out


def test_encode_stream_cuts_where_encode_pieces_cuts(tmp_path, shared_data, gpt2_tokenizer):
    """Same ids for the text whole, in encode_pieces' pieces and streamed in pieces of any size (the trained
    byte-level BPE and GPT-2's tokenizer)."""
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:40_000]
    text += "  double  spaces, 1234 5678 ünïcödé wörds ✓\n\n\t tabs a b c d " + text[:3000]
    bpe = train_bpe_tokenizer(iter([text[:20_000]]), vocab_size=500, save_to=str(tmp_path / "t" / "tokenizer.json"))
    rng = random.Random(0)
    for tok in (bpe, load_tokenizer(gpt2_tokenizer)):
        whole = tok.encode_batch([text])[0]
        for piece_chars, at_once in ((7, 1), (100, 1), (4096, 1), (100, 3)):
            pieces = [p.tolist() for p in tok.encode_pieces(text, piece_chars=piece_chars, at_once=at_once)]
            streamed = [p.tolist() for p in tok.encode_stream(_cut(text, rng), piece_chars=piece_chars,
                                                              at_once=at_once)]
            assert streamed == pieces, (piece_chars, at_once)  # the same cuts
            assert np.concatenate(streamed).tolist() == whole
    no_space = "x" * 5000  # no safe cut: encoded whole, as encode_pieces does
    assert [len(p) for p in bpe.encode_stream(_cut(no_space, rng), piece_chars=100)] == [
        len(bpe.encode_batch([no_space])[0])]
    assert [p.tolist() for p in bpe.encode_stream(["ab", " ", "cd"], piece_chars=2)] == [
        p.tolist() for p in bpe.encode_pieces("ab cd", piece_chars=2)]


def test_prepare_output_is_byte_identical_with_and_without_streaming(tmp_path, monkeypatch):
    """A small corpus with two huge lines (plain and .jsonl.zst): prepared whole-line and streamed, every output
    file is the same bytes."""
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "délta", "😀", "x\ny", 'q"uote', "tab\t", "end."]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(60)]
    huge = [" ".join(rng.choice(words) for _ in range(3000)) for _ in range(2)]
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [json.dumps({"text": t}, ensure_ascii=i % 2 == 0) + "\n" for i, t in enumerate(docs[:30] + [huge[0]] + docs[30:])]
    (raw / "a.jsonl").write_text("".join(lines), encoding="utf-8")
    zlines = [json.dumps({"id": 1, "text": huge[1], "meta": "m" * 300}) + "\n"] + lines[:10]
    (raw / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(zlines).encode()))
    tok = train_bpe_tokenizer(iter(docs), vocab_size=300, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    monkeypatch.setattr(units, "PIECE_CHARS", 500)  # the huge documents are tokenized in pieces either way
    outs = []
    for name, line_bytes in (("whole", 1 << 30), ("streamed", 1000)):
        monkeypatch.setattr(jsonstream, "STREAM_LINE_BYTES", line_bytes)
        monkeypatch.setattr(jsonstream, "STREAM_CHUNK", 777)
        monkeypatch.setattr(jsonstream, "LONG_STRING_CHARS", 100)
        out = tmp_path / "out"  # the same directory name: config.yaml and manifests name it
        prep.prepare(PrepareConfig(sources=[SourceConfig(name="s", paths=[str(raw / "*")])],
                                   tokenizer=TokenizerConfig(path=tok.path), output_dir=str(out), seq_len=32,
                                   sequences_per_part=20, unit_bytes=4000, progress=False, workers=1))
        files = {}
        for root, _, names in os.walk(out):
            for f in names:
                if f == ".lock":  # the lock holder's process id
                    continue
                p = os.path.join(root, f)
                files[os.path.relpath(p, out)] = open(p, "rb").read()
        outs.append(files)
        os.rename(out, tmp_path / name)
        docs_read = list(iter_documents(SourceConfig(name="s", paths=[str(raw / "*")]), stream=True))
        assert sum(d.stream is not None for d in docs_read) == (0 if name == "whole" else 2)
    assert len(outs[0]) > 5 and outs[0].keys() == outs[1].keys()
    assert [k for k in outs[0] if outs[0][k] != outs[1][k]] == []
