"""A property of ``prepare`` (issue 55): for random corpora, stopped anywhere and rerun, the output is exactly right.

Random corpora mix empty, short, piece-sized and over-threshold documents and texts no tokenizer can take, in
``.jsonl``, ``.jsonl.zst``, ``.parquet`` and ``.txt`` files, cut into work units of random sizes (so every kind of
document is first, inside and last in a unit, and parts end inside documents). The thresholds are lowered so that
this stays small: a text over 40 characters is tokenized in pieces, a ``.jsonl`` line over 200 bytes is streamed. A
preparation is stopped at random points (a SIGTERM, or a kill before, inside or after a part's write), then rerun
until it finishes. Asserted, against an oracle of this file's own (it reads each unit's spans itself and encodes
every good text whole): every run ends normally, each unit's shards hold exactly the direct encoding of its good
documents, each followed by EOS, packed (its remainder dropped), the bad ones are counted, and the stopped and rerun
output equals the uninterrupted one byte for byte.

Size: README's test command runs a fixed set of examples (about a minute); ``--all`` runs more, new ones each time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import curation.ingest.jsonstream as jsonstream
import curation.ingest.prepare as prep
import curation.ingest.units as units
from curation.ingest.tokenizer import train_bpe_tokenizer
from curation.io.shards import read_column
from curation.io.stop import GracefulStop, StopRequested
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
from tests import timing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: The lowered thresholds (module constants of the code under test), here and in the job processes.
THRESHOLDS = {(units, "PIECE_CHARS"): 40, (jsonstream, "STREAM_LINE_BYTES"): 200, (jsonstream, "STREAM_CHUNK"): 7,
              (jsonstream, "LONG_STRING_CHARS"): 16}
SEQ_LEN = 16
WORDS = ["alpha", "beta", "gamma", "délta", "über", "x", "end.", "twelve", "ünïcödé", "w😀rd", "12", "tab\tbed"]
FORMATS = ("jsonl", "jsonl.zst", "parquet", "txt")
# A bad document: "empty" (blank text; in a .txt, more blank lines: no record at all), "surrogate" (a lone
# surrogate: valid JSON, but no text; in a .txt, its bytes as CESU-8, which is not UTF-8; parquet cannot hold it).
KINDS = ("empty", "surrogate", "short", "piece", "long")


def _examples(request, fast: int, more: int) -> dict:
    """Hypothesis settings: ``fast`` fixed examples in README's command, ``more`` random ones under ``--all``."""
    full = request.config.getoption("--all")
    return dict(max_examples=more if full else fast, derandomize=not full, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(200)]
    return train_bpe_tokenizer(iter(texts), vocab_size=300, save_to=str(path))


# ------------------------------------------------------------------------------------------------
# corpora
# ------------------------------------------------------------------------------------------------
def _text(kind: str, n: int) -> str:
    if kind == "empty":
        return " \t " if n % 2 else ""
    if kind == "surrogate":
        return f"{WORDS[n % len(WORDS)]} lone \ud800 half {WORDS[(n + 3) % len(WORDS)]}"
    size = {"short": 1 + n % 6, "piece": 6 + n % 5, "long": 40 + n * 3}[kind]  # words: ~10, ~40, 200+ characters
    return " ".join(WORDS[(n * 5 + 3 * i + i * i) % len(WORDS)] for i in range(size))


@st.composite
def corpora(draw, max_files: int = 3, max_docs: int = 9) -> list[tuple[str, list[tuple[str, str]]]]:
    """Files: (format, [(kind, text)]); parquet holds no lone surrogate (pyarrow refuses to write one)."""
    files = []
    for f in range(draw(st.integers(1, max_files))):
        fmt = draw(st.sampled_from(FORMATS))
        kinds = KINDS if fmt != "parquet" else tuple(k for k in KINDS if k != "surrogate")
        docs = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=max_docs))
        seeds = draw(st.lists(st.integers(0, 50), min_size=len(docs), max_size=len(docs)))
        files.append((fmt, [(k, _text(k, s + 13 * f)) for k, s in zip(docs, seeds, strict=True)]))
    # one long document somewhere: at least one sequence comes out (else prepare refuses the corpus, rightly)
    fmt, docs = files[draw(st.integers(0, len(files) - 1))]
    docs.insert(draw(st.integers(0, len(docs))), ("long", _text("long", draw(st.integers(0, 50)))))
    return files


