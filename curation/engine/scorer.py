"""Token-loss scoring: a plain scorer class, and scored shards written and read by stream step.

:class:`TokenLossScorer` loads one model once (``__init__(config)``) and maps a batch of token
sequences to its per-token losses as numpy float16 (``__call__``): the reference's ``ℓ(w̃)``, and in a
pipelined scoring worker the proxy snapshot's ``ℓ(u)`` too, under
``torch.inference_mode``. It runs in-process (tests, the single-process trainer) and, unchanged,
as a Ray actor (the Ray engine wraps the class; nothing here imports ray). New reference weights
arrive with :meth:`TokenLossScorer.load_weights` (a version number travels with them).

Scored shards (docs/DESIGN.md §5: candidate columns + ``ref_loss`` + ``episode``) hold the candidate
stream *by step*: a part ``steps-<first>-<stop>/`` holds the ``b`` sequences of each step
``first ≤ t < stop`` in stream order, and the manifest records each part's step range. The trainer
(:class:`ScoredShards`) looks a step up by range, so parts may be written by different workers in
any order. The manifest's ``extra.stream`` is the :class:`~curation.core.stream.CandidateStream` the
steps refer to; a reader with a different stream is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from curation.core.host_sync import HostCopies, pinned
from curation.core.losses import autocast, model_token_losses
from curation.core.stream import CandidateStream
from curation.engine.weights import FlatStaging, load_state_flat
from curation.io.models import build_causal_lm, load_weights, resolve_device
from curation.io.shards import merge_part_indexes, open_shards, part_name, save_manifest, write_part
from curation.io.stream_reader import StreamReader
from schemas.manifest import Manifest, ShardRecord
from schemas.shards import SCORED
from schemas.train_config import ScorerConfig

__all__ = ["TokenLossScorer", "check_finite_losses", "resolve_device", "write_scored_steps", "ScoredShards"]


def check_finite_losses(losses: Tensor, what: str) -> None:
    """Raise ``ValueError`` naming the first ``(row, position)`` where ``losses`` is not finite.

    One host synchronisation (a reduction to one flag); the position is searched for only on failure.
    """
    if not bool(torch.isfinite(losses).all()):
        bad = (~torch.isfinite(losses)).nonzero()[0].tolist()
        raise ValueError(f"{what} loss is not finite at (row, position) {tuple(bad)}: the {what} diverged")


def _as_tokens(batch: Any) -> Tensor:
    if isinstance(batch, Mapping):
        batch = batch.get("tokens", batch.get("input_ids"))
    if isinstance(batch, np.ndarray):
        batch = torch.from_numpy(batch.astype(np.int64, copy=False))
    if not isinstance(batch, Tensor) or batch.dim() != 2:
        raise TypeError("a scorer batch is a (b, L) token array/tensor or a mapping with 'tokens'")
    return batch.long()


class TokenLossScorer:
    """Per-token losses of one model, the reference or a proxy snapshot (loaded once, scored without gradients).

    Args:
        config: the model and where/how to run it.
        model: use this module instead of building one from ``config.model`` (the trainer's
            in-process reference); it is not copied.
    """

    def __init__(self, config: ScorerConfig, *, model: nn.Module | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if model is None:
            model = build_causal_lm(config.model)
            if config.weights is not None:
                load_weights(model, config.weights)
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.version: int | None = None
        self.staging = FlatStaging()

    def load_weights(self, weights: Mapping[str, Tensor] | str, version: int | None = None) -> None:
        """Replace the weights (a state dict, or a safetensors path) and record their version; on a GPU in one
        non-blocking copy per dtype from a reused pinned buffer (:func:`~curation.engine.weights.load_state_flat`)."""
        if isinstance(weights, str):
            load_weights(self.model, weights)
        else:
            load_state_flat(self.model, weights, what="scorer weights", staging=self.staging)
        self.version = version

    def to(self, device: torch.device | str) -> TokenLossScorer:
        """Move the model (e.g. to the training device to score, back to CPU to offload)."""
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    def forward(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        """The model's part of :meth:`losses`: float32 ``(b, L)`` losses of a batch already on the device.

        From the final hidden states, chunk by chunk: no ``(b, L, V)`` logits (:mod:`curation.core.losses`). An
        instance attribute may replace it (``jobs/bench_scoring.py --pipeline-only`` puts a stub of negligible
        cost there to time everything else)."""
        with autocast(self.config.precision, self.device):
            losses, _ = model_token_losses(self.model, tokens, valid)
        return losses

    def queue_losses(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        """float32 ``(b, L)`` losses on the scorer's device (0 at invalid positions), *unchecked*: on a GPU the
        work is only queued (no host synchronisation; ``tokens`` in pinned memory are copied asynchronously).
        The caller checks them (:func:`check_finite_losses`, or a flag copied back with the results)."""
        out = []
        bs = self.config.batch_size
        # A sharded (FSDP) reference is trained again later (blade-nosync): the buffers its forward gathers the
        # parameters into must not become inference tensors.
        with torch.no_grad() if isinstance(self.model, FSDPModule) else torch.inference_mode():
            whole = tokens.shape[0] <= bs
            for i in range(0, tokens.shape[0], bs):
                chunk = tokens if whole else tokens[i : i + bs]
                vchunk = None if valid is None else valid if whole else valid[i : i + bs]
                if chunk.device != self.device:  # (the copy's dispatch costs as much as a small step's own work)
                    chunk = chunk.to(self.device, non_blocking=True)
                if vchunk is not None and vchunk.device != self.device:
                    vchunk = vchunk.to(self.device, non_blocking=True)
                out.append(self.forward(chunk, vchunk))
        if len(out) == 1:
            return out[0]
        return torch.cat(out) if out else torch.zeros(tokens.shape, dtype=torch.float32, device=self.device)

    def losses(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        """float32 ``(b, L)`` losses on the scorer's device (0 at invalid positions); raises ``ValueError`` naming
        the first non-finite one (one host synchronisation)."""
        losses = self.queue_losses(tokens, valid)
        check_finite_losses(losses, "reference")
        return losses

    def __call__(self, batch: Any) -> np.ndarray:
        """``ℓ(w̃)`` of a ``(b, L)`` token batch as numpy float16 (0 at position 0)."""
        return self.score_many([batch])[0]

    def score_many(self, batches: Sequence[Any]) -> list[np.ndarray]:
        """:meth:`__call__` of several batches with one wait on the host: every forward is queued, then one
        finiteness flag and the float16 losses of all of them are copied back together (non-blocking, into pinned
        memory, one event). A non-finite loss raises ``ValueError`` naming the first ``(row, position)`` of the
        first batch that has one (searched for only then)."""
        if not batches:
            return []
        losses = [self.queue_losses(pinned(_as_tokens(b), self.device)) for b in batches]
        stacked = torch.cat([x.to(torch.float16).reshape(-1) for x in losses])
        finite = torch.stack([x.sum() for x in losses]).isfinite().all()  # (a sum that overflows: the exact check)
        copies = HostCopies(self.device, slots=1)
        host = copies.get(copies.put({"losses": stacked, "finite": finite}))
        if not bool(host["finite"]):
            for x in losses:
                check_finite_losses(x, "reference")
        out, offset = [], 0
        for x in losses:
            n = x.numel()
            out.append(host["losses"][offset:offset + n].view(x.shape).numpy().copy())
            offset += n
        return out


# ------------------------------------------------------------------------------------------------
# scored shards
# ------------------------------------------------------------------------------------------------
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


class ScoredShards:
    """Reference losses of stream steps, read from a scored-shard directory.

    Args:
        path: the directory (``write_scored_steps`` layout, validated against the scored schema).
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

    def covers(self, step: int) -> bool:
        """Whether the directory holds the scores of ``step``."""
        return any(first <= step < stop for first, stop, _ in self._ranges)

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
