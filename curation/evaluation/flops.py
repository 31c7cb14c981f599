"""Analytic FLOPs of a decoder-only transformer (Llama-style), per token.

One formula for the whole project: the quality benchmark's compute accounting (``training/quality/compute.py``)
and the trainer's throughput and MFU figures read it from here.

Forward FLOPs per token of a model with ``n`` layers, hidden size ``h``, MLP width ``m`` (gated: three
matrices), ``H`` query heads and ``G`` key/value heads of size ``d = h / H``, vocabulary ``V`` and context
``L``::

    2 · ( n · (2·h·h + 2·h·G·d + 3·h·m) + h·V )      # every weight used in a matmul, the LM head included
  + 2 · n · L · h                                    # attention scores and values, causal (average L/2 keys)

The embedding lookup is free; norms, activations and the softmax are ignored (a few percent at these sizes).
Backward costs two forwards, so training costs ``3 ×`` forward. A token the loss mask drops still costs its
forward and backward (it is in the sequence).

Example:
    >>> s = ModelShape(hidden=4, layers=1, intermediate=8, vocab=10, heads=1, kv_heads=1, context=8)
    >>> forward_flops_per_token(s)
    464.0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "forward_flops_per_token", "train_flops_per_token"]


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a decoder-only transformer depend on."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    context: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any, context: int | None = None) -> ModelShape:
        """From an HF config (a ``PretrainedConfig`` or its dict); ``context`` defaults to its
        ``max_position_embeddings`` (pass the training sequence length when it is shorter)."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                               "num_attention_heads") if get(k) is None]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}: cannot count its FLOPs")
        heads = int(get("num_attention_heads"))
        ctx = context if context is not None else get("max_position_embeddings")
        if ctx is None:
            raise ValueError("model config lacks max_position_embeddings: give the context length")
        return cls(hidden=int(get("hidden_size")), layers=int(get("num_hidden_layers")),
                   intermediate=int(get("intermediate_size")), vocab=int(get("vocab_size")), heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads), context=int(ctx))


def forward_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs per token (module docstring)."""
    h, n = shape.hidden, shape.layers
    kv = shape.kv_heads * (h // shape.heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * shape.intermediate
    return 2.0 * (n * per_layer + h * shape.vocab) + 2.0 * n * shape.context * h


def train_flops_per_token(shape: ModelShape) -> float:
    """Forward + backward FLOPs per token (backward = two forwards)."""
    return 3.0 * forward_flops_per_token(shape)
