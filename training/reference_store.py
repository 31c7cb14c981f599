"""The in-process reference ``w̃`` off the training device, once it has scored its episode.

``blade`` (every refresh starts again from ``u``) scores every step of an episode right after the refresh; after that,
``w̃`` is read only by the ``‖u − w̃‖`` statistic, the checkpoints and ``final/reference.safetensors``. Moving
the float32 module to the host for that doubled the host memory of a GPU run (issue 12: 1.67× a plain run
at 124M parameters). :class:`CompactReference` keeps those weights in bfloat16 in one flat host buffer that
every refresh reuses (pinned when CUDA is available, so the copy from the device is a DMA): half the bytes,
no allocation per refresh, and no module.

The rounding to bfloat16 changes only what reads ``w̃`` after its scores exist: the logged distance (relative
error ~2⁻⁹ per weight) and the saved reference. The masks do not change: they come from the scores, and a
checkpoint carries the remaining scores of the episode (:class:`training.algorithm.BladeAlgorithm`), so a
resumed run does not re-score with the rounded weights.

``blade-nosync`` carries the reference's AdamW state (two moments, twice the weights) from refresh to refresh.
Between refreshes it follows the weights off the GPU: :class:`HostOptimizerState` keeps it in float32 (exactly)
in one reused pinned host buffer, and the next refresh copies it back (non-blocking) and continues from it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from curation.core.refresh import Clone, RefreshWorkspace
from curation.engine.scorer import ReferenceScorer
from curation.io.models import load_state
from schemas.train_config import ModelConfig, ScorerConfig
from training.sharding import (
    full_state_dict,
    gather_optimizer_state,
    is_sharded,
    load_full_state_dict,
    reshard,
    shard_optimizer_state,
    sharded_clone,
)

__all__ = ["CompactReference", "HostOptimizerState", "InProcessReference"]


class _HostBuffer:
    """Tensors packed one after another in one flat host buffer of one dtype, allocated on first use (or when the
    total size changes) and reused after that; pinned when CUDA is available, so the copies between it and a GPU
    are DMAs that need not block."""

    dtype: torch.dtype

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffer: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def _fill(self, tensors: list[Tensor]) -> None:
        """Copy ``tensors`` into the buffer, the first at offset 0 and each right after the previous one."""
        size = sum(t.numel() for t in tensors)
        if self._buffer is None or self._buffer.numel() != size:
            self._buffer = torch.empty(size, dtype=self.dtype, pin_memory=self.pin)
        offset = 0
        for t in tensors:
            self._buffer[offset : offset + t.numel()].view(t.shape).copy_(t, non_blocking=self.pin)
            offset += t.numel()
        if self.pin:
            torch.cuda.synchronize()  # the buffer may be read on the host right after

    def _slice(self, offset: int, shape: torch.Size) -> Tensor:
        assert self._buffer is not None
        return self._buffer[offset : offset + shape.numel()].view(shape)


class CompactReference(_HostBuffer):
    """``w̃``'s floating-point weights in bfloat16 in one reused host buffer (see the module docstring)."""

    dtype = torch.bfloat16

    def __init__(self, *, pin: bool | None = None) -> None:
        super().__init__(pin=pin)
        # state-dict name → (offset, shape); tied weights (one storage, several names) share an offset
        self._layout: dict[str, tuple[int, torch.Size]] = {}
        self._params: list[str] = []  # names of the module's parameters (tied weights once)
        self._others: dict[str, Tensor] = {}  # non-floating entries, kept as they are
        self.version: int | None = None

    @property
    def holds(self) -> bool:
        return self.version is not None

    def store(self, module: nn.Module, version: int) -> None:
        """Copy ``module``'s weights into the buffer (allocated on first use, or when the layout changes)."""
        layout: dict[str, tuple[int, torch.Size]] = {}
        offsets: dict[int, int] = {}  # address of a tensor's data → its offset, so a tied weight is stored once
        unique: list[Tensor] = []
        others: dict[str, Tensor] = {}
        size = 0
        for name, t in module.state_dict().items():
            if not t.is_floating_point():
                others[name] = t.detach().to("cpu").clone()
                continue
            if t.data_ptr() not in offsets:
                offsets[t.data_ptr()] = size
                unique.append(t.detach())
                size += t.numel()
            layout[name] = (offsets[t.data_ptr()], t.shape)
        self._fill(unique)
        self._layout, self._others, self.version = layout, others, version
        self._params = [n for n, _ in module.named_parameters()]

    def clear(self) -> None:
        """Forget the weights (the buffer stays allocated for the next refresh)."""
        self.version = None

    def _view(self, name: str) -> Tensor:
        return self._slice(*self._layout[name])

    def parameters(self) -> dict[str, Tensor]:
        """The parameters by name (views into the buffer, bfloat16), as ``param_distance`` reads a module's."""
        return {n: self._view(n) for n in self._params}

    def state_dict(self) -> dict[str, Tensor]:
        """A state dict of the weights (bfloat16 copies of the floating entries, which ``load_state_dict`` casts
        back to the module's dtype), safe to keep after the next :meth:`store`."""
        return {**{n: self._view(n).clone() for n in self._layout}, **{k: v.clone() for k, v in self._others.items()}}


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of a stored optimizer state lives on the host, and the device it came from."""

    shape: torch.Size
    device: torch.device
    offset: int = 0  # in the float32 buffer, unless ``held``
    held: Tensor | None = None  # a tensor of another dtype, kept as a host copy of its own


def _map_state(state: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """An optimizer state dict with ``fn`` applied to every per-parameter value (``param_groups`` copied)."""
    return {**state, "state": {k: {n: fn(v) for n, v in s.items()} for k, s in state["state"].items()},
            "param_groups": copy.deepcopy(state["param_groups"])}


class HostOptimizerState(_HostBuffer):
    """An optimizer ``state_dict()``'s float32 tensors (AdamW's moments and step counts) in one reused host buffer.

    ``blade-nosync`` carries the reference AdamW from one refresh to the next; between refreshes it is only
    read by checkpoints, so off a GPU it need not hold twice the reference's weights in device memory. The
    values are kept in float32, exactly: :meth:`restore` gives back a state whose tensors are equal, on the
    devices they came from, so the continued AdamW takes the same steps.
    """

    dtype = torch.float32

    def __init__(self, *, pin: bool | None = None) -> None:
        super().__init__(pin=pin)
        self._layout: dict[str, Any] | None = None  # the state dict with a _Slot for each tensor

    @property
    def holds(self) -> bool:
        return self._layout is not None

    def store(self, state: Mapping[str, Any]) -> None:
        """Copy ``state``'s tensors to the host (into the buffer, allocated on first use or when the sizes change)."""
        tensors: list[Tensor] = []
        size = 0

        def slot(v: Any) -> Any:
            nonlocal size
            if not isinstance(v, Tensor):
                return v
            if v.dtype != self.dtype:
                return _Slot(v.shape, v.device, held=v.detach().to("cpu", copy=True))
            tensors.append(v.detach())
            size += v.numel()
            return _Slot(v.shape, v.device, offset=size - v.numel())

        layout = _map_state(state, slot)
        self._fill(tensors)
        self._layout = layout

    def clear(self) -> None:
        """Forget the state (the buffer stays allocated for the next refresh)."""
        self._layout = None

    def _view(self, s: Any) -> Any:
        if not isinstance(s, _Slot):
            return s
        return s.held if s.held is not None else self._slice(s.offset, s.shape)

    def state_dict(self) -> dict[str, Any]:
        """The stored state with host tensors (views into the buffer, valid until the next :meth:`store`), as a
        checkpoint saves it."""
        assert self._layout is not None
        return _map_state(self._layout, self._view)

    def restore(self) -> dict[str, Any]:
        """A copy of the stored state with each tensor back on the device it was stored from (non-blocking copies
        from the pinned buffer): new tensors, which the optimizer that loads them may update in place."""
        assert self._layout is not None
        return _map_state(self._layout, lambda s: self._view(s).to(s.device, copy=True, non_blocking=self.pin)
                          if isinstance(s, _Slot) else s)


