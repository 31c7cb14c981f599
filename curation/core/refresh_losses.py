"""The losses of a refresh step (:func:`curation.core.refresh.refresh_reference`): a batch's mean loss, and the
validation and candidate losses from one forward over both batches' rows stacked (``RefreshSettings.joint_forward``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from curation.core.losses import TokenBatch, autocast, model_logits, token_losses
from curation.core.selection import masked_mean

__all__ = ["joint_losses", "mean_loss"]


def _forward_losses(model: nn.Module, batch: TokenBatch, device: torch.device, *, precision: str
                    ) -> tuple[Tensor, Tensor, TokenBatch]:
    """Per-position losses and valid targets of ``batch`` (and the batch on ``device``)."""
    # whether every position is real, asked where the batch is (on the host, before its copy: no device read)
    padded = batch.valid is not None and not bool(batch.valid.all())
    batch = batch.to(device)
    with autocast(precision, device):
        logits = model_logits(model, batch.tokens, batch.valid if padded else None)
    losses, valid = token_losses(logits, batch.tokens, batch.valid)
    return losses, valid, batch


def _masked_loss(losses: Tensor, valid: Tensor, mask: Tensor | None) -> Tensor:
    """The mean loss over the valid targets, weighted by the selection ``mask`` (α) when given."""
    if mask is None:
        return masked_mean(losses, valid)
    if mask.shape != valid.shape:
        raise ValueError(f"candidate mask has shape {tuple(mask.shape)}, tokens have {tuple(valid.shape)}")
    alpha = mask & valid if mask.dtype == torch.bool else mask.float() * valid
    return masked_mean(losses, alpha)


def mean_loss(model: nn.Module, batch: TokenBatch, device: torch.device, *, use_mask: bool, precision: str) -> Tensor:
    """``batch``'s mean loss on ``device`` (over its selection α with ``use_mask``), its forward at ``precision``."""
    losses, valid, batch = _forward_losses(model, batch, device, precision=precision)
    return _masked_loss(losses, valid, batch.mask if use_mask else None)


def joint_losses(model: nn.Module, val: TokenBatch, cand: TokenBatch, device: torch.device, *, precision: str
                  ) -> tuple[Tensor, Tensor] | None:
    """``L_val`` and ``L_train(α)`` from one forward over the validation rows and the candidate rows stacked
    (:attr:`RefreshSettings.joint_forward`); ``None`` when they cannot be stacked (different lengths).

    Every row's losses are its own (causal attention, each row masked alone), so both means are over the same
    terms as two separate forwards; only the order in which a GPU sums them may differ."""
    if val.tokens.shape[1] != cand.tokens.shape[1] or (cand.mask is not None and cand.mask.shape != cand.tokens.shape):
        return None  # (a mask of the wrong shape: the separate forwards' error names it)
    n = val.tokens.shape[0]
    valid = None
    if val.valid is not None or cand.valid is not None:
        valid = torch.cat([b.valid if b.valid is not None else torch.ones_like(b.tokens, dtype=torch.bool)
                           for b in (val, cand)])
    mask = None
    if cand.mask is not None:  # the validation rows' part is not read; it only lets one copy carry both
        mask = torch.cat([torch.zeros_like(val.tokens, dtype=cand.mask.dtype), cand.mask])
    both = TokenBatch(torch.cat([val.tokens, cand.tokens]), valid, mask)
    losses, valid, both = _forward_losses(model, both, device, precision=precision)
    return (_masked_loss(losses[:n], valid[:n], None),
            _masked_loss(losses[n:], valid[n:], None if both.mask is None else both.mask[n:]))
