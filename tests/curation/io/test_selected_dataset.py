"""Selected-token shards read by other trainers: HF labels (-100 where loss_mask is 0) from shards the trainer wrote,
through our reader and streaming's; ``transformers.Trainer`` trains on them with a loss equal to our masked loss."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from curation.core.losses import target_valid, token_losses
from curation.core.selection import masked_mean
from curation.io.selected_dataset import (
    IGNORE_INDEX,
    SelectedTokens,
    StreamingSelectedTokens,
    hf_example,
    hf_labels,
)
from curation.io.shards import read_column
from schemas.manifest import Manifest
from tests.training.conftest import VOCAB, prepare_small_demo, tiny_config
from training.runs.train_job import train

ROWS, STEPS, WARMUP = 8, 5, 2


@pytest.fixture(scope="module")
def selected(tmp_path_factory) -> str:
    """A blade run's selected/ (2 warm-up steps, then 3 selecting ones: 40 rows of 128 tokens)."""
    root = prepare_small_demo(str(tmp_path_factory.mktemp("demo")))
    cfg = tiny_config(root, str(tmp_path_factory.mktemp("run") / "blade"), max_steps=STEPS, eval={"interval": 100},
                      selection={"warmup_steps": WARMUP})
    return train(cfg).selected


def test_hf_labels_by_hand():
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0]], dtype=torch.uint8)
    assert hf_labels(tokens, mask).tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]
    assert hf_labels(tokens[0], mask[0]).tolist() == [-100, -100, 7, 8]  # one row: position 0 never labelled
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2, 3\), tokens have \(2, 4\)"):
        hf_labels(tokens, mask[:, :3])
    with pytest.raises(KeyError, match="not a selected-token shard directory"):
        hf_example({"tokens": np.zeros(4, np.uint16), "source": "x"})


def test_labels_are_the_tokens_exactly_where_the_trainer_kept_them(selected):
    tokens, masks, scores = (read_column(selected, c) for c in ("tokens", "loss_mask", "score"))
    steps = read_column(selected, "step")
    ds = SelectedTokens(selected)
    assert len(ds) == len(tokens) == ROWS * STEPS
    labelled = 0
    for i in range(len(ds)):
        ex = ds[i]
        assert ex["input_ids"].dtype == ex["labels"].dtype == torch.int64
        assert ex["input_ids"].tolist() == tokens[i].astype(np.int64).tolist()
        keep = masks[i].astype(bool)
        assert not keep[0]  # position 0: no target
        expected = np.where(keep, tokens[i].astype(np.int64), IGNORE_INDEX)
        assert ex["labels"].tolist() == expected.tolist()
        labelled += int((ex["labels"] != IGNORE_INDEX).sum())
        if steps[i] < WARMUP:  # warm-up rows train on every target and carry no score
            assert keep[1:].all() and np.isnan(scores[i].astype(np.float32)).all()
        else:  # Δ at every target, 0 at position 0
            assert scores[i][0] == 0 and np.isfinite(scores[i].astype(np.float32)).all()
            assert 0 < keep.sum() < len(keep) - 1
    kept = sum(r.state["kept_tokens"] for r in Manifest.load(selected).shards)
    assert labelled == kept  # every kept token has its label, nothing else


def test_streaming_reads_the_same_examples_from_its_own_cache(selected, tmp_path):
    """The remote/local pair: streaming decompresses into the separate ``local`` cache, the run's directory is left
    as the trainer wrote it."""
    before = sorted(os.path.join(d, f) for d, _, fs in os.walk(selected) for f in fs)
    ours = SelectedTokens(selected)
    theirs = StreamingSelectedTokens(remote=selected, local=str(tmp_path / "cache"), shuffle=False, batch_size=ROWS,
                                     validate_hash="xxh64")
    assert len(theirs) == len(ours)
    for i in (0, 9, len(ours) - 1):
        a, b = ours[i], theirs[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert sorted(os.path.join(d, f) for d, _, fs in os.walk(selected) for f in fs) == before


class _RecordingTrainer(Trainer):
    """HF's Trainer, recording each step's inputs, HF's loss and the logits it came from."""

    seen: list[tuple[dict[str, torch.Tensor], float, torch.Tensor]]

    def compute_loss(self, model, inputs, return_outputs=False, **kw):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kw)
        self.seen.append(({k: v.detach().clone() for k, v in inputs.items()}, float(loss), outputs.logits.detach()))
        return (loss, outputs) if return_outputs else loss


def test_the_hf_trainer_trains_on_the_selection_with_our_masked_loss(selected, tmp_path):
    """``transformers.Trainer`` (shuffled batches, its own collator) on :class:`SelectedTokens`: each step's loss is our
    masked mean ``Σ α ℓ / Σ α`` of the same logits, with α the shards' ``loss_mask`` of the rows it drew."""
    tokens, masks = read_column(selected, "tokens"), read_column(selected, "loss_mask")
    row_of = {t.astype(np.int64).tobytes(): i for i, t in enumerate(tokens)}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=128))
    before = [p.detach().clone() for p in model.parameters()]
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=ROWS, max_steps=3,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                             dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = _RecordingTrainer(model=model, args=args, train_dataset=SelectedTokens(selected))
    trainer.seen = []
    trainer.train()
    assert len(trainer.seen) == 3
    for inputs, hf_loss, logits in trainer.seen:
        rows = [row_of[r.numpy().tobytes()] for r in inputs["input_ids"]]
        alpha = torch.from_numpy(np.stack([masks[i] for i in rows]).astype(bool))
        losses, valid = token_losses(logits, inputs["input_ids"])
        assert torch.equal(valid, target_valid(inputs["input_ids"]))
        ours = float(masked_mean(losses, alpha & valid))
        assert hf_loss == pytest.approx(ours, rel=1e-6, abs=1e-6)
        assert 0 < int(alpha.sum()) < alpha.numel()
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert logged == pytest.approx([s[1] for s in trainer.seen], abs=1e-4)  # what the user sees is that loss
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
