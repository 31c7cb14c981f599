"""Exact online BLADE on the (small) demo corpus: exact k, refresh schedule, Δ from the forward pass,
all policies through one path, scores from scored shards."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from composer.core import Callback

from curation.core.losses import token_losses
from curation.core.selection import num_selected
from curation.io.models import build_causal_lm, build_scorer, save_weights
from curation.io.shards import read_column
from curation.io.stream_reader import StreamReader
from schemas.manifest import Manifest
from schemas.train_config import ScorerConfig
from tests.scored_steps import write_scored_steps
from training.runs.train_job import train


class Capture(Callback):
    """Records every step's selection; snapshots proxy and reference weights before chosen steps."""

    def __init__(self, algorithm_of, snapshot_steps=()):
        self.algorithm_of = algorithm_of
        self.snapshot_steps = set(snapshot_steps)
        self.records, self.snapshots = [], {}
        self.proxy_forwards = 0

    def fit_start(self, state, logger):
        proxy = state.model.model

        def hook(module, args, output):
            if module is proxy:  # deep copies (the reference) carry the hook too
                self.proxy_forwards += 1

        proxy.register_forward_hook(hook)
        # every step's record as it is delivered (a step later: training.blocks.step_reads)
        self.algorithm_of().subscribe(lambda rec: self.records.append(copy.deepcopy(rec)))

    def batch_start(self, state, logger):
        step = int(state.timestamp.batch)
        if step in self.snapshot_steps:
            alg = self.algorithm_of()
            self.snapshots[step] = (
                copy.deepcopy(state.model.model.state_dict()),
                copy.deepcopy(alg.reference.module.state_dict()),
                state.batch["tokens"].clone(),
            )


def _run(cfg, snapshot_steps=()):
    holder = {}
    cap = Capture(lambda: holder["alg"], snapshot_steps)
    from training.runs.wiring import build_training

    run = build_training(cfg, callbacks=[cap])
    holder["alg"] = run.algorithm
    run.trainer.fit()
    run.trainer.close()
    return run, cap


def test_blade_keeps_exactly_k_refreshes_on_schedule_and_scores_from_the_forward_pass(make_config):
    cfg = make_config("blade", eval={"interval": 100})
    run, cap = _run(cfg, snapshot_steps=(3, 9))
    alg = run.algorithm
    W, tau, gamma = cfg.selection.warmup_steps, cfg.selection.tau, cfg.selection.gamma
    assert [r["step"] for r in alg.refresh_log] == list(range(W, cfg.max_steps, tau)) == [2, 5, 8]
    assert [r["version"] for r in alg.refresh_log] == [0, 1, 2]
    assert [r.step for r in cap.records] == list(range(cfg.max_steps))
    for rec in cap.records:
        n_valid = rec.n_valid
        assert n_valid == 8 * 127
        if rec.step < W:
            assert rec.n_kept == n_valid and rec.episode == -1 and np.isnan(rec.scores[rec.valid]).all()
            continue
        assert rec.episode == (rec.step - W) // tau == rec.ref_version
        assert rec.n_kept == num_selected(gamma, n_valid) == int(np.floor(gamma * n_valid + 0.5))
        kept, dropped = rec.scores[rec.mask], rec.scores[rec.valid & ~rec.mask]
        assert np.isfinite(rec.scores[rec.valid]).all() and kept.min() >= dropped.max()  # top-γ by Δ
        assert not rec.mask[:, 0].any()
    # one proxy forward per training step (plus the one evaluation at the end): ℓ(u) is not recomputed
    eval_batches = 1
    assert cap.proxy_forwards == cfg.max_steps + eval_batches

    # Δ = ℓ(u_t) − ℓ(w̃_e), recomputed independently from the weights the step saw
    for step in (3, 9):
        proxy_sd, ref_sd, tokens = cap.snapshots[step]
        model = build_causal_lm(cfg.model)
        model.load_state_dict(proxy_sd)
        with torch.no_grad():
            lu, valid = token_losses(model(input_ids=tokens).logits, tokens)
        model.load_state_dict(ref_sd)
        lw = build_scorer(ScorerConfig(model=cfg.model, device="cpu", batch_size=8), model=model)(tokens)
        delta = (lu - torch.from_numpy(lw).float()).numpy()
        rec = cap.records[step]
        np.testing.assert_allclose(rec.scores[valid.numpy()], delta[valid.numpy()], rtol=0, atol=1e-5)

    # selected-token shards hold exactly what was trained on
    sel = os.path.join(cfg.output_dir, "selected")
    steps = np.array(read_column(sel, "step"))
    masks = read_column(sel, "loss_mask")
    tokens = read_column(sel, "tokens")
    assert steps.tolist() == [r.step for r in cap.records for _ in range(8)]
    for rec in cap.records:
        rows = np.flatnonzero(steps == rec.step)
        assert np.array_equal(np.stack([masks[i] for i in rows]).astype(bool), rec.mask)
        assert np.array_equal(np.stack([tokens[i] for i in rows]), rec.tokens)
    manifest = Manifest.load(sel)
    assert manifest.complete and sum(c.kept_tokens for c in manifest.sources.values()) == sum(
        r.n_kept for r in cap.records)


