"""Per-token losses of a causal LM and the glue to get logits out of a model.

Conventions used everywhere in :mod:`curation` (DESIGN.md §2):

* A batch is ``tokens`` of shape ``(b, L)`` plus an optional boolean ``valid`` of the same shape
  marking real tokens (``False`` for padding or tokens the caller wants ignored).
* Loss arrays are aligned with ``tokens``: position ``n`` holds
  ``ℓ_n = -log p(tokens[:, n] | tokens[:, :n])``, computed from ``logits[:, n - 1]``. Position 0
  predicts nothing and is never valid. Every mask in this package (validity, selection α) is over
  these *target* positions, so a selection mask can be written next to ``tokens`` unchanged.

Pure torch: no ray, no composer.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CPU_CHUNK_ELEMENTS",
    "DEFAULT_CHUNK_ELEMENTS",
    "TokenBatch",
    "as_token_batch",
    "model_logits",
    "target_valid",
    "token_losses",
]

#: Upper bound on ``rows × vocab`` logits upcast to float32 at once by :func:`token_losses` on a GPU
#: (2**25 floats = 128 MiB). Bounds the extra memory of the float32 upcast for bf16 logits.
DEFAULT_CHUNK_ELEMENTS = 1 << 25
#: The same bound on a CPU, where it is chosen for the cache instead (2**21 floats = 8 MiB): for a 32k
#: vocabulary the cross-entropy of cache-sized chunks runs ≈ 2.2× faster without gradients and ≈ 1.3×
#: with them than in one piece (2 threads, 2048 rows). The values do not depend on the block size.
CPU_CHUNK_ELEMENTS = 1 << 21


def target_valid(tokens: Tensor, valid: Tensor | None = None) -> Tensor:
    """Validity of the loss positions of ``tokens``.

    Position ``n`` is valid iff ``n > 0`` and ``valid[:, n]``. The context of a valid target is
    not checked: for *left*-padded input, also mark the first real token of each row invalid
    (it has no context) before calling.

    Args:
        tokens: ``(b, L)`` token ids.
        valid: optional ``(b, L)`` boolean mask of real tokens; ``None`` means all real.

    Returns:
        ``(b, L)`` boolean tensor on ``tokens.device``.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape (b, L), got {tuple(tokens.shape)}")
    if valid is None:
        out = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    else:
        if valid.shape != tokens.shape:
            raise ValueError(
                f"valid has shape {tuple(valid.shape)} but tokens have shape {tuple(tokens.shape)}"
            )
        if valid.dtype != torch.bool:
            raise TypeError(f"valid must be a bool tensor, got {valid.dtype}")
        out = valid.to(device=tokens.device, copy=True)
    out[:, 0] = False
    return out


