"""select_top_fraction (the LMO of docs/DESIGN.md §2), excess_loss, num_selected and masked_mean."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from curation.core.selection import excess_loss, masked_mean, num_selected, random_scores, select_top_fraction


def _reference_select(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Obvious implementation: stable sort by (-score, flat index) among valid positions."""
    s = scores.reshape(-1).double()
    v = valid.reshape(-1)
    idx = [i for i in range(s.numel()) if v[i]]
    idx.sort(key=lambda i: (-float(s[i]), i))
    out = torch.zeros(s.numel(), dtype=torch.bool)
    out[idx[:k]] = True
    return out.view(valid.shape)


# sync=True: the kthvalue path (CPU default); sync=False: the host-synchronisation-free path (GPU default).
SYNC = pytest.mark.parametrize("sync", [True, False], ids=["kthvalue", "sync-free"])


@SYNC
def test_lmo_equivalence_by_brute_force(sync):
    """The mask minimises <l(w) - l(u), a> over {a in {0,1}^N : sum a = k, a = 0 off valid}."""
    gen = torch.Generator().manual_seed(1234)
    checked = 0
    for trial in range(60):
        n = int(torch.randint(1, 13, (1,), generator=gen))  # N <= 12
        rows = 2 if n % 2 == 0 and trial % 3 == 0 else 1
        shape = (rows, n // rows)
        # integer-valued losses on a small range -> many exact ties in the excess loss
        lu = torch.randint(0, 4, shape, generator=gen).float()
        lw = torch.randint(0, 4, shape, generator=gen).float()
        valid = torch.rand(shape, generator=gen) < 0.75
        if trial % 7 == 0:
            valid[...] = True
        scores = excess_loss(lu, lw)
        scores[~valid] = float("nan")  # invalid scores must not be read
        c = (lw - lu).reshape(-1).tolist()  # <l(w) - l(u), a>
        vflat = valid.reshape(-1).tolist()
        n_valid = sum(vflat)
        for gamma in (0.1, 0.25, 0.5, 0.6, 0.75, 1.0):
            mask = select_top_fraction(scores, valid, gamma, sync=sync)
            k = num_selected(gamma, n_valid)
            a = mask.reshape(-1).tolist()
            assert sum(a) == k
            assert not any(ai and not vi for ai, vi in zip(a, vflat, strict=True))
            got = sum(ci for ci, ai in zip(c, a, strict=True) if ai)
            best = math.inf
            best_vectors = []
            for alpha in itertools.product((0, 1), repeat=len(c)):
                if sum(alpha) != k or any(ai and not vi for ai, vi in zip(alpha, vflat, strict=True)):
                    continue
                val = sum(ci for ci, ai in zip(c, alpha, strict=True) if ai)
                if val < best - 1e-12:
                    best, best_vectors = val, [alpha]
                elif abs(val - best) <= 1e-12:
                    best_vectors.append(alpha)
            if k == 0:
                assert not any(a)
                continue
            assert got == pytest.approx(best, abs=1e-9)
            # among the minimisers, ours is the one preferring lower flat indices (lexicographic max)
            assert tuple(a) == max(best_vectors)
            checked += 1
    assert checked > 200


def test_sign_convention_keeps_reference_good_proxy_bad():
    proxy = torch.tensor([[5.0, 0.5]])  # token 0: proxy bad; token 1: proxy good
    ref = torch.tensor([[0.5, 5.0]])  # token 0: reference good; token 1: reference bad
    delta = excess_loss(proxy, ref)
    assert delta.tolist() == [[4.5, -4.5]]
    mask = select_top_fraction(delta, torch.ones(1, 2, dtype=torch.bool), 0.5)
    assert mask.tolist() == [[True, False]]


def test_excess_loss_is_float32_from_fp16_reference():
    d = excess_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0], dtype=torch.float16))
    assert d.dtype == torch.float32 and d.tolist() == [0.5, -1.0]
    with pytest.raises(ValueError, match="shape"):
        excess_loss(torch.zeros(2), torch.zeros(3))


@pytest.mark.parametrize(
    ("gamma", "n", "k"),
    [
        (0.5, 5, 3),
        (0.5, 3, 2),
        (0.25, 2, 1),
        (0.6, 10, 6),
        (0.01, 3, 1),
        (1.0, 7, 7),
        (0.3, 0, 0),
        (0.49, 2, 1),
    ],
)
def test_num_selected_rounds_half_up_with_minimum_one(gamma, n, k):
    assert num_selected(gamma, n) == k


