"""Reading a run's selected shards step by step, within a budget: which parts are read (:func:`choose_parts`: all of
them when the run fits the budget, else parts spread evenly over the run), and the rows of each step they hold
(:func:`read_steps`: one shard file in memory at a time, decoded a chunk of rows at a time).

Every position of a row but the first is a *candidate* (position 0 predicts nothing: ``loss_mask`` and ``score`` are 0
there); ``loss_mask`` marks the kept ones; ``score`` is Δ (NaN in warm-up rows, where every candidate is kept).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from curation.inspector.run import Part
from curation.io.shards import ShardReader

__all__ = ["StepRows", "choose_parts", "read_steps", "spread", "part_offsets"]

#: Rows decoded at once.
_CHUNK = 256


@dataclass
class StepRows:
    """The rows one step trained on, in their order in the shards.

    Attributes:
        step: the step.
        first: the index of the step's first row in the whole selected directory (rows are in step order).
        tokens: ``(n, L)`` token ids.
        mask: ``(n, L)`` kept positions.
        score: ``(n, L)`` Δ (float32; NaN where unscored).
        sources: one source per row.
        episode: one episode per row.
    """

    step: int
    first: int
    tokens: np.ndarray
    mask: np.ndarray
    score: np.ndarray
    sources: list[str]
    episode: np.ndarray

    @property
    def candidates(self) -> np.ndarray:
        """``(n, L)``: every position but the first."""
        c = np.ones(self.mask.shape, dtype=bool)
        c[:, 0] = False
        return c

    @property
    def scored(self) -> np.ndarray:
        """``(n,)``: rows with Δ (not warm-up rows)."""
        return np.isfinite(self.score[:, 1:]).any(axis=1) if self.score.shape[1] > 1 else np.zeros(len(self), bool)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def spread(n: int, k: int) -> list[int]:
    """``k`` indices of ``range(n)`` spread evenly, the first and the last included (all of them when ``k ≥ n``)."""
    if k >= n:
        return list(range(n))
    if k <= 1:
        return [0] if k == 1 and n else []
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def choose_parts(parts: Sequence[Part], max_tokens: int) -> list[Part]:
    """The parts to read: all when their tokens fit ``max_tokens``, else as many as fit, spread evenly over the run
    (at least one)."""
    total = sum(p.tokens for p in parts)
    if total <= max_tokens or not parts:
        return list(parts)
    mean = total / len(parts)
    return [parts[i] for i in spread(len(parts), max(1, int(max_tokens // max(mean, 1))))]


def _decode(reader: ShardReader, ids: range) -> dict[str, object]:
    got = reader.gather(ids)
    if got is not None:
        return got
    rows = [reader[i] for i in ids]  # (row by row: a damaged record is named)
    return {k: (np.stack([np.asarray(r[k]) for r in rows]) if k != "source" else [str(r[k]) for r in rows])
            for k in rows[0]}


def read_steps(parts: Sequence[Part], offsets: dict[str, int], *, wanted: Callable[[int], bool] = lambda s: True,
               done: Callable[[int], None] = lambda n: None) -> Iterator[StepRows]:
    """The steps of ``parts`` (in order) whose step ``wanted`` accepts. ``offsets[part.path]`` is the part's first
    row in the whole directory; ``done(tokens)`` is called as each chunk of rows has been read (progress)."""
    for part in parts:
        reader = ShardReader(part.path, cache_shards=1)
        n = len(reader)
        held: list[dict[str, object]] = []
        held_step: int | None = None
        start_row = 0
        for start in range(0, n, _CHUNK):
            ids = range(start, min(n, start + _CHUNK))
            cols = _decode(reader, ids)
            steps = np.asarray(cols["step"]).reshape(-1)
            cuts = [0, *(np.flatnonzero(np.diff(steps)) + 1).tolist(), len(steps)]
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                step = int(steps[a])
                if held_step is not None and step != held_step:
                    if wanted(held_step):
                        yield _rows(held_step, offsets[part.path] + start_row, held)
                    held, start_row = [], start + a
                held_step = step
                if wanted(step):
                    held.append({k: (v[a:b]) for k, v in cols.items()})
            done(int(np.asarray(cols["tokens"]).shape[1]) * len(ids))
        if held_step is not None and held and wanted(held_step):
            yield _rows(held_step, offsets[part.path] + start_row, held)


def _rows(step: int, first: int, pieces: list[dict[str, object]]) -> StepRows:
    def cat(k: str) -> np.ndarray:
        return np.concatenate([np.asarray(p[k]) for p in pieces])

    sources = [str(s) for p in pieces for s in p["source"]]  # type: ignore[union-attr]
    return StepRows(step=step, first=first, tokens=cat("tokens").astype(np.int64), mask=cat("loss_mask").astype(bool),
                    score=cat("score").astype(np.float32), sources=sources, episode=cat("episode").astype(np.int64))


def part_offsets(parts: Sequence[Part]) -> dict[str, int]:
    """Each part's first row in the whole directory (the parts of a directory, all of them, in order)."""
    out, at = {}, 0
    for p in parts:
        out[p.path] = at
        at += p.samples
    return out
