"""RefreshData: the refresh's batches and call, built once for the trainer and the refresh actor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from curation.core.policies import get_policy
from curation.core.refresh import RefreshSettings, refresh_reference, train_static_reference
from curation.core.refresh_data import RecentMasks, RefreshData
from curation.core.schedule import Schedule
from schemas.train_config import SelectionConfig

L = 6  # sequence length
B = 2  # candidate rows per proxy step
N_VAL = 10  # validation rows


def val_tokens(ids: np.ndarray) -> torch.Tensor:
    """Validation row i is ``[i, i, ...]``: a batch's tokens say which rows it holds."""
    return torch.as_tensor(np.asarray(ids), dtype=torch.int64)[:, None].repeat(1, L)


def step_tokens(step: int) -> torch.Tensor:
    """Row r of proxy step s is ``[10 s + r, ...]`` (ids < 32, a tiny model's vocabulary, for s < 3)."""
    return (10 * step + torch.arange(B, dtype=torch.int64))[:, None].repeat(1, L)


def make(schedule: Schedule | None = None, rb: int = 3, **selection) -> RefreshData:
    schedule = schedule or Schedule(2, 3, 20)
    cfg = SelectionConfig(**{"seed": 4, "refresh_steps": 3, "rho1_steps": 2, **selection})
    return RefreshData(RefreshSettings.of(cfg, lr=1e-3, batch_size=rb, precision="fp32"), schedule,
                       num_validation=N_VAL, validation_path="val/", validation_tokens=val_tokens,
                       step_tokens=step_tokens)


def first_column(batches) -> list[list[int]]:
    return [b["tokens"][:, 0].tolist() for b in batches]


def test_validation_batches_follow_the_stream_seeded_seed_plus_one():
    # the stream's definition: epoch e of a stream seeded s is default_rng([s, e]).permutation(N);
    # version e, refresh step k takes positions (e·K + k)·rb ... + rb (K = 3, rb = 3: inside epoch 0 for e ≤ 0)
    perm = np.random.default_rng([4 + 1, 0]).permutation(N_VAL)
    assert first_column(make().validation_batches(0)) == [perm[0:3].tolist(), perm[3:6].tolist(), perm[6:9].tolist()]
    # version 1 starts at stream step 3: positions 9..17 straddle epochs 0 and 1
    both = np.concatenate([perm, np.random.default_rng([5, 1]).permutation(N_VAL)])
    assert first_column(make().validation_batches(1)) == [both[9:12].tolist(), both[12:15].tolist(),
                                                          both[15:18].tolist()]
    static = np.random.default_rng([4 + 2, 0]).permutation(N_VAL)  # RHO-1: seed + 2, version 0, rho1_steps
    assert first_column(make().static_batches()) == [static[0:3].tolist(), static[3:6].tolist()]


def test_candidate_batches_cycle_the_recent_rows_with_their_masks():
    masks = np.zeros((2, B, L), np.uint8)
    masks[0, 0, 1] = masks[0, 1, 2] = masks[1, 0, 3] = masks[1, 1, 4] = 1  # one kept position per row
    recent = RecentMasks([3, 4], masks)
    got = list(make().candidate_batches(5, recent))
    # rows: step 3 → 30, 31; step 4 → 40, 41 (n = 4); rb = 3 rows at a time, cycled
    assert first_column(got) == [[30, 31, 40], [41, 30, 31], [40, 41, 30]]
    kept = [b["mask"].nonzero()[:, 1].tolist() for b in got]
    assert kept == [[1, 2, 3], [4, 1, 2], [3, 4, 1]]
    assert all(b["mask"].dtype == torch.bool for b in got)


def test_without_recent_steps_the_refresh_steps_batch_with_every_valid_target_stands_in():
    got = list(make(Schedule(0, 2, 20)).candidate_batches(1, RecentMasks()))  # version 1 is due before step 2
    assert first_column(got) == [[20, 21, 20], [21, 20, 21], [20, 21, 20]]
    expected = torch.ones(3, L, dtype=torch.bool)
    expected[:, 0] = False  # position 0 predicts nothing
    assert all(torch.equal(b["mask"], expected) for b in got)


@pytest.mark.parametrize("selection", [{"lam": 0.0}, {"refresh_steps": 0}])
def test_no_candidate_term_no_candidate_batches(selection):
    assert list(make(**selection).candidate_batches(0, RecentMasks([0], np.ones((1, B, L), np.uint8)))) == []


def test_empty_validation_set_names_the_directory():
    with pytest.raises(ValueError, match="val/: the validation set is empty"):
        RefreshData(RefreshSettings(batch_size=2), Schedule(0, 1), num_validation=0, validation_path="val/",
                    validation_tokens=val_tokens, step_tokens=step_tokens)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=L))


def test_refresh_and_static_reference_are_the_core_calls_with_these_batches():
    data = make(lam=0.5, ref_weight_decay=0.02, ref_grad_clip=0.5)
    settings = RefreshSettings(seed=4, refresh_steps=3, lam=0.5, lr=1e-3, weight_decay=0.02, grad_clip=0.5,
                               rho1_steps=2, batch_size=3, precision="fp32")
    assert data.cfg == settings  # RefreshSettings.of: the selection config's fields, the resolved ones as given
    proxy = tiny_llama()
    recent = RecentMasks([0, 1], np.ones((2, B, L), np.uint8))
    got = data.refresh(get_policy("blade"), proxy, 2, recent)
    want = refresh_reference(proxy, list(data.validation_batches(2)), list(data.candidate_batches(2, recent)),
                             settings)
    assert got.objectives == want.objectives and len(got.objectives) == 3
    assert all(torch.equal(a, b) for a, b in zip(got.model.parameters(), want.model.parameters(), strict=True))
    static = data.train_static(proxy)
    want = train_static_reference(proxy, list(data.static_batches()), settings)
    assert static.val_losses == want.val_losses and len(static.val_losses) == 2
