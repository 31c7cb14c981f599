"""The five selection policies behind one interface."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curation.core.policies import POLICIES, POLICY_NAMES, RefreshMode, ScoreKind, get_policy
from curation.core.refresh import RefreshSettings, RefreshStart
from curation.core.selection import num_selected
from curation.core.stats import param_distance


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    proxy = torch.rand(4, 16, generator=gen) * 5
    ref = torch.rand(4, 16, generator=gen) * 5
    valid = torch.rand(4, 16, generator=gen) < 0.8
    valid[:, 0] = False
    return proxy, ref, valid


def test_registry_names_and_modes():
    assert POLICY_NAMES == ("full", "random", "rho1", "blade", "blade-nosync")
    assert {n: (p.score_kind, p.refresh_mode) for n, p in POLICIES.items()} == {
        "full": (ScoreKind.NONE, RefreshMode.NONE),
        "random": (ScoreKind.RANDOM, RefreshMode.NONE),
        "rho1": (ScoreKind.EXCESS_LOSS, RefreshMode.STATIC),
        "blade": (ScoreKind.EXCESS_LOSS, RefreshMode.SYNC),
        "blade-nosync": (ScoreKind.EXCESS_LOSS, RefreshMode.CONTINUE),
    }
    assert [n for n, p in POLICIES.items() if p.needs_reference] == ["rho1", "blade", "blade-nosync"]
    assert [n for n, p in POLICIES.items() if p.refreshes] == ["blade", "blade-nosync"]
    assert get_policy(POLICIES["blade"]) is POLICIES["blade"]
    with pytest.raises(
        ValueError, match="unknown selection policy 'rho2'.*full, random, rho1, blade, blade-nosync"
    ):
        get_policy("rho2")


def test_full_keeps_every_valid_token_whatever_gamma():
    proxy, _, valid = _batch()
    mask, scores = get_policy("full").select(proxy, valid, 0.3)
    assert torch.equal(mask, valid)
    assert (scores == 0).all()
    with pytest.raises(ValueError, match="gamma"):
        get_policy("full").select(proxy, valid, 1.2)


def test_random_keeps_exactly_k_seeded_and_ignores_losses():
    proxy, ref, valid = _batch()
    policy = get_policy("random")
    k = num_selected(0.6, int(valid.sum()))
    a, _ = policy.select(proxy, valid, 0.6, generator=torch.Generator().manual_seed(1))
    b, _ = policy.select(proxy * 0 + 1, valid, 0.6, generator=torch.Generator().manual_seed(1))
    c, _ = policy.select(proxy, valid, 0.6, generator=torch.Generator().manual_seed(2))
    assert int(a.sum()) == k and not (a & ~valid).any()
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="Generator"):
        policy.select(proxy, valid, 0.6)


def test_random_is_roughly_uniform_over_positions():
    valid = torch.ones(2, 10, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, 10)
    for _ in range(2000):
        counts += get_policy("random").select(torch.zeros(2, 10), valid, 0.5, generator=gen)[0]
    # each position kept with probability 1/2: 1000 ± ~5 sigma (sigma ~ 22)
    assert counts.min() > 890 and counts.max() < 1110


@pytest.mark.parametrize("name", ["rho1", "blade", "blade-nosync"])
def test_excess_loss_policies_select_by_delta(name):
    policy = get_policy(name)
    proxy = torch.tensor([[0.0, 5.0, 0.5, 3.0, 2.0]])
    ref = torch.tensor([[0.0, 0.5, 5.0, 3.0, 0.0]])
    valid = torch.tensor([[False, True, True, True, True]])
    mask, scores = policy.select(proxy, valid, 0.5, ref_losses=ref)  # k = 2 of 4
    assert scores.tolist() == [[0.0, 4.5, -4.5, 0.0, 2.0]]
    assert mask.tolist() == [[False, True, False, False, True]]
    with pytest.raises(ValueError, match="ref_losses"):
        policy.select(proxy, valid, 0.5)


def test_nan_reference_loss_on_valid_token_raises():
    proxy, ref, valid = _batch()
    ref[1, 3] = float("nan")
    valid[1, 3] = True
    with pytest.raises(ValueError, match=r"non-finite score nan at valid position \(1, 3\)"):
        get_policy("blade").select(proxy, valid, 0.6, ref_losses=ref)


class _Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


def _vals():
    while True:
        yield torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])


def _cands():
    while True:
        yield (torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3]]), None, torch.ones(1, 8, dtype=torch.bool))


def test_refresh_dispatch_sync_vs_continue():
    torch.manual_seed(0)
    proxy, previous = _Bigram(), _Bigram()
    settings = RefreshSettings(refresh_steps=3, lr=0.05)
    blade = get_policy("blade").refresh(proxy, _vals(), _cands(), settings, RefreshStart(previous=previous))
    sync = get_policy("blade").refresh(proxy, _vals(), _cands(), settings)
    assert param_distance(blade.model, sync.model) == 0.0  # blade ignores `previous`: w0 <- u
    nosync = get_policy("blade-nosync").refresh(proxy, _vals(), _cands(), settings, RefreshStart(previous=previous))
    assert param_distance(nosync.model, sync.model) > 0
    zero = get_policy("blade-nosync").refresh(proxy, [], [], RefreshSettings(refresh_steps=0), RefreshStart(previous=previous))
    assert param_distance(zero.model, previous) == 0.0
    first = get_policy("blade-nosync").refresh(proxy, _vals(), _cands(), settings, RefreshStart(previous=None))
    assert param_distance(first.model, sync.model) == 0.0  # first episode: from the proxy
    for name in ("full", "random", "rho1"):
        with pytest.raises(ValueError, match="never refreshed"):
            get_policy(name).refresh(proxy, _vals(), _cands(), settings)


def test_train_static_reference_is_exported_for_rho1():
    from curation.core.policies import train_static_reference

    torch.manual_seed(0)
    base = _Bigram()
    result = train_static_reference(base, _vals(), RefreshSettings(rho1_steps=5, lr=0.1))
    assert result.steps == 5 and result.val_losses[-1] < result.val_losses[0]
