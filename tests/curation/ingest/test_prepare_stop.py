"""`jobs/prepare.py` sent SIGTERM mid-run: it finishes the part in progress, stops with a line saying where a
rerun resumes, and the rerun's output equals an uninterrupted run's; a second signal stops it at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

import curation.ingest.prepare as prep
from schemas.manifest import Manifest
from tests import timing
from tests.curation.ingest.test_prepare import _cfg, _rows, corpus  # noqa: F401 (corpus: a fixture)

pytestmark = pytest.mark.slow  # two job processes each (CI runs them: pytest --all)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: Runs jobs/prepare.py with every part write slowed down by DELAY seconds (so a signal lands mid-run).
_SLOW_JOB = """
import runpy, sys, time
sys.path.insert(0, {repo!r})
import curation.ingest.units as units
real = units.write_part
def slow(*a, **k):
    time.sleep({delay})
    return real(*a, **k)
units.write_part = slow
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def _start(tmp_path, cfg, delay: float) -> subprocess.Popen:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    code = _SLOW_JOB.format(repo=REPO, delay=delay, script=os.path.join(REPO, "jobs", "prepare.py"))
    return subprocess.Popen([sys.executable, "-c", code, "--config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_a_part(cfg, proc) -> None:
    manifest = os.path.join(cfg.output_dir, "candidates", "manifest.json")
    deadline = timing.Deadline(120)
    while not os.path.exists(manifest) and not deadline.expired() and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None and os.path.exists(manifest)


def _rerun(cfg) -> None:
    path = os.path.join(os.path.dirname(cfg.output_dir), "job.yaml")
    done = timing.run([sys.executable, os.path.join(REPO, "jobs", "prepare.py"), "--config", path],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout


def test_sigterm_finishes_the_part_in_progress_and_a_rerun_continues_exactly(tmp_path, corpus):  # noqa: F811
    sources = corpus[0]
    clean = prep.prepare(_cfg(tmp_path / "clean", sources, sequences_per_part=2)).dirs
    cfg = _cfg(tmp_path / "job", sources, sequences_per_part=2)
    proc = _start(tmp_path / "job", cfg, delay=0.3)
    _wait_for_a_part(cfg, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = timing.communicate(proc, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received: finishing the part in progress, then stopping" in err
    cand = os.path.join(cfg.output_dir, "candidates")
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped on SIGTERM after finishing {cand}/") and last.endswith(
        "; rerun the same command to resume from the next part (finished parts are kept)"), err
    assert "Traceback" not in err
    m = Manifest.load(cand)
    assert not m.complete and 1 <= len(m.shards)
    assert last.split("after finishing ")[1].split(";")[0] == os.path.join(cand, m.shards[-1].name)
    on_disk = {f"{s}/{p}" for s in os.listdir(cand) if os.path.isdir(os.path.join(cand, s))
               for p in os.listdir(os.path.join(cand, s)) if not p.startswith("unit-")}  # parts, not unit records
    assert on_disk == {s.name for s in m.shards}  # the part in progress was finished and recorded, no other
    _rerun(cfg)
    for group in ("candidates", "validation"):
        assert _rows(os.path.join(cfg.output_dir, group)) == _rows(clean[group]), group
    a, b = Manifest.load(cand), Manifest.load(clean["candidates"])
    assert [s.model_dump() for s in a.shards] == [s.model_dump() for s in b.shards]
    assert a.sources == b.sources


def test_a_second_sigterm_stops_at_once_and_a_rerun_still_continues_exactly(tmp_path, corpus):  # noqa: F811
    sources = corpus[0]
    clean = prep.prepare(_cfg(tmp_path / "clean", sources, sequences_per_part=2)).dirs
    cfg = _cfg(tmp_path / "job", sources, sequences_per_part=2)
    proc = _start(tmp_path / "job", cfg, delay=5.0)  # the second signal comes inside a slow part write
    _wait_for_a_part(cfg, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    at_once = timing.Deadline(3)  # (3 s on an idle machine: the part's write alone takes 5 s)
    proc.send_signal(signal.SIGTERM)
    timing.communicate(proc, timeout=60)
    assert proc.returncode == -signal.SIGTERM and not at_once.expired(), at_once  # ended by the signal, not the part
    _rerun(cfg)
    for group in ("candidates", "validation"):
        assert _rows(os.path.join(cfg.output_dir, group)) == _rows(clean[group]), group