class InProcessReference:
    """The trainer's own reference ``w̃`` (exact mode without the engine) and the refresh workspace it is built in.

    While it scores (right after a refresh) it is a float32 module on the training device inside a
    :class:`~curation.engine.scorer.ReferenceScorer`; between refreshes, with ``offload``, it is moved to the
    host, or, once it has scored everything it will score (``compact=True`` to :meth:`offload`), kept as a
    :class:`CompactReference` and the module dropped; ``blade-nosync``'s AdamW state goes to a
    :class:`HostOptimizerState` with it. On a CPU nothing moves.

    With a sharded proxy (``parallel.strategy: fsdp``, :mod:`training.sharding`) the reference is sharded the
    same way and stays on the devices: each rank holds its shards of ``w̃`` (and, while refreshing, of its
    AdamW state), never a whole model; :meth:`state_dict` gathers it (a collective).

    Args:
        model_config: the proxy's model config (recorded with the scorer).
        precision: the scorer's ``fp32`` / ``amp_bf16``.
        batch_size: sequences per scoring forward.
        offload: keep it off the training device between refreshes.
        keep_optimizer_state: the refresh workspace keeps AdamW's moments (``blade-nosync``).
    """

    def __init__(self, *, model_config: ModelConfig, precision: str, batch_size: int, offload: bool,
                 keep_optimizer_state: bool) -> None:
        self.model_config = model_config
        self.precision = precision
        self.batch_size = batch_size
        self.offload_between = offload
        self.keep_optimizer_state = keep_optimizer_state
        self.scorer: ReferenceScorer | None = None
        self.compact = CompactReference()
        self.train_device = torch.device("cpu")
        self.workspace = RefreshWorkspace(keep_optimizer_state=keep_optimizer_state)
        self._optimizer_state: dict[str, Any] | None = None
        self.optimizer_host = HostOptimizerState()  # the carried AdamW state while the module is off the device
        self.sharded = False  # set at fit start: the proxy is FSDP-sharded

    def place(self, proxy: nn.Module) -> None:
        """Follow the proxy: its device, and whether it is sharded (then so is every reference module)."""
        self.train_device = next(proxy.parameters()).device
        self.sharded = is_sharded(proxy)

    @property
    def clone(self) -> Clone:
        """How a reference module is built from the proxy (a deep copy; shard by shard when sharded)."""
        return sharded_clone if self.sharded else copy.deepcopy

    def build(self, proxy: nn.Module, weights: Mapping[str, Tensor], *, what: str = "reference weights") -> nn.Module:
        """A reference module with the proxy's architecture and ``weights`` (full tensors, e.g. a checkpoint's):
        on the host, or, sharded, in this rank's shards on the training device (with a checkpoint's gathered
        AdamW state, ``blade-nosync``, loaded into the shards of the workspace's optimizer: :meth:`_adopt`)."""
        module = self.clone(proxy)
        if not self.sharded:
            module.to("cpu")
            load_state(module, weights, what=what)
            return module
        load_full_state_dict(module, weights, what=what)
        if self._optimizer_state is not None:
            self._adopt(module, self._optimizer_state)
        return module

    @property
    def optimizer_state(self) -> dict[str, Any] | None:
        """``blade-nosync``'s carried AdamW state (None for the other policies and before the first refresh): the
        last refresh's live state, a checkpoint's, or, while offloaded, host views of :attr:`optimizer_host`."""
        return self.optimizer_host.state_dict() if self.optimizer_host.holds else self._optimizer_state

    @optimizer_state.setter
    def optimizer_state(self, state: dict[str, Any] | None) -> None:
        self._optimizer_state = state
        self.optimizer_host.clear()

    def saved_optimizer_state(self) -> dict[str, Any] | None:
        """The carried AdamW state as a checkpoint holds it. Sharded: its moments gathered to full tensors, on
        rank 0 (``{}`` on the other ranks; a collective every rank calls)."""
        if not self.sharded or self._optimizer_state is None:
            return self.optimizer_state
        return gather_optimizer_state(self._optimizer_state)

    def _adopt(self, module: nn.Module, full: dict[str, Any]) -> None:
        """Resume ``blade-nosync`` sharded: ``module`` (the checkpoint's reference) becomes the workspace's, and the
        checkpoint's gathered AdamW state is loaded into the shards of the workspace's optimizer, which the next
        refresh continues in place."""
        ws = self.workspace
        ws.model = module
        params = list(module.parameters())
        optimizer = ws.adamw(params, fresh=True)
        optimizer.load_state_dict(shard_optimizer_state(full, params))
        self._optimizer_state = ws.last_state = optimizer.state_dict()

    def optimizer_state_for_refresh(self) -> dict[str, Any] | None:
        """The AdamW state the next refresh continues. From the host store it comes back to the training device
        (non-blocking copies) and is handed to the workspace, which loads it into its AdamW without a copy."""
        if not self.optimizer_host.holds:
            return self._optimizer_state
        self.workspace.carry(self.optimizer_host.restore())
        self.optimizer_host.clear()
        return self.workspace.last_state

    @property
    def module(self) -> nn.Module | None:
        """The float32 module (None before the first reference, and once compacted or dropped)."""
        return None if self.scorer is None else self.scorer.model

    def set(self, module: nn.Module, version: int, *, offload: bool = True, compact: bool = False) -> None:
        """Make ``module`` the reference. A freshly refreshed one stays where it was computed (``offload=False``):
        it scores the coming steps there right away and is offloaded after that, so its weights cross to the
        host once per refresh, not there and back."""
        if self.scorer is None:  # built where the module is (the scorer moves its model to its device)
            where = "cuda" if next(module.parameters()).device.type == "cuda" else "cpu"
            cfg = ScorerConfig(model=self.model_config, device=where, precision=self.precision,
                               batch_size=self.batch_size)
            self.scorer = ReferenceScorer(cfg, model=module)
        else:
            self.scorer.model = module.eval()
            for p in module.parameters():
                p.requires_grad_(False)
        self.scorer.version = version
        self.compact.clear()
        if not offload:
            self.scorer.device = next(module.parameters()).device
        elif self.offload_between:
            self.offload(compact=compact)
        else:
            self.scorer.to(self.train_device)

    def scorer_on_device(self) -> ReferenceScorer:
        """The scorer with its module on the training device."""
        if self.scorer is None or self.scorer.model is None:
            raise RuntimeError("no reference module to score with (it was compacted after scoring its episode)")
        return self.scorer.to(self.train_device)

    def offload(self, *, compact: bool = False) -> None:
        """Move the module off the training device (a no-op on a CPU), or keep it as a :class:`CompactReference`
        (``compact``: it will not score again). The refresh workspace it lives in keeps the module and its AdamW
        without their device memory (:meth:`~curation.core.refresh.RefreshWorkspace.park`): the next refresh
        allocates them on the training device again, without rebuilding either. A carried AdamW state
        (``blade-nosync``) is copied to :attr:`optimizer_host`, and its device tensors released."""
        assert self.scorer is not None and self.scorer.model is not None
        if self.train_device.type == "cpu" or self.sharded:
            return
        if compact:
            self.compact.store(self.scorer.model, int(self.scorer.version or 0))
            self.scorer.model = None
        else:
            self.scorer.to("cpu")
        if self._optimizer_state is not None:  # the AdamW moments follow the weights (the workspace drops its own)
            self.optimizer_host.store(self._optimizer_state)
            self._optimizer_state = None
        self.workspace.park(weights=compact)

    def drop(self) -> None:
        """Forget the weights (``blade``: a refresh restarts from ``u``)."""
        if self.scorer is not None:
            self.scorer.model = None
        self.compact.clear()

    def for_distance(self) -> nn.Module | dict[str, Tensor] | None:
        """What ``param_distance`` reads as ``w̃`` (None without a reference; sharded: in its shards)."""
        if self.compact.holds:
            return self.compact.parameters()
        return reshard(self.module) if self.sharded and self.module is not None else self.module

    def state_dict(self) -> dict[str, Tensor] | None:
        """``w̃``'s weights on the CPU (bfloat16 once compacted), or None. Sharded: gathered to full tensors on
        rank 0 (``{}`` on the other ranks); a collective every rank calls."""
        if self.compact.holds:
            return self.compact.state_dict()
        if self.module is not None and self.sharded:
            return full_state_dict(self.module)
        if self.module is not None:
            return {k: v.detach().to("cpu").clone() for k, v in self.module.state_dict().items()}
        return None
