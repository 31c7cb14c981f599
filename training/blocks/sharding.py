"""``parallel.strategy: fsdp``: the proxy and the in-process reference sharded across the trainer ranks.

With FSDP (PyTorch's ``fully_shard``, "FSDP2", applied by Composer's parallelism config) every rank holds
``1/N`` of each parameter as a ``DTensor``; a module's forward gathers the full parameters of one decoder
layer at a time. The BLADE reference is sharded **the same way** (same layers wrapped, same mesh), so:

* **Synchronisation** ``w̃_0 ← u`` copies each rank's local shards: no rank ever holds a whole model.
* **Refresh**: every rank runs the same ``K`` AdamW steps on the same deterministic batches; FSDP averages
  the identical gradients, so each rank's shard follows the single-process refresh (float summation order
  aside), and the AdamW state is sharded with the parameters.
* **Scoring**: each rank scores its own rows with the sharded reference (a collective forward: every rank
  scores the same number of steps, which the schedule guarantees).
* ``‖u − w̃‖``: the squared differences of the local shards, summed over the ranks
  (:func:`curation.core.stats.param_distance` does this for any ``DTensor``).
* **Weights on disk** (checkpoints, ``final/``): gathered to full tensors (:func:`full_state_dict`, a
  collective every rank calls), written by rank 0, and loaded back into the shards on every rank.

``copy.deepcopy`` of a sharded module is not supported by PyTorch; :func:`sharded_clone` builds the
clone's skeleton on the ``meta`` device from the HF config and shards it before any memory is allocated.

Activation checkpointing (``model.activation_checkpointing``) of a sharded model is Composer's: its FSDP config
(``activation_checkpointing``) wraps the decoder layers :func:`install_checkpoint_policy` names in PyTorch's
checkpoint wrappers before sharding. A clone is wrapped the same way (its refresh steps save the same memory, and
its parameters keep the proxy's names, which ``‖u − w̃‖`` pairs them by).

``torch.distributed`` and Composer's activation-checkpointing helper; Composer's FSDP is configured in
:mod:`training.blocks.trainer`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from composer.distributed.activation_checkpointing import apply_ac
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from curation.core.refresh import copy_buffers

#: An optimizer's ``state_dict()``: ``state`` (parameter index → its moments and step) and ``param_groups``.
OptimizerState = Mapping[str, "Mapping[int, Mapping[str, Tensor | float]] | list[dict[str, object]]"]

__all__ = ["average_on_gloo", "decoder_layers", "install_wrap_policy", "install_checkpoint_policy", "is_sharded", "shard_like", "sharded_clone", "full_state_dict",
           "load_full_state_dict", "reshard", "gather_optimizer_state", "shard_optimizer_state"]


def is_sharded(module: nn.Module | None) -> bool:
    """Whether ``module`` (or one of its submodules) is FSDP-sharded."""
    return module is not None and any(isinstance(m, FSDPModule) for m in module.modules())


def decoder_layers(hf: nn.Module) -> tuple[type, ...]:
    """The classes FSDP wraps one by one: the HF model's ``_no_split_modules`` (its decoder layers).

    Raises:
        ValueError: the model names none (FSDP would then gather the whole model in every forward).
    """
    names = set(getattr(hf, "_no_split_modules", None) or ())
    classes = tuple({type(m) for m in hf.modules() if type(m).__name__ in names})
    if not classes:
        raise ValueError(f"parallel.strategy=fsdp: {type(hf).__name__} names no decoder layer class "
                         "(_no_split_modules) to shard by; use strategy=ddp")
    return classes


def install_wrap_policy(hf: nn.Module) -> None:
    """Tell Composer's FSDP2 wrapping to shard every decoder layer, then the model (``fsdp_wrap_fn``)."""
    layers = decoder_layers(hf)
    hf.fsdp_wrap_fn = lambda module: isinstance(module, layers)  # type: ignore[attr-defined]


def install_checkpoint_policy(hf: nn.Module) -> None:
    """Tell Composer's FSDP activation checkpointing to wrap every decoder layer (``activation_checkpointing_fn``),
    and turn the HF model's key/value cache off: a wrapped layer's forward runs again in the backward pass, and with
    the cache on it would append its keys and values to the ones the first pass stored (HF's own gradient
    checkpointing turns the cache off while training for the same reason; clones built from the config inherit
    it). Training never reads the cache: the logits are the same."""
    layers = decoder_layers(hf)
    hf.activation_checkpointing_fn = lambda module: isinstance(module, layers)  # type: ignore[attr-defined]
    hf.config.use_cache = False


