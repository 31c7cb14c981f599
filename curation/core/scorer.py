"""Token-loss scoring, pure torch: :class:`TokenLossScorer` holds one model and maps a batch of token sequences to its
per-token losses as numpy float16 (``__call__``): the reference's ``ℓ(w̃)``, and in a pipelined scoring worker the
proxy snapshot's ``ℓ(u)`` too, under ``torch.inference_mode``, from the final hidden states in chunks (no full logits:
:mod:`curation.core.losses`).

The compute kernel of both sides of the seam: the engine's scoring workers (:mod:`curation.engine.workers`, built from
a config by :func:`curation.io.models.build_scorer`) and the trainer's in-process reference
(:mod:`training.selection.reference`, around its own module). New weights arrive with
:meth:`TokenLossScorer.load_weights` (a version number travels with them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from curation.core.flat_weights import FlatStaging, load_state_flat
from curation.core.host_sync import HostCopies, pinned
from curation.core.losses import autocast, is_fsdp, model_token_losses

__all__ = ["TokenLossScorer", "check_finite_losses", "as_tokens"]


def check_finite_losses(losses: Tensor, what: str) -> None:
    """Raise ``ValueError`` naming the first ``(row, position)`` where ``losses`` is not finite.

    One host synchronisation (a reduction to one flag); the position is searched for only on failure.
    """
    if not bool(torch.isfinite(losses).all()):
        bad = (~torch.isfinite(losses)).nonzero()[0].tolist()
        raise ValueError(f"{what} loss is not finite at (row, position) {tuple(bad)}: the {what} diverged")


def as_tokens(batch: Tensor | np.ndarray | Mapping[str, Tensor | np.ndarray]) -> Tensor:
    """A scorer batch as a ``(b, L)`` int64 tensor: a token tensor or array, or a mapping with ``tokens``."""
    if isinstance(batch, Mapping):
        batch = batch.get("tokens", batch.get("input_ids"))
    if isinstance(batch, np.ndarray):
        batch = torch.from_numpy(batch.astype(np.int64, copy=False))
    if not isinstance(batch, Tensor) or batch.dim() != 2:
        raise TypeError("a scorer batch is a (b, L) token array/tensor or a mapping with 'tokens'")
    return batch.long()


class TokenLossScorer:
    """Per-token losses of one model, the reference or a proxy snapshot (held once, scored without gradients).

    Args:
        model: the causal LM (moved to ``device``, put in eval mode, its parameters frozen; not copied).
        device: where it scores.
        batch_size: sequences per forward (a larger batch is scored in chunks of this many).
        precision: ``fp32``, or ``amp_bf16`` (the forward under bf16 autocast on CUDA; losses in float32).

    A model built from a config (:class:`~schemas.train_config.ScorerConfig`: its architecture, weights file, device)
    comes from :func:`curation.io.models.build_scorer`.
    """

    def __init__(self, model: nn.Module, *, device: torch.device, batch_size: int, precision: str = "fp32") -> None:
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.precision = precision
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.version: int | None = None
        self.staging = FlatStaging()

    def load_weights(self, weights: Mapping[str, Tensor], version: int | None = None) -> None:
        """Replace the weights (a state dict: names and shapes must match) and record their version; on a GPU in one
        non-blocking copy per dtype from a reused pinned buffer (:func:`~curation.core.flat_weights.load_state_flat`)."""
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
        with autocast(self.precision, self.device):
            losses, _ = model_token_losses(self.model, tokens, valid)
        return losses

    def queue_losses(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        """float32 ``(b, L)`` losses on the scorer's device (0 at invalid positions), *unchecked*: on a GPU the
        work is only queued (no host synchronisation; ``tokens`` in pinned memory are copied asynchronously).
        The caller checks them (:func:`check_finite_losses`, or a flag copied back with the results)."""
        out = []
        bs = self.batch_size
        # A sharded (FSDP) reference is trained again later (blade-nosync): the buffers its forward gathers the
        # parameters into must not become inference tensors.
        with torch.no_grad() if is_fsdp(self.model) else torch.inference_mode():
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

    def __call__(self, batch: Tensor | np.ndarray | Mapping[str, Tensor | np.ndarray]) -> np.ndarray:
        """``ℓ(w̃)`` of a ``(b, L)`` token batch as numpy float16 (0 at position 0)."""
        return self.score_many([batch])[0]

    def score_many(self, batches: Sequence[Tensor | np.ndarray | Mapping[str, Tensor | np.ndarray]]) -> list[np.ndarray]:
        """:meth:`__call__` of several batches with one wait on the host: every forward is queued, then one
        finiteness flag and the float16 losses of all of them are copied back together (non-blocking, into pinned
        memory, one event). A non-finite loss raises ``ValueError`` naming the first ``(row, position)`` of the
        first batch that has one (searched for only then)."""
        if not batches:
            return []
        losses = [self.queue_losses(pinned(as_tokens(b), self.device)) for b in batches]
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
