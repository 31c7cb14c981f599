"""The deterministic candidate stream: ``(seed, step) → sample ids`` (docs/DESIGN.md §3).

Every consumer of candidate batches (the trainer's loader in single-process runs, the Ray
coordinator and its scoring workers later) asks this one function which sequences make up proxy
step ``t``. It is what makes exact mode possible (scores exist for exactly the batches the trainer
will see), and what makes resume well defined (the batch of step ``t`` does not depend on how the
run got there).

The stream is an endless sequence of epochs; epoch ``e`` is a permutation of ``range(num_samples)``
drawn from ``numpy.random.default_rng([seed, e])``. Step ``t`` takes positions
``[t·b, (t+1)·b)`` of the concatenated epochs, so a batch may straddle two epochs and every epoch
visits every sample exactly once.

:class:`CandidateStream` is pure numpy. :class:`StreamReader` adds reading the sequences of a step
from a candidate-shard directory (``streaming.LocalDataset``).

Example:
    >>> s = CandidateStream(num_samples=10, batch_size=4, seed=0)
    >>> s.batch_ids(0).shape
    (4,)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["CandidateStream"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class CandidateStream:
    """Which candidate sequences make up each proxy step.

    Attributes:
        num_samples: sequences in the candidate pool (``N``).
        batch_size: sequences per proxy step (``b``, the global candidate batch).
        seed: stream seed; the same ``(num_samples, batch_size, seed)`` always gives the same stream.
    """

    num_samples: int
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("num_samples", self.num_samples, 1)
        _check_int("batch_size", self.batch_size, 1)
        _check_int("seed", self.seed, 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of sample ids that epoch ``epoch`` visits (int64)."""
        return _epoch_order(self.num_samples, self.seed, _check_int("epoch", epoch, 0)).copy()

    def batch_ids(self, step: int) -> np.ndarray:
        """Sample ids of proxy step ``step`` (int64, length ``batch_size``)."""
        step = _check_int("step", step, 0)
        return self.positions(step * self.batch_size, (step + 1) * self.batch_size)

    def positions(self, start: int, stop: int) -> np.ndarray:
        """Sample ids at stream positions ``[start, stop)`` (int64)."""
        start, stop = _check_int("start", start, 0), _check_int("stop", stop, 0)
        if stop < start:
            raise ValueError(f"stop ({stop}) must be >= start ({start})")
        n = self.num_samples
        out = np.empty(stop - start, dtype=np.int64)
        filled = 0
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, n)
            take = min(stop - pos, n - offset)
            out[filled : filled + take] = _epoch_order(n, self.seed, epoch)[offset : offset + take]
            filled += take
            pos += take
        return out

    def steps(self, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(step, sample_ids)`` for steps ``start ≤ t < stop``."""
        for t in range(start, stop):
            yield t, self.batch_ids(t)

    def to_dict(self) -> dict[str, int]:
        """JSON-ready form (written into manifests and checked on resume)."""
        return {"num_samples": self.num_samples, "batch_size": self.batch_size, "seed": self.seed}


@lru_cache(maxsize=4)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)
    order.setflags(write=False)
    return order


