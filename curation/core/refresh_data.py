"""What a reference refresh reads, built in one place (DESIGN.md §2).

Both the single-process trainer (:class:`training.selection.algorithm.BladeAlgorithm`) and the engine's refresh
actor (:class:`curation.engine.refresh_runner.RefreshRunner`) compute reference versions; they must
feed :func:`~curation.core.refresh.refresh_reference` the same batches with the same settings, or the
engine's references (and so its masks) would differ from the trainer's. :class:`RefreshData` is that
one recipe; the callers only say how to read token rows:

* **validation batches** (``L_val``) of reference version ``e``: ``K`` batches of ``refresh_batch_size``
  validation rows, batch ``k`` taking the ids of step ``e·K + k`` of a
  :class:`~curation.core.stream.CandidateStream` over the validation set seeded ``seed + 1``
  (:data:`VALIDATION_SEED_OFFSET`). RHO-1's static reference draws its ``rho1_steps`` batches the
  same way from a stream seeded ``seed + 2`` (:data:`STATIC_SEED_OFFSET`), version 0.
* **candidate batches** (``L_train(α, w)``) of version ``e``: the rows of the recent trained steps
  (:class:`RecentMasks`, oldest first) with their masks α, cycled ``refresh_batch_size`` rows at a
  time. Before anything was trained (``W = 0``, first refresh) the candidate batch of the refresh step
  ``W + e·τ`` (:meth:`~curation.core.schedule.Schedule.refresh_step`) with every valid target stands in.
* **the call**: ``K = refresh_steps``, ``λ``, ``η_w``, weight decay, clipping and precision, through the
  policy's refresh (``blade``: from ``u``; ``blade-nosync``: from the previous reference).

Pure torch + numpy: no ray, no composer.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from curation.core.losses import target_valid
from curation.core.policies import SelectionPolicy
from curation.core.refresh import (
    FROM_PROXY,
    Clone,
    RefreshResult,
    RefreshSettings,
    RefreshStart,
    train_static_reference,
)
from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream

__all__ = ["STATIC_SEED_OFFSET", "VALIDATION_SEED_OFFSET", "RecentMasks", "RefreshData"]

#: The validation stream of the refreshes is seeded ``selection.seed + VALIDATION_SEED_OFFSET``.
VALIDATION_SEED_OFFSET = 1
#: The validation stream of RHO-1's static reference is seeded ``selection.seed + STATIC_SEED_OFFSET``.
STATIC_SEED_OFFSET = 2


@dataclass
class RecentMasks:
    """The recent trained steps and their masks (what ``L_train(α, w)`` of a refresh uses).

    Attributes:
        steps: the proxy steps, oldest first.
        masks: ``(n, b, L)`` uint8 α of those steps (``None`` when there are none).
    """

    steps: list[int] = field(default_factory=list)
    masks: np.ndarray | None = None  # (n, b, L) uint8

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[int, np.ndarray]]) -> RecentMasks:
        """From ``(step, mask)`` pairs, oldest first (a trainer's window of recent steps)."""
        if not pairs:
            return cls()
        return cls([int(s) for s, _ in pairs], np.stack([np.asarray(m, dtype=np.uint8) for _, m in pairs]))


class RefreshData:
    """Builds the inputs of every refresh of a run and runs it (see the module docstring).

    Args:
        settings: the refresh settings.
        schedule: the run's schedule (where reference version ``e`` is due).
        num_validation: rows in the validation set.
        validation_path: the validation set's directory (named in errors).
        validation_tokens: ``ids → (len(ids), L)`` int64 tokens of those validation rows.
        step_tokens: ``step → (b, L)`` int64 tokens of the candidate batch of that proxy step.

    Raises:
        ValueError: the validation set is empty (names ``validation_path``).
    """

    def __init__(
        self,
        settings: RefreshSettings,
        schedule: Schedule,
        *,
        num_validation: int,
        validation_path: str,
        validation_tokens: Callable[[np.ndarray], Tensor],
        step_tokens: Callable[[int], Tensor],
    ) -> None:
        if num_validation == 0:
            raise ValueError(f"{validation_path}: the validation set is empty")
        self.cfg = settings
        self.schedule = schedule
        self.validation_tokens = validation_tokens
        self.step_tokens = step_tokens
        n, rb = num_validation, settings.batch_size
        self.val_stream = CandidateStream(n, rb, seed=settings.seed + VALIDATION_SEED_OFFSET)
        self.static_stream = CandidateStream(n, rb, seed=settings.seed + STATIC_SEED_OFFSET)

    def validation_batches(self, version: int) -> Iterator[dict[str, Tensor]]:
        """The ``K`` validation batches of reference ``version`` (read lazily, one per refresh step)."""
        return self._val_batches(self.val_stream, version, self.cfg.refresh_steps)

    def static_batches(self) -> Iterator[dict[str, Tensor]]:
        """The ``rho1_steps`` validation batches of RHO-1's static reference."""
        return self._val_batches(self.static_stream, 0, self.cfg.rho1_steps)

    def _val_batches(self, stream: CandidateStream, version: int, steps: int) -> Iterator[dict[str, Tensor]]:
        for k in range(steps):
            yield {"tokens": self.validation_tokens(stream.batch_ids(version * steps + k))}

    def candidate_batches(self, version: int, recent: RecentMasks) -> Iterator[dict[str, Tensor]]:
        """The ``K`` candidate batches (``tokens``, ``mask`` = α) of reference ``version``.

        The rows of ``recent``'s steps are read now and cycled; without recent steps, the refresh step's
        candidate batch with every valid target. Nothing when ``K = 0`` or ``λ = 0`` (no ``L_train`` term).
        """
        steps = self.cfg.refresh_steps
        if steps == 0 or self.cfg.lam == 0:
            return iter(())
        if recent.steps:
            tokens = torch.cat([self.step_tokens(s) for s in recent.steps])
            masks = torch.from_numpy(np.asarray(recent.masks).astype(bool)).reshape(tokens.shape)
        else:
            tokens = self.step_tokens(self.schedule.refresh_step(version))
            masks = target_valid(tokens)
        n, rb = tokens.shape[0], self.cfg.batch_size

        def gen() -> Iterator[dict[str, Tensor]]:
            for k in range(steps):
                idx = torch.arange(k * rb, (k + 1) * rb) % n
                yield {"tokens": tokens[idx], "mask": masks[idx]}

        return gen()

    def refresh(self, policy: SelectionPolicy, proxy: nn.Module, version: int, recent: RecentMasks,
                start: RefreshStart = FROM_PROXY) -> RefreshResult:
        """Reference ``version`` from ``proxy`` (``u``) through ``policy``'s refresh.

        Args:
            policy: ``blade`` (from ``u``) or ``blade-nosync`` (from ``start.previous``, continuing its
                ``optimizer_state``).
            proxy: the proxy at the refresh step (not modified).
            version: the reference version (its validation batches; its refresh step when ``recent`` is empty).
            recent: the recent trained steps and their masks.
            start: the refresh's start state (:class:`~curation.core.refresh.RefreshStart`: previous weights and
                AdamW state, the reused workspace, how the reference module is built).
        """
        return policy.refresh(proxy, self.validation_batches(version), self.candidate_batches(version, recent),
                              self.cfg, start)

    def train_static(self, base: nn.Module, *, clone: Clone = copy.deepcopy) -> RefreshResult:
        """RHO-1's static reference (version 0): ``rho1_steps`` steps on validation data from ``base``."""
        return train_static_reference(base, self.static_batches(), self.cfg, clone=clone)


def recent_state(recent: Iterable[tuple[int, np.ndarray]]) -> dict[str, Tensor | None]:
    """The recent ``(step, mask)`` pairs as checkpoint tensors (``recent_steps``, ``recent_masks``)."""
    pairs = list(recent)
    return {
        "recent_steps": torch.tensor([s for s, _ in pairs], dtype=torch.int64),
        "recent_masks": torch.from_numpy(np.stack([m for _, m in pairs])) if pairs else None,
    }


def restore_recent(recent: deque[tuple[int, np.ndarray]], state: Mapping[str, Any]) -> None:
    """Refill ``recent`` from a checkpoint written with :func:`recent_state`."""
    recent.clear()
    masks = state.get("recent_masks")
    for i, s in enumerate(state["recent_steps"].tolist()):
        recent.append((int(s), masks[i].numpy().copy()))

