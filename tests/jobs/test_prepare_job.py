"""The prepare job's command line: configs in jobs/configs validate, errors exit non-zero with the message."""

import glob
import json
import os
import subprocess
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
    # issue 32: the failed run's config.yaml refused the corrected rerun; issue 57: a first run that failed before
    # its first output leaves no directory at all (nothing that looks started), so the rerun starts afresh
    assert not (tmp_path / "out2").exists()
    out = _run(*args, "--set", f"sources.0.paths=[{bad}]", "--set", f"output_dir={tmp_path / 'out2'}",
               "--set", "skip_bad_records=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "note:" not in out.stderr, out.stderr
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


def test_a_fifo_input_and_a_read_error_end_the_job_in_one_line_naming_the_input(tmp_path):
    """P26: a FIFO among the inputs hung the job for ever; P27: an input failing on read (EIO: /proc/self/mem at
    offset 0) was reported naming the output directory only."""
    tok = tmp_path / "tok.json"
    from curation.ingest.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(iter(["a b c"] * 20), vocab_size=260, save_to=str(tok))
    os.mkfifo(tmp_path / "pipe.jsonl")
    common = ["--set", "validation=[]", "--set", f"tokenizer.path={tok}", "--set", "demo=false", "--set", "workers=1",
              "--set", "progress=false"]
    out = _run("--set", f"sources=[{{name: s, paths: [{tmp_path / 'pipe.jsonl'}]}}]", "--set",
               f"output_dir={tmp_path / 'a'}", *common, cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'pipe.jsonl'}: is a FIFO (named pipe), not a regular file: inputs are read as files, "
        "more than once (source 's')"]
    out = _run("--set", "sources=[{name: s, format: jsonl, paths: [/proc/self/mem]}]", "--set",
               f"output_dir={tmp_path / 'b'}", *common, cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"error: preparing into {tmp_path / 'b'} failed (/proc/self/mem): Input/output error"]


def _own_text(tmp_path, n: int = 3) -> list:
    paths = []
    for i in range(n):
        path = tmp_path / f"s{i}.jsonl"
        path.write_text("".join(json.dumps({"text": f"source {i} document {j} " * 30}) + "\n" for j in range(60)))
        paths.append(path)
    return paths


def test_a_failed_first_run_leaves_no_directory_and_the_rerun_starts_afresh(tmp_path):
    """issue 57: a prepare that failed on a missing input left config.yaml and .lock in a new output directory,
    which then looked started. Now nothing is left; a directory that held a run keeps its record when a rerun fails."""
    text, = _own_text(tmp_path, 1)
    args = ["--set", "validation=[]", "--set", "demo=false", "--set", "seq_len=16", "--set", "workers=1",
            "--set", "tokenizer.vocab_size=300", "--set", f"output_dir={tmp_path / 'runs' / 'out'}"]
    out = _run(*args, "--set", f"sources=[{{name: s, paths: [{tmp_path / 'missing.jsonl'}]}}]", cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.splitlines() == [
        f"error: {tmp_path / 'missing.jsonl'}: no such file (source 's')"], out.stderr
    assert not (tmp_path / "runs" / "out").exists()
    out = _run(*args, "--set", f"sources=[{{name: s, paths: [{text}]}}]", cwd=tmp_path)
    assert out.returncode == 0 and "note:" not in out.stderr, out.stderr
    record = (tmp_path / "runs" / "out" / "config.yaml").read_text()
    out = _run(*args, "--set", f"sources=[{{name: s, paths: [{text}, {tmp_path / 'missing.jsonl'}]}}]", cwd=tmp_path)
    assert out.returncode == 1  # (a changed config: refused before anything is touched)
    assert (tmp_path / "runs" / "out" / "config.yaml").read_text() == record


def test_a_piped_prepare_prints_a_line_per_interval_and_no_carriage_return(tmp_path):
    """issue 57: under a pipe (``> log``, ``ray job submit``) tqdm's ``\\r`` frames made one line of hundreds of
    characters; now whole lines, at most one per tenth of the units and the last, as the trainer prints."""
    paths = _own_text(tmp_path, 3)
    sources = ", ".join(f"{{name: s{i}, paths: [{p}]}}" for i, p in enumerate(paths))
    proc = timing.run([sys.executable, os.path.join(REPO, "jobs", "prepare.py"), "--set", f"sources=[{sources}]",
                           "--set", "validation=[]", "--set", "demo=false", "--set", "seq_len=16", "--set", "workers=1",
                           "--set", "tokenizer.vocab_size=300", "--set", f"output_dir={tmp_path / 'out'}",
                           "--set", "unit_bytes=20000"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=300)
    text = proc.stdout.decode()
    assert proc.returncode == 0, text
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.startswith("prepare out: ")]
    units = int(lines[-1].split("/")[1].split()[0])
    assert units >= 6 and lines[-1].startswith(f"prepare out: {units}/{units} units (100%) | "), lines
    assert 2 <= len(lines) <= 11 and all(len(line) < 200 for line in lines), lines
