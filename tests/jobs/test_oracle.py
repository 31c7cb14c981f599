"""Every training path equals the one-page BLADE loop (:func:`curation.core.loop.blade_loop`) bit for bit on
CPU float32: ``jobs/train.py`` (single process, exact mode) for every policy, here; ``jobs/curate_and_train.py`` in
exact mode on Ray and its pipelined mode with ``P = 1`` in tests/jobs/test_curate_and_train.py (its runs of the same
config, compared with :func:`oracle` through :func:`assert_equals_oracle`). Compared: the sequences and the mask α of
every step (the selected-token shards), the final proxy weights, and the refresh log."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from curation.core.loop import LoopResult, blade_loop
from curation.io.models import build_causal_lm
from curation.io.shards import open_shards, read_column
from schemas.train_config import TrainConfig
from tests.conftest import load_job

REPO = Path(__file__).resolve().parents[2]


def _tokens(path: str) -> torch.Tensor:
    ds = open_shards(path, "candidate")
    return torch.stack([torch.from_numpy(np.asarray(ds[i]["tokens"]).astype(np.int64)) for i in range(len(ds))])


def oracle(train: dict) -> tuple[LoopResult, torch.Tensor]:
    """The loop on the run's data and settings (and the candidate tokens, to check each step's sequences)."""
    cfg = TrainConfig.model_validate(train)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or threads)  # the runs' setting (tiny_train: 1)
    try:
        cand = _tokens(cfg.data.candidates)
        out = blade_loop(build_causal_lm(cfg.model), cand, _tokens(cfg.data.validation), selection=cfg.selection,
                         optim=cfg.optim, batch_size=cfg.batch_size, steps=cfg.max_steps, seed=cfg.seed,
                         refresh_batch_size=cfg.refresh_batch_size)
    finally:
        torch.set_num_threads(threads)
    return out, cand


def assert_equals_oracle(run_dir: str, expected: LoopResult, candidates: torch.Tensor) -> None:
    selected = os.path.join(run_dir, "selected")
    steps = np.asarray(read_column(selected, "step"))
    tokens, masks = read_column(selected, "tokens"), read_column(selected, "loss_mask")
    assert sorted(set(steps.tolist())) == list(range(len(expected.masks)))
    for t, (ids, alpha) in enumerate(zip(expected.sample_ids, expected.masks, strict=True)):
        rows = np.flatnonzero(steps == t)
        assert torch.equal(torch.from_numpy(np.stack([tokens[i] for i in rows]).astype(np.int64)), candidates[ids]), t
        assert torch.equal(torch.from_numpy(np.stack([masks[i] for i in rows]).astype(bool)), alpha), t
    final = load_file(os.path.join(run_dir, "final", "model.safetensors"))
    want = expected.model.state_dict()
    assert final.keys() == want.keys()
    assert all(torch.equal(final[k], want[k]) for k in want), [k for k in want if not torch.equal(final[k], want[k])]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        refreshes = json.load(f)["refreshes"]
    assert [{k: r[k] for k in e} for r, e in zip(refreshes, expected.refresh_log, strict=True)] == expected.refresh_log


@pytest.fixture(scope="module")
def blade(tiny_train, tmp_path_factory):
    """The oracle of the tiny blade run (14 steps, W = 2, τ = 4, K = 2, b = 8)."""
    train = tiny_train(str(tmp_path_factory.mktemp("oracle") / "unused"))
    return (*oracle(train), train)


@pytest.mark.parametrize("policy", ["blade", "blade-nosync", "rho1", "random", "full"])
def test_the_single_process_trainer_equals_the_loop(tiny_train, tmp_path, policy, blade):
    train = tiny_train(str(tmp_path / "run"), selection={"policy": policy})
    expected, cand = blade[:2] if policy == "blade" else oracle(train)
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(train))
    assert load_job("train", "_oracle").main(["--config", str(config)]) == 0
    assert_equals_oracle(train["output_dir"], expected, cand)
    if policy == "blade":  # the loop is not trivially satisfied: another policy's run differs from it
        other, _ = oracle({**train, "selection": {**train["selection"], "policy": "blade-nosync"}})
        assert not all(torch.equal(a, b) for a, b in zip(other.masks, expected.masks, strict=True))
