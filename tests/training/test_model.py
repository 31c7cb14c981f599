"""The masked-loss ComposerModel: hand-computed loss, mask independence, microbatch normalisation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from curation.io.models import build_causal_lm
from schemas.train_config import demo_model_config
from training.blocks.data import annotate_batch, make_data_spec, split_batch
from training.blocks.model import MaskedCausalLM, TokenLoss, TokenPerplexity

V = 64


class FixedLogits(nn.Module):
    """``model(tokens)`` returns a fixed logits tensor (a leaf we can take gradients against)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits


def _hand_nll(row: list[float], target: int) -> float:
    return -(row[target] - math.log(sum(math.exp(x) for x in row)))


def test_masked_loss_equals_hand_computation():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [5.0, -1.0, 0.5], [0.3, 0.2, 0.1]]])
    tokens = torch.tensor([[2, 0, 1, 2]])
    mask = torch.tensor([[True, True, False, True]])  # position 0 predicts nothing: never counted
    model = MaskedCausalLM(FixedLogits(logits.clone()))
    batch = {"tokens": tokens, "loss_mask": mask}
    loss = model.loss(model(batch), batch)
    # kept positions 1 and 3: targets 0 under logits[0] and 2 under logits[2]
    expected = (_hand_nll([1.0, 2.0, 3.0], 0) + _hand_nll([5.0, -1.0, 0.5], 2)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # without a mask: mean over every loss position 1..3
    everything = (_hand_nll([1.0, 2.0, 3.0], 0) + _hand_nll([0.0, 0.0, 0.0], 1) + _hand_nll([5.0, -1.0, 0.5], 2)) / 3
    assert model.loss(model({"tokens": tokens}), {"tokens": tokens}).item() == pytest.approx(everything, abs=1e-6)
    # the annotated (microbatch-ready) path gives the same value on a whole batch
    annotated = annotate_batch({"tokens": tokens, "loss_mask": mask})
    assert annotated["kept_total"] == 2 and annotated["rows_total"] == 1
    assert model.loss(model(annotated), annotated).item() == pytest.approx(expected, abs=1e-6)


def test_gradient_does_not_depend_on_targets_of_unmasked_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, V, generator=g)
    tokens = torch.randint(0, V, (3, 6), generator=g)
    mask = torch.rand(3, 6, generator=g) < 0.5
    mask[:, 1] = True

    def grad(tok: torch.Tensor) -> torch.Tensor:
        model = MaskedCausalLM(FixedLogits(logits.clone()))
        batch = annotate_batch({"tokens": tok, "loss_mask": mask})
        model.loss(model(batch), batch).backward()
        return model.model.logits.grad.clone()

    perturbed = tokens.clone()
    perturbed[~mask] = (perturbed[~mask] + 17) % V  # every unmasked target changes
    assert torch.equal(grad(tokens), grad(perturbed))
    kept = tokens.clone()
    kept[0, 1] = (kept[0, 1] + 1) % V  # a kept target does matter (the test can fail)
    assert not torch.equal(grad(tokens), grad(kept))


def test_end_to_end_gradient_ignores_an_unmasked_final_target():
    # With a real causal LM a token is also context for later positions; the last token is only a
    # target, so when its position is unmasked, changing it must not change any gradient.
    torch.manual_seed(0)
    hf = build_causal_lm(demo_model_config(V, hidden=32, layers=1, seq_len=16))
    tokens = torch.randint(0, V, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[:, -1] = False

    def grads(tok: torch.Tensor) -> list[torch.Tensor]:
        model = MaskedCausalLM(copy.deepcopy(hf))
        batch = annotate_batch({"tokens": tok, "loss_mask": mask})
        model.loss(model(batch), batch).backward()
        return [p.grad.clone() for p in model.parameters()]

    other = tokens.clone()
    other[:, -1] = (other[:, -1] + 5) % V
    assert all(torch.equal(a, b) for a, b in zip(grads(tokens), grads(other), strict=True))


def _composer_step(hf: nn.Module, batch: dict, microbatch: int) -> dict[str, torch.Tensor]:
    """One Composer SGD step (lr 1) on ``batch``: returns θ_before − θ_after = the gradient."""
    from composer import Trainer

    model = MaskedCausalLM(copy.deepcopy(hf))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    loader = DataLoader([batch], batch_size=None)
    trainer = Trainer(
        model=model, train_dataloader=make_data_spec(loader), max_duration="1ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=1.0), device="cpu",
        device_train_microbatch_size=microbatch, accumulate_train_batch_on_tokens=False,
        progress_bar=False, log_to_console=False, loggers=[],
    )
    trainer.fit()
    trainer.close()
    return {k: before[k] - v.detach() for k, v in model.named_parameters()}


def test_microbatched_and_full_batch_gradients_match():
    torch.manual_seed(0)
    hf = build_causal_lm(demo_model_config(V, hidden=32, layers=1, seq_len=16))
    tokens = torch.randint(0, V, (7, 16))
    # very different kept counts per row, so a per-microbatch mean would be wrong
    mask = torch.zeros(7, 16, dtype=torch.bool)
    mask[0, 1:] = True
    mask[3, 5:7] = True
    mask[6, 2] = True
    batch = {"tokens": tokens, "loss_mask": mask, "source": ["s"] * 7}
    full = _composer_step(hf, batch, 7)
    micro = _composer_step(hf, batch, 3)  # 3 + 3 + 1 rows
    # reference: the gradient of the masked mean over the whole batch, by plain autograd
    ref_model = MaskedCausalLM(copy.deepcopy(hf))
    ref_model.loss(ref_model({"tokens": tokens, "loss_mask": mask}), {"tokens": tokens, "loss_mask": mask}).backward()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(full[name], p.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(micro[name], p.grad, rtol=1e-5, atol=1e-7)
    # a per-microbatch mean (what an unannotated loss would give) is measurably different
    model = MaskedCausalLM(copy.deepcopy(hf))
    with torch.no_grad():
        whole = float(model.loss(model({"tokens": tokens, "loss_mask": mask}), {"tokens": tokens, "loss_mask": mask}))
        naive = sum(float(model.loss(model(mb), mb)) * mb["tokens"].shape[0] / 7
                    for mb in split_batch({"tokens": tokens, "loss_mask": mask}, 3))
    assert abs(naive - whole) > 1e-3


def test_split_batch_matches_composer_default_order():
    from composer.core.data_spec import _default_split_batch

    batch = {"tokens": torch.arange(20).view(10, 2), "source": [str(i) for i in range(10)], "step": 3}
    ours, theirs = split_batch(batch, 4), _default_split_batch(batch, 4)
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and a["source"] == b["source"] and a["step"] == b["step"] == 3
    assert len(split_batch(batch, 16)) == 1  # a short (last) batch is one microbatch


def test_validation_metrics():
    losses = torch.tensor([[0.0, 1.0, 3.0], [0.0, 2.0, 10.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    m, p = TokenLoss(), TokenPerplexity()
    m.update(losses, mask)
    p.update(losses, mask)
    assert m.compute().item() == pytest.approx(2.0)
    assert p.compute().item() == pytest.approx(math.exp(2.0), rel=1e-6)
