"""A real :class:`training.selection.reference.InProcessReference` on small in-memory rows (test scaffolding shared
by test_reference_store.py and the 2-process FSDP worker shard_worker.py; not collected by pytest).

The validation rows, the recent trained steps (tokens with their masks α) and the candidate batch the reference
scores are fixed random tensors; everything else (refresh settings, schedule, ranks, meters) is the product's.
"""

from __future__ import annotations

from typing import Any

import torch

from curation.core.distributed import current_ranks
from curation.core.policies import get_policy
from curation.core.refresh import RefreshSettings
from curation.core.refresh_data import RecentMasks, RefreshData
from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream
from schemas.train_config import ModelConfig
from training.blocks.data import StepBatches
from training.blocks.meters import Meters
from training.selection.reference import InProcessReference, ReferenceSettings


class FixedSteps(StepBatches):
    """Every step's candidate batch is ``tokens`` (what the reference scores)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        super().__init__(CandidateStream(tokens.shape[0], tokens.shape[0], 0), 1 << 20)
        self.tokens = tokens

    def batch(self, step: int) -> dict[str, Any]:
        return {"tokens": self.tokens, "step": step}


def make_reference(model: ModelConfig, policy: str, *, val: torch.Tensor, recent: list[dict[str, torch.Tensor]],
                   score: torch.Tensor, steps: int, lam: float = 1.0, lr: float = 1e-2, batch: int = 2,
                   offload: bool = True) -> tuple[InProcessReference, RecentMasks]:
    """The reference of a run of ``policy`` whose refreshes take ``steps`` AdamW steps on batches of ``batch``
    validation rows of ``val`` and the ``recent`` steps (``tokens`` and ``mask`` each), refreshing at every step
    (``τ = 1``) and scoring ``score`` (this rank's rows of it). Returns it and the recent masks a refresh takes."""
    tokens = [r["tokens"] for r in recent]
    refresh = RefreshData(RefreshSettings(refresh_steps=steps, lam=lam, lr=lr, batch_size=batch), Schedule(0, 1),
                          num_validation=val.shape[0], validation_path="validation",
                          validation_tokens=lambda ids: val[torch.from_numpy(ids)], step_tokens=lambda s: tokens[s])
    settings = ReferenceSettings(policy=get_policy(policy), model=model, precision="fp32", score_batch_size=batch,
                                 offload=offload)
    ref = InProcessReference(settings, refresh, FixedSteps(score), schedule=Schedule(0, 1), ranks=current_ranks(),
                             meters=Meters())
    masks = RecentMasks.from_pairs([(i, r["mask"].to(torch.uint8).numpy()) for i, r in enumerate(recent)])
    return ref, masks
