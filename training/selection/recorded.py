"""The engine-fed pipelined trainer's record of what each step trained on (the engine selected it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from curation.core.losses import target_valid
from curation.core.policies import get_policy
from curation.core.refresh_data import recent_state, restore_recent
from curation.core.stats import SelectionRecord

__all__ = ["EngineSelection"]


class EngineSelection(Algorithm):
    """Bookkeeping of the pipelined (plain masked-loss) trainer: what each step trained on.

    A :class:`~training.blocks.callbacks.StepSelections` like the BLADE algorithm: ``policy``, ``last``, ``recent``,
    ``refresh_log`` (the engine writes its own), ``timers``, ``counts``.
    """

    def __init__(self, policy: str, *, recent_batches: int) -> None:
        self.policy = get_policy(policy)
        self.last: SelectionRecord | None = None
        self.recent: deque[tuple[int, np.ndarray]] = deque(maxlen=recent_batches)
        self.refresh_log: list[dict[str, Any]] = []
        self.timers: dict[str, float] = {}
        self.counts: dict[str, int] = {"selected_steps": 0}

    def match(self, event: Event, state: State) -> bool:
        return event == Event.BATCH_END

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        batch = state.batch
        tokens = batch["tokens"].cpu()
        valid = target_valid(tokens)
        mask = batch["loss_mask"].cpu().bool() & valid
        rec = SelectionRecord(
            step=int(batch["step"]), episode=int(batch["episode"]), ref_version=int(batch["ref_version"]),
            tokens=tokens.numpy(), mask=mask.numpy(), valid=valid.numpy(), scores=batch["score"].cpu().float().numpy(),
            sources=list(batch["source"]), sample_ids=batch["sample_id"].cpu().numpy(),
        )
        self.recent.append((rec.step, rec.mask.astype(np.uint8)))
        self.counts["selected_steps"] += int(rec.ref_version >= 0)
        self.last = rec

    def state_dict(self) -> dict[str, Any]:
        return {
            **recent_state(self.recent),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        restore_recent(self.recent, state)
        self.counts.update(state.get("counts", {}))
