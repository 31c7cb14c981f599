"""Prepare on Ray (jobs/prepare.py with workers > 1): the output directory equals the in-process one (N = 1) file
for file, also after a worker or the whole job is killed and rerun, or after a SIGTERM; bad input names file:line
and keeps the finished units."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

import curation.ingest.prepare as prep
from curation.ingest.tokenizer import train_bpe_tokenizer
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
from schemas.manifest import Manifest, UnitRecord
from tests import timing
from tests.conftest import load_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
JOB = os.path.join(REPO, "jobs", "prepare.py")
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources (four jsonl files, ~0.8 MB, and one small txt file), a tokenizer, the in-process output."""
    d = tmp_path_factory.mktemp("pool")
    rng = np.random.default_rng(0)
    (d / "raw").mkdir()
    for i in range(4):
        docs = [" ".join(rng.choice(WORDS, rng.integers(5, 200))) for _ in range(300)]
        (d / "raw" / f"web{i}.jsonl").write_text("".join(json.dumps({"text": t, "i": i}) + "\n" for t in docs))
    (d / "raw" / "val.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 50)) for _ in range(80)) + "\n")
    tok = train_bpe_tokenizer(iter(WORDS * 20), vocab_size=300, save_to=str(d / "tok" / "tokenizer.json"))
    base = PrepareConfig(
        sources=[SourceConfig(name="web", paths=[str(d / "raw" / "web*.jsonl")]),
                 SourceConfig(name="small", paths=[str(d / "raw" / "web0.jsonl")], max_documents=50)],
        validation=[SourceConfig(name="val", paths=[str(d / "raw" / "val.txt")])],
        tokenizer=TokenizerConfig(path=tok.path), output_dir=str(d / "one"), seq_len=64, sequences_per_part=48,
        unit_bytes=60_000, progress=False, workers=1,
    )
    reference = prep.prepare(base)
    assert reference.workers == 1 and Manifest.load(reference.dirs["candidates"]).extra["units"]["web"] >= 8
    return {"dir": d, "base": base, "reference": base.output_dir}


def _config(corpus, name: str, **updates) -> str:
    cfg = corpus["base"].model_copy(update={"output_dir": str(corpus["dir"] / name), "workers": 2, **updates})
    path = corpus["dir"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return str(path)


def _env() -> dict:
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONUNBUFFERED": "1"}


def _run(config: str, *extra: str) -> subprocess.CompletedProcess:
    return timing.run([sys.executable, JOB, "--config", config, *extra], capture_output=True, text=True,
                          timeout=600, env=_env())


_JOB = load_job("prepare", "_pool")


def _run_here(config: str, capfd) -> tuple[int, str, str]:  # noqa: ANN001 - pytest's capfd
    """``jobs/prepare.py``'s ``main`` in this test process, joining its Ray instance (fixture ``ray_local``; a rerun
    needs no new interpreter nor Ray start): (exit status, stdout, stderr)."""
    capfd.readouterr()
    rc = _JOB.main(["--config", config])
    out, err = capfd.readouterr()
    return rc, out, err


def _files(root: str) -> dict[str, bytes]:
    """Every file of an output directory but its lock and config record; manifests without the config
    (which names the output directory and the worker count)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if rel in (".lock", "config.yaml"):
                continue
            data = open(path, "rb").read()
            if name == "manifest.json":
                m = json.loads(data)
                m.pop("config")
                data = json.dumps(m, sort_keys=True).encode()
            elif name.startswith("unit-") and name.endswith(".json"):
                # a unit record's input fingerprints are [size, mtime_ns, hash]: size and mtime are the input file's
                # as the unit read it (a unit kept across an edit elsewhere in its file keeps those of that time;
                # an edited and restored input has a new mtime), not something the unit made; its hash is compared
                r = json.loads(data)
                for fp in r.get("inputs") or []:
                    fp[0] = fp[1] = None
                data = json.dumps(r, sort_keys=True).encode()
            out[rel] = data
    return out


def _assert_same_as_one_process(corpus, out: str) -> None:
    ours, theirs = _files(out), _files(corpus["reference"])
    assert sorted(ours) == sorted(theirs)
    assert [k for k in ours if ours[k] != theirs[k]] == []


def _session_tasks(sid: int) -> list[int]:
    """PIDs of the session's Ray workers running a work unit (their title is ``ray::run_unit``)."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                session = int(f.read().rsplit(")", 1)[1].split()[3])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0]
        except (OSError, ValueError, IndexError):
            continue
        if session == sid and title.startswith(b"ray::run_unit"):
            pids.append(int(entry))
    return pids


def _records(out: str) -> dict[str, UnitRecord]:
    found = {}
    for folder, _, names in os.walk(out):
        for name in names:
            if name.startswith("unit-") and name.endswith(".json"):
                found[os.path.join(folder, name)] = UnitRecord.load(os.path.join(folder, name))
    return found


def _wait(proc, until, what: str, timeout: float = 300) -> None:
    deadline = timing.Deadline(timeout)
    while proc.poll() is None and not deadline.expired():
        if until():
            return
        time.sleep(0.02)
    raise AssertionError(f"the job ended (or {timeout:.0f}s passed) before {what}")


def test_two_ray_workers_write_what_one_process_writes(corpus):
    proc = _run(_config(corpus, "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(2 workers)" in proc.stdout
    _assert_same_as_one_process(corpus, str(corpus["dir"] / "two"))


def test_killed_workers_resume_their_units_and_the_output_is_the_same(corpus, session_killer):
    """SIGKILL of the processes running units mid-way: Ray runs those tasks again, each resumes its unit from the
    record (finished parts kept, not rewritten), and the output equals one process's."""
    out = str(corpus["dir"] / "killed_workers")
    proc = subprocess.Popen([sys.executable, JOB, "--config", _config(corpus, "killed_workers")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    try:
        before: dict = {}
        stamps: dict = {}
        killed: list[int] = []

        def kill_a_unit_in_progress() -> bool:
            """Once a unit has a finished part, SIGKILL the unit tasks running at that moment (the parts finished
            before, and their times, read first). Their pids are the ones found in the same look: a unit may end
            between two looks, which left the test nothing to kill."""
            records = _records(out)
            if not any(r.parts and not r.done for r in records.values()):
                return False
            pids = _session_tasks(proc.pid)
            if not pids:
                return False
            before.update((path, r) for path, r in records.items() if r.parts)
            stamps.update((part, os.stat(part).st_mtime_ns) for part in (
                os.path.join(os.path.dirname(os.path.dirname(path)), p.name) for path, r in before.items()
                for p in r.parts if p.samples))
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.extend(pids)
            return True

        _wait(proc, kill_a_unit_in_progress, "a unit had a finished part")
        stdout, stderr = timing.communicate(proc, timeout=600)
    finally:
        session_killer(proc.pid)
    assert killed and proc.returncode == 0, stderr[-3000:]
    _assert_same_as_one_process(corpus, out)
    after = _records(out)
    for path, record in before.items():  # every part finished before the kill is still the first one written
        assert after[path].parts[:len(record.parts)] == record.parts
    assert all(os.stat(part).st_mtime_ns == t for part, t in stamps.items())


def test_a_killed_job_resumes_without_redoing_finished_units(corpus, session_killer, ray_local, capfd):
    out = str(corpus["dir"] / "killed_job")
    cfg = _config(corpus, "killed_job")
    proc = subprocess.Popen([sys.executable, JOB, "--config", cfg], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_env(), start_new_session=True)
    _wait(proc, lambda: sum(r.done for r in _records(out).values()) >= 2, "two units were done")
    session_killer(proc.pid)  # the driver, its local Ray instance and the workers
    timing.wait(proc, timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the job ended before it could be killed"
    done = {path: r for path, r in _records(out).items() if r.done}
    stamps = {path: os.stat(path).st_mtime_ns for path in done}
    rc, _, stderr = _run_here(cfg, capfd)  # the rerun in this process
    assert rc == 0, stderr[-3000:]
    assert all(os.stat(path).st_mtime_ns == t for path, t in stamps.items())  # a done unit is never run again
    _assert_same_as_one_process(corpus, out)


def test_sigterm_lets_the_units_in_progress_finish_and_a_rerun_completes_the_same_output(corpus, session_killer,
                                                                                        ray_local, capfd):
    out = str(corpus["dir"] / "sigterm")
    cfg = _config(corpus, "sigterm")
    proc = subprocess.Popen([sys.executable, JOB, "--config", cfg], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    try:
        _wait(proc, lambda: any(r.parts for r in _records(out).values()), "a part was finished")
        proc.send_signal(signal.SIGTERM)  # the driver only, as a scheduler preempting the job
        _, stderr = timing.communicate(proc, timeout=300)
    finally:
        session_killer(proc.pid)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "SIGTERM received: finishing the work units in progress (up to 30s), then stopping" in stderr
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"stopped on SIGTERM after the work units in progress finished \([12]\); rerun the same "
                        r"command to resume from the next part \(finished parts are kept\)", last), last
    stopped = Manifest.load(os.path.join(out, "candidates"))
    records = _records(os.path.join(out, "candidates"))
    assert not stopped.complete and sorted(s.name for s in stopped.shards) == sorted(
        p.name for r in records.values() for p in r.parts)
    assert all(r.done for r in records.values())  # the units in progress finished: none is half done
    rc, _, stderr = _run_here(cfg, capfd)  # the rerun in this process
    assert rc == 0, stderr[-3000:]
    _assert_same_as_one_process(corpus, out)


def test_bad_input_names_file_and_line_and_a_rerun_after_the_fix_completes(corpus, ray_local, capfd):
    """(Both runs in this process, joining its Ray instance.)"""
    path = corpus["dir"] / "raw" / "web2.jsonl"
    good = path.read_text()
    lines = good.splitlines(keepends=True)
    lines[200] = '{"text": "fine"\n'
    out = str(corpus["dir"] / "bad")
    cfg = _config(corpus, "bad")
    try:
        path.write_text("".join(lines))
        rc, _, stderr = _run_here(cfg, capfd)
    finally:
        path.write_text(good)
    assert rc == 1
    assert f"error: {path}:201: malformed JSON" in stderr, stderr[-3000:]
    kept = {p: r for p, r in _records(out).items() if r.done}
    assert kept and not Manifest.load(os.path.join(out, "candidates")).complete
    stamps = {p: os.stat(p).st_mtime_ns for p in kept}
    rc, _, stderr = _run_here(cfg, capfd)
    assert rc == 0, stderr[-3000:]
    # the fix moved the cuts after it: those units were prepared again, the ones before it were kept
    after = _records(out)
    same = [p for p in kept if after[p].spans == kept[p].spans]
    assert same and all(os.stat(p).st_mtime_ns == stamps[p] for p in same)
    _assert_same_as_one_process(corpus, out)
