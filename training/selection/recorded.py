"""The engine-fed pipelined trainer's record of what each step trained on (the engine selected it): built on the host
from the batch the engine's parts gave (nothing of it is on the device), delivered with the step's loss a step later
(:class:`~training.blocks.step_reads.StepReads`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
from composer.core import State
from torch import Tensor

from curation.core.losses import target_valid
from curation.core.policies import get_policy
from curation.core.refresh_data import recent_state, restore_recent
from curation.core.stats import SelectionRecord
from training.blocks.step_reads import StepReads

__all__ = ["EngineSelection"]


class EngineSelection(StepReads[SelectionRecord, SelectionRecord]):
    """Bookkeeping of the pipelined (plain masked-loss) trainer: what each step trained on.

    A :class:`~training.blocks.callbacks.StepSelections` like the BLADE algorithm: ``policy``, ``last``, ``recent``,
    ``refresh_log`` (the engine writes its own), ``timers``, ``counts``.
    """

    def __init__(self, policy: str, *, recent_batches: int) -> None:
        super().__init__()
        self.policy = get_policy(policy)
        self.last: SelectionRecord | None = None
        self.recent: deque[tuple[int, np.ndarray]] = deque(maxlen=recent_batches)
        self.refresh_log: list[dict[str, Any]] = []
        self.timers: dict[str, float] = {}
        self.counts: dict[str, int] = {"selected_steps": 0}
        self.extra_values: list[Any] = []  # (state, step, version) → device tensors read with the record

    def step_info(self, state: State) -> SelectionRecord:
        batch = state.batch
        tokens = batch["tokens"].cpu()
        valid = target_valid(tokens)
        mask = batch["loss_mask"].cpu().bool() & valid
        return SelectionRecord(
            step=int(batch["step"]), episode=int(batch["episode"]), ref_version=int(batch["ref_version"]),
            tokens=tokens.numpy(), mask=mask.numpy(), valid=valid.numpy(), scores=batch["score"].cpu().float().numpy(),
            sources=list(batch["source"]), sample_ids=batch["sample_id"].cpu().numpy(),
        )

    def finish(self, step: int, host: dict[str, Tensor], rec: SelectionRecord, loss: float | None) -> SelectionRecord:
        rec.loss = loss
        if "distance" in host:
            rec.distance = float(host["distance"])
        self.recent.append((rec.step, rec.mask.astype(np.uint8)))
        self.counts["selected_steps"] += int(rec.ref_version >= 0)
        self.last = rec
        return rec

    def step_values(self, state: State) -> dict[str, Tensor]:
        values: dict[str, Tensor] = {}
        batch = state.batch
        for extra in self.extra_values:
            values.update(extra(state, int(batch["step"]), int(batch["ref_version"])))
        return values

    def state_dict(self) -> dict[str, Any]:
        self.drain()
        return {
            **recent_state(self.recent),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        restore_recent(self.recent, state)
        self.counts.update(state.get("counts", {}))
