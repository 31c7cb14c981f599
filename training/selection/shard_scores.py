"""``ℓ(w̃)`` written by others: scored shards (``data.scored``) or the Ray engine's scored parts, read live.

:class:`ShardScores` gives the BLADE algorithm this rank's rows of a step's reference losses and checks them
against the candidate stream (the same sequences) and the schedule (the reference version the step needs).
:class:`EngineScores` is the engine's source: it waits until a scoring worker has written the part holding
the step, through the engine's declared handle (:class:`curation.engine.handle.EngineHandle`), so nothing here
imports ray.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from curation.core.distributed import Ranks
from curation.engine.handle import EngineFeed

__all__ = ["ScoreSource", "ShardScores", "EngineScores"]


class ScoreSource(Protocol):
    """Reference losses by step: ``read(step) → (tokens, ref_loss float16, episode)`` of the step's ``b`` rows."""

    path: str

    def read(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


class ShardScores:
    """This rank's rows of each step's ``ℓ(w̃)`` from ``source``, checked (module docstring)."""

    def __init__(self, source: ScoreSource, ranks: Ranks) -> None:
        self.source = source
        self.ranks = ranks

    def losses(self, step: int, tokens: np.ndarray, version: int) -> np.ndarray:
        """``ℓ(w̃)`` of this rank's rows of ``step`` (its ``tokens``), scored by reference ``version``.

        Raises:
            ValueError: the scored sequences are not the candidate stream's, or were scored by another version.
        """
        scored, ref, episodes = self.source.read(step)
        rows = self.ranks.rows(scored.shape[0])
        scored, ref, episodes = scored[rows], ref[rows], episodes[rows]
        if not np.array_equal(scored.astype(np.int64), tokens):
            raise ValueError(
                f"{self.source.path}: the scored sequences of step {step} are not the candidate stream's"
            )
        if (episodes != version).any():
            raise ValueError(
                f"{self.source.path}: step {step} was scored by reference version {int(episodes[0])}, "
                f"the schedule needs version {version} (stale scores)"
            )
        return ref


class EngineScores:
    """Reference losses of stream steps from the engine's scored parts, read live through the feed
    (:meth:`~curation.engine.handle.EngineFeed.rows`: it waits until a worker has written the step's part).

    Args:
        feed: the running engine, the scored-shard directory it writes, the trainer's candidate stream, how long to
            wait for a step's scores before failing.
    """

    def __init__(self, feed: EngineFeed) -> None:
        self.feed = feed
        self.path = feed.out_dir

    def read(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, ref_loss float16, episode)`` of the ``b`` sequences of ``step`` (waits for them)."""
        rows = self.feed.rows(step)
        return (rows.column("tokens"), rows.column("ref_loss").astype(np.float16),
                np.asarray([int(e) for e in rows.column("episode")]))
