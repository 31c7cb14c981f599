"""curation.evaluation.heldout: whole-document token loss (hand-computed on tiny models), bootstrap and paired
intervals, model/tokenizer/set resolution and its errors."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from curation.evaluation.heldout import (
    DocScores,
    EvalError,
    bootstrap_mean,
    document_windows,
    evaluate_models,
    export_hf,
    load_model,
    paired_difference,
    read_set,
    resolve_models,
    results_markdown,
    score_documents,
)
from curation.ingest.tokenizer import train_bpe_tokenizer
from curation.io.atomic import write_manifest
from curation.io.models import build_causal_lm, save_weights
from schemas.config import SourceConfig
from schemas.eval_config import EvalModelSpec, EvaluateConfig
from schemas.train_config import demo_model_config
from tests.conftest import write_jsonl

TEXTS = ["Tom has 3 apples and buys 4 more. He has 7 apples now.",
         "The river ran quietly past the old mill while the town slept.",
         "Ada pays 12 dollars for 3 pens, so one pen costs 4 dollars.",
         "A short one."]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe_tokenizer(TEXTS * 5, vocab_size=300, save_to=str(path))


def _model(vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = demo_model_config(vocab, hidden=32, layers=1, seq_len=64)
    return build_causal_lm(cfg.model_copy(update={"init_seed": seed})).eval()


def _direct_losses(model, tok, text: str) -> tuple[float, int]:
    """Sum of -log p over [EOS] + ids + [EOS] in one forward pass (no windows, no batching)."""
    seq = torch.tensor([[tok.eos_id, *tok.encode_batch([text])[0], tok.eos_id]])
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=seq).logits[0, :-1].double(), -1)
    return float(-logp.gather(1, seq[0, 1:, None]).sum()), seq.shape[1] - 1


def test_document_windows_predict_every_target_once():
    assert document_windows([5, 6, 7], 0, 10) == [[0, 5, 6, 7, 0]]
    assert document_windows([5, 6, 7], 0, 3) == [[0, 5, 6], [6, 7, 0]]
    for n in range(0, 20):
        for max_len in (2, 3, 5, 8):
            ids = list(range(1, n + 1))
            wins = document_windows(ids, 0, max_len)
            assert all(2 <= len(w) <= max_len for w in wins)
            targets = [t for w in wins for t in w[1:]]
            assert targets == ids + [0]  # each target exactly once, in order
            # every window starts where the previous one ended (context continues by one token)
            assert all(a[-1] == b[0] for a, b in zip(wins, wins[1:], strict=False))


def test_uniform_model_loss_is_log_vocab(tok):
    model = _model(tok.vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # zero embeddings (tied head): every logit is 0, p = 1/V for every token
    s = score_documents(model, tok, TEXTS, max_len=8, batch_size=3)
    lengths = [len(ids) + 1 for ids in tok.encode_batch(TEXTS)]
    assert s.counts.tolist() == lengths
    np.testing.assert_allclose(s.sums, np.array(lengths) * math.log(tok.vocab_size), rtol=1e-6)
    assert s.mean == pytest.approx(math.log(tok.vocab_size), rel=1e-6)


def test_scores_equal_a_direct_forward_pass_whatever_the_batching(tok):
    model = _model(tok.vocab_size, seed=3)
    direct = [_direct_losses(model, tok, t) for t in TEXTS]
    for batch in (1, 3, 16):
        s = score_documents(model, tok, TEXTS, max_len=64, batch_size=batch)
        assert s.counts.tolist() == [c for _, c in direct]
        np.testing.assert_allclose(s.sums, [x for x, _ in direct], rtol=1e-5)
    # with short windows the first document loses context: its loss changes, its count does not
    short = score_documents(model, tok, TEXTS, max_len=6, batch_size=4)
    assert short.counts.tolist() == [c for _, c in direct]
    assert short.sums[0] != pytest.approx(direct[0][0], rel=1e-6)


def test_bootstrap_and_paired_intervals():
    a = DocScores(np.array([2.0, 4.0, 9.0]), np.array([1, 2, 3]))
    assert a.mean == pytest.approx(15 / 6)
    iv = bootstrap_mean(a, rounds=2000, seed=1)
    assert iv.lo <= iv.value <= iv.hi and iv.lo >= 2.0 and iv.hi <= 3.0  # per-doc means are 2, 2, 3
    assert bootstrap_mean(a, rounds=0) == type(iv)(15 / 6, 15 / 6, 15 / 6)
    # b = a + 0.5 nats on every token: the paired difference is exactly -0.5 in every resample
    b = DocScores(a.sums + 0.5 * a.counts, a.counts)
    d = paired_difference(a, b, rounds=500, seed=0)
    assert (d.value, d.lo, d.hi) == pytest.approx((-0.5, -0.5, -0.5))
    same = paired_difference(a, a, rounds=100)
    assert (same.value, same.lo, same.hi) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same documents"):
        paired_difference(a, DocScores(np.ones(2), np.ones(2, dtype=np.int64)))
    # resamples are seeded: the same seed gives the same interval
    assert bootstrap_mean(a, rounds=300, seed=7) == bootstrap_mean(a, rounds=300, seed=7)


def _hf_dir(tmp_path, tok, name="m", seed=0):
    d = tmp_path / name
    export_hf(_model(tok.vocab_size, seed), tok.path, str(d))
    return d


def _run_dir(tmp_path, tok, name="run", seed=0):
    """What training.runs.wiring.train leaves: config.yaml (data.tokenizer) + final/model.safetensors + final/config.json."""
    run = tmp_path / name
    model = _model(tok.vocab_size, seed)
    save_weights(model, str(run / "final" / "model.safetensors"))
    model.config.to_json_file(str(run / "final" / "config.json"))
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": tok.path, "candidates": str(tmp_path / "c")}}))
    return run


def test_run_and_hf_directory_of_the_same_weights_score_the_same(tmp_path, tok):
    hf = _hf_dir(tmp_path, tok, "hf", seed=5)
    run = _run_dir(tmp_path, tok, "run", seed=5)
    other = _hf_dir(tmp_path, tok, "other", seed=6)
    src = SourceConfig(name="s", paths=[str(write_jsonl(tmp_path / "s.jsonl", [{"text": t} for t in TEXTS]))])
    cfg = EvaluateConfig(models=[EvalModelSpec(path=str(hf)), EvalModelSpec(path=str(run / "final")),
                                 EvalModelSpec(path=str(other), name="seed6")],
                         sets=[src], max_len=64, bootstrap=200, output_dir=str(tmp_path / "eval"), progress=False)
    refs = resolve_models(cfg.models)
    assert [r.name for r in refs] == ["hf", "run", "seed6"]
    res = evaluate_models(refs, cfg)
    loss = res["loss"]["s"]
    assert loss["hf"]["mean"] == pytest.approx(loss["run"]["mean"], abs=1e-6)
    direct = [_direct_losses(_model(tok.vocab_size, 5), tok, t) for t in TEXTS]
    assert loss["hf"]["mean"] == pytest.approx(sum(x for x, _ in direct) / sum(c for _, c in direct), rel=1e-5)
    pairs = {(r["a"], r["b"]): r for r in res["paired"]["s"]}
    assert set(pairs) == {("hf", "run"), ("hf", "seed6"), ("run", "seed6")}
    assert pairs[("hf", "run")]["mean"] == pytest.approx(0.0, abs=1e-6)
    assert pairs[("hf", "seed6")]["mean"] == pytest.approx(loss["hf"]["mean"] - loss["seed6"]["mean"])
    md = results_markdown(res)
    assert "| hf − seed6 |" in md and "s (4 docs)" in md


def test_glob_names_each_run_and_skips_unfinished(tmp_path, tok):
    _run_dir(tmp_path / "train", tok, "blade")
    _run_dir(tmp_path / "train", tok, "full", seed=1)
    (tmp_path / "train" / "unfinished").mkdir()
    refs = resolve_models([EvalModelSpec(path=str(tmp_path / "train" / "*"))])
    assert [r.name for r in refs] == ["blade", "full"]
    with pytest.raises(EvalError, match="no finished run or HF model directory matches"):
        resolve_models([EvalModelSpec(path=str(tmp_path / "nothing" / "*"))])


def test_bad_models_are_named(tmp_path, tok):
    with pytest.raises(EvalError, match=r"models.0 \(.*missing\): no such model directory"):
        resolve_models([EvalModelSpec(path=str(tmp_path / "missing"))])
    hf = _hf_dir(tmp_path, tok, "noweights")
    os.remove(hf / "model.safetensors")
    with pytest.raises(EvalError, match="noweights has no model.safetensors"):
        resolve_models([EvalModelSpec(path=str(hf))])
    with pytest.raises(EvalError, match="neither an HF model directory"):
        resolve_models([EvalModelSpec(path=str(tmp_path))])
    a = _hf_dir(tmp_path, tok, "a")
    with pytest.raises(EvalError, match="duplicate names"):
        resolve_models([EvalModelSpec(path=str(a)), EvalModelSpec(path=str(a))])
    with pytest.raises(EvalError, match="weights: no such file"):
        resolve_models([EvalModelSpec(path=str(a), weights=str(tmp_path / "w.safetensors"))])


def test_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path, tok):
    small = tmp_path / "small"
    export_hf(_model(270), tok.path, str(small))  # a 270-id model with the 300-id tokenizer
    (ref,) = resolve_models([EvalModelSpec(path=str(small))])
    with pytest.raises(EvalError, match=r"tokenizer .*tokenizer.json has vocab_size 300 but the model .* embeds only 270 ids; not this model"):
        load_model(ref)
    # a run evaluated with a tokenizer other than the one its shards were made with
    from schemas.manifest import Manifest

    run = _run_dir(tmp_path, tok, "run")
    (tmp_path / "c").mkdir()
    write_manifest(str(tmp_path / "c"), Manifest(kind="candidate", job="prepare", tokenizer_fingerprint="0" * 64))
    (ref,) = resolve_models([EvalModelSpec(path=str(run))])
    with pytest.raises(EvalError, match="not the one its training shards were made with"):
        load_model(ref)


def test_bad_and_empty_sets_are_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EvalError, match=r"set 'e': .*empty.jsonl: file is empty"):
        read_set(SourceConfig(name="e", paths=[str(empty)]))
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"question": "q", "answer": "a"}, {"question": "q2"}])
    with pytest.raises(EvalError, match=r"set 'r': .*rows.jsonl:2: missing field 'answer'"):
        read_set(SourceConfig(name="r", paths=[str(rows)], template="{question}\n{answer}"))
    with pytest.raises(EvalError, match="set 'k': no documents in .* after skipping 2"):
        read_set(SourceConfig(name="k", paths=[str(rows)], text_field="question", skip_documents=2))
    assert read_set(SourceConfig(name="ok", paths=[str(rows)], text_field="question", skip_documents=1)) == ["q2"]


@pytest.mark.parametrize("path", [".", "./", "sub/.."])
def test_a_model_given_as_dot_is_named_after_its_directory_never_dot(tmp_path, monkeypatch, path):
    # the name is also the folder of its lm_eval export (output_dir/hf/<name>): never '.' or '..'
    model = tmp_path / "my-model"
    (model / "sub").mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / f).write_text("{}")
    monkeypatch.chdir(model)
    [ref] = resolve_models([EvalModelSpec(path=path)])
    assert ref.name == "my-model"
