"""Scored shards read by stream step (docs/DESIGN.md §5: candidate columns + ``ref_loss`` + ``episode``): what a
trainer reads as ``data.scored`` (:class:`ScoredShards`).

Scored shards hold the candidate stream *by step*: a part ``steps-<first>-<stop>/`` holds the ``b`` sequences of each
step ``first ≤ t < stop`` in stream order, and the manifest records each part's step range, so a step is looked up by
range and parts may be written by different workers in any order. The manifest's ``extra.stream`` is the
:class:`~curation.core.stream.CandidateStream` the steps refer to; a reader with a different stream is refused. The
Ray engine writes them (``jobs/curate_and_train.py``, exact mode: :class:`curation.engine.workers.ScoringWorker`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from curation.core.stream import CandidateStream
from curation.io.shards import open_shards
from schemas.manifest import Manifest
from schemas.shards import SCORED

__all__ = ["ScoredShards"]


class ScoredShards:
    """Reference losses of stream steps, read from a scored-shard directory.

    Args:
        path: the directory (parts ``steps-<first>-<stop>/`` of whole steps, the manifest recording each part's
            step range; validated against the scored schema).
        stream: the trainer's candidate stream; must equal the one the shards were scored for.

    Raises:
        ShardSchemaError: the directory does not hold scored shards.
        ValueError: the shards were scored for another stream.
    """

    def __init__(self, path: str, stream: CandidateStream) -> None:
        self.path = path
        manifest = Manifest.load(path)
        if manifest.extra.get("stream") != stream.to_dict():
            raise ValueError(
                f"{path}: scored shards were written for stream {manifest.extra.get('stream')}, "
                f"but training uses {stream.to_dict()} (batch_size, seed and candidate count must match)"
            )
        self.stream = stream
        self.dataset = open_shards(path, SCORED)
        self._ranges: list[tuple[int, int, int]] = []  # (first_step, stop_step, first row)
        row = 0
        for rec in manifest.shards:
            if not rec.complete:
                continue
            first, stop = int(rec.state["first_step"]), int(rec.state["stop_step"])
            self._ranges.append((first, stop, row))
            row += rec.samples

    def read(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, ref_loss float16, episode)`` of the ``b`` sequences of ``step``.

        Raises:
            KeyError: the step is not in the directory (message lists the ranges present).
        """
        b = self.stream.batch_size
        for first, stop, row in self._ranges:
            if first <= step < stop:
                start = row + (step - first) * b
                items = [self.dataset[start + i] for i in range(b)]
                return (
                    np.stack([np.asarray(x["tokens"]) for x in items]),
                    np.stack([np.asarray(x["ref_loss"]) for x in items]).astype(np.float16),
                    np.asarray([int(x["episode"]) for x in items]),
                )
        have = ", ".join(f"[{f}, {s})" for f, s, _ in self._ranges) or "none"
        raise KeyError(f"{self.path}: no scores for step {step} (steps present: {have})")

    def steps(self) -> Iterable[int]:
        """All steps present, ascending."""
        for first, stop, _ in sorted(self._ranges):
            yield from range(first, stop)