def shard_like(module: nn.Module, mesh: object | None = None, *, checkpointed: bool = False) -> nn.Module:
    """Apply ``fully_shard`` as Composer does for the proxy: each decoder layer, then the whole model (with
    ``checkpointed``, each decoder layer in an activation-checkpoint wrapper first, as Composer does)."""
    layers = decoder_layers(module)
    if checkpointed:
        apply_ac(module, True, False, lambda sub: isinstance(sub, layers))
    for sub in module.modules():
        if isinstance(sub, layers):
            fully_shard(sub, mesh=mesh)
    fully_shard(module, mesh=mesh)
    average_on_gloo(module)
    return module


def average_on_gloo(module: nn.Module) -> None:
    """Make FSDP's gradients the average over the ranks on a gloo process group (CPU training).

    FSDP reduce-scatters float32 gradients with ``ReduceOp.AVG``, which gloo's ``reduce_scatter_tensor``
    (torch 2.7) applies as a sum: the gradients come out ``N`` times too large (measured: 2× on 2 ranks),
    which changes gradient clipping. Each FSDP unit gets a hook (FSDP's public ``set_all_reduce_hook``,
    run on the reduce-scatter output) that divides by ``N``. nccl averages correctly: nothing is changed.
    """
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = _mesh(sub).get_group()  # type: ignore[union-attr]
        if torch.distributed.get_backend(group) == "gloo":
            size = torch.distributed.get_world_size(group)
            sub.set_all_reduce_hook(lambda reduced, n=size: reduced.div_(n))


def _mesh(module: nn.Module) -> object | None:
    for p in module.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


def sharded_clone(source: nn.Module) -> nn.Module:
    """A new sharded module equal to the sharded HF model ``source``: its skeleton is built on ``meta``
    from ``source.config``, sharded on ``source``'s mesh, and filled with ``source``'s local shards (and
    buffers). Nothing is gathered; memory is allocated for one shard per parameter."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        clone = AutoModelForCausalLM.from_config(source.config)
    shard_like(clone, _mesh(source), checkpointed=hasattr(source, "activation_checkpointing_fn"))
    device = next(source.parameters()).device
    clone.to_empty(device=device)
    copy_local(clone, source)
    clone.train(source.training)
    return clone


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def copy_local(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s parameters and buffers into ``dst`` shard by shard (same sharding on both sides)."""
    source = src.state_dict()
    with torch.no_grad():
        for name, t in dst.state_dict().items():
            _local(t).copy_(_local(source[name]))
    copy_buffers(dst, src)


def reshard(module: nn.Module) -> nn.Module:
    """Free the gathered parameters a forward pass without a backward pass left behind: FSDP keeps the root
    unit's parameters gathered after a forward (for the backward that usually follows), so after scoring or
    evaluation they are plain tensors until resharded. Returns ``module``."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
    return module


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The full (unsharded) weights of a sharded ``module`` on the CPU, on rank 0 (``{}`` on the other ranks).
    A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(module)
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(module: nn.Module, weights: Mapping[str, Tensor], *, what: str = "weights") -> None:
    """Load full weights (every rank holds them) into a sharded ``module``: each rank keeps its shards.

    Raises:
        ValueError: names or shapes do not fit (names ``what``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    mine = module.state_dict()
    if mine.keys() != set(weights):
        only_mine, only_theirs = sorted(mine.keys() - set(weights)), sorted(set(weights) - mine.keys())
        raise ValueError(f"{what} do not fit the model: missing {only_mine[:5]}, unexpected {only_theirs[:5]}")
    set_model_state_dict(module, dict(weights), options=StateDictOptions(full_state_dict=True, strict=True))


def gather_optimizer_state(state: OptimizerState) -> dict[str, Any]:
    """An optimizer ``state_dict()`` whose moments are sharded (``DTensor``) with every tensor gathered to its full
    shape on the CPU, on rank 0 (``{}`` on the other ranks): the form a checkpoint holds. A collective: every rank
    calls it (one parameter's moments are gathered at a time)."""
    keep = torch.distributed.get_rank() == 0
    out: dict[Any, dict[str, Any]] = {}
    for i, entry in state["state"].items():
        gathered = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in entry.items()}
        if keep:
            out[i] = {k: v.detach().to("cpu").clone() if isinstance(v, Tensor) else v for k, v in gathered.items()}
    return {"state": out, "param_groups": copy.deepcopy(state["param_groups"])} if keep else {}


def shard_optimizer_state(full: OptimizerState, params: list[Tensor]) -> dict[str, Any]:
    """The reverse of :func:`gather_optimizer_state` for an optimizer over ``params`` (every rank holds ``full``):
    each moment of the shape of its parameter is sharded like it (a collective), other entries are kept."""
    from torch.distributed.tensor import distribute_tensor

    state = {}
    for i, entry in full["state"].items():
        p = params[int(i)]
        state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                    if isinstance(p, DTensor) and isinstance(v, Tensor) and v.shape == p.shape else v
                    for k, v in entry.items()}
    return {"state": state, "param_groups": copy.deepcopy(full["param_groups"])}
