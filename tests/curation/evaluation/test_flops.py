"""curation.evaluation.flops: the one FLOPs formula, against hand-computed values and a real model's weights."""

from __future__ import annotations

from torch import nn

from curation.evaluation.flops import ModelShape, forward_flops, forward_flops_per_token, train_flops
from curation.io.models import build_causal_lm
from schemas.train_config import demo_model_config


def test_flops_by_hand():
    # the quality benchmark's tiny setting: per layer q,k,v,o 4·4² = 64, gated MLP 3·4·8 = 96; head 4·10 = 40
    tiny = ModelShape(hidden=4, layers=1, intermediate=8, vocab=10, context=8)
    assert tiny.matmul_weights == 200
    assert forward_flops_per_token(tiny) == 2 * 200 + 2 * 1 * 8 * 4 == 464
    assert forward_flops(tiny, 16) == 464 * 16 and train_flops(tiny, 16) == 3 * 464 * 16
    # grouped-query attention: 4 heads of 8 (q width 32), 1 key-value head (k, v width 8)
    gqa = ModelShape(hidden=32, layers=2, intermediate=64, vocab=100, context=16, q_width=32, kv_width=8)
    per_layer = 2 * 32 * 32 + 2 * 32 * 8 + 3 * 32 * 64
    assert gqa.matmul_weights == 2 * per_layer + 32 * 100
    assert forward_flops_per_token(gqa) == 2 * (2 * per_layer + 3200) + 2 * 2 * 16 * 32


def test_the_shape_of_the_demo_llama_counts_its_matmul_weights():
    """The analytic count equals the weights of every nn.Linear of the built model (the tied LM head included)."""
    cfg = demo_model_config(512, hidden=32, layers=2)
    hf = build_causal_lm(cfg)
    shape = ModelShape.of_hf_config(hf.config, context=128)
    linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, nn.Linear))
    assert shape.matmul_weights == linear
    # hidden 32, 2 heads of 16, intermediate 32·8//3//8·8 + 8 = 88, vocab 512, context 128
    assert (shape.hidden, shape.layers, shape.intermediate, shape.q_width, shape.kv_width) == (32, 2, 88, 32, 32)
    assert forward_flops_per_token(shape) == 2 * (2 * (4 * 32 * 32 + 3 * 32 * 88) + 32 * 512) + 2 * 2 * 128 * 32
    assert ModelShape.of_hf_config(cfg.hf_config, context=128) == shape  # a config dict reads the same


def test_other_architectures_have_no_flops_model():
    assert ModelShape.of_hf_config({"model_type": "gpt2", "n_embd": 64}, context=128) is None