@pytest.mark.parametrize("policy", ["full", "random", "rho1", "blade-nosync"])
def test_every_policy_runs_through_the_same_path(make_config, policy):
    cfg = make_config(policy, max_steps=8, eval={"interval": 100})
    run, cap = _run(cfg)
    alg = run.algorithm
    k = num_selected(cfg.selection.gamma, 8 * 127)
    for rec in cap.records:
        if policy == "full" or rec.step < cfg.selection.warmup_steps:
            assert rec.n_kept == rec.n_valid
        else:
            assert rec.n_kept == k
    if policy == "rho1":  # one static reference, trained before step 0, never refreshed
        assert [(r["step"], r["version"]) for r in alg.refresh_log] == [(0, 0)]
        assert {r.ref_version for r in cap.records if r.step >= 2} == {0}
        assert alg.counts["refreshes"] == 0
    if policy == "blade-nosync":  # the reference optimizer state is carried between refreshes
        assert alg.counts["refreshes"] == 2 and alg.reference.optimizer_state() is not None
    if policy in ("full", "random"):
        assert alg.reference is None and alg.counts["score_steps"] == 0
    if policy == "random":
        other = make_config(policy, "random2", max_steps=8, eval={"interval": 100}, selection={"seed": 1})
        _, cap2 = _run(other)
        assert not np.array_equal(cap.records[-1].mask, cap2.records[-1].mask)


def test_blade_with_microbatches_selects_per_microbatch(make_config):
    cfg = make_config("blade", "mb", max_steps=6, microbatch_size=3, eval={"interval": 100})
    _, cap = _run(cfg)
    gamma = cfg.selection.gamma
    for rec in cap.records[2:]:
        expected = [num_selected(gamma, int(rec.valid[i : i + 3].sum())) for i in (0, 3, 6)]
        assert [int(rec.mask[i : i + 3].sum()) for i in (0, 3, 6)] == expected


def test_scores_from_scored_shards_give_the_same_masks_as_the_in_process_reference(make_config, tmp_path):
    base = make_config("rho1", "a", max_steps=7, eval={"interval": 100})
    ref = build_causal_lm(base.model.model_copy(update={"init_seed": 11}))
    weights = save_weights(ref, str(tmp_path / "ref.safetensors"))
    a = make_config("rho1", "a", max_steps=7, eval={"interval": 100}, selection={"reference_weights": weights})
    out_a = train(a)
    # the reference is kept with the final weights (rho1: exactly the static reference it was given)
    from safetensors.torch import load_file

    saved, given = load_file(out_a.final_reference), ref.state_dict()
    assert saved and all(torch.equal(v, given[k]) for k, v in saved.items())
    # the Ray engine's job, done here in-process: score the stream's steps W.. with the same reference
    scored = str(tmp_path / "scored")
    reader = StreamReader.open(a.data.candidates, batch_size=a.batch_size, seed=a.seed)
    scorer = build_scorer(ScorerConfig(model=a.model, weights=weights, device="cpu", batch_size=a.batch_size))
    write_scored_steps(scored, reader, scorer, range(2, 7), episode_of=lambda t: 0, vocab_size=512)
    b = make_config("rho1", "b", max_steps=7, eval={"interval": 100}, data={"scored": scored})
    out_b = train(b)
    assert out_b.run.algorithm.reference is None  # no in-process reference at all
    assert out_b.final_reference is None
    ma, mb = read_column(out_a.selected, "loss_mask"), read_column(out_b.selected, "loss_mask")
    assert len(ma) == len(mb) == 56 and all(np.array_equal(x, y) for x, y in zip(ma, mb, strict=True))
    sa, sb = read_column(out_a.selected, "score"), read_column(out_b.selected, "score")
    assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(sa, sb, strict=True))

    # scores from another reference version are refused (stale scores)
    stale = str(tmp_path / "stale")
    write_scored_steps(stale, reader, scorer, range(2, 7), episode_of=lambda t: 1, vocab_size=512)
    c = make_config("rho1", "c", max_steps=7, data={"scored": stale})
    with pytest.raises(ValueError, match="stale scores"):
        train(c)


