"""curation.evaluation.harness: lm-evaluation-harness on a local GSM8K-style file, offline, on a tiny HF directory
(the wiring, not the score). Needs the `eval` extra, which CI installs (README's set-up command)."""

from __future__ import annotations

import pytest
import yaml

from curation.evaluation.harness import HARNESS_MISSING, harness_available, write_gsm8k_task
from curation.evaluation.heldout import export_hf
from curation.ingest.tokenizer import train_bpe_tokenizer
from curation.io.models import build_causal_lm
from schemas.eval_config import LmEvalConfig
from schemas.train_config import demo_model_config
from tests.conftest import write_jsonl

PROBLEMS = [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "Ada has 10 pens and gives 2 away. How many are left?", "answer": "10 - 2 = 8\n#### 8"},
            {"question": "A box holds 6 eggs. How many eggs are in 2 boxes?", "answer": "2 * 6 = 12\n#### 12"}]


def test_task_yaml_reads_the_local_file(tmp_path):
    data = write_jsonl(tmp_path / "test.jsonl", PROBLEMS)
    task = yaml.safe_load(open(write_gsm8k_task(str(tmp_path / "tasks"), str(data), max_gen_toks=7)))
    assert task["dataset_path"] == "json"
    assert task["dataset_kwargs"]["data_files"]["test"] == str(data)
    assert task["generation_kwargs"]["max_gen_toks"] == 7
    assert task["doc_to_text"] == "Question: {{question}}\nAnswer:"
    assert task["filter_list"][0]["filter"][0]["regex_pattern"] == "#### (\\-?[0-9\\.\\,]+)"
    with pytest.raises(FileNotFoundError, match="lm_eval.gsm8k_file: no such file"):
        write_gsm8k_task(str(tmp_path / "tasks"), str(tmp_path / "absent.jsonl"))


@pytest.mark.slow
def test_gsm8k_exact_match_on_a_tiny_model_offline(tmp_path, monkeypatch):
    if not harness_available():
        pytest.skip(HARNESS_MISSING)
    from curation.evaluation.harness import run_harness

    texts = [p["question"] + "\n" + p["answer"] for p in PROBLEMS]
    tok = train_bpe_tokenizer(texts * 3, vocab_size=300, save_to=str(tmp_path / "tok" / "tokenizer.json"))
    model = build_causal_lm(demo_model_config(tok.vocab_size, hidden=32, layers=1, seq_len=128)).eval()
    model_dir = export_hf(model, tok.path, str(tmp_path / "tiny"))
    data = write_jsonl(tmp_path / "test.jsonl", PROBLEMS)
    # nothing may be fetched: an unreachable proxy makes any network access fail
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # run_harness sets them
        monkeypatch.setenv(var, "1")
    cfg = LmEvalConfig(gsm8k_file=str(data), limit=2, max_gen_toks=4, batch_size=2)
    out = run_harness({"tiny": model_dir}, cfg, str(tmp_path / "tasks"))
    metrics = out["tiny"]["gsm8k_local"]
    assert set(metrics) >= {"exact_match,strict-match", "exact_match,flexible-extract"}
    # a random 300-token model does not write "#### 7": strict exact match is 0 of the 2 problems
    assert metrics["exact_match,strict-match"] == 0.0
    assert 0.0 <= metrics["exact_match,flexible-extract"] <= 1.0