def token_losses(
    logits: Tensor,
    tokens: Tensor,
    valid: Tensor | None = None,
    *,
    chunk_elements: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token negative log-likelihood of ``tokens`` under ``logits``, in float32.

    ``losses[:, n] = -log softmax(logits[:, n - 1])[tokens[:, n]]`` for valid ``n`` and 0
    elsewhere. Logits of any floating dtype are upcast to float32 chunk by chunk (at most
    ``chunk_elements`` logits at a time), so bf16/fp16 logits never materialise a full float32
    copy. Differentiable with respect to ``logits``.

    Args:
        logits: ``(b, L, V)`` next-token logits, as returned by a causal LM for ``tokens``.
        tokens: ``(b, L)`` integer token ids. Ids at invalid positions are not read (they may be
            out of range, e.g. ``-100``).
        valid: optional ``(b, L)`` boolean mask of real tokens (see :func:`target_valid`).
        chunk_elements: memory bound of the float32 upcast, in logits; ``None``:
            :data:`CPU_CHUNK_ELEMENTS` for CPU logits, :data:`DEFAULT_CHUNK_ELEMENTS` otherwise.
            The values do not depend on it.

    Returns:
        ``(losses, valid)``: float32 ``(b, L)`` losses (0 at invalid positions) and the boolean
        ``(b, L)`` validity of each loss position (position 0 always ``False``).

    Raises:
        ValueError: on inconsistent shapes.
    """
    if logits.dim() != 3 or logits.shape[:2] != tokens.shape:
        raise ValueError(
            f"logits must have shape (b, L, V) matching tokens {tuple(tokens.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got {tokens.dtype}")
    tokens = tokens.to(logits.device)
    out_valid = target_valid(tokens, None if valid is None else valid.to(logits.device))
    if chunk_elements is None:
        chunk_elements = CPU_CHUNK_ELEMENTS if logits.device.type == "cpu" else DEFAULT_CHUNK_ELEMENTS
    b, length, vocab = logits.shape
    if length < 2 or b == 0:
        return torch.zeros((b, length), dtype=torch.float32, device=logits.device), out_valid

    tv = out_valid[:, 1:]
    zero = torch.zeros((), dtype=tokens.dtype, device=tokens.device)
    # targets[:, n] is predicted by logits[:, n]; the last column (predicting nothing) is a dummy 0.
    targets = torch.cat([torch.where(tv, tokens[:, 1:], zero), torch.zeros_like(tokens[:, :1])], dim=1).long()
    # Whole sequences over all L positions: a contiguous (b, L, V) reshapes to (b·L, V) without a copy,
    # whereas the strided slice `logits[:, :-1]` would be copied (for a large vocabulary that copy costs as
    # much as the cross-entropy itself). The loss of the last position is computed and dropped (1/L extra
    # work). Rows go through the cross-entropy `chunk_elements` logits at a time (bounds the float32
    # upcast of low-precision logits; on a CPU, cache-sized chunks are also faster for large
    # vocabularies), taken with `split`: views whose gradients are gathered by one concatenation.
    # (Slicing blocks out of `logits` and writing them into a preallocated result would instead allocate
    # a full-size zero gradient per block in the backward pass: 1.7x slower training steps.) Row-wise,
    # the values are those of the sliced computation.
    flat = logits.reshape(b * length, vocab)
    flat_targets = targets.reshape(-1)
    rows = max(1, chunk_elements // max(vocab, 1))
    if flat.shape[0] <= rows:
        nll_all = F.cross_entropy(flat.float(), flat_targets, reduction="none")
    else:
        nll_all = torch.cat([
            F.cross_entropy(chunk.float(), tgt, reduction="none")
            for chunk, tgt in zip(flat.split(rows), flat_targets.split(rows), strict=True)
        ])
    nll_all = nll_all.view(b, length)
    nll = nll_all[:, :-1]
    # torch.where (not multiplication) so that a non-finite logit at an invalid position stays out.
    nll = torch.where(tv, nll, torch.zeros((), dtype=nll.dtype, device=nll.device))
    losses = torch.cat([torch.zeros((b, 1), dtype=nll.dtype, device=nll.device), nll], dim=1)
    return losses, out_valid


@dataclass(frozen=True)
class TokenBatch:
    """A batch of token sequences with optional validity and selection masks.

    Attributes:
        tokens: ``(b, L)`` integer token ids.
        valid: optional ``(b, L)`` boolean mask of real tokens (``None``: all real).
        mask: optional ``(b, L)`` selection mask α over loss positions (bool or float weights);
            ``None`` means every valid position.
    """

    tokens: Tensor
    valid: Tensor | None = None
    mask: Tensor | None = None

    def to(self, device: torch.device | str) -> TokenBatch:
        """Return a copy with every tensor moved to ``device``."""
        return TokenBatch(
            self.tokens.to(device),
            None if self.valid is None else self.valid.to(device),
            None if self.mask is None else self.mask.to(device),
        )


def as_token_batch(batch: Any) -> TokenBatch:
    """Normalise the accepted batch forms into a :class:`TokenBatch`.

    Accepted: a :class:`TokenBatch`; a ``(b, L)`` token tensor; a tuple/list
    ``(tokens[, valid[, mask]])``; or a mapping with ``tokens`` (or ``input_ids``) and optional
    ``valid`` (or ``attention_mask``) and ``mask`` (or ``loss_mask``).

    Raises:
        TypeError: for anything else.
    """
    if isinstance(batch, TokenBatch):
        return batch
    if isinstance(batch, Tensor):
        return TokenBatch(batch)
    if isinstance(batch, tuple | list) and 1 <= len(batch) <= 3:
        return TokenBatch(*batch)
    if isinstance(batch, Mapping):
        tokens = batch.get("tokens", batch.get("input_ids"))
        if tokens is None:
            raise TypeError(f"batch mapping needs a 'tokens' or 'input_ids' key, got keys {sorted(batch)}")
        valid = batch.get("valid", batch.get("attention_mask"))
        if valid is not None and valid.dtype != torch.bool:
            valid = valid.bool()
        mask = batch.get("mask", batch.get("loss_mask"))
        return TokenBatch(tokens, valid, mask)
    raise TypeError(
        "a batch must be a TokenBatch, a token tensor, a (tokens, valid, mask) tuple or a mapping, "
        f"got {type(batch).__name__}"
    )


def _accepts_input_ids(model: nn.Module) -> tuple[bool, bool]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # builtins / C extensions without a signature
        return False, False
    return "input_ids" in params, "attention_mask" in params


def model_logits(model: nn.Module, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
    """Run ``model`` on ``tokens`` and return its ``(b, L, V)`` logits.

    Works with any HF ``AutoModelForCausalLM``-like module (``forward(input_ids=...,
    attention_mask=...)`` returning an object with ``.logits``) and with plain modules called as
    ``model(tokens)`` that return a logits tensor (or a tuple whose first item is one). The
    attention mask is passed only when some position is invalid.

    Args:
        model: the causal LM.
        tokens: ``(b, L)`` token ids (moved to the model's device if needed).
        valid: optional ``(b, L)`` boolean mask of real tokens.

    Returns:
        The logits tensor.
    """
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = tokens.device
    tokens = tokens.to(device)
    has_ids, has_mask = _accepts_input_ids(model)
    if has_ids:
        kwargs: dict[str, Tensor] = {}
        if has_mask and valid is not None and not bool(valid.all()):
            kwargs["attention_mask"] = valid.to(device=device, dtype=torch.long)
        out = model(input_ids=tokens, **kwargs)
    else:
        out = model(tokens)
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, tuple | list) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(f"cannot find logits in the output of {type(model).__name__}: {type(out).__name__}")
