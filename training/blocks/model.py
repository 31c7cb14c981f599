"""The masked-loss ComposerModel around any HF ``AutoModelForCausalLM``.

Batches are dicts (see :mod:`training.blocks.data`): ``tokens`` ``(b, L)`` int64, optional ``valid``
``(b, L)`` bool (real tokens; ``None`` = all), optional ``loss_mask`` ``(b, L)`` bool (α over
loss positions, aligned with ``tokens``: position ``n`` is the loss of predicting ``tokens[n]``;
``None`` = every valid position), plus non-tensor fields (``source``, ``step``, ...).

The loss is the mean over kept positions, ``Σ α ℓ / Σ α``, with the denominator taken over the
*whole* batch even when Composer splits it into microbatches: Composer multiplies each microbatch
loss by ``rows_mb / rows_batch``, so a microbatch returns ``Σ_mb α ℓ / K · rows_batch / rows_mb``
where ``K`` (``batch["kept_total"]``) and ``rows_batch`` (``batch["rows_total"]``) are written on
the full batch before the split (:func:`training.blocks.data.annotate_batch`). The sum over microbatches
is then exactly the full-batch masked mean (test: equal gradients).

The forward pass returns the logits; :meth:`MaskedCausalLM.token_losses` computes the per-token
losses once (with the graph) and caches them in the outputs, so the BLADE algorithm's selection and
the loss share one cross-entropy.

How the model runs (``model.activation_checkpointing``, ``model.compile``): :func:`checkpoint_activations`
recomputes each decoder layer's activations in the backward pass (the HF model's own gradient checkpointing,
non-reentrant; a sharded model is checkpointed by Composer's FSDP config instead: :mod:`training.blocks.sharding`);
:meth:`MaskedCausalLM.compile_forward` runs this module's forward passes through ``torch.compile`` while the HF
module itself stays as it is, so its weights keep their names and its copies (the in-process reference) run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
from composer.models import ComposerModel
from torch import Tensor, nn
from torchmetrics import Metric

from curation.core.distributed import normalised_loss
from curation.core.losses import model_logits, token_losses
from curation.core.selection import masked_mean
from training.blocks.data import Batch

__all__ = ["MaskedCausalLM", "LMOutputs", "TokenLoss", "TokenPerplexity", "kept_mask", "checkpoint_activations"]


class LMOutputs(dict):
    """Forward outputs: ``logits``, and ``losses``/``valid`` once computed (a dict, so Composer can move it)."""


def kept_mask(batch: Batch, valid: Tensor) -> Tensor:
    """α of a batch: ``loss_mask & valid`` (all valid positions when the batch has no mask)."""
    mask = batch.get("loss_mask")
    if mask is None:
        return valid
    mask = mask.to(valid.device)
    if mask.shape != valid.shape:
        raise ValueError(f"loss_mask has shape {tuple(mask.shape)}, tokens have {tuple(valid.shape)}")
    return mask.bool() & valid


class MaskedCausalLM(ComposerModel):
    """A causal LM trained on the mean loss of its kept tokens.

    Args:
        model: an HF causal LM (``forward(input_ids=...) → .logits``) or any module mapping tokens to logits.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # No per-step train metric: it repeated ``loss/train/total`` and cost a read on the host every step
        # (Composer computes and logs train metrics after each batch); the loss is logged by StepReads.
        self.train_metrics: dict[str, Metric] = {}
        self.val_metrics = {"TokenLoss": TokenLoss(), "TokenPerplexity": TokenPerplexity()}
        self.compiled: nn.Module | None = None  # not a submodule: the same weights, no second name for them

    def compile_forward(self, **options: Any) -> None:
        """Run the forward passes (training and evaluation) through ``torch.compile(self.model, **options)``."""
        object.__setattr__(self, "compiled", torch.compile(self.model, **options))

    # --- forward / loss ----------------------------------------------------------------------
    def forward(self, batch: Batch) -> LMOutputs:
        model = self.compiled if self.compiled is not None else self.model
        return LMOutputs(logits=model_logits(model, batch["tokens"], batch.get("valid")))

    def token_losses(self, outputs: LMOutputs, batch: Batch) -> tuple[Tensor, Tensor]:
        """Per-token float32 losses (with graph) and validity; computed once per forward."""
        if outputs.get("losses") is None:
            losses, valid = token_losses(outputs["logits"], batch["tokens"], batch.get("valid"))
            outputs["losses"], outputs["valid"] = losses, valid
        return outputs["losses"], outputs["valid"]

    def loss(self, outputs: LMOutputs, batch: Batch) -> Tensor:
        losses, valid = self.token_losses(outputs, batch)
        alpha = kept_mask(batch, valid)
        kept_total = batch.get("kept_total")
        if kept_total is None:  # no microbatch bookkeeping: the plain masked mean
            return masked_mean(losses, alpha)
        return normalised_loss(losses, alpha, kept_total=int(kept_total), rows_total=int(batch["rows_total"]))

    # --- metrics -----------------------------------------------------------------------------
    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        return self.train_metrics if is_train else self.val_metrics

    def eval_forward(self, batch: Batch, outputs: LMOutputs | None = None) -> LMOutputs:
        return outputs if outputs is not None else self.forward(batch)

    def update_metric(self, batch: Batch, outputs: LMOutputs, metric: Metric) -> None:
        with torch.no_grad():
            losses, valid = self.token_losses(outputs, batch)
            metric.update(losses.detach(), kept_mask(batch, valid))


def checkpoint_activations(hf: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (HF gradient checkpointing, non-reentrant:
    the same gradients, less activation memory, about one more forward of compute).

    Raises:
        ValueError: the model does not support it (names the class and the setting).
    """
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.activation_checkpointing: {type(hf).__name__} does not support gradient "
                         "checkpointing; set it to false")
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class TokenLoss(Metric):
    """Mean token loss over kept (or valid) positions, accumulated over batches."""

    full_state_update = False

    def __init__(self, dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.add_state("sum_loss", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, losses: Tensor, mask: Tensor) -> None:
        self.sum_loss += torch.where(mask, losses.double(), 0.0).sum()
        self.count += mask.sum()

    def compute(self) -> Tensor:
        return (self.sum_loss / self.count.clamp(min=1)).float()


class TokenPerplexity(TokenLoss):
    """``exp`` of :class:`TokenLoss`."""

    def compute(self) -> Tensor:
        return torch.exp(super().compute())
