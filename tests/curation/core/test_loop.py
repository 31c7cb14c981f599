"""The one-page BLADE loop (curation.core.loop): schedule, exact k, Δ recomputed independently, the
policies' relations to each other, and the proxy step checked against a hand-written AdamW loop.

(That the trainers equal it bit for bit is tested in tests/jobs/test_oracle.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from curation.core.loop import blade_loop
from curation.core.selection import num_selected
from curation.core.stream import CandidateStream
from curation.io.models import build_causal_lm
from schemas.train_config import OptimConfig, SelectionConfig, demo_model_config

V, L, B = 64, 16, 4
W, TAU, K = 2, 3, 2


@pytest.fixture(scope="module")
def data():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    g = torch.Generator().manual_seed(0)
    model = build_causal_lm(demo_model_config(V, hidden=16, layers=1, seq_len=L))
    yield model, torch.randint(0, V, (40, L), generator=g), torch.randint(0, V, (12, L), generator=g)
    torch.set_num_threads(threads)


def run(data, policy="blade", steps=9, **selection):
    model, cand, val = data
    sel = SelectionConfig(policy=policy, warmup_steps=W, tau=TAU, refresh_steps=K, refresh_batch_size=2,
                          refresh_candidate_batches=2, rho1_steps=3, **selection)
    return blade_loop(model, cand, val, selection=sel, optim=OptimConfig(lr=1e-2), batch_size=B, steps=steps,
                      seed=1)


def _nll(model, tokens):
    """ℓ_n per position (0 at position 0), written without the core's loss functions."""
    logits = model(input_ids=tokens).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1), reduction="none")
    return torch.cat([torch.zeros(tokens.shape[0], 1), nll.view(tokens.shape[0], L - 1)], dim=1)


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(("policy", "steps", "versions"), [
    ("blade", [2, 5, 8], [0, 1, 2]), ("blade-nosync", [2, 5, 8], [0, 1, 2]), ("rho1", [0], [0]),
    ("random", [], []), ("full", [], []),
])
def test_refreshes_follow_the_schedule_and_k_tokens_are_kept_after_the_warm_up(data, policy, steps, versions):
    out = run(data, policy)
    assert [r["step"] for r in out.refresh_log] == steps and [r["version"] for r in out.refresh_log] == versions
    assert all(r["steps"] == (3 if policy == "rho1" else K) for r in out.refresh_log)
    assert (out.reference is None) == (policy in ("random", "full"))
    stream = CandidateStream(40, B, 1)
    assert [ids.tolist() for ids in out.sample_ids] == [stream.batch_ids(t).tolist() for t in range(9)]
    n_valid = B * (L - 1)
    for t, (mask, scores) in enumerate(zip(out.masks, out.scores, strict=True)):
        assert mask.dtype == torch.bool and not mask[:, 0].any()
        if t < W:
            assert int(mask.sum()) == n_valid and torch.isnan(scores).all()
            continue
        gamma = 1.0 if policy == "full" else 0.6
        assert int(mask.sum()) == num_selected(gamma, n_valid) == (n_valid if policy == "full" else 36)
        valid = torch.ones_like(mask)
        valid[:, 0] = False
        assert scores[mask].min() >= scores[valid & ~mask].max() if policy != "full" else True


def test_full_is_plain_clipped_adamw_on_the_mean_loss_of_every_valid_token(data):
    model, cand, _ = data
    out = run(data, "full", steps=5)
    u = copy.deepcopy(model)
    opt = torch.optim.AdamW(u.parameters(), lr=1e-2, weight_decay=0.01)
    for t in range(5):
        tokens = cand[CandidateStream(40, B, 1).batch_ids(t)]
        opt.zero_grad()
        _nll(u, tokens)[:, 1:].mean().backward()
        torch.nn.utils.clip_grad_norm_(u.parameters(), 1.0)
        opt.step()
    for k, v in u.state_dict().items():
        torch.testing.assert_close(out.model.state_dict()[k], v, rtol=0, atol=2e-6)
    assert not _same_weights(out.model, model)  # it trained; the base model was left alone
    assert _same_weights(model, build_causal_lm(demo_model_config(V, hidden=16, layers=1, seq_len=L)))


