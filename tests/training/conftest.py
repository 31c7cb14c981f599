"""Fixtures for the training tests: a small demo corpus prepared once per session, tiny configs."""

from __future__ import annotations

import os

import pytest

from curation.ingest.demo import write_demo_corpus
from curation.ingest.prepare import prepare
from schemas.config import PrepareConfig
from schemas.train_config import TrainConfig, demo_model_config

#: Small demo corpus: ≈ 600 candidate and ≈ 50 validation sequences of 128 tokens, vocab 512.
SIZES = {"target": 300, "general": 300, "noise": 150, "target_val": 80}
VOCAB = 512


def prepare_small_demo(root: str) -> str:
    """Prepare the small demo corpus under ``root`` (``root/data/{candidates,validation,tokenizer}``)."""
    write_demo_corpus(os.path.join(root, "raw"), sizes=SIZES)
    cfg = PrepareConfig.demo_default(root)
    cfg = cfg.model_copy(update={"progress": False, "tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": VOCAB})})
    prepare(cfg)
    return root


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> str:
    return prepare_small_demo(str(tmp_path_factory.mktemp("demo")))


def _merge(base: dict, updates: dict) -> dict:
    out = dict(base)
    for k, v in updates.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_config(root: str, out: str, policy: str = "blade", **updates) -> TrainConfig:
    """A few-second run: tiny Llama, b=8, W=2, τ=3, K=2, checkpoints every 4 steps.

    ``updates`` are merged into the config (nested dicts merge into sections).
    """
    base = TrainConfig.demo_default(root, policy=policy).model_dump(mode="json")
    tiny = {
        "model": demo_model_config(VOCAB, hidden=32, layers=1).model_dump(mode="json"),
        "output_dir": out,
        "batch_size": 8,
        "max_steps": 11,
        "progress_bar": False,
        "plots": False,
        "threads": 1,
        "device": "cpu",  # the tests compare with CPU float32 values, also on a machine with a GPU
        "selection": {"warmup_steps": 2, "tau": 3, "refresh_steps": 2, "refresh_batch_size": 2, "rho1_steps": 3,
                      "refresh_candidate_batches": 2},
        "eval": {"interval": 5, "batch_size": 16, "max_batches": 1},
        "checkpoint": {"interval": 4, "keep": -1},
    }
    return TrainConfig.model_validate(_merge(_merge(base, tiny), updates))


@pytest.fixture
def make_config(demo_root, tmp_path):
    """``make_config(policy, name=policy, **updates)`` → a tiny :class:`TrainConfig` writing under tmp_path."""

    def make(policy: str = "blade", name: str | None = None, **updates) -> TrainConfig:
        return tiny_config(demo_root, str(tmp_path / (name or policy)), policy, **updates)

    return make


@pytest.fixture(scope="session")
def single_blade_12(demo_root, tmp_path_factory):
    """The single-process blade run of :func:`tiny_config` for 12 steps (computed once per test process): what the
    data-parallel runs of that config are compared with (tests/training/test_parallel*.py): ``train``'s
    :class:`~training.runs.finish.Finished`, without the wired run."""
    import dataclasses

    from training.runs.train_job import train

    res = train(tiny_config(demo_root, str(tmp_path_factory.mktemp("single-blade-12") / "single"), "blade",
                            max_steps=12))
    return dataclasses.replace(res, run=None)
