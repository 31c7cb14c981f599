"""Measured FLOPs of any causal LM, for the architectures :mod:`curation.evaluation.flops` has no formula for
(GPT-2, GPT-NeoX, OPT, Phi, ...: every Hugging Face causal LM).

:func:`measured_forward_flops_per_token` counts the FLOPs of one forward pass over one sequence with torch's
``FlopCounterMode``, on a copy of the model built from its config under ``FakeTensorMode``: no weight is allocated
and no arithmetic is done (a 7B Llama is counted in about 2 s on a CPU, whatever the device the model trains on),
the model itself is untouched, and the count does not depend on FSDP, ``torch.compile`` or the device. The copy runs
eager attention, so the attention scores and values are matrix products the counter sees (torch 2.7 does not count
SDPA's CPU kernel); they are counted over the whole ``L × L`` square (the causal half is not discounted, as the
analytic formula does: for the demo's Llama at L = 128 the measured count is 6.6% higher than the analytic one).
The count is every matrix-product FLOP of the forward: a training step is :data:`~curation.evaluation.flops.
TRAIN_PASSES` of them.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["measured_forward_flops_per_token"]


def measured_forward_flops_per_token(model: nn.Module, context: int) -> float:
    """FLOPs per token of a forward pass of ``model`` (a Hugging Face causal LM: its class and ``config``) over a
    sequence of ``context`` tokens (module docstring). Leaves the model, and the global random state, as they were.

    Raises:
        RuntimeError: (or another error of the model's forward) when the forward cannot run on fake tensors (an
            architecture with data-dependent control flow); the caller names the model and goes without FLOPs.
    """
    config = copy.deepcopy(model.config)
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # a copy's construction notes (already shown for the model itself)
    try:
        with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=True):
            fake = _model_class(model)._from_config(config, attn_implementation="eager")
            fake.eval()
            ids = torch.zeros((1, int(context)), dtype=torch.long)
            with FlopCounterMode(display=False) as counter, torch.no_grad():
                fake(input_ids=ids)
    finally:
        quiet.setLevel(level)
    return counter.get_total_flops() / int(context)


def _model_class(model: nn.Module) -> type:
    """The model's own class (FSDP2's ``fully_shard`` swaps in a subclass made by torch: its first base not of torch)."""
    return next(c for c in type(model).__mro__ if not c.__module__.startswith("torch."))
