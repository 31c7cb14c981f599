"""Every job's ``--help`` answers before torch, Composer, Ray or transformers load (DESIGN.md §4: the jobs defer
their heavy imports), each in a fresh interpreter, as a user runs it."""

from __future__ import annotations

import json
import sys

import pytest

from tests import timing
from tests.conftest import REPO, load_job

#: What a job may import only after its arguments are parsed (each takes seconds to import).
HEAVY = ("torch", "composer", "ray", "transformers")

#: Every user-facing job: a script of jobs/ with a ``main``.
JOBS = sorted(p.stem for p in (REPO / "jobs").glob("*.py")
              if p.name != "__init__.py" and "def main(" in p.read_text(encoding="utf-8"))

#: Runs ``jobs/<job>.py --help`` as ``python jobs/<job>.py --help`` would, then reports the exit code, the help text
#: and which of HEAVY were imported.
_PROBE = """
import contextlib, io, json, runpy, sys
job, heavy = sys.argv[1], set(sys.argv[2].split(","))
sys.argv = [job, "--help"]
out, code = io.StringIO(), "no SystemExit"
with contextlib.redirect_stdout(out):
    try:
        runpy.run_path(job, run_name="__main__")
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "help": out.getvalue(),
                  "heavy": sorted(m for m in sys.modules if m.split(".")[0] in heavy)}))
"""


def test_the_jobs_are_found():
    assert {"prepare", "train", "curate_and_train", "evaluate", "bench_quality", "bench_scoring"} <= set(JOBS)


@pytest.mark.parametrize("job", JOBS)
def test_each_jobs_help_answers_before_torch_composer_or_ray_load(job, tmp_path):
    proc = timing.run([sys.executable, "-c", _PROBE, str(REPO / "jobs" / f"{job}.py"), ",".join(HEAVY)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["code"] in (0, None), (got["code"], proc.stderr)
    assert got["help"].startswith("usage:"), got["help"]
    assert not got["heavy"], f"jobs/{job}.py --help imported {sorted({m.split('.')[0] for m in got['heavy']})}"


def test_bench_quality_offers_the_presets_of_its_setting():
    """``--preset``'s choices are named in the job (so that ``--help`` needs no torch): they are the setting's."""
    from bench.quality.setting import PRESETS

    assert sorted(load_job("bench_quality", "_presets").PRESET_NAMES) == sorted(PRESETS)
