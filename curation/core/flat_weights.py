"""A model's weights between a GPU and the host in one piece per dtype, pure torch.

:func:`device_to_host` gathers the tensors into one flat buffer per dtype on the device and copies it once into
pinned host memory (one wait); :func:`load_state_flat` packs a host state dict into one pinned buffer per dtype
(:class:`FlatStaging`, reused version after version), copies it to the device without blocking and scatters it into
the model's tensors there. A copy per tensor (``load_state_dict``, ``.to("cpu")``) made the host wait once per
tensor: 111 times per load of a 12-layer model. On a CPU (no queue, :func:`~curation.core.host_sync.queues`) both are
the plain copies. Used by the scorer (:mod:`curation.core.scorer`) and the engine's weights
(:mod:`curation.engine.weights`), the refresh actor and the scoring workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from curation.core.host_sync import event, queues

__all__ = ["device_to_host", "FlatStaging", "load_state_flat"]


# ------------------------------------------------------------------------------------------------
# one copy per dtype between the device and the host
# ------------------------------------------------------------------------------------------------
def _groups(tensors: Mapping[str, Tensor]) -> dict[torch.dtype, list[str]]:
    out: dict[torch.dtype, list[str]] = {}
    for name, t in tensors.items():
        out.setdefault(t.dtype, []).append(name)
    return out


def device_to_host(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Host copies of ``tensors``: from a GPU (:func:`~curation.core.host_sync.queues`) one flat copy per dtype into
    pinned memory and one wait for all of them; host tensors are detached as they are (no copy)."""
    on = [t.device for t in tensors.values()]
    if not on or not queues(on[0]):
        return {k: v.detach().to("cpu") for k, v in tensors.items()}
    out: dict[str, Tensor] = {}
    pending = []
    for dtype, names in _groups(tensors).items():
        flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
        host = torch.empty(flat.shape, dtype=dtype, pin_memory=True).copy_(flat, non_blocking=True)
        pending.append((host, names))
    done = event(on[0])
    done.synchronize()  # every dtype's copy: the one wait
    for host, names in pending:
        offset = 0
        for n in names:
            t = tensors[n]
            out[n] = host[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
    return out


class FlatStaging:
    """Pinned host buffers (one per dtype) a model's weights are packed into before their copy to the device, reused
    from one load to the next (the next load waits for the previous one's copies first: at most one wait)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, Tensor] = {}
        self._ready: Any = None

    def buffer(self, dtype: torch.dtype, size: int) -> Tensor:
        if self._ready is not None:  # the previous load's copies out of these buffers are done
            self._ready.synchronize()
            self._ready = None
        held = self._buffers.get(dtype)
        if held is None or held.numel() != size:
            held = self._buffers[dtype] = torch.empty(size, dtype=dtype, pin_memory=True)
        return held

    def loaded(self, device: torch.device) -> None:
        self._ready = event(device)


def load_state_flat(model: nn.Module, state: Mapping[str, Tensor], *, what: str = "weights",
                    staging: FlatStaging | None = None) -> None:
    """``model.load_state_dict(state, strict=True)``, on a GPU in one non-blocking copy per dtype: ``state``'s host
    tensors are packed into pinned buffers (``staging``'s, reused), copied to the device at once and scattered into
    the model's tensors there (no wait; ``staging``'s next load waits for this one's copies). Elsewhere (a CPU, or
    a ``state`` already on the device), ``load_state_dict`` itself.

    Raises:
        RuntimeError: names or shapes differ (as ``load_state_dict`` raises; the flat path names ``what``).
    """
    target = model.state_dict()
    device = next(iter(target.values())).device if target else torch.device("cpu")
    if not queues(device) or any(t.device.type != "cpu" for t in state.values()):
        model.load_state_dict(dict(state), strict=True)
        return
    if target.keys() != state.keys():
        missing, unexpected = sorted(target.keys() - state.keys()), sorted(state.keys() - target.keys())
        raise RuntimeError(f"{what}: weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, t in target.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise RuntimeError(f"{what}: weights do not fit the model: {name} has shape {tuple(state[name].shape)}, "
                             f"the model's {tuple(t.shape)}")
    staging = staging or FlatStaging()
    with torch.no_grad():
        for dtype, names in _groups(target).items():
            size = sum(target[n].numel() for n in names)
            host = staging.buffer(dtype, size)
            offset = 0
            for n in names:  # (host copies; a dtype the model holds differently is cast as load_state_dict does)
                k = target[n].numel()
                host[offset:offset + k].copy_(state[n].reshape(-1))
                offset += k
            flat = host.to(device, non_blocking=True)
            offset = 0
            for n in names:
                k = target[n].numel()
                target[n].copy_(flat[offset:offset + k].view(target[n].shape))
                offset += k
    staging.loaded(device)
