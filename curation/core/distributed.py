"""Token selection over a candidate batch split across data-parallel ranks (DESIGN.md §2), and the
loss normaliser that makes the averaged DDP gradient equal the single-process one.

Rank ``r`` of ``N`` holds rows ``[r·b/N, (r+1)·b/N)`` of each candidate batch of ``b`` rows. Gathering
in rank order rebuilds the single-process row order, so the flat index of the gathered ``(b, L)``
tensor is the global flat index and :func:`~curation.core.selection.select_top_fraction` on it gives
exactly the single-process mask: the same ``k = num_selected(γ, global valid count)`` and the same
tie-break by lower global flat index. Every rank computes that mask from bitwise-identical inputs and
keeps its own slice.

* ``scope="global"``: the top-γ of the whole candidate batch (the single-process selection).
* ``scope="rank"``: the top-γ of each rank's ``b/N`` rows (each block keeps its own γ share; equal to
  a single process selecting per microbatch of ``b/N`` rows). The choice needs no communication;
  the scores are still gathered so that every rank holds the full-batch record.

Pure torch (``torch.distributed``): no ray, no composer. The process group is whatever the caller
runs in (Ray Train sets it up for the trainer); with no process group (or one rank) everything is
local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from curation.core.selection import select_top_fraction

__all__ = [
    "all_ranks_true",
    "SCOPES",
    "Ranks",
    "GlobalSelection",
    "current_ranks",
    "gather_rows",
    "select_across_ranks",
    "global_rows",
    "normalised_loss",
]

Scope = Literal["global", "rank"]


#: The selection scopes (``selection.scope`` of the training config).
SCOPES: tuple[str, ...] = ("global", "rank")


@dataclass(frozen=True)
class Ranks:
    """Where this process is in the data-parallel group: ``rank`` of ``world_size``."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")

    def rows(self, batch_rows: int) -> slice:
        """This rank's rows of a global batch of ``batch_rows`` rows (which must split evenly)."""
        if batch_rows % self.world_size:
            raise ValueError(f"a batch of {batch_rows} rows does not split over {self.world_size} ranks")
        n = batch_rows // self.world_size
        return slice(self.rank * n, (self.rank + 1) * n)


def current_ranks() -> Ranks:
    """The rank and world size of the initialised default process group (``Ranks()`` without one)."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


def all_ranks_true(flag: Tensor, ranks: Ranks) -> bool:
    """Whether a boolean scalar ``flag`` is true on every rank: one ``all_reduce`` (MIN, on ``flag``'s device), so
    every rank takes the same branch; with one rank, ``flag`` itself."""
    if ranks.world_size == 1:
        return bool(flag)
    t = flag.to(torch.int32).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def gather_rows(local: Tensor, ranks: Ranks) -> Tensor:
    """Concatenate every rank's ``local`` (same shape on each) along dim 0, in rank order.

    One ``all_gather_into_tensor``; with one rank, ``local`` itself. Bool tensors travel as uint8.
    """
    if ranks.world_size == 1:
        return local
    src = local.contiguous()
    is_bool = src.dtype == torch.bool
    if is_bool:
        src = src.to(torch.uint8)
    out = torch.empty((ranks.world_size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
    dist.all_gather_into_tensor(out, src)
    return out.bool() if is_bool else out


@dataclass
class GlobalSelection:
    """The selection of one candidate batch as every rank sees it after :func:`select_across_ranks`.

    Attributes:
        mask: ``(b, L)`` bool α of the whole batch (identical on every rank).
        scores: ``(b, L)`` float32 scores of the whole batch.
        valid: ``(b, L)`` bool validity of the whole batch.
        local: this rank's rows of ``mask``.
        kept: ``Σ α`` of the whole batch (``K``: :meth:`curation.core.step.SelectionStep.kept` knows it beforehand);
            computed when read (on a GPU reading it waits for the selection).
    """

    mask: Tensor
    scores: Tensor
    valid: Tensor
    local: Tensor

    @property
    def kept(self) -> int:
        return int(self.mask.sum())


def select_across_ranks(
    scores: Tensor, valid: Tensor, gamma: float, ranks: Ranks, *, scope: Scope = "global", select: bool = True,
) -> GlobalSelection:
    """Top-γ selection of a candidate batch whose rows are split over ``ranks``.

    Args:
        scores: this rank's ``(b/N, L)`` scores (float; upcast to float32 for the gather).
        valid: this rank's ``(b/N, L)`` bool validity.
        gamma: fraction kept (per batch for ``global``, per rank block for ``rank``).
        ranks: this process's place in the group; every rank must call this with the same arguments'
            shapes (a collective).
        scope: ``global`` or ``rank`` (module docstring).
        select: ``False`` (warm-up): keep every valid token; scores and validity are still gathered.

    Returns:
        The whole batch's mask, scores, validity, this rank's mask slice and the kept count.
    """
    if scope not in SCOPES:
        raise ValueError(f"selection scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if scores.shape != valid.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and valid {tuple(valid.shape)} differ in shape")
    all_scores = gather_rows(scores.float(), ranks)
    all_valid = gather_rows(valid.bool(), ranks)
    if not select:
        mask = all_valid.clone()
    elif scope == "global":
        mask = select_top_fraction(all_scores, all_valid, gamma)
    else:
        n = scores.shape[0]
        mask = torch.cat([select_top_fraction(all_scores[i : i + n], all_valid[i : i + n], gamma)
                          for i in range(0, all_scores.shape[0], n)])
    return GlobalSelection(mask=mask, scores=all_scores, valid=all_valid, local=mask[ranks.rows(mask.shape[0])])


def global_rows(local_rows: int, ranks: Ranks) -> int:
    """The ``rows_total`` a rank's loss must be normalised with: the global batch's rows ``b = N · b/N``.

    Composer scales each rank's microbatch loss by ``rows_mb / (b/N)`` and DDP averages the gradients over
    the ``N`` ranks; a loss ``Σ_mb αℓ · (rows_total / rows_mb) / K`` with ``rows_total = b`` and ``K`` the
    global kept count then gives ``∇(Σ_batch αℓ) / K``: the single-process gradient of the whole batch.
    """
    return int(local_rows) * ranks.world_size


def normalised_loss(losses: Tensor, alpha: Tensor, *, kept_total: int, rows_total: int) -> Tensor:
    """A microbatch's share of the batch loss ``Σ_batch αℓ / K``: ``Σ_mb αℓ · (rows_total / rows_mb) / K``.

    Composer multiplies it by ``rows_mb / rows_per_rank`` before ``backward`` and DDP averages over the
    ranks, so with ``rows_total`` = the global rows (:func:`global_rows`) and ``kept_total`` = the global
    ``K`` the summed gradient is the single-process one. With one rank and no microbatching it is the
    masked mean. Positions outside ``alpha`` are excluded with ``torch.where`` (NaN there does not leak).
    """
    scale = rows_total / losses.shape[0]  # undone by Composer's rows_mb / rows_total
    total = torch.where(alpha, losses, torch.zeros((), device=losses.device)).sum()
    return total * (scale / max(int(kept_total), 1))
