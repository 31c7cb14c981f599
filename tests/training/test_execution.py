"""``model.activation_checkpointing`` and ``model.compile`` on a CPU: the same gradients with checkpointing (and the
decoder layers really run twice), the same training run; a compiled run matches an eager one and selects the same
tokens."""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from curation.io.models import build_causal_lm
from curation.io.shards import read_column
from schemas.train_config import TrainConfig, demo_model_config
from training.blocks.model import MaskedCausalLM, checkpoint_activations
from training.runs.train_job import train


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (4, 32), generator=g)
    return {"tokens": tokens, "loss_mask": torch.rand(4, 32, generator=g) < 0.6}


def _grads(model: MaskedCausalLM, batch: dict) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.loss(model(batch), batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _layer_calls(model: MaskedCausalLM, batch: dict) -> int:
    """Forward calls of the first decoder layer in one training step (forward hooks do not see a recomputation)."""
    layer, calls = model.model.model.layers[0], []
    forward = layer.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    layer.forward = counted
    try:
        _grads(model, batch)
    finally:
        del layer.forward
    return len(calls)


def test_activation_checkpointing_gives_the_gradients_of_a_plain_backward():
    torch.manual_seed(0)
    plain = MaskedCausalLM(build_causal_lm(demo_model_config(512, hidden=32, layers=2, seq_len=32)))
    checkpointed = copy.deepcopy(plain)
    checkpoint_activations(checkpointed.model)
    batch = _batch()
    want, got = _grads(plain, batch), _grads(checkpointed, batch)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
    # the activations are recomputed: each decoder layer runs again in the backward pass
    assert (_layer_calls(plain, batch), _layer_calls(checkpointed, batch)) == (1, 2)
    # the module keeps its names (checkpoints and ‖u − w̃‖ pair weights by name) and copies keep checkpointing
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()
    assert _layer_calls(copy.deepcopy(checkpointed), batch) == 2


def test_a_model_without_gradient_checkpointing_is_refused():
    with pytest.raises(ValueError, match=r"^model.activation_checkpointing: Linear does not support gradient "
                                         r"checkpointing; set it to false$"):
        checkpoint_activations(torch.nn.Linear(2, 2))


def _with_model(cfg: TrainConfig, **options) -> TrainConfig:
    return TrainConfig.model_validate({**cfg.model_dump(), "model": {**cfg.model.model_dump(), **options}})


def test_a_run_with_checkpointing_equals_one_without(make_config):
    eager = train(make_config("blade", "plain", max_steps=6))
    ckpt = train(_with_model(make_config("blade", "checkpointed", max_steps=6), activation_checkpointing=True))
    a, b = load_file(eager.final_weights), load_file(ckpt.final_weights)
    assert all(torch.equal(a[k], b[k]) for k in a)  # on a CPU, bit for bit
    masks = [np.stack(read_column(r.selected, "loss_mask")) for r in (eager, ckpt)]
    assert np.array_equal(*masks)


def test_a_compiled_forward_keeps_the_names_and_leaves_copies_eager():
    model = MaskedCausalLM(build_causal_lm(demo_model_config(512, hidden=32, layers=1, seq_len=32)))
    names = list(model.state_dict())
    model.compile_forward(backend="eager")  # dynamo capture only: no C compiler needed for this check
    batch = _batch()
    torch.testing.assert_close(model(batch)["logits"], model.model(input_ids=batch["tokens"]).logits)
    assert list(model.state_dict()) == names and not any(m is model.compiled for m in model.modules())
    assert copy.deepcopy(model.model)._compiled_call_impl is None  # the reference, a copy of the HF module


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile (inductor) on a CPU needs a C++ compiler (g++)")
def test_a_compiled_run_matches_an_eager_one(make_config, monkeypatch):
    """Inductor on a CPU compiles C++ kernels (minutes on a busy 2-core machine): 3 steps, one of them selecting.
    One compile thread: inductor's default pool of compile processes cost 81 s of CPU against 70 s in this process
    (measured on the 2-core machine)."""
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    small = {"max_steps": 3, "eval": {"interval": 3, "batch_size": 8, "max_batches": 1}}
    eager = train(make_config("blade", "eager", **small))
    compiled = train(_with_model(make_config("blade", "compiled", **small), compile=True))
    a, b = load_file(eager.final_weights), load_file(compiled.final_weights)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    masks = [np.stack(read_column(r.selected, "loss_mask")) for r in (eager, compiled)]
    assert np.array_equal(*masks)
    summaries = [json.load(open(r.summary, encoding="utf-8")) for r in (eager, compiled)]
    assert summaries[1]["validation"][-1]["loss"] == pytest.approx(summaries[0]["validation"][-1]["loss"], abs=1e-5)


def test_compile_is_refused_with_fsdp(make_config):
    cfg = make_config("blade", parallel={"workers": 2, "strategy": "fsdp"})
    with pytest.raises(ValueError, match="model.compile is not wired for parallel.strategy=fsdp"):
        TrainConfig.model_validate({**cfg.model_dump(), "model": {**cfg.model.model_dump(), "compile": True}})


def test_compile_on_a_cpu_without_a_cpp_compiler_is_refused(make_config, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a: None)
    cfg = _with_model(make_config("blade"), compile=True)
    with pytest.raises(ValueError, match=r"^model.compile on a CPU needs a C\+\+ compiler \(g\+\+ not found; "):
        train(cfg)
    assert not os.path.exists(os.path.join(cfg.output_dir, "config.yaml"))  # before anything was written