def test_a_non_finite_proxy_loss_fails_clearly(make_config):
    class Poison(Callback):
        def batch_start(self, state, logger):
            if int(state.timestamp.batch) == 3:
                with torch.no_grad():
                    state.model.model.lm_head.weight[0, 0] = float("nan")

    from training.runs.wiring import build_training

    cfg = make_config("blade", max_steps=5)  # checkpoints every 4 steps: the next one would hold step 3
    run = build_training(cfg, callbacks=[Poison()])
    with pytest.raises(ValueError, match="step 3: the proxy's token loss is not finite"):
        run.trainer.fit()
    run.trainer.close()
    # checked once the step's results are read on the host (after its update, not between forward and backward
    # as a sync there would cost a GPU step), and before the step is recorded or checkpointed
    assert run.algorithm.last.step == 2
    assert not [f for f in os.listdir(os.path.join(cfg.output_dir, "checkpoints")) if "ba4" in f]


def test_one_precision_setting_reaches_the_reference_scorer(make_config):
    """The trainer's `precision` is the in-process reference's (on a CPU both run in float32)."""
    cfg = make_config("blade", "prec", max_steps=4, eval={"interval": 100})
    run = train(cfg).run
    assert run.algorithm.reference.settings.precision == "fp32"
    assert run.algorithm.reference.scorer.precision == "fp32"


@pytest.mark.gpu
def test_exact_mode_on_cuda_in_bf16_gives_the_same_masks_from_scored_shards(make_config, tmp_path):
    """On a GPU under amp_bf16, ℓ(w̃) scored by a worker-style scorer (the trainer's precision) gives the masks
    of the in-process reference; and the bf16 scores stay within tolerance of float32 ones."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (amp_bf16 exact mode)")
    base = make_config("rho1", "ga", max_steps=7, eval={"interval": 100})
    ref = build_causal_lm(base.model.model_copy(update={"init_seed": 11}))
    weights = save_weights(ref, str(tmp_path / "ref.safetensors"))
    common = dict(max_steps=7, eval={"interval": 100}, device="cuda", precision="amp_bf16")
    a = make_config("rho1", "ga", selection={"reference_weights": weights}, **common)
    out_a = train(a)
    scored = str(tmp_path / "scored")
    reader = StreamReader.open(a.data.candidates, batch_size=a.batch_size, seed=a.seed)
    scorer = build_scorer(ScorerConfig(model=a.model, weights=weights, device="cuda", batch_size=a.batch_size,
                                          precision="amp_bf16"))
    write_scored_steps(scored, reader, scorer, range(2, 7), episode_of=lambda t: 0, vocab_size=512)
    b = make_config("rho1", "gb", data={"scored": scored}, **common)
    out_b = train(b)
    ma, mb = read_column(out_a.selected, "loss_mask"), read_column(out_b.selected, "loss_mask")
    assert len(ma) == len(mb) and all(np.array_equal(x, y) for x, y in zip(ma, mb, strict=True))
    fp32 = build_scorer(ScorerConfig(model=a.model, weights=weights, device="cuda", batch_size=a.batch_size))
    tokens = reader.read(3).tokens
    lo, hi = scorer(tokens).astype(np.float32), fp32(tokens).astype(np.float32)
    assert np.max(np.abs(lo - hi) / np.maximum(np.abs(hi), 1.0)) < 3e-2
