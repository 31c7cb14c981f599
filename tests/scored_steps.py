"""Scored shards written in-process (what the Ray engine's scoring workers write, by step), for the tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from curation.io.shards import merge_part_indexes, part_name, save_manifest, write_part
from curation.io.stream_reader import StreamReader
from schemas.manifest import Manifest, ShardRecord
from schemas.shards import SCORED


def write_scored_steps(
    out_dir: str,
    reader: StreamReader,
    scorer: Callable[[np.ndarray], np.ndarray],
    steps: range,
    *,
    episode_of: Callable[[int], int],
    vocab_size: int,
    job: str = "score",
    config: dict[str, Any] | None = None,
    tokenizer_fingerprint: str | None = None,
) -> ShardRecord:
    """Score the candidate batches of ``steps`` and write them as one scored part.

    Resumable: a part already recorded in ``out_dir/manifest.json`` is not written again.

    Args:
        out_dir: scored-shard directory (created).
        reader: the candidate stream and shards.
        scorer: tokens ``(b, L)`` → float16 losses (a :class:`TokenLossScorer`).
        steps: a contiguous step range.
        episode_of: the episode (reference version) that scores a step.
        vocab_size: for the token column's dtype.
        job: recorded in a new manifest.
        config: recorded in a new manifest.
        tokenizer_fingerprint: recorded in a new manifest (the trainer checks it against its data).

    Returns:
        The part's record.
    """
    if steps.step != 1 or len(steps) == 0:
        raise ValueError(f"steps must be a non-empty contiguous range, got {steps}")
    manifest = Manifest.load_if_exists(out_dir) or Manifest(
        kind=SCORED.name, job=job, config=config or {}, vocab_size=vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint, extra={"stream": reader.stream.to_dict()},
    )
    if manifest.extra.get("stream") != reader.stream.to_dict():
        raise ValueError(
            f"{out_dir}: scored for stream {manifest.extra.get('stream')}, not {reader.stream.to_dict()}"
        )
    name = part_name(steps.start, steps.stop)
    for rec in manifest.shards:
        if rec.name == name and rec.complete:
            return rec
    rows: list[dict[str, Any]] = []
    n_tokens = 0
    for t in steps:
        batch = reader.read(t)
        ref = np.asarray(scorer(batch.tokens), dtype=np.float16)
        episode = int(episode_of(t))
        for i in range(batch.tokens.shape[0]):
            rows.append({"tokens": batch.tokens[i], "source": batch.sources[i], "ref_loss": ref[i], "episode": episode})
            n_tokens += batch.tokens.shape[1]
            manifest.counts(batch.sources[i]).sequences += 1
    write_part(os.path.join(out_dir, name), SCORED, rows, vocab_size=vocab_size)
    rec = ShardRecord(name=name, samples=len(rows), tokens=n_tokens,
                      state={"first_step": steps.start, "stop_step": steps.stop})
    manifest.shards.append(rec)
    manifest.shards.sort(key=lambda r: r.state["first_step"])
    merge_part_indexes(out_dir, [r.name for r in manifest.shards if r.complete])
    save_manifest(out_dir, manifest)
    return rec
