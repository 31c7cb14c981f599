"""One selection step for every trainer and worker (curation.core.step): kept counts, scores, masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from curation.core.distributed import Ranks
from curation.core.policies import get_policy
from curation.core.selection import num_selected, random_scores, select_top_fraction
from curation.core.step import SelectionStep, kept_per_block, step_generator


def _valid() -> torch.Tensor:
    valid = torch.ones(4, 10, dtype=torch.bool)
    valid[:, 0] = False
    valid[3, 1:] = False  # row 3: nothing valid
    return valid


def test_kept_counts_per_block_by_hand():
    valid = _valid()  # rows 0-2: 9 valid each, row 3: none; 27 in all
    # global: round(0.5 · 27) = 14 (half up); blocks of 2 rows: round(0.5 · 18) = 9 and round(0.5 · 9) = 5
    assert kept_per_block(valid, 0.5, 4) == [14]
    assert kept_per_block(valid, 0.5, 2) == [9, 5]
    assert kept_per_block(valid, 0.5, 3) == [num_selected(0.5, 27), 0]  # the last block is shorter
    step = SelectionStep("blade", 0.5)
    assert step.kept(valid, selecting=True) == [14] and step.kept(valid, selecting=True, block_rows=2) == [9, 5]
    assert step.kept(valid, selecting=False) == [27]  # warm-up: every valid token
    assert SelectionStep("full", 0.5).kept(valid, selecting=True) == [27]  # full ignores γ
    # data-parallel ranks (no communication needed): the whole batch, or each rank's rows
    assert SelectionStep("blade", 0.5, ranks=Ranks(1, 2)).kept(valid, selecting=True, block_rows=1) == [14]
    assert SelectionStep("blade", 0.5, ranks=Ranks(0, 2), scope="rank").kept(valid, selecting=True) == [9, 5]
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        SelectionStep("blade", 0.5, ranks=Ranks(0, 3)).kept(valid, selecting=True)
    with pytest.raises(ValueError, match="at least one row"):
        kept_per_block(valid, 0.5, 0)
    with pytest.raises(ValueError, match="scope must be one of global, rank"):
        SelectionStep("blade", 0.5, scope="node")


@pytest.mark.parametrize("policy", ["full", "rho1", "blade", "blade-nosync"])
def test_a_single_process_step_is_the_policys_selection(policy):
    g = torch.Generator().manual_seed(1)
    proxy, ref = torch.rand(4, 10, generator=g) * 5, (torch.rand(4, 10, generator=g) * 5).half()
    valid = _valid()
    sel = SelectionStep(policy, 0.3)(7, proxy, valid, ref)
    mask, scores = get_policy(policy).select(proxy, valid, 0.3, ref_losses=ref)
    assert torch.equal(sel.mask, mask) and torch.equal(sel.scores, scores.float()) and torch.equal(sel.local, mask)
    assert sel.kept == int(mask.sum()) == sum(SelectionStep(policy, 0.3).kept(valid, selecting=True))


def test_random_draws_each_block_from_the_generator_of_its_first_row():
    proxy, valid = torch.zeros(4, 10), _valid()
    step = SelectionStep("random", 0.5, seed=3)
    whole = step(9, proxy, valid)
    drawn = random_scores((4, 10), step_generator(3, 9, 0))
    assert torch.equal(whole.scores, drawn) and torch.equal(whole.mask, select_top_fraction(drawn, valid, 0.5))
    seed = int(np.random.SeedSequence([3, 9, 2]).generate_state(1)[0])  # the rule, restated
    second = step(9, proxy[2:], valid[2:], offset=2)  # a single process's second microbatch of 2 rows
    assert torch.equal(second.scores, random_scores((2, 10), torch.Generator().manual_seed(seed)))
    assert not torch.equal(second.scores, drawn[2:])  # per-block draws, not a slice of the whole batch's
    assert torch.equal(step(9, proxy, valid).mask, whole.mask)  # deterministic
    assert not torch.equal(step(10, proxy, valid).scores, whole.scores)


def test_warm_up_keeps_every_valid_token_without_scores():
    valid = _valid()
    sel = SelectionStep("blade", 0.2)(0, torch.rand(4, 10), valid, None, selecting=False)
    assert torch.equal(sel.mask, valid) and sel.kept == 27
    assert all(math.isnan(x) for x in sel.scores.flatten().tolist())
