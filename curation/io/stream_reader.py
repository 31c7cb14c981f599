"""Reading the sequences of one proxy step from a candidate-shard directory (``streaming.LocalDataset``).

Which sequences a step holds is :class:`curation.core.stream.CandidateStream`'s answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from curation.core.stream import CandidateStream
from curation.io.shards import open_shards


@dataclass
class StepBatch:
    """The candidate sequences of one proxy step.

    Attributes:
        step: proxy step ``t``.
        sample_ids: ``(b,)`` ids into the candidate directory.
        tokens: ``(b, L)`` token ids (the shard dtype, uint16 or uint32).
        sources: one source label per sequence.
    """

    step: int
    sample_ids: np.ndarray
    tokens: np.ndarray
    sources: list[str]


class StreamReader:
    """Read the sequences of stream steps from a candidate-shard directory.

    Args:
        dataset: a map-style dataset whose items have ``tokens`` and ``source`` (e.g. what
            :func:`curation.io.shards.open_shards` returns).
        stream: the candidate stream; its ``num_samples`` must equal ``len(dataset)``.
        path: the directory (for error messages).
    """

    def __init__(self, dataset: Any, stream: CandidateStream, *, path: str = "<dataset>") -> None:
        if len(dataset) != stream.num_samples:
            raise ValueError(
                f"{path}: holds {len(dataset)} sequences but the stream was built for {stream.num_samples}"
            )
        self.dataset = dataset
        self.stream = stream
        self.path = path

    @classmethod
    def open(cls, path: str, *, batch_size: int, seed: int, spec: str = "candidate") -> StreamReader:
        """Open ``path`` (validated against the shard ``spec``) with a stream over all its sequences."""
        ds = open_shards(path, spec)
        return cls(ds, CandidateStream(len(ds), batch_size, seed), path=path)

    def read(self, step: int) -> StepBatch:
        """The batch of proxy step ``step``."""
        ids = self.stream.batch_ids(step)
        rows = [self.dataset[int(i)] for i in ids]
        tokens = np.stack([np.asarray(r["tokens"]) for r in rows])
        return StepBatch(step=step, sample_ids=ids, tokens=tokens, sources=[str(r["source"]) for r in rows])
