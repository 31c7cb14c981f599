"""Messages about ``s3://`` outputs name the URL the user gave, never the local cache path it is worked on through
(``BLADE_CACHE_DIR``), and a failed first run into a bucket leaves nothing there; on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from curation.io import objects
from tests import timing

pytestmark = pytest.mark.slow  # job processes against the test S3 server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job(name: str, *args: str, s3, cwd) -> subprocess.CompletedProcess:
    return timing.run([sys.executable, os.path.join(REPO, "jobs", f"{name}.py"), *args], cwd=cwd, env=s3.env(),
                          capture_output=True, text=True, timeout=300)


def test_messages_about_an_object_store_output_name_its_url_and_a_failed_first_run_leaves_nothing(s3, tmp_path):
    text = tmp_path / "a.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(60)))
    url = s3.url("runs/data")
    args = ["--set", "validation=[]", "--set", "demo=false", "--set", "seq_len=16", "--set", "workers=1",
            "--set", "tokenizer.vocab_size=300", "--set", f"output_dir={url}"]
    missing = tmp_path / "missing.jsonl"
    out = _job("prepare", *args, "--set", f"sources=[{{name: s, paths: [{missing}]}}]", s3=s3, cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.splitlines() == [f"error: {missing}: no such file (source 's')"]
    assert not objects.list_objects(url)  # no config.yaml in the bucket that would make it look started
    assert not os.path.exists(os.path.join(s3.cache, "s3", s3.name, "runs", "data"))

    out = _job("prepare", *args, "--set", f"sources=[{{name: s, paths: [{text}]}}]", s3=s3, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "config.yaml" in objects.list_objects(url)
    out = _job("prepare", *args, "--set", f"sources=[{{name: s, paths: [{text}]}}]", "--set", "seq_len=32",
               s3=s3, cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.startswith(f"error: {url} was written with a different config (differs in: seq_len):")
    assert f"rerun with the config recorded in {url}/config.yaml to resume" in out.stderr
    assert s3.cache not in out.stderr + out.stdout, out.stderr

    # a message from below the job's entry (the shards' manifest against another tokenizer) names the URL too
    other = tmp_path / "other-tokenizer"
    out = _job("prepare", "--set", "validation=[]", "--set", "demo=false", "--set", "seq_len=16", "--set", "workers=1",
               "--set", "tokenizer.vocab_size=280", "--set", f"output_dir={other}",
               "--set", f"sources=[{{name: s, paths: [{text}]}}]", s3=s3, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    out = _job("train", "--set", f"data.candidates={url}/candidates", "--set", f"data.validation={url}/candidates",
               "--set", f"data.tokenizer={other}/tokenizer/tokenizer.json", "--set", f"output_dir={s3.url('runs/t')}",
               s3=s3, cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.startswith(f"error: tokenizer mismatch: {url}/candidates/manifest.json was written with "), \
        out.stderr
    assert s3.cache not in out.stderr, out.stderr
