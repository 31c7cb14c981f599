"""The prepare job's command line: configs in jobs/configs validate, errors exit non-zero with the message."""

import glob
import json
import os
import subprocess
import sys

import pytest

from schemas.config import PrepareConfig, load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "jobs", "configs", "prepare_*.yaml"))))
def test_shipped_prepare_configs_validate(path):
    cfg = load_config(PrepareConfig, path=path)
    assert cfg.sources


def _run(*args, cwd):
    return subprocess.run([sys.executable, os.path.join(REPO, "jobs", "prepare.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_bad_input_exits_1_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{oops\n")
    out = _run("--set", f"sources=[{{name: s, paths: [{bad}]}}]", "--set", "validation=[]",
               "--set", f"output_dir={tmp_path / 'out'}", "--set", "demo=false", cwd=tmp_path)
    assert out.returncode == 1
    assert f"{bad}:2: malformed JSON" in out.stderr


def test_unknown_key_exits_2(tmp_path):
    out = _run("--set", "seq_lenn=3", cwd=tmp_path)
    assert out.returncode == 2 and "seq_lenn: unknown key" in out.stderr


def test_embedded_default_runs(tmp_path):
    out = _run(cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "tokens/s (1 worker)" in out.stdout and "candidates: " in out.stdout  # small: in-process, no Ray
    assert os.path.exists(tmp_path / "runs" / "demo" / "data" / "candidates" / "index.json")
