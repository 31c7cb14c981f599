"""Selection across data-parallel ranks and the global loss normaliser (curation.core.distributed).

One 2-process gloo group (tests/curation/core/dist_worker.py, started as two plain processes with a file
rendezvous: test scaffolding only; the product's trainer processes come from Ray Train) checks
everything that needs a real collective; the rest runs in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from curation.core.distributed import Ranks, global_rows, normalised_loss, select_across_ranks
from curation.core.selection import masked_mean, num_selected, select_top_fraction
from curation.core.step import kept_per_block
from tests import timing

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))
import dist_worker as W  # noqa: E402


def test_ranks_rows_and_errors():
    assert Ranks(1, 3).rows(12) == slice(4, 8)
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        Ranks(0, 3).rows(10)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        Ranks(2, 2)


def test_one_rank_is_the_plain_selection():
    scores, valid, _ = W.batch()
    sel = select_across_ranks(scores, valid, W.GAMMA, Ranks())
    assert torch.equal(sel.mask, select_top_fraction(scores, valid, W.GAMMA))
    assert torch.equal(sel.local, sel.mask) and sel.kept == num_selected(W.GAMMA, int(valid.sum()))
    with pytest.raises(ValueError, match="scope must be one of global, rank"):
        select_across_ranks(scores, valid, W.GAMMA, Ranks(), scope="node")


def test_normalised_loss_is_the_masked_mean_and_sums_over_microbatches():
    g = torch.Generator().manual_seed(1)
    losses = torch.rand(6, 4, generator=g)
    alpha = torch.rand(6, 4, generator=g) > 0.5
    k = int(alpha.sum())
    whole = normalised_loss(losses, alpha, kept_total=k, rows_total=6)
    assert torch.allclose(whole, masked_mean(losses, alpha))
    # Composer weighs microbatch m by rows_m / rows_total: the weighted parts add up to the whole.
    parts = [normalised_loss(losses[i:i + 2], alpha[i:i + 2], kept_total=k, rows_total=6) * (2 / 6)
             for i in range(0, 6, 2)]
    assert torch.allclose(sum(parts), whole)
    nan = losses.clone()
    nan[~alpha] = float("nan")  # unkept positions never leak
    assert torch.isfinite(normalised_loss(nan, alpha, kept_total=k, rows_total=6))


@pytest.mark.slow
def test_two_gloo_ranks_select_like_one_process_and_average_to_its_gradient(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    init = tmp_path / "rendezvous"
    procs = [subprocess.Popen([sys.executable, str(HERE / "dist_worker.py"), str(r), "2", str(init), str(tmp_path)],
                              env=env, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = timing.communicate(p, timeout=240)
        assert p.returncode == 0, err[-3000:]
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    scores, valid, tokens = W.batch()
    single = select_top_fraction(scores, valid, W.GAMMA)
    per_block = torch.cat([select_top_fraction(scores[i:i + 3], valid[i:i + 3], W.GAMMA) for i in (0, 3)])
    assert not torch.equal(single, per_block)  # the two scopes really differ on this batch
    for r, res in enumerate(got):
        rows = slice(3 * r, 3 * r + 3)
        g = res["global"]
        # the single-process mask exactly (same k, same tie-break by global flat index), on every rank
        assert torch.equal(g["mask"], single) and torch.equal(g["local"], single[rows])
        assert g["kept"] == num_selected(W.GAMMA, int(valid.sum())) == sum(kept_per_block(valid, W.GAMMA, 6))
        assert torch.equal(g["scores"], scores) and torch.equal(g["valid"], valid)
        # per-rank scope: each rank's block keeps its own γ share
        assert torch.equal(res["rank"]["mask"], per_block)
        assert res["rank"]["kept"] == sum(kept_per_block(valid, W.GAMMA, 3))
        # warm-up: every valid token, whole batch
        assert torch.equal(res["warm"]["mask"], valid) and torch.equal(res["warm"]["local"], valid[rows])
        assert res["agree"] == [False, True]  # all_ranks_true: false on rank 1 only is false on both ranks

    # The DDP-averaged gradient of the globally normalised loss is the single-process gradient of the batch.
    m = W.model()
    masked_mean(W.token_losses(m, tokens), single).backward()
    want = torch.cat([p.grad.flatten() for p in m.parameters()])
    assert torch.equal(got[0]["grad"], got[1]["grad"])
    assert torch.allclose(got[0]["grad"], want, atol=1e-7, rtol=1e-5), (got[0]["grad"] - want).abs().max()


def test_global_rows():
    assert global_rows(4, Ranks(1, 2)) == 8 and global_rows(4, Ranks()) == 4
