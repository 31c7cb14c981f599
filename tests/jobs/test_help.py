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


#: Each job with a config: its config model and embedded default.
def _config_jobs():
    from schemas.config import PrepareConfig
    from schemas.engine_config import CurateAndTrainConfig, CurateConfig
    from schemas.eval_config import EvaluateConfig
    from schemas.train_config import ReplayConfig, TrainConfig

    return {"prepare": PrepareConfig, "train": TrainConfig, "replay": ReplayConfig, "curate": CurateConfig,
            "curate_and_train": CurateAndTrainConfig, "evaluate": EvaluateConfig}


@pytest.mark.parametrize("job", ["prepare", "train", "replay", "curate", "curate_and_train", "evaluate"])
def test_every_config_key_of_every_job_has_a_description(job):
    from curation.io.config_help import config_keys

    model = _config_jobs()[job]
    missing = [d.key for d in config_keys(model, model.demo_default().model_dump(mode="json")) if not d.description]
    assert not missing, f"jobs/{job}.py: config keys without a description (Field(description=...)): {missing}"


def test_help_lists_every_key_with_its_default_and_description(capsys):
    from schemas.engine_config import CurateAndTrainConfig
    from schemas.records import leaves

    with pytest.raises(SystemExit) as done:
        load_job("curate_and_train", "_help").main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:") and "--help [SECTION]" in text
    lines = text.splitlines()
    stripped = {line.strip() for line in lines}
    for key, value in leaves(CurateAndTrainConfig.demo_default().model_dump(mode="json")).items():
        if any(p.isdigit() for p in key.split(".")) or ".hf_config." in key:
            continue  # lists and free-form mappings are shown as one value (below)
        assert f"{key} = {json.dumps(value) if not isinstance(value, str) else value}" in stripped, key
    assert "  train.optim.betas = [0.9, 0.999]" in lines
    at = lines.index("  train.selection.gamma = 0.6")
    assert lines[at + 1].strip() == "γ: fraction of valid tokens kept per candidate batch, in (0, 1]"
    assert any(line.startswith("  train.model.hf_config = {\"model_type\": \"llama\"") for line in lines)
    assert "  prepare.sources.N.text_field = text" in lines  # a list's item keys, with the field's default


def test_help_of_one_section_lists_that_sections_keys_only(capsys):
    from schemas.train_config import SelectionConfig

    with pytest.raises(SystemExit) as done:
        load_job("curate_and_train", "_help1").main(["--help", "train.selection"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    listing = text[text.index("config keys under train.selection"):].splitlines()[1:]
    keys = [line.split(" = ")[0].strip() for line in listing if line.startswith("  ") and line[2] != " "]
    assert keys == [f"train.selection.{k}" for k in SelectionConfig.model_fields]


def test_help_of_an_unknown_section_exits_2_naming_the_nearest(capsys):
    with pytest.raises(SystemExit) as done:
        load_job("train", "_help2").main(["--help", "selecton"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --help selecton: no such section or key (did you mean selection?)"), err


def test_help_of_a_section_answers_before_torch_composer_or_ray_load(tmp_path):
    probe = _PROBE.replace('sys.argv = [job, "--help"]', 'sys.argv = [job, "--help", "train.selection"]')
    proc = timing.run([sys.executable, "-c", probe, str(REPO / "jobs" / "curate_and_train.py"), ",".join(HEAVY)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["code"] == 0 and "train.selection.gamma = 0.6" in got["help"] and not got["heavy"], got
