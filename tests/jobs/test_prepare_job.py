"""The prepare job's command line: configs in jobs/configs validate, errors exit non-zero with the message."""

import glob
import json
import os
import sys

import pytest

from schemas.config import PrepareConfig, load_config
from tests import timing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "jobs", "configs", "prepare_*.yaml"))))
def test_shipped_prepare_configs_validate(path):
    cfg = load_config(PrepareConfig, path=path)
    assert cfg.sources


def _run(*args, cwd):
    return timing.run([sys.executable, os.path.join(REPO, "jobs", "prepare.py"), *args], cwd=cwd,
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


def test_an_llm_foundry_mds_dataset_is_prepared_and_a_bad_id_is_one_line(tmp_path):
    """The README's example: an MDS token dataset as a source, then the same dataset with an id outside the
    vocabulary: exit 1 with one line naming the shard file, the sample and the id."""
    from curation.ingest.tokenizer import train_bpe_tokenizer
    from tests.curation.ingest.test_token_sources import _texts, foundry_samples, write_foundry_mds

    tok = train_bpe_tokenizer(iter(_texts(0, 300)), vocab_size=300, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    samples = list(foundry_samples(tok.encode_batch(_texts(1, 100)), eos=[tok.eos_id]))
    data = write_foundry_mds(tmp_path / "my-copy-c4" / "train_small", samples, size_limit=1 << 26)
    args = ["--set", f"sources=[{{name: c4, format: mds, paths: [{data}]}}]", "--set", "validation=[]",
            "--set", f"tokenizer.path={tok.path}", "--set", "seq_len=32", "--set", "demo=false"]
    out = _run(*args, "--set", f"output_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"candidates: {len(samples)} sequences × 32 tokens from {len(samples)} documents" in out.stdout
    samples[7][3] = 5000
    bad = write_foundry_mds(tmp_path / "bad", samples, size_limit=1 << 26)
    out = _run(*args, "--set", f"sources.0.paths=[{bad}]", "--set", f"output_dir={tmp_path / 'out2'}", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        f"error: {bad}/shard.00000.mds.zstd:8: token id 5000 (position 3) is outside the tokenizer's vocabulary "
        f"(ids 0 to {tok.vocab_size - 1}): was this data tokenized with another tokenizer?")
    # issue 32: the failed run's config.yaml refused the corrected rerun; it protected no output, so it is replaced
    assert (tmp_path / "out2" / "config.yaml").exists()
    out = _run(*args, "--set", f"sources.0.paths=[{bad}]", "--set", f"output_dir={tmp_path / 'out2'}",
               "--set", "skip_bad_records=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[0] == (f"note: {tmp_path / 'out2' / 'config.yaml'} records a config that produced "
                                          "no output yet (differs in: skip_bad_records): replacing it with this run's")
    assert load_config(PrepareConfig, path=str(tmp_path / "out2" / "config.yaml")).skip_bad_records


def test_a_wrong_tokenizer_path_leaves_no_record_so_the_corrected_rerun_runs(tmp_path):
    """issue 32: a wrong tokenizer.path left a config.yaml that refused the rerun with the right one."""
    text = tmp_path / "a.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    args = ["--set", f"sources=[{{name: s, paths: [{text}]}}]", "--set", "validation=[]", "--set", "demo=false",
            "--set", f"output_dir={tmp_path / 'out'}", "--set", "seq_len=16", "--set", "workers=1"]
    out = _run(*args, "--set", f"tokenizer.path={tmp_path / 'nowhere.json'}", cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.startswith("error: ") and "nowhere.json" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "out" / "config.yaml").exists()
    out = _run(*args, "--set", "tokenizer.vocab_size=300", cwd=tmp_path)  # corrected: a tokenizer trained here
    assert out.returncode == 0, out.stderr