def test_delta_is_the_proxy_loss_minus_the_float16_reference_loss(data):
    """Step 7's Δ, recomputed from the proxy after 7 steps (a 7-step run: the loop is causal) and the
    reference of episode 1 (steps 5..7, the last reference of an 8-step run)."""
    before, out = run(data, "blade", steps=7), run(data, "blade", steps=8)
    assert all(torch.equal(a, b) for a, b in zip(before.masks, out.masks[:7], strict=False))
    assert out.refresh_log[-1]["version"] == 1
    tokens = data[1][torch.from_numpy(out.sample_ids[7])]
    with torch.no_grad():
        delta = _nll(before.model, tokens) - _nll(out.reference, tokens).half().float()
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[:, 0] = False
    torch.testing.assert_close(out.scores[7][valid], delta[valid], rtol=0, atol=5e-3)
    assert torch.equal(out.masks[7], out.masks[7] & valid)


def test_blade_nosync_equals_blade_until_the_second_refresh(data):
    sync, cont = run(data, "blade"), run(data, "blade-nosync")
    first = W + TAU  # the first refresh starts from u in both; the second continues from w̃ in nosync
    assert all(torch.equal(a, b) for a, b in zip(sync.masks[:first], cont.masks[:first], strict=True))
    assert sync.refresh_log[0] == cont.refresh_log[0] and sync.refresh_log[1] != cont.refresh_log[1]
    assert not all(torch.equal(a, b) for a, b in zip(sync.masks[first:], cont.masks[first:], strict=True))


def test_the_refresh_never_touches_the_proxy(data):
    """With γ = 1 every valid token is kept whatever Δ is: blade (with its refreshes) trains like full."""
    blade, full = run(data, "blade", gamma=1.0), run(data, "full")
    assert len(blade.refresh_log) == 3 and _same_weights(blade.model, full.model)


def test_rho1_with_its_reference_given_equals_rho1_training_it(data):
    trained = run(data, "rho1")
    model, cand, val = data
    sel = SelectionConfig(policy="rho1", warmup_steps=W, tau=TAU, refresh_batch_size=2, reference_weights="w.st")
    given = blade_loop(model, cand, val, selection=sel, optim=OptimConfig(lr=1e-2), batch_size=B, steps=9, seed=1,
                       reference=trained.reference.state_dict())
    assert given.refresh_log == [] and _same_weights(given.model, trained.model)
    assert all(torch.equal(a, b) for a, b in zip(given.masks, trained.masks, strict=True))
    with pytest.raises(ValueError, match="reference_weights is set: pass its weights as `reference`"):
        blade_loop(model, cand, val, selection=sel, optim=OptimConfig(), batch_size=B, steps=1)


def test_random_masks_come_from_the_selection_seed(data):
    a, b, c = run(data, "random", steps=4), run(data, "random", steps=4), run(data, "random", steps=4, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.masks, b.masks, strict=True))
    assert not torch.equal(a.masks[3], c.masks[3]) and torch.equal(a.masks[0], c.masks[0])  # warm-up: all


def test_bad_inputs_are_refused(data):
    model, cand, val = data
    kw = {"selection": SelectionConfig(), "optim": OptimConfig(), "batch_size": B}
    with pytest.raises(ValueError, match=r"candidates must be a non-empty \(N, L\) integer token tensor"):
        blade_loop(model, cand.float(), val, steps=1, **kw)
    with pytest.raises(ValueError, match=r"validation must be .* got torch.int64 \(12,\)"):
        blade_loop(model, cand, val[:, 0], steps=1, **kw)
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        blade_loop(model, cand, val, steps=0, **kw)