def _write(root: str, files) -> list[str]:
    """Write the corpus; the paths in order (file names sort as written)."""
    os.makedirs(root, exist_ok=True)
    paths = []
    for i, (fmt, docs) in enumerate(files):
        path = os.path.join(root, f"f{i}.{fmt}")
        if fmt in ("jsonl", "jsonl.zst"):
            data = "".join(json.dumps({"id": j, "text": t}, ensure_ascii=j % 2 == 0) + "\n"
                           for j, (_, t) in enumerate(docs)).encode("utf-8", "surrogatepass")
            with open(path, "wb") as f:
                f.write(zstandard.ZstdCompressor().compress(data) if fmt == "jsonl.zst" else data)
        elif fmt == "parquet":
            pq.write_table(pa.table({"text": [t for _, t in docs]}), path, row_group_size=2)
        else:  # paragraphs between blank lines; an empty document is only blank lines
            with open(path, "wb") as f:
                for _, t in docs:
                    f.write(t.encode("utf-8", "surrogatepass") + b"\n\n")
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------
# the oracle: each unit's documents read from its spans by this file's own code, encoded whole
# ------------------------------------------------------------------------------------------------
def _span_texts(path: str, start: int, stop: int | None, files) -> list[str | None]:
    """The texts of a unit's span, as this test wrote them (None: a bad document)."""
    fmt, docs = files[int(os.path.basename(path)[1:].split(".")[0])]
    if fmt == "jsonl":  # the lines whose first byte is in [start, stop)
        raw = open(path, "rb").read()
        offsets = np.cumsum([0] + [len(x) for x in raw.splitlines(keepends=True)])[:-1]
        chosen = [j for j, o in enumerate(offsets) if start <= o < (len(raw) if stop is None else stop)]
    elif fmt == "parquet":  # the rows of row groups [start, stop) (2 rows each)
        chosen = [j for j in range(len(docs)) if start <= j // 2 < (10**9 if stop is None else stop)]
    else:
        assert (start, stop) == (0, None)
        chosen = [j for j, (kind, _) in enumerate(docs) if not (fmt == "txt" and kind == "empty")]
        if not chosen:  # a .txt of blank lines only: one bad record, "file is empty"
            return [None]
    return [None if docs[j][0] in ("empty", "surrogate") else docs[j][1] for j in chosen]


def _check_against_oracle(out: str, files, tok) -> None:
    cand = os.path.join(out, "candidates")
    records = sorted(f for f in os.listdir(os.path.join(cand, "s")) if f.startswith("unit-"))
    seen_good = seen_bad = 0
    for name in records:
        rec = json.load(open(os.path.join(cand, "s", name)))
        texts = [t for path, a, b in rec["spans"] for t in _span_texts(path, a, b, files)]
        good = [t for t in texts if t is not None]
        stream = [i for t in good for i in tok.tokenizer.encode(t, add_special_tokens=False).ids + [tok.eos_id]]
        n = len(stream) // SEQ_LEN
        want = sorted(map(tuple, np.asarray(stream[:n * SEQ_LEN]).reshape(n, SEQ_LEN).tolist()))
        got = sorted(tuple(np.asarray(r).tolist()) for p in rec["parts"] if p["samples"]
                     for r in read_column(os.path.join(cand, p["name"]), "tokens"))
        assert got == want, f"unit {name}: {len(got)} sequences, expected {len(want)}"
        c = rec["counts"]
        assert (c["documents"], c["bad_records"], c["dropped_tokens"]) == (len(good), len(texts) - len(good),
                                                                           len(stream) - n * SEQ_LEN), name
        seen_good, seen_bad = seen_good + len(good), seen_bad + len(texts) - len(good)
    good = sum(kind not in ("empty", "surrogate") for _, docs in files for kind, _ in docs)
    bad = sum(kind == "surrogate" or (kind == "empty" and fmt != "txt") for fmt, docs in files for kind, _ in docs)
    bad += sum(fmt == "txt" and all(kind == "empty" for kind, _ in docs) for fmt, docs in files)  # "file is empty"
    assert (seen_good, seen_bad) == (good, bad)


def _tree(out: str) -> dict[str, bytes]:
    """Every file of an output directory (its lock left out), its own path written as ``<out>``."""
    files = {}
    for d, _, names in os.walk(out):
        for n in names:
            if n != ".lock":
                p = os.path.join(d, n)
                files[os.path.relpath(p, out)] = open(p, "rb").read().replace(out.encode(), b"<out>")
    return files


def _config(root: str, out: str, tok, unit_bytes: int, per_part: int) -> PrepareConfig:
    return PrepareConfig(sources=[SourceConfig(name="s", paths=[os.path.join(root, "f*")])],
                         tokenizer=TokenizerConfig(path=tok.path), output_dir=out, seq_len=SEQ_LEN,
                         sequences_per_part=per_part, unit_bytes=unit_bytes, skip_bad_records=True, progress=False,
                         workers=1)


# ------------------------------------------------------------------------------------------------
# stops in this process: a real SIGTERM to itself, or a "kill" (an exception nothing catches) before, inside or
# after the write of the n-th part
# ------------------------------------------------------------------------------------------------
class _Killed(BaseException):  # noqa: N818 (a BaseException, like a kill: no handler of the code under test sees it)
    pass


STOPS = ("sigterm", "kill_before_part", "kill_inside_part", "kill_after_part")


def _stopped_run(cfg: PrepareConfig, at: int, how: str, mp: pytest.MonkeyPatch) -> bool:
    """Prepare, stopped at the ``at``-th part write in the way ``how``; False when it finished before."""
    real, calls = units.write_part, {"n": 0}

    def write_part(part_dir, spec, samples, **kw):
        calls["n"] += 1
        if calls["n"] != at:
            return real(part_dir, spec, samples, **kw)
        if how == "sigterm":  # handled between bytecodes: the part is finished, then the unit stops
            signal.raise_signal(signal.SIGTERM)
        elif how == "kill_before_part":
            raise _Killed()
        elif how == "kill_inside_part":  # a shard half written in the part's .tmp directory
            def dying(rows):
                for i, row in enumerate(rows):
                    if i == 1:
                        raise _Killed()
                    yield row
            samples = dying(samples)
        n = real(part_dir, spec, samples, **kw)
        if how == "kill_after_part":  # the part is written, its unit's record does not list it
            raise _Killed()
        return n

    mp.setattr(units, "write_part", write_part)
    try:
        with GracefulStop():
            prep.prepare(cfg)
        return False
    except (_Killed, StopRequested):
        return True
    finally:
        mp.setattr(units, "write_part", real)


def test_prepare_stopped_anywhere_and_rerun_gives_the_direct_encoding_byte_for_byte(request, tmp_path, tokenizer):
    assert threading.current_thread() is threading.main_thread()  # the SIGTERM is handled by GracefulStop here

    @settings(**_examples(request, fast=25, more=100))
    @given(files=corpora(), unit_bytes=st.sampled_from([1, 60, 150, 400, 1 << 20]), per_part=st.integers(1, 4),
           stops=st.lists(st.tuples(st.integers(1, 12), st.sampled_from(STOPS)), min_size=1, max_size=3))
    # found by CI: a .txt whose every non-blank line is bad was one bad record ("file is empty"), not one per line
    @example(files=[("jsonl", [("long", "alpha über 12 end. über über end. 12 über alpha 12 12 " * 3 + "alpha über 12 end."),
                               ("empty", "")]),
                    ("txt", [("surrogate", "beta lone \ud800 half über"), ("surrogate", "beta lone \ud800 half über")])],
             unit_bytes=1, per_part=1, stops=[(1, "sigterm")])
    def check(files, unit_bytes, per_part, stops):
        root = tempfile.mkdtemp(dir=tmp_path)
        try:
            with pytest.MonkeyPatch.context() as mp:
                for (module, name), value in THRESHOLDS.items():
                    mp.setattr(module, name, value)
                _write(os.path.join(root, "raw"), files)
                clean = os.path.join(root, "clean", "out")
                prep.prepare(_config(os.path.join(root, "raw"), clean, tokenizer, unit_bytes, per_part))
                _check_against_oracle(clean, files, tokenizer)
                cfg = _config(os.path.join(root, "raw"), os.path.join(root, "stopped", "out"), tokenizer, unit_bytes,
                              per_part)
                for at, how in stops:
                    _stopped_run(cfg, at, how, mp)
                prep.prepare(cfg)  # the rerun that finishes
                assert _tree(cfg.output_dir) == _tree(clean)
        finally:
            shutil.rmtree(root)

    check()


# ------------------------------------------------------------------------------------------------
# the job itself: jobs/prepare.py in a process of its own, sent SIGTERM or SIGKILL, then run again
# ------------------------------------------------------------------------------------------------
_JOB = """
import runpy, sys, time
sys.path.insert(0, {repo!r})
import curation.ingest.jsonstream as jsonstream, curation.ingest.units as units
for name, value in {thresholds!r}.items():
    setattr(units if name == "PIECE_CHARS" else jsonstream, name, value)
real = units.write_part
def slow(*a, **k):  # a part takes a while: the signal lands mid-run
    time.sleep({delay})
    return real(*a, **k)
units.write_part = slow
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def _job(config: str, delay: float) -> list[str]:
    code = _JOB.format(repo=REPO, thresholds={name: v for (_, name), v in THRESHOLDS.items()}, delay=delay,
                       script=os.path.join(REPO, "jobs", "prepare.py"))
    return [sys.executable, "-c", code, "--config", config]


def test_the_job_killed_or_stopped_anywhere_and_rerun_gives_the_same_output(request, tmp_path, tokenizer):
    @settings(**_examples(request, fast=2, more=5))
    @given(files=corpora(max_files=2, max_docs=6), unit_bytes=st.sampled_from([60, 400]),
           parts=st.integers(1, 6), how=st.sampled_from([signal.SIGTERM, signal.SIGKILL]))
    def check(files, unit_bytes, parts, how):
        root = tempfile.mkdtemp(dir=tmp_path)
        try:
            raw = os.path.join(root, "raw")
            _write(raw, files)
            with pytest.MonkeyPatch.context() as mp:
                for (module, name), value in THRESHOLDS.items():
                    mp.setattr(module, name, value)
                clean = os.path.join(root, "clean", "out")
                prep.prepare(_config(raw, clean, tokenizer, unit_bytes, 2))
            cfg = _config(raw, os.path.join(root, "job", "out"), tokenizer, unit_bytes, 2)
            config = os.path.join(root, "job.json")  # YAML's superset
            with open(config, "w") as f:
                json.dump(cfg.model_dump(mode="json"), f)
            proc = subprocess.Popen(_job(config, 0.1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            folder = os.path.join(cfg.output_dir, "candidates", "s")
            deadline = timing.Deadline(120)
            while proc.poll() is None and not deadline.expired() and len(
                    [p for p in (os.listdir(folder) if os.path.isdir(folder) else []) if p.startswith("part-")
                     and not p.endswith(".tmp")]) < parts:
                time.sleep(0.005)
            if proc.poll() is None:
                proc.send_signal(how)
            _, err = timing.communicate(proc, timeout=120)
            assert proc.returncode in (0, -signal.SIGKILL, 128 + signal.SIGTERM), err
            assert "Traceback" not in err
            done = timing.run(_job(config, 0.0), capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            assert _tree(cfg.output_dir) == _tree(clean)
        finally:
            shutil.rmtree(root)

    check()


def test_the_oracle_sees_a_wrong_output(tmp_path, tokenizer):
    """The oracle fails on an output that lost a document's EOS (so the property above can fail)."""
    files = [("jsonl", [("short", _text("short", 1)), ("long", _text("long", 2))])]
    root = str(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        for (module, name), value in THRESHOLDS.items():
            mp.setattr(module, name, value)
        _write(os.path.join(root, "raw"), files)
        out = os.path.join(root, "out")
        real = units._UnitPacker.add

        def no_eos(self, doc):
            doc.eos = False
            return real(self, doc)

        mp.setattr(units._UnitPacker, "add", no_eos)
        prep.prepare(_config(os.path.join(root, "raw"), out, tokenizer, 1 << 20, 2))
    with pytest.raises(AssertionError):
        _check_against_oracle(out, files, tokenizer)

