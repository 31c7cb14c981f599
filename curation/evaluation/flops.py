"""Analytic FLOPs of a decoder-only transformer: the one formula behind the trainer's MFU
(:mod:`training.blocks.throughput`) and the quality benchmark's equal-compute comparisons
(:mod:`bench.quality.setting`).

Per token, a forward pass costs 2 FLOPs per weight of every matrix multiplication (the LM head included, tied or
not; embedding look-ups, norms and activations are left out) plus ``2 · layers · context · attention width`` for
the attention scores and values (the counting of Kaplan et al., 2020: PaLM's MFU counts the attention term twice,
which is larger for long contexts). A training step is 3 forwards (the backward pass costs 2).

No torch: a model is described by its :class:`ModelShape`, read from a Hugging Face config
(:meth:`ModelShape.of_hf_config`) for the Llama family (Llama, Mistral, Qwen2/3, OLMo, Gemma: grouped-query attention
and a gated MLP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TRAIN_PASSES", "GATED_MLP_MODELS", "ModelShape", "forward_flops_per_token", "train_flops",
           "forward_flops"]

#: A training step in forwards: forward + backward (2 forwards).
TRAIN_PASSES = 3.0

#: ``model_type`` of the HF configs whose layers are attention (q, k, v, o) + a gated MLP (gate, up, down).
GATED_MLP_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "gemma", "gemma2"})


@dataclass(frozen=True)
class ModelShape:
    """The sizes the FLOPs of a decoder-only transformer depend on.

    Attributes:
        hidden: model width ``h``.
        layers: decoder layers.
        intermediate: width of the gated MLP.
        vocab: rows of the LM head (the model's vocabulary, padding included).
        context: tokens per sequence ``L`` (the attention term).
        q_width: width of the queries (heads × head size); None = ``hidden``.
        kv_width: width of the keys and of the values (key-value heads × head size); None = ``q_width``.
    """

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    context: int
    q_width: int | None = None
    kv_width: int | None = None

    @property
    def matmul_weights(self) -> int:
        """Weights used in matrix multiplications per token: q, k, v, o and the gated MLP per layer, the LM head."""
        q = self.q_width or self.hidden
        kv = self.kv_width or q
        per_layer = 2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.hidden * self.vocab

    @classmethod
    def of_hf_config(cls, config: Any, context: int) -> ModelShape | None:
        """The shape of an HF model config (``transformers.PretrainedConfig`` or a dict) of the Llama family, with
        sequences of ``context`` tokens; None for another architecture (its FLOPs are not modelled here)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        if get("model_type") not in GATED_MLP_MODELS:
            return None
        missing = [k for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                               "num_attention_heads") if get(k) is None]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}: cannot count its FLOPs")
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        head_dim = int(get("head_dim", None) or hidden // heads)
        kv_heads = int(get("num_key_value_heads", None) or heads)
        return cls(hidden=hidden, layers=int(get("num_hidden_layers")), intermediate=int(get("intermediate_size")),
                   vocab=int(get("vocab_size")), context=int(context), q_width=heads * head_dim,
                   kv_width=kv_heads * head_dim)


def forward_flops_per_token(shape: ModelShape) -> float:
    """``2 · matmul weights + 2 · layers · context · query width`` (module docstring)."""
    return 2.0 * shape.matmul_weights + 2.0 * shape.layers * shape.context * (shape.q_width or shape.hidden)


def forward_flops(shape: ModelShape, tokens: int | float) -> float:
    """FLOPs of a forward pass over ``tokens`` tokens (scoring, evaluation)."""
    return forward_flops_per_token(shape) * tokens


def train_flops(shape: ModelShape, tokens: int | float) -> float:
    """FLOPs of a forward and backward pass over ``tokens`` tokens (every token of a batch: a masked-out token
    still costs its share of both passes)."""
    return TRAIN_PASSES * forward_flops_per_token(shape) * tokens
