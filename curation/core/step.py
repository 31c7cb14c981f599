"""One step's token selection, the same for every trainer and worker (DESIGN.md §2).

:class:`SelectionStep` turns a step's per-token losses into its mask α: NaN scores and every valid token during
warm-up; otherwise the policy's scores (Δ = ℓ(u) − ℓ(w̃), uniform random, or none) and the top-γ of the
selection block. It is used by the single-process trainer (:class:`training.selection.BladeAlgorithm`), by every
rank of the data-parallel trainer, and by the engine's scoring workers in pipelined mode. A single process is
world size 1: the same code, with collectives that are no-ops (:func:`~curation.core.distributed.gather_rows`).
:mod:`curation.core.loop` (the test oracle) restates it independently.

**Selection blocks.** The top-γ is taken over one *block* of rows of the step's candidate batch:

* the whole batch (``scope="global"``, the paper's selection; with data-parallel ranks the block's rows are
  spread over the ranks and gathered);
* each rank's rows (``scope="rank"``);
* each microbatch of a single process that microbatches (the mask must exist before each microbatch's
  backward pass): the block starts at the microbatch's first row, ``offset``.

``random`` draws the scores of a whole block from the generator of ``(seed, step, first row of the block)``
(:func:`step_generator`), so the draw does not depend on how the block's rows are spread over ranks.

Pure torch + numpy: no ray, no composer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from curation.core.distributed import SCOPES, GlobalSelection, Ranks, select_across_ranks
from curation.core.policies import SelectionPolicy, get_policy
from curation.core.selection import num_selected, random_scores

__all__ = ["SelectionStep", "step_generator", "kept_per_block"]


def step_generator(seed: int, step: int, offset: int = 0, device: torch.device | str | None = None
                   ) -> torch.Generator:
    """The ``random`` policy's generator for the block of ``step`` whose first row is ``offset``: on ``device`` where
    it is a GPU (the draw is made there, no copy to the device), else on the CPU. A GPU's generator draws other
    numbers than a CPU's from the same seed: a GPU run's ``random`` masks are its own (every rank of a group, on GPUs
    alike, draws the same ones)."""
    on = torch.device(device) if device is not None and torch.device(device).type == "cuda" else None
    generator = torch.Generator(device=on) if on is not None else torch.Generator()
    return generator.manual_seed(int(np.random.SeedSequence([seed, step, offset]).generate_state(1)[0]))


def kept_per_block(valid: Tensor, gamma: float, block_rows: int) -> list[int]:
    """Tokens kept in each block of ``block_rows`` rows of a full batch's validity ``(b, L)`` (the last block may
    be shorter): ``num_selected(γ, valid_block.sum())``. Their sum is the step's kept count ``K`` that normalises
    the loss; it needs no communication (validity is known from the data)."""
    if block_rows < 1:
        raise ValueError(f"a selection block needs at least one row, got {block_rows}")
    return [num_selected(gamma, int(valid[i : i + block_rows].sum())) for i in range(0, valid.shape[0], block_rows)]


@dataclass(frozen=True)
class SelectionStep:
    """The selection of every step of one run (see the module docstring).

    Args:
        policy: the selection policy (or its name).
        gamma: ``γ``, the fraction of valid tokens kept (``full`` keeps every one whatever ``γ``).
        seed: the run's selection seed (``random``'s generators).
        ranks: this process's place in the data-parallel group (``Ranks()``: a single process).
        scope: ``global`` (top-γ of the whole batch) or ``rank`` (of each rank's rows).
    """

    policy: SelectionPolicy
    gamma: float
    seed: int = 0
    ranks: Ranks = field(default_factory=Ranks)
    scope: str = "global"

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", get_policy(self.policy))
        if self.scope not in SCOPES:
            raise ValueError(f"selection scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")

    def kept(self, valid: Tensor, *, selecting: bool, block_rows: int | None = None) -> list[int]:
        """The kept count of each selection block of a step whose full batch has validity ``valid``: blocks of
        ``block_rows`` rows in a single process (``None``: the whole batch), the ranks' blocks under ``rank``
        scope. In warm-up (``selecting=False``) every valid token is kept."""
        gamma = self.policy.effective_gamma(self.gamma) if selecting else 1.0
        rows = valid.shape[0]
        if self.ranks.world_size > 1:
            own = self.ranks.rows(rows)  # (refuses a batch that does not split over the ranks)
            block_rows = rows if self.scope == "global" else own.stop - own.start
        return kept_per_block(valid, gamma, block_rows or rows)

    def scores(self, step: int, proxy_losses: Tensor, ref_losses: Tensor | None, *, offset: int = 0) -> Tensor:
        """This process's rows of the step's scores (``offset``: the first row of a single process's block)."""
        if not self.policy.needs_generator:
            return self.policy.scores(proxy_losses, ref_losses)
        rows, length = proxy_losses.shape
        n = self.ranks.world_size
        device = proxy_losses.device
        if n > 1 and self.scope == "global":  # one draw for the whole batch; this rank's rows of it
            g = step_generator(self.seed, step, 0, device)
            drawn = random_scores((rows * n, length), g, device)[self.ranks.rows(rows * n)]
        else:
            first = offset + (self.ranks.rank * rows if n > 1 else 0)
            drawn = random_scores((rows, length), step_generator(self.seed, step, first, device), device)
        return drawn.to(device)  # (a no-op where the draw was made on the device)

    def __call__(self, step: int, proxy_losses: Tensor | None, valid: Tensor, ref_losses: Tensor | None = None, *,
                 selecting: bool = True, offset: int = 0) -> GlobalSelection:
        """Select step ``step``: this process's rows' ``(rows, L)`` losses and validity in (no losses needed in
        warm-up); the block's mask, scores and validity (gathered over the ranks), this process's rows of the mask
        (``local``) and the kept count out. A collective with data-parallel ranks: every rank calls it at every
        step."""
        if selecting:
            scores = self.scores(step, proxy_losses, ref_losses, offset=offset)
        else:  # warm-up: every valid token, no scores
            scores = torch.full(valid.shape, math.nan, dtype=torch.float32, device=valid.device)
        gamma = self.policy.effective_gamma(self.gamma)
        return select_across_ranks(scores, valid, gamma, self.ranks, scope=self.scope, select=selecting)
