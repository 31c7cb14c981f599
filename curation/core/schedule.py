"""The proxy-step schedule: warm-up, episodes, reference refreshes (docs/DESIGN.md §2).

Proxy steps are numbered ``t = 0, 1, 2, ...`` (``t`` is the step about to be taken).

* Steps ``0 ≤ t < W`` are warm-up: the proxy trains on every valid token, no reference exists.
* A refresh is due *before* step ``t = W + e·τ`` (``e = 0, 1, ...``); it produces reference
  version ``e``, which scores steps ``W + e·τ ≤ t < W + (e+1)·τ``.
* The episode of step ``t ≥ W`` is therefore ``e = ⌊(t − W) / τ⌋``, and equals the reference
  version that scores it. During warm-up the episode is ``-1`` (no reference).

The original design note wrote ``e = ⌊t/τ⌋``, which counts episodes from step 0 and leaves the warm-up prefix
unnumbered; the two agree when ``W = 0``. Counting from the end of the warm-up makes the first
refresh (at ``t = W``) episode 0 whatever ``W`` is, so every episode has exactly τ steps.

Static (``rho1``) and reference-free policies use the same warm-up and episode numbering but no
refreshes; see :meth:`Schedule.reference_version`.

Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (types only: the core imports nothing of schemas at run time)
    from schemas.train_config import TrainConfig

__all__ = ["WARMUP_EPISODE", "Schedule"]

#: Episode (and reference version) of warm-up steps.
WARMUP_EPISODE = -1


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class Schedule:
    """Warm-up / episode / refresh schedule of the proxy.

    Attributes:
        warmup: ``W``, number of warm-up steps (all tokens, no selection).
        tau: ``τ``, proxy steps per episode (between two refreshes).
        total_steps: total proxy steps, or ``None`` if open-ended. Refreshes are only due while
            steps remain to be scored.
    """

    warmup: int
    tau: int
    total_steps: int | None = None

    def __post_init__(self) -> None:
        _check_int("warmup", self.warmup, 0)
        _check_int("tau", self.tau, 1)
        if self.total_steps is not None:
            _check_int("total_steps", self.total_steps, 0)

    @classmethod
    def of(cls, cfg: TrainConfig) -> Schedule:
        """The run's schedule (warm-up ``W``, refresh interval ``τ``, ``max_steps``), built here once: every object
        of a run that needs one is given this one (the trainer, and in the engine's job its plan, scoring workers and
        refresh, as the object itself)."""
        return cls(cfg.selection.warmup_steps, cfg.selection.tau, cfg.max_steps)

    def _check_step(self, t: int) -> int:
        return _check_int("step t", t, 0)

    def is_warmup(self, t: int) -> bool:
        """Whether step ``t`` is a warm-up step (trains on all valid tokens)."""
        return self._check_step(t) < self.warmup

    def episode(self, t: int) -> int:
        """Episode of step ``t``: ``⌊(t − W) / τ⌋``, or ``-1`` during warm-up."""
        if self.is_warmup(t):
            return WARMUP_EPISODE
        return (t - self.warmup) // self.tau

    def refresh_due(self, t: int) -> bool:
        """Whether a refresh must run before step ``t`` (``t = W, W + τ, ...``, ``t < total_steps``)."""
        if self.is_warmup(t):
            return False
        if self.total_steps is not None and t >= self.total_steps:
            return False
        return (t - self.warmup) % self.tau == 0

    def reference_version(self, t: int, *, refreshed: bool = True) -> int:
        """Reference version that scores step ``t``; ``-1`` during warm-up (no selection).

        Args:
            t: proxy step.
            refreshed: ``False`` for a static reference (``rho1``): version 0 scores every step
                after the warm-up.
        """
        e = self.episode(t)
        if e == WARMUP_EPISODE or refreshed:
            return e
        return 0

    def refresh_step(self, version: int) -> int:
        """The step before which reference ``version`` is computed: ``W + version·τ``."""
        return self.warmup + _check_int("version", version, 0) * self.tau

    def episode_starts(self, stop: int | None = None) -> range:
        """The first steps of the episodes that start before ``stop`` (default ``total_steps``):
        ``W, W + τ, ...``, the steps a refresh is due before (in a run that refreshes).

        Raises:
            ValueError: ``stop`` and ``total_steps`` are both ``None``.
        """
        if stop is None:
            if self.total_steps is None:
                raise ValueError("episode_starts needs a stop step or total_steps")
            stop = self.total_steps
        return range(self.warmup, _check_int("stop", stop, 0), self.tau)

    def steps_scored_by(self, version: int) -> range:
        """Steps scored by reference ``version`` (one episode; clipped to ``total_steps``)."""
        start = self.refresh_step(version)
        stop = start + self.tau
        if self.total_steps is not None:
            stop = min(stop, self.total_steps)
            start = min(start, stop)
        return range(start, stop)

    def episode_end(self, t: int) -> int:
        """The step after the last step of ``t``'s episode (``W + (e+1)·τ``, clipped to ``total_steps``).

        The steps ``t ≤ s < episode_end(t)`` are scored by the same reference as ``t``: what a reference
        can score ahead right after it is computed.

        Raises:
            ValueError: ``t`` is a warm-up step (no episode).
        """
        e = self.episode(t)
        if e == WARMUP_EPISODE:
            raise ValueError(f"step {t} is a warm-up step (W = {self.warmup}): it belongs to no episode")
        return self.steps_scored_by(e).stop

    def same_episodes(self, saved: Mapping[str, Any]) -> bool:
        """Whether a schedule saved with :meth:`to_dict` numbers steps as this one does: the same ``W`` and
        ``τ`` (``total_steps`` may differ: a finished run may be extended with more steps)."""
        theirs, mine = dict(saved), self.to_dict()
        theirs.pop("total_steps", None)
        mine.pop("total_steps")
        return theirs == mine

    def num_refreshes(self) -> int:
        """Number of refreshes in a run of ``total_steps`` steps.

        Raises:
            ValueError: if ``total_steps`` is ``None``.
        """
        if self.total_steps is None:
            raise ValueError("num_refreshes needs total_steps")
        remaining = self.total_steps - self.warmup
        return 0 if remaining <= 0 else -(-remaining // self.tau)

    def to_dict(self) -> dict[str, int | None]:
        """JSON-serialisable form."""
        return asdict(self)
