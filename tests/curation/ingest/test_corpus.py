"""Input formats and every bad-input case with its message (file and line)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from curation.ingest.corpus import BadRecordError, Document, iter_documents, resolve_paths
from schemas.config import SourceConfig


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _docs(source, **kw):
    return list(iter_documents(source, **kw))


def test_jsonl_text_field_and_positions(tmp_path):
    p = _jsonl(tmp_path / "a.jsonl", [{"body": "one"}, {"body": "two"}])
    docs = _docs(SourceConfig(name="s", paths=[p], text_field="body"))
    assert [(d.text, d.line, d.next_record) for d in docs] == [("one", 1, 1), ("two", 2, 2)]


def test_template_joins_fields(tmp_path):
    p = _jsonl(tmp_path / "qa.jsonl", [{"question": "Q?", "answer": "A."}])
    (doc,) = _docs(SourceConfig(name="s", paths=[p], template="{question}\n{answer}"))
    assert doc.text == "Q?\nA."


def test_jsonl_zst_streamed(tmp_path):
    raw = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(1000)).encode()
    p = tmp_path / "c.jsonl.zst"
    p.write_bytes(zstandard.ZstdCompressor().compress(raw))
    docs = _docs(SourceConfig(name="s", paths=[str(p)]))
    assert len(docs) == 1000 and docs[-1].text == "doc 999" and docs[-1].line == 1000


def test_parquet_with_configurable_column(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["alpha", "beta", "gamma"], "id": [1, 2, 3]}), p)
    docs = _docs(SourceConfig(name="s", paths=[str(p)], text_field="content"))
    assert [d.text for d in docs] == ["alpha", "beta", "gamma"]
    assert [d.line for d in docs] == [1, 2, 3]
    resumed = _docs(SourceConfig(name="s", paths=[str(p)], text_field="content"), start_record=2)
    assert [d.text for d in resumed] == ["gamma"]


def test_txt_split_modes(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("para one\nstill one\n\npara two\n\n\nthree\n", encoding="utf-8")
    blank = _docs(SourceConfig(name="s", paths=[str(p)]))
    assert [d.text for d in blank] == ["para one\nstill one", "para two", "three"]
    assert [d.line for d in blank] == [1, 4, 7]
    lines = _docs(SourceConfig(name="s", paths=[str(p)], txt_split="line"))
    assert [d.text for d in lines] == ["para one", "still one", "para two", "three"]
    whole = _docs(SourceConfig(name="s", paths=[str(p)], txt_split="file"))
    assert len(whole) == 1 and whole[0].text.startswith("para one")


def test_globs_sorted_and_resume_position(tmp_path):
    for name in ("b", "a", "c"):
        _jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name}{i}"} for i in range(3)])
    src = SourceConfig(name="s", paths=[str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl")])
    assert [p.rsplit("/", 1)[1] for p in resolve_paths(src)] == ["a.jsonl", "b.jsonl", "c.jsonl"]
    all_docs = _docs(src)
    assert [d.text for d in all_docs][:4] == ["a0", "a1", "a2", "b0"]
    d = all_docs[4]  # b1
    rest = _docs(src, start_file=d.file_index, start_record=d.next_record)
    assert [x.text for x in rest] == [x.text for x in all_docs[5:]]


@pytest.mark.parametrize(
    "content,line,reason",
    [
        (b'{"text": "ok"}\n{"text": "bad\n', 2, r"malformed JSON \(Invalid control character at column 14\)$"),
        (b'{"text": "ok"}\n{"text": "bad', 2, r"malformed JSON \(Unterminated string starting at column 10\)$"),
        (b'{"text": "ok" "x"}\n', 1, r"malformed JSON \(Expecting ',' delimiter at column 15\)$"),
        (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 2, r"not valid UTF-8 \(byte 0xe9 at column 14\)"),
        (b'{"text": "ok"}\n{"body": "x"}\n', 2, r"missing text field 'text' \(fields present: body\)"),
        (b'{"text": "ok"}\n{"text": "   "}\n', 2, r"empty document"),
        (b'{"text": "ok"}\n[1, 2]\n', 2, r"expected a JSON object, got list"),
        (b'{"text": 5}\n', 1, r"field 'text' is int, expected a string"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, content, line, reason):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(content)
    bad = [x for x in _docs(SourceConfig(name="s", paths=[str(p)])) if isinstance(x, BadRecordError)]
    assert len(bad) == 1
    assert bad[0].line == line
    assert f"{p}:{line}: " in str(bad[0])
    import re

    assert re.search(reason, str(bad[0]))


def test_empty_file_and_unreadable_path(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    (err,) = _docs(SourceConfig(name="s", paths=[str(empty)]))
    assert isinstance(err, BadRecordError) and str(err) == f"{empty}: file is empty"
    with pytest.raises(BadRecordError, match=r"nope\.jsonl: no such file \(source 's'\)"):
        resolve_paths(SourceConfig(name="s", paths=[str(tmp_path / "nope.jsonl")]))
    with pytest.raises(BadRecordError, match=r"no file matches this pattern"):
        resolve_paths(SourceConfig(name="s", paths=[str(tmp_path / "*.parquet")]))
    locked = tmp_path / "locked.jsonl"
    locked.write_text('{"text": "x"}\n')
    locked.chmod(0)
    try:
        out = _docs(SourceConfig(name="s", paths=[str(locked)]))
        import os

        if os.geteuid() != 0:  # root can read anything; the message path is still exercised below
            assert isinstance(out[0], BadRecordError) and "cannot open" in str(out[0])
    finally:
        locked.chmod(0o644)


def test_skip_missing_resolves_what_is_left_and_still_refuses_a_directory(tmp_path):
    """``skip_missing`` (a finished prepare's unit records checked after an input was deleted): a path that is gone
    and a glob that matches nothing add no file instead of raising; a directory is still refused."""
    for name in ("a", "b"):
        _jsonl(tmp_path / f"{name}.jsonl", [{"text": name}])
    paths = [str(tmp_path / "a.jsonl"), str(tmp_path / "gone.jsonl"), str(tmp_path / "*.parquet"),
             str(tmp_path / "b*.jsonl")]
    src = SourceConfig(name="s", paths=paths)
    with pytest.raises(BadRecordError, match=r"gone\.jsonl: no such file \(source 's'\)"):
        resolve_paths(src)
    assert resolve_paths(src, skip_missing=True) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert resolve_paths(src.model_copy(update={"paths": paths[1:3]}), skip_missing=True) == []
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(BadRecordError, match="is a directory"):
        resolve_paths(src.model_copy(update={"paths": [str(tmp_path / "dir.jsonl")]}), skip_missing=True)


def test_unreadable_directory_entry(tmp_path):
    d = tmp_path / "dir.jsonl"
    d.mkdir()
    with pytest.raises(BadRecordError, match="is a directory"):
        resolve_paths(SourceConfig(name="s", paths=[str(d)]))


def test_txt_non_utf8_line(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"fine\n\nbad \xff here\n")
    items = _docs(SourceConfig(name="s", paths=[str(p)]))
    assert isinstance(items[0], Document) and items[0].text == "fine"
    assert isinstance(items[1], BadRecordError) and items[1].line == 3 and "not valid UTF-8 (byte 0xff" in str(items[1])


def _zst_blocks(tmp_path, blocks=5, per_block=400):
    """A single-frame .jsonl.zst of ``blocks`` flushed blocks; returns (rows, frame bytes, block ends)."""
    rows = [json.dumps({"text": f"doc {i} " + "word " * 20}) + "\n" for i in range(blocks * per_block)]
    cobj = zstandard.ZstdCompressor().compressobj()
    frame, ends = b"", []
    for b in range(blocks):
        frame += cobj.compress("".join(rows[b * per_block:(b + 1) * per_block]).encode())
        frame += cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        ends.append(len(frame))
    frame += cobj.flush()
    return rows, frame, ends


def test_truncated_zst_is_an_error_naming_the_file(tmp_path):
    """A file cut at a block boundary used to read as a shorter valid file (1,200 of 2,000 documents, no
    error); a file cut in its first block read as 'file is empty'."""
    rows, frame, ends = _zst_blocks(tmp_path)
    p = tmp_path / "c.jsonl.zst"
    p.write_bytes(frame)
    assert [d.text for d in _docs(SourceConfig(name="s", paths=[str(p)]))] == [json.loads(r)["text"] for r in rows]
    for cut, complete in ((ends[2], 1200), (ends[2] + 7, 1200), (ends[0] - 5, 0), (9, 0)):
        p.write_bytes(frame[:cut])
        items = _docs(SourceConfig(name="s", paths=[str(p)]))
        assert all(isinstance(d, Document) for d in items[:-1]) and len(items) - 1 >= complete
        err = items[-1]
        assert isinstance(err, BadRecordError) and err.file == str(p) and err.line == len(items)
        assert "truncated zstd file: the data ends inside a zstd frame" in str(err), cut
    # two whole frames back to back are still one valid file
    p.write_bytes(frame + frame)
    assert len(_docs(SourceConfig(name="s", paths=[str(p)]))) == 2 * len(rows)


def test_a_pre_tokenized_format_is_not_read_as_text(tmp_path):
    (tmp_path / "x.arrow").write_bytes(b"ARROW1")
    items = _docs(SourceConfig(name="s", paths=[str(tmp_path / "x.arrow")], format="arrow"))
    assert [str(e) for e in items] == [f"{tmp_path}/x.arrow: format 'arrow' holds token ids, not text (source 's')"]


# ------------------------------------------------------------------------------------------------
# text no tokenizer can take: a bad record naming file:line in every text format (issue 55, P25)
# ------------------------------------------------------------------------------------------------
SURROGATE = "the text holds the lone surrogate \\ud800 (character 6), which is not Unicode text: no tokenizer can encode it"


def test_a_lone_surrogate_is_a_bad_record_in_jsonl_and_in_a_template(tmp_path):
    p = tmp_path / "s.jsonl"  # valid JSON (an escaped lone surrogate, common in scraped dumps)
    p.write_text('{"text": "fine"}\n{"text": "lone \\ud800 surrogate", "q": "a", "a": "b \\udfff"}\n'
                 '{"text": "pair \\ud83d\\ude00 is fine"}\n')
    items = _docs(SourceConfig(name="s", paths=[str(p)]))
    assert [d.text for d in items if isinstance(d, Document)] == ["fine", "pair \U0001F600 is fine"]
    assert str(items[1]) == f"{p}:2: {SURROGATE}"
    t = _docs(SourceConfig(name="s", paths=[str(p)], template="{q}: {a}"), )
    assert [str(x) for x in t if isinstance(x, BadRecordError)] == [
        f"{p}:1: missing field 'q' used by the template (fields present: text)",
        f"{p}:2: the text holds the lone surrogate \\udfff (character 6), which is not Unicode text: no tokenizer can "
        "encode it",
        f"{p}:3: missing field 'q' used by the template (fields present: text)"]


def test_text_that_is_not_utf8_is_a_bad_record_in_parquet_and_txt(tmp_path):
    """A parquet string column holding bytes that are not UTF-8 (a writer that did not check: pyarrow reads them with
    a UnicodeDecodeError), and a .txt holding a surrogate's CESU-8 bytes, name the row / line."""
    raw = pa.array([b"ok text", b"lone \xed\xa0\x80 x", b"also fine"], type=pa.binary())
    column = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # unchecked bytes in a string column
    pq.write_table(pa.table({"text": column}), tmp_path / "p.parquet")
    items = _docs(SourceConfig(name="s", paths=[str(tmp_path / "p.parquet")]))
    assert [d.text for d in items if isinstance(d, Document)] == ["ok text", "also fine"]
    assert str(items[1]) == f"{tmp_path / 'p.parquet'}:2: not valid UTF-8 (byte 0xed at column 6)"
    (tmp_path / "t.txt").write_bytes(b"one\n\nlone \xed\xa0\x80 x\n\ntwo\nbad \xff\n\nthree\n")
    items = _docs(SourceConfig(name="s", paths=[str(tmp_path / "t.txt")]))
    assert [d.text if isinstance(d, Document) else str(d) for d in items] == [
        "one", f"{tmp_path / 't.txt'}:3: not valid UTF-8 (byte 0xed at column 6)",
        f"{tmp_path / 't.txt'}:6: not valid UTF-8 (byte 0xff at column 5)", "three"]  # every bad line, on its own


# ------------------------------------------------------------------------------------------------
# inputs that are no regular files, and read errors (issue 55: P26, P27)
# ------------------------------------------------------------------------------------------------
def test_a_fifo_or_a_device_among_the_inputs_is_refused_up_front(tmp_path):
    """P26: a FIFO among the inputs hung prepare for ever (open waits for a writer)."""
    import os

    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    for paths, bad in (([str(tmp_path / "pipe.jsonl")], tmp_path / "pipe.jsonl"),
                       ([str(tmp_path / "*.jsonl")], tmp_path / "pipe.jsonl"),  # a glob matching it too
                       (["/dev/zero"], "/dev/zero")):
        kind = "a device" if str(bad).startswith("/dev") else "a FIFO (named pipe)"
        with pytest.raises(BadRecordError) as e:
            resolve_paths(SourceConfig(name="s", paths=paths))
        assert str(e.value) == f"{bad}: is {kind}, not a regular file: inputs are read as files, more than once " \
                               "(source 's')"


def test_a_stop_signal_ends_a_wait_for_input_at_once(tmp_path):
    """P26: inside GracefulStop, the first SIGTERM was swallowed while open() waited on a FIFO (the handler returns,
    Python retries the call). A FIFO that appears after the check (read as the given file list): the signal stops
    the wait."""
    import os
    import signal
    import threading

    from curation.io.stop import GracefulStop, StopRequested

    fifo = tmp_path / "late.jsonl"
    os.mkfifo(fifo)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    with GracefulStop(), pytest.raises(StopRequested) as e:
        list(iter_documents(SourceConfig(name="s", paths=[str(fifo)]), files=[str(fifo)]))
    timer.join()
    assert str(e.value) == f"stopped on SIGTERM while opening {fifo}"


def test_a_read_error_names_the_input(tmp_path):
    """P27: an input that fails on read (EIO) was reported as `preparing into <out> failed: Input/output error`.
    /proc/self/mem is a regular file whose read at offset 0 fails with EIO."""
    import errno

    with pytest.raises(OSError) as e:
        _docs(SourceConfig(name="s", paths=["/proc/self/mem"], format="jsonl"))
    assert e.value.errno == errno.EIO and e.value.filename == "/proc/self/mem"