def test_selection_is_global_over_the_batch_not_per_row():
    scores = torch.tensor([[9.0, 8.0, 7.0], [1.0, 2.0, 3.0]])
    mask = select_top_fraction(scores, torch.ones(2, 3, dtype=torch.bool), 0.5)
    assert mask.tolist() == [[True, True, True], [False, False, False]]


@SYNC
def test_ties_break_by_lower_flat_index(sync):
    scores = torch.tensor([[1.0, 2.0, 2.0], [2.0, 2.0, 0.0]])
    mask = select_top_fraction(scores, torch.ones(2, 3, dtype=torch.bool), 0.5, sync=sync)  # k = 3
    assert mask.tolist() == [[False, True, True], [True, False, False]]
    valid = torch.tensor([[True, True, False], [True, True, True]])
    mask = select_top_fraction(scores, valid, 0.4, sync=sync)  # n=5, k=2: the 2.0 at [0,2] is invalid
    assert mask.tolist() == [[False, True, False], [True, False, False]]


@SYNC
def test_matches_stable_sort_reference_on_large_tied_fp16_inputs(sync):
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        scores = (torch.randn(8, 512, generator=gen) * 2).round().to(dtype)  # heavy ties
        valid = torch.rand(8, 512, generator=gen) < 0.9
        for gamma in (0.1, 0.6, 0.999):
            mask = select_top_fraction(scores, valid, gamma, sync=sync)
            k = num_selected(gamma, int(valid.sum()))
            assert torch.equal(mask, _reference_select(scores, valid, k)), (dtype, gamma)


def test_gamma_one_keeps_every_valid_token():
    scores = torch.randn(3, 5)
    valid = torch.rand(3, 5) < 0.5
    valid[0, 0] = True
    assert torch.equal(select_top_fraction(scores, valid, 1.0), valid)
    assert torch.equal(select_top_fraction(scores, None, 1), torch.ones(3, 5, dtype=torch.bool))


@SYNC
def test_all_invalid_gives_empty_mask_and_one_valid_keeps_one(sync):
    scores = torch.randn(2, 4)
    assert not select_top_fraction(scores, torch.zeros(2, 4, dtype=torch.bool), 0.5, sync=sync).any()
    valid = torch.zeros(2, 4, dtype=torch.bool)
    valid[1, 2] = True
    assert select_top_fraction(scores, valid, 0.01, sync=sync).nonzero().tolist() == [[1, 2]]
    assert torch.equal(select_top_fraction(scores, valid, 1.0, sync=sync), valid)


def test_sync_free_path_reads_no_number_on_the_host(monkeypatch):
    """Every host read of a tensor value (bool(), int(), float(), .item(), .tolist()) fails inside the call."""
    gen = torch.Generator().manual_seed(3)
    scores = (torch.randn(4, 64, generator=gen) * 2).round()
    valid = torch.rand(4, 64, generator=gen) < 0.8
    want = select_top_fraction(scores, valid, 0.6, sync=True)

    def refuse(*args, **kwargs):
        raise AssertionError("host synchronisation in the sync-free path")

    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = select_top_fraction(scores, valid, 0.6, sync=False)
    monkeypatch.undo()
    assert torch.equal(got, want) and int(got.sum()) == num_selected(0.6, int(valid.sum()))


def test_sync_free_path_still_refuses_non_finite_scores_on_cpu():
    scores = torch.tensor([[1.0, float("nan"), 2.0]])
    with pytest.raises(RuntimeError, match="non-finite score"):
        select_top_fraction(scores, None, 0.5, sync=False)


