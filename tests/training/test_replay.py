"""Replay (BLADE-Tr): another model size trained on selected-token shards honours the loss mask;
a reader that only knows `tokens` (llm-foundry's text dataset) reads the shards too."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from streaming import StreamingDataset

from curation.io.models import build_causal_lm
from curation.io.outdir import ConfigMismatch
from curation.io.shards import read_column
from schemas.train_config import ReplayConfig, demo_model_config
from training.blocks.data import TokenRows, rows_loader
from training.blocks.model import MaskedCausalLM
from training.runs.train_job import build_replay, replay, train


@pytest.fixture
def selected(make_config):
    # W = 0: every step selects (refresh before step 0), so every replayed batch has a real mask
    out = train(make_config("blade", "source-run", max_steps=6, eval={"interval": 100}, selection={"warmup_steps": 0}))
    return out.selected


def _replay_cfg(demo_root, selected, out, **kw) -> ReplayConfig:
    data = {
        "selected": selected,
        "validation": os.path.join(demo_root, "data", "validation"),
        "tokenizer": os.path.join(demo_root, "data", "tokenizer", "tokenizer.json"),
        "model": demo_model_config(512, hidden=48, layers=2).model_dump(),  # wider and deeper than the proxy
        "output_dir": out,
        "batch_size": 8,
        "progress_bar": False,
        "threads": 1,
        "eval": {"interval": 3, "batch_size": 16, "max_batches": 1},
        **kw,
    }
    return ReplayConfig.model_validate(data)


def test_replay_loader_reads_the_trained_masks_in_training_order(selected):
    rows = TokenRows(selected, "selected", use_mask=True)
    batch = next(iter(rows_loader(rows, batch_size=8)))
    masks, steps = read_column(selected, "loss_mask"), read_column(selected, "step")
    assert steps[:8] == [0] * 8 and batch["loss_mask"].dtype == torch.bool and not batch["loss_mask"].all()
    assert np.array_equal(batch["loss_mask"].numpy(), np.stack(masks[:8]).astype(bool))


def test_replay_trains_on_kept_tokens_only(demo_root, selected, tmp_path):
    cfg = _replay_cfg(demo_root, selected, str(tmp_path / "replay"), max_steps=1, optim={"lr": 1e-2})
    run = build_replay(cfg)
    hf0 = build_causal_lm(cfg.model)  # the same initial weights (seeded init)
    run.trainer.fit()
    loss = run.trainer.state.total_loss_dict["loss/train/total"]
    run.trainer.close()
    rows = TokenRows(selected, "selected", use_mask=True)
    first = next(iter(rows_loader(rows, batch_size=8)))
    assert 0.5 < first["loss_mask"].float().mean() < 0.7  # γ = 0.6 of the 127 loss positions per row
    model = MaskedCausalLM(hf0)
    with torch.no_grad():
        masked = float(model.loss(model(first), first))
        unmasked = float(model.loss(model({"tokens": first["tokens"]}), {"tokens": first["tokens"]}))
    assert loss == pytest.approx(masked, rel=1e-5)
    assert abs(masked - unmasked) > 1e-3  # the test can tell a masked from an unmasked loss


def test_replay_job_wiring_to_a_bigger_model(demo_root, selected, tmp_path):
    out = replay(_replay_cfg(demo_root, selected, str(tmp_path / "replay")))
    assert os.path.exists(out.final_weights)
    assert [p["step"] for p in out.validation] == [3, 6]
    assert sum(p.numel() for p in out.run.model.parameters()) > 2 * sum(
        p.numel() for p in build_causal_lm(demo_model_config(512, hidden=32, layers=1)).parameters())


def test_a_reader_that_only_knows_tokens_reads_selected_shards(selected, tmp_path):
    """llm-foundry's StreamingTextDataset reads `tokens` only (ndarray column → int64 tensor)."""

    class TokensOnlyTextDataset(StreamingDataset):
        def __getitem__(self, idx):
            sample = super().__getitem__(idx)
            return torch.from_numpy(sample["tokens"][:128].copy()).to(torch.int64)

    local = str(tmp_path / "copy")  # StreamingDataset decompresses shards next to them
    shutil.copytree(selected, local)
    ds = TokensOnlyTextDataset(local=local, shuffle=False, batch_size=8)
    tokens = read_column(selected, "tokens")
    assert len(ds) == len(tokens) == 48
    for i in (0, 17, 47):
        assert ds[i].dtype == torch.int64 and torch.equal(ds[i], torch.from_numpy(tokens[i].astype(np.int64)))


def test_plain_pytorch_and_hf_labels_reproduce_the_masked_loss(selected, tmp_path):
    """A hand-written collate (what curation.io.selected_dataset does): labels = tokens where loss_mask else -100;
    HF's own loss (it shifts labels internally) is then exactly our masked mean."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    local = str(tmp_path / "copy")
    shutil.copytree(selected, local)
    ds = StreamingDataset(local=local, shuffle=False, batch_size=8, validate_hash="xxh64")

    def collate(rows):
        tokens = torch.from_numpy(np.stack([r["tokens"] for r in rows]).astype(np.int64))
        mask = torch.from_numpy(np.stack([r["loss_mask"] for r in rows]).astype(bool))
        return {"input_ids": tokens, "labels": tokens.masked_fill(~mask, -100)}

    loader = torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    batch = next(iter(loader))
    ours = MaskedCausalLM(model)
    ref_batch = {"tokens": batch["input_ids"], "loss_mask": batch["labels"] != -100}
    with torch.no_grad():
        assert float(model(**batch).loss) == pytest.approx(float(ours.loss(ours(ref_batch), ref_batch)), rel=1e-5)
    for i, batch in enumerate(loader):  # a few plain steps work
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if i == 2:
            break
    assert torch.isfinite(loss)


def test_a_rerun_with_another_source_is_refused_not_reported_as_replayed(demo_root, selected, tmp_path):
    out = str(tmp_path / "replay-src")
    cfg = _replay_cfg(demo_root, selected, out, max_steps=2)
    replay(cfg)
    other = str(tmp_path / "other-selected")
    shutil.copytree(selected, other)
    before = {name: open(os.path.join(out, name), "rb").read() for name in ("config.yaml", "validation.json")}
    with pytest.raises(ConfigMismatch) as err:
        replay(cfg.model_copy(update={"selected": other}))
    assert err.value.keys == ["selected"] and f'selected: "{selected}" → "{other}"' in str(err.value)
    assert {name: open(os.path.join(out, name), "rb").read() for name in before} == before
