"""One rank of the 2-process gloo check in test_distributed.py (run as a script, not collected by pytest).

    python dist_worker.py RANK WORLD INIT_FILE OUT_DIR

Builds the same deterministic candidate batch on every rank, selects across ranks (both scopes) and takes
one DDP gradient of the normalised masked loss on its rows; saves what it saw to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from curation.core.distributed import Ranks, all_ranks_true, global_rows, normalised_loss, select_across_ranks

B, L, V, GAMMA = 6, 5, 11, 0.45


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores quantised to 0.5 (many ties: the flat-index tie-break decides), a few invalid positions."""
    g = torch.Generator().manual_seed(3)
    scores = torch.round(torch.randn(B, L, generator=g) * 2) / 2
    valid = torch.rand(B, L, generator=g) > 0.2
    valid[:, 0] = False
    tokens = torch.randint(0, V, (B, L), generator=g)
    return scores, valid, tokens


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 4), nn.Linear(4, V))


def token_losses(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = m(tokens[:, :-1])
    out = torch.zeros(tokens.shape)
    out[:, 1:] = nn.functional.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1),
                                             reduction="none").view(tokens.shape[0], -1)
    return out


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ranks = Ranks(rank, world)
    scores, valid, tokens = batch()
    rows = ranks.rows(B)
    res = {s: select_across_ranks(scores[rows], valid[rows], GAMMA, ranks, scope=s) for s in ("global", "rank")}
    warm = select_across_ranks(scores[rows], valid[rows], GAMMA, ranks, select=False)

    # One DDP step on this rank's rows with the global mask: Composer's per-rank scale rows_mb / (b/N) is
    # applied by hand here (one microbatch per rank, so it is 1), DDP averages the gradients.
    ddp = nn.parallel.DistributedDataParallel(model())
    sel = res["global"]
    loss = normalised_loss(token_losses(ddp, tokens[rows]), sel.local, kept_total=sel.kept,
                           rows_total=global_rows(len(range(B)[rows]), ranks))
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in ddp.module.parameters()])
    # a flag false on rank 1 only is false on every rank; true on both, true
    agree = [all_ranks_true(torch.tensor(rank == 0), ranks), all_ranks_true(torch.tensor(True), ranks)]
    fields = {name: {**s.__dict__, "kept": s.kept} for name, s in (*res.items(), ("warm", warm))}
    torch.save({**fields, "grad": grad, "agree": agree}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
