"""Your own corpus and model, as a user brings them (issue 57): a GPT-2 directory made in the test with
``save_pretrained`` (tiny config, its own tokenizer) named by ``model.path`` alone, text as jsonl, parquet and txt.

* ``jobs/train.py --set model.path=DIR`` trains it (the default's ``hf_config`` is replaced), reports FLOPs measured
  for an architecture without a formula and its MFU, writes ``final/`` that ``AutoModelForCausalLM`` and
  ``AutoTokenizer`` both load, and prints no warning and no carriage return under a pipe;
* the worked example ``jobs/configs/own_corpus_own_model.yaml`` runs the main job (prepare, Ray engine, Composer)
  with only its paths and a short schedule given on the command line, and records the merged config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests import timing
from tests.own_model import EOS, GPT2, write_own_corpus, write_own_model

pytestmark = pytest.mark.slow  # job processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L = 128
# the tiny GPT-2's forward FLOPs per token, every matrix product of its eager forward: per layer q, k, v and the
# output 4·h², the MLP 8·h² (2 FLOPs a weight), the head h·V, and the attention's L × L scores and values 2·2·L·h
H, V = GPT2["n_embd"], 384
FLOPS = 2 * (GPT2["n_layer"] * 12 * H * H + H * V) + 4 * GPT2["n_layer"] * L * H
PEAK = 1e12


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("own")
    corpus = write_own_corpus(str(root / "my-corpus"))
    model = write_own_model(str(root / "my-model"), corpus)
    return {"root": root, "corpus": corpus, "model": model}


def _env() -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")},
            "PYTHONPATH": REPO}


def _job(name: str, *args: str, cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    return timing.run([sys.executable, os.path.join(REPO, "jobs", f"{name}.py"), *args], cwd=cwd, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


def _assert_loads_in_hugging_face(final: str, model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, theirs = AutoTokenizer.from_pretrained(final), AutoTokenizer.from_pretrained(model_dir)
    text = "parse the release file and print its version"
    assert tok(text).input_ids == theirs(text).input_ids and tok.eos_token == EOS
    model = AutoModelForCausalLM.from_pretrained(final)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.vocab_size == len(tok)


def test_a_local_gpt2_directory_named_by_model_path_alone_trains_reports_mfu_and_leaves_a_loadable_final(own):
    from curation.ingest.prepare import prepare
    from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig

    root, c = own["root"], own["corpus"]
    data = str(root / "data")
    prepare(PrepareConfig(sources=[SourceConfig(name="docs", paths=[c["docs"]]),
                                   SourceConfig(name="changelogs", paths=[c["changelogs"]], text_field="body"),
                                   SourceConfig(name="man", paths=[c["man"]])],
                          validation=[SourceConfig(name="target", paths=[c["target"]])],
                          tokenizer=TokenizerConfig(path=own["model"]), output_dir=data, seq_len=L, progress=False))
    out = root / "train"
    proc = _job("train", "--set", f"model.path={own['model']}", "--set", f"data.tokenizer={own['model']}",
                "--set", f"data.candidates={data}/candidates", "--set", f"data.validation={data}/validation",
                "--set", f"output_dir={out}", "--set", "max_steps=4", "--set", "batch_size=4", "--set", "threads=1",
                "--set", "device=cpu", "--set", "selection.warmup_steps=2", "--set", "selection.tau=2",
                "--set", "selection.refresh_steps=1", "--set", "eval.max_batches=1", "--set", "plots=false",
                "--set", f"throughput.peak_flops={PEAK}", "--set", "throughput.log_interval=2", cwd=root)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "\r" not in proc.stdout
    assert not [line for line in proc.stdout.splitlines() if "warn" in line.lower() or "deprecat" in line.lower()], \
        proc.stdout  # transformers' `torch_dtype` deprecation, once per load, among them
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert all(" | mfu -" not in line for line in lines[1:]), lines  # a rate over the window: MFU shown

    record = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert record["path"] == own["model"] and record["hf_config"] is None  # model.path alone replaced hf_config
    tp = json.loads((out / "summary.json").read_text())["throughput"]
    assert FLOPS == 65536 and tp["forward_flops_per_token"] == FLOPS and tp["flops_method"] == "measured"
    assert tp["proxy_flops"] == 3 * FLOPS * 4 * 4 * L
    assert tp["mfu"] == pytest.approx(tp["proxy_flops"] / tp["train_seconds"] / PEAK)
    _assert_loads_in_hugging_face(str(out / "final"), own["model"])


@pytest.mark.ray
def test_the_worked_example_runs_the_main_job_on_your_corpus_and_model_with_only_its_paths_given(own):
    root, c, model = own["root"], own["corpus"], own["model"]
    example = os.path.join(REPO, "jobs", "configs", "own_corpus_own_model.yaml")
    paths = [f"prepare.sources.0.paths=[{c['docs']}]", f"prepare.sources.1.paths=[{c['changelogs']}]",
             f"prepare.sources.2.paths=[{c['man']}]", f"prepare.validation.0.paths=[{c['target']}]",
             f"prepare.tokenizer.path={model}", f"train.model.path={model}", f"train.data.tokenizer={model}"]
    short = ["train.max_steps=6", "train.batch_size=8", "train.selection.warmup_steps=2", "train.selection.tau=2",
             "train.selection.refresh_steps=1", "train.eval.max_batches=1", "train.plots=false",
             "workers.range_steps=2", "engine.lookahead=4", "train.throughput.log_interval=3"]
    args = ["--config", example, *[a for s in paths + short for a in ("--set", s)]]
    proc = _job("curate_and_train", *args, cwd=root, timeout=900)  # relative paths: runs/own/... under root
    assert proc.returncode == 0, proc.stdout[-5000:]
    text = proc.stdout
    assert "\r" not in text and "Token authentication" not in text and "torch_dtype" not in text, text[-3000:]
    assert text.count("prepare data: ") >= 1 and "preparing the corpus into runs/own/data" in text

    run = root / "runs" / "own" / "blade"
    summary = json.loads((run / "summary.json").read_text())
    assert sorted(summary["tokens"]["per_source"]) == ["changelogs", "docs", "man"]  # jsonl, parquet, txt
    assert summary["steps"] == 6 and summary["throughput"]["forward_flops_per_token"] == FLOPS
    _assert_loads_in_hugging_face(str(run / "final"), model)
    printed = _job("curate_and_train", *args, "--print-config", cwd=root)
    assert yaml.safe_load((run / "engine_config.yaml").read_text()) == yaml.safe_load(printed.stdout)  # the merged