@pytest.mark.gpu
def test_selection_on_cuda_has_no_host_synchronisation_and_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (checks the selection hot path for host synchronisations)")
    gen = torch.Generator().manual_seed(11)
    scores = (torch.randn(8, 1024, generator=gen) * 3).round()
    valid = torch.rand(8, 1024, generator=gen) < 0.9
    want = select_top_fraction(scores, valid, 0.6)
    s, v = scores.cuda(), valid.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        delta = excess_loss(s, torch.zeros_like(s, dtype=torch.float16))
        got = select_top_fraction(delta, v, 0.6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("gamma", [0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_invalid_gamma_raises_with_value(gamma):
    with pytest.raises(ValueError, match=rf"gamma must be in \(0, 1\], got {gamma!r}"):
        select_top_fraction(torch.zeros(4), torch.ones(4, dtype=torch.bool), gamma)


def test_non_numeric_gamma_raises_type_error():
    with pytest.raises(TypeError, match="gamma"):
        select_top_fraction(torch.zeros(4), torch.ones(4, dtype=torch.bool), "0.5")
    with pytest.raises(TypeError, match="gamma"):
        select_top_fraction(torch.zeros(4), torch.ones(4, dtype=torch.bool), True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_score_on_valid_position_raises_with_value_and_position(bad):
    scores = torch.zeros(2, 3)
    scores[1, 2] = bad
    with pytest.raises(ValueError, match=rf"non-finite score {bad} at valid position \(1, 2\)"):
        select_top_fraction(scores, torch.ones(2, 3, dtype=torch.bool), 0.5)
    valid = torch.ones(2, 3, dtype=torch.bool)
    valid[1, 2] = False  # the same value on an invalid position is ignored
    assert select_top_fraction(scores, valid, 0.5).sum() == 3


def test_argument_errors():
    with pytest.raises(TypeError, match="bool"):
        select_top_fraction(torch.zeros(3), torch.ones(3), 0.5)
    with pytest.raises(ValueError, match="shape"):
        select_top_fraction(torch.zeros(3), torch.ones(4, dtype=torch.bool), 0.5)
    with pytest.raises(TypeError, match="generator"):
        select_top_fraction(torch.zeros(3), None, 0.5, generator=torch.Generator())
    with pytest.raises(TypeError, match="floating"):
        select_top_fraction(torch.zeros(3, dtype=torch.long), None, 0.5)


def test_deterministic_and_input_untouched():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 16, generator=gen).round()
    valid = torch.rand(4, 16, generator=gen) < 0.8
    s0, v0 = scores.clone(), valid.clone()
    masks = [select_top_fraction(scores, valid, 0.6) for _ in range(3)]
    assert all(torch.equal(masks[0], m) for m in masks[1:])
    assert torch.equal(scores, s0) and torch.equal(valid, v0)


def test_random_scores_path_keeps_exactly_k_and_is_seeded():
    valid = torch.rand(4, 50, generator=torch.Generator().manual_seed(0)) < 0.7
    k = num_selected(0.3, int(valid.sum()))
    a = select_top_fraction(None, valid, 0.3, generator=torch.Generator().manual_seed(5))
    b = select_top_fraction(None, valid, 0.3, generator=torch.Generator().manual_seed(5))
    c = select_top_fraction(None, valid, 0.3, generator=torch.Generator().manual_seed(6))
    assert a.sum() == k and not (a & ~valid).any()
    assert torch.equal(a, b) and not torch.equal(a, c)
    # the same as selecting on explicitly drawn random scores (one code path)
    explicit = random_scores(valid.shape, torch.Generator().manual_seed(5))
    assert torch.equal(a, select_top_fraction(explicit, valid, 0.3))
    with pytest.raises(TypeError, match="generator"):
        select_top_fraction(None, valid, 0.3)


def test_masked_mean_values_and_weights():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[True, False, True], [False, False, True]])
    assert masked_mean(losses, mask).item() == pytest.approx((1 + 3 + 6) / 3)
    weights = torch.tensor([[0.5, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_mean(losses, weights).item() == pytest.approx((0.5 + 4) / 1.5)
    assert masked_mean(losses.half(), mask).dtype == torch.float32


def test_masked_mean_gradient_and_empty_mask():
    losses = torch.tensor([1.0, float("inf"), 3.0, 5.0], requires_grad=True)
    mask = torch.tensor([True, False, False, True])
    masked_mean(losses, mask).backward()
    assert losses.grad.tolist() == [0.5, 0.0, 0.0, 0.5]
    losses.grad = None
    empty = masked_mean(losses, torch.zeros(4, dtype=torch.bool))
    assert empty.item() == 0.0 and empty.requires_grad
    empty.backward()
    assert losses.grad.tolist() == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="shape"):
        masked_mean(losses, torch.ones(3, dtype=torch.bool))
