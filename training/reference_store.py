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
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from curation.core.refresh import Clone, RefreshWorkspace
from curation.engine.scorer import ReferenceScorer
from schemas.train_config import ModelConfig, ScorerConfig
from training.sharding import full_state_dict, is_sharded, load_full_state_dict, reshard, sharded_clone

__all__ = ["CompactReference", "InProcessReference"]


class CompactReference:
    """``w̃``'s floating-point weights in bfloat16 in one reused host buffer (see the module docstring)."""

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffer: Tensor | None = None
        # state-dict name → (offset, shape); tied weights (one storage, several names) share an offset
        self._layout: dict[str, tuple[int, torch.Size]] = {}
        self._params: list[str] = []  # names of the module's parameters (tied weights once)
        self._others: dict[str, Tensor] = {}  # non-floating entries, kept as they are
        self.version: int | None = None

    @property
    def holds(self) -> bool:
        return self.version is not None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def store(self, module: nn.Module, version: int) -> None:
        """Copy ``module``'s weights into the buffer (allocated on first use, or when the layout changes)."""
        layout: dict[str, tuple[int, torch.Size]] = {}
        offsets: dict[int, int] = {}  # address of a tensor's data → its offset, so a tied weight is stored once
        unique: list[tuple[int, Tensor]] = []
        others: dict[str, Tensor] = {}
        size = 0
        for name, t in module.state_dict().items():
            if not t.is_floating_point():
                others[name] = t.detach().to("cpu").clone()
                continue
            if t.data_ptr() not in offsets:
                offsets[t.data_ptr()] = size
                unique.append((size, t.detach()))
                size += t.numel()
            layout[name] = (offsets[t.data_ptr()], t.shape)
        if self._buffer is None or self._buffer.numel() != size:
            self._buffer = torch.empty(size, dtype=torch.bfloat16, pin_memory=self.pin)
        for offset, t in unique:
            self._buffer[offset : offset + t.numel()].view(t.shape).copy_(t, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # the buffer is read on the host right after
        self._layout, self._others, self.version = layout, others, version
        self._params = [n for n, _ in module.named_parameters()]

    def clear(self) -> None:
        """Forget the weights (the buffer stays allocated for the next refresh)."""
        self.version = None

    def _view(self, name: str) -> Tensor:
        assert self._buffer is not None
        offset, shape = self._layout[name]
        return self._buffer[offset : offset + shape.numel()].view(shape)

    def parameters(self) -> dict[str, Tensor]:
        """The parameters by name (views into the buffer, bfloat16), as ``param_distance`` reads a module's."""
        return {n: self._view(n) for n in self._params}

    def state_dict(self) -> dict[str, Tensor]:
        """A state dict of the weights (bfloat16 copies of the floating entries, which ``load_state_dict`` casts
        back to the module's dtype), safe to keep after the next :meth:`store`."""
        return {**{n: self._view(n).clone() for n in self._layout}, **{k: v.clone() for k, v in self._others.items()}}


class InProcessReference:
    """The trainer's own reference ``w̃`` (exact mode without the engine) and the refresh workspace it is built in.

    While it scores (right after a refresh) it is a float32 module on the training device inside a
    :class:`~curation.engine.scorer.ReferenceScorer`; between refreshes, with ``offload``, it is moved to the
    host, or, once it has scored everything it will score (``compact=True`` to :meth:`offload`), kept as a
    :class:`CompactReference` and the module dropped. On a CPU nothing moves.

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
        on the host, or, sharded, in this rank's shards on the training device."""
        if self.sharded:
            module = sharded_clone(proxy)
            load_full_state_dict(module, weights, what=what)
            return module
        module = copy.deepcopy(proxy).to("cpu")
        try:
            module.load_state_dict(dict(weights), strict=True)
        except RuntimeError as e:
            raise ValueError(f"{what}: weights do not fit the model: {e}") from e
        return module

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
        (``compact``: it will not score again). The refresh workspace it lives in goes with it: the next
        refresh builds its module on the training device again (device to device)."""
        assert self.scorer is not None and self.scorer.model is not None
        if self.train_device.type == "cpu" or self.sharded:
            return
        if compact:
            self.compact.store(self.scorer.model, int(self.scorer.version or 0))
            self.scorer.model = None
        else:
            self.scorer.to("cpu")
        self.workspace = RefreshWorkspace(keep_optimizer_state=self.keep_optimizer_state)

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
