"""A diverging reference stops the run (issue 32): check_reference on hand-made losses and weights, and
refresh_reference with a learning rate far too large (``selection.ref_lr=1e3``) on a tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch

from curation.core.divergence import GROWTH, DivergenceError, check_reference
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
