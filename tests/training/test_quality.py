"""training.quality: the compute model (hand-computed FLOPs), seed intervals, equal-compute snapshots."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from training.quality.report import seed_interval
from training.quality.setting import (
    Setting,
    compute,
    equal_compute_steps,
    eval_sources,
    forward_flops_per_token,
)

TINY = Setting(hidden=4, layers=1, vocab=10, seq_len=8, batch=2, warmup=2, tau=3, rho1_steps=5, steps=10)


def test_flops_by_hand():
    # per layer: q,k,v,o 4·4² = 64, MLP 3·4·8 = 96 (intermediate int(4·8/3)//8·8 = 8); head 4·10 = 40
    # forward per token: 2·(160 + 40) + attention 2·1·8·4 = 464
    assert forward_flops_per_token(TINY) == 464
    tokens = 2 * 8
    full = compute(TINY, "full", 10)
    assert (full.proxy, full.scoring, full.refresh) == (3 * 464 * tokens * 10, 0, 0)
    assert compute(TINY, "random", 10) == full
    rho1 = compute(TINY, "rho1", 10)  # scoring after W = 2 steps; static reference: 5 steps of b/4 = 1 sequence
    assert (rho1.scoring, rho1.refresh) == (464 * tokens * 8, 3 * 464 * 1 * 8 * 5)
    sel = {"refresh_steps": 2, "lam": 1.0, "refresh_batch_size": 2}
    blade = compute(TINY, "blade", 10, sel=sel)  # refreshes before steps 2, 5, 8: 3 × 2 steps × (2 val + 2 cand) × 8
    assert blade.refresh == 3 * 464 * (2 * 8 * 2) * 2 * 3
    assert compute(TINY, "blade", 10, sel={**sel, "lam": 0.0}).refresh == blade.refresh / 2  # no candidate batch
    assert compute(TINY, "blade-nosync", 10, sel=sel) == blade
    assert blade.total == blade.proxy + blade.scoring + blade.refresh
    assert equal_compute_steps(TINY, "blade", sel) == round(blade.total / (3 * 464 * tokens))
    assert equal_compute_steps(TINY, "full") == equal_compute_steps(TINY, "random") == 10


def test_seed_interval():
    iv = seed_interval([0.1, 0.2, 0.3])
    half = 4.303 * 0.1 / math.sqrt(3)
    assert (iv.value, iv.lo, iv.hi) == pytest.approx((0.2, 0.2 - half, 0.2 + half))
    assert seed_interval([0.5]).lo == seed_interval([0.5]).hi == 0.5
    assert seed_interval([-0.1, -0.1]).hi == pytest.approx(-0.1)  # no spread: a zero-width interval


def test_evaluation_sets_are_disjoint_from_pool_and_base():
    from training.quality.setting import SOURCES, data_configs

    s = Setting()
    cfgs = data_configs(s, "/tmp/unused")
    pool = {c.name: c for c in cfgs["pool"].sources}
    base = {c.name: c for c in cfgs["base"].sources}
    assert "math" not in pool and "aqua" not in pool  # math in other styles is evaluation only
    for ev in eval_sources(s):
        name = ev.name.removesuffix("_heldout")
        if ev.name.endswith("_heldout"):  # [base | held-out | pool] slices of the same documents
            assert ev.skip_documents == base[name].max_documents
            assert pool[name].skip_documents == ev.skip_documents + ev.max_documents
        else:
            assert all(ev.paths[0] not in c.paths for c in [*pool.values(), *base.values()])
    assert {n for n, *_, held, _ in SOURCES if held} == {"c4", "wikitext2", "lambada"}


@pytest.mark.slow
def test_full_snapshot_equals_a_shorter_run(make_config, tmp_path):
    """The equal-compute `full` models are snapshots of one long run: the same weights as a shorter run."""
    from training.quality.runs import run_training

    short = run_training(make_config("full", name="short", max_steps=4), str(tmp_path / "short" / "result.json"))
    long = run_training(make_config("full", name="long", max_steps=7), str(tmp_path / "long" / "result.json"),
                        snapshots=(4, 7))
    a, b = load_file(short["final_weights"]), load_file(long["snapshots"]["4"])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    last = load_file(long["final_weights"])
    assert all((last[k] == load_file(long["snapshots"]["7"])[k]).all() for k in last)
    assert long["config"]["snapshots"] == [4, 7]


def test_gpu_preset_meets_the_brief():
    """One H100-class GPU: a 30–125M-parameter Llama, context ≥ 512, the GPT-2 tokenizer, ≥ 2,000 proxy
    steps, 3 seeds, resumable in pieces."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from training.quality.setting import PRESETS, SHARED, model_config

    s = PRESETS["gpu"]
    cfg = dict(model_config(s).hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    assert 30e6 <= sum(p.numel() for p in model.parameters()) <= 125e6
    assert s.seq_len >= 512 and s.steps >= 2000 and s.seeds == 3 and s.long_steps >= s.steps
    assert s.tokenizer == "tokenizer_gpt2/gpt2_tokenizer.json" and s.vocab >= 50257
    assert s.checkpoint_interval is not None and s.checkpoint_interval < s.steps
    assert PRESETS["cpu"] == Setting()  # the default preset is the previous CPU setting
    assert SHARED.endswith("data")


def test_a_run_recorded_before_new_defaulted_settings_is_still_reused():
    """A package upgrade that adds settings with behaviour-preserving defaults must not retrain (or delete) runs."""
    from schemas.train_config import TrainConfig
    from training.quality.runs import _effective

    cfg = TrainConfig.demo_default().model_dump(mode="json")
    old = {k: v for k, v in cfg.items() if k != "parallel"}
    old["selection"] = {k: v for k, v in cfg["selection"].items() if k != "scope"}
    assert _effective(old) == _effective(cfg)
    changed = {**old, "batch_size": old["batch_size"] * 2}
    assert _effective(changed) != _effective(cfg)
