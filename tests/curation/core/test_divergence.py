"""A diverging reference stops the run (issue 32): check_reference on hand-made losses and weights, and
refresh_reference with a learning rate far too large (``selection.ref_lr=1e3``) on a tiny Llama; a diverging proxy
too: check_proxy on hand-made training losses."""

from __future__ import annotations

import math

import pytest
import torch

from curation.core.divergence import GROWTH, PATIENCE, DivergenceError, check_proxy, check_reference
from curation.core.refresh import RefreshSettings, refresh_reference
from tests.curation.core.test_refresh import VOCAB, cand_stream, tiny_llama, val_stream

W = [torch.ones(3, 3)]


@pytest.mark.parametrize("losses", [[3.0, 2.5, 2.0], [2.0, 2.0 * GROWTH], [3.48, 3.5, math.log(VOCAB) + 0.4], [3.29, 4.75, 3.1], [5.0], []])
def test_a_refresh_that_lowers_keeps_or_barely_raises_its_loss_passes(losses):
    check_reference(losses, W, vocab_size=VOCAB, lr=1e-3)


@pytest.mark.parametrize(("losses", "weights", "said"), [
    ([3.46, 1.37e7, 3.4657, 3.4657], W, "its validation loss went from 3.460 to 1.37e+07 in 4 steps (more than 4.0× "
     "its start)"),  # refresh_reference at lr 1e3: a jump, then the uniform guess
    ([2.0, 2.6], W, "its validation loss went from 2.000 to 2.6 in 2 steps (more than 1.25× its start)"),
    ([3.4, 3.3, 4.0], W, "its validation loss went from 3.400 to 4 in 3 steps (above ln V = 3.466, a uniform "
     "guess over the 32 ids)"),
    ([2.0, float("nan")], W, "its validation loss became nan"),
    ([2.0, 1.9], [torch.tensor([1.0, float("inf")])], "its weights are no longer finite"),
])
def test_a_diverged_refresh_is_one_line_naming_the_setting(losses, weights, said):
    with pytest.raises(DivergenceError) as e:
        check_reference(losses, weights, vocab_size=VOCAB, lr=1000.0)
    assert str(e.value) == f"the reference diverged in a refresh: {said}; lower selection.ref_lr (now 1000)"


def test_refresh_reference_with_a_far_too_large_learning_rate_raises():
    proxy = tiny_llama()
    settings = RefreshSettings(refresh_steps=4, lam=1.0, lr=1e3, batch_size=4)
    with pytest.raises(DivergenceError, match=r"^the reference diverged in a refresh: .*; lower selection.ref_lr "
                                              r"\(now 1000\)$"):
        refresh_reference(proxy, val_stream(0), cand_stream(1), settings)
    ok = refresh_reference(proxy, val_stream(0), cand_stream(1), RefreshSettings(refresh_steps=4, lr=1e-3))
    assert ok.val_losses[-1] < ok.val_losses[0]  # the usual learning rate: no error


U = math.log(VOCAB)  # 3.466: a uniform guess over the 32 ids


@pytest.mark.parametrize("losses", [
    [],
    [U + 2.0] * (PATIENCE - 1),  # a bad start, not yet PATIENCE steps of it
    [U + 2.0] * (PATIENCE - 1) + [U + 0.4],  # one step back within MARGIN of ln V
    [U + 0.5] * PATIENCE,  # at ln V + MARGIN, not above
    [3.0, 2.5, 2.0],
])
def test_a_proxy_that_learns_or_is_briefly_worse_than_uniform_passes(losses):
    check_proxy(losses, vocab_size=VOCAB, lr=1e-3)


@pytest.mark.parametrize(("losses", "said"), [
    ([2.0, float("nan")], "its training loss became nan"),
    ([2.0, float("inf")], "its training loss became inf"),
    ([2.0] + [U + 0.51] * PATIENCE, f"its training loss stayed above ln V = 3.466 (a uniform guess over the 32 ids) "
     f"for {PATIENCE} steps, at 3.976"),
    ([1e4] * PATIENCE, f"its training loss stayed above ln V = 3.466 (a uniform guess over the 32 ids) for {PATIENCE} "
     "steps, at 1e+04"),
])
def test_a_diverged_proxy_is_one_line_naming_optim_lr(losses, said):
    with pytest.raises(DivergenceError) as e:
        check_proxy(losses, vocab_size=VOCAB, lr=1000.0)
    assert str(e.value) == f"the proxy diverged: {said}; lower optim.lr (now 1000)"
