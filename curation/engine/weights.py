"""Model weights as numpy arrays: what goes into the object store once per version, saved as safetensors.

Between a GPU and the host a model's weights cross in one piece per dtype (:func:`device_to_host`,
:func:`load_state_flat`): the tensors are gathered into one flat buffer on the device and copied once into pinned
host memory (one wait), or packed into one pinned host buffer (:class:`FlatStaging`, reused version after version)
and copied once to the device without blocking, then scattered into the parameters there. A copy per tensor
(``load_state_dict``, ``.to("cpu")``) made the host wait once per tensor: 111 times per load of a 12-layer model.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from curation.core.host_sync import event, queues
from curation.io import storage
from curation.io.models import save_weights


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


# ------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------
@dataclass
class Weights:
    """A state dict as numpy arrays: one object per version in Ray's object store, read zero-copy.

    Attributes:
        arrays: name → array (bfloat16 tensors are stored as their int16 bit patterns).
        bf16: names of the bfloat16 tensors.
    """

    arrays: dict[str, np.ndarray]
    bf16: tuple[str, ...] = ()

    @classmethod
    def from_state_dict(cls, model: nn.Module | Mapping[str, Tensor]) -> Weights:
        sd = model.state_dict() if isinstance(model, nn.Module) else model
        arrays, bf16 = {}, []
        for k, v in device_to_host(sd).items():
            if v.dtype == torch.bfloat16:
                bf16.append(k)
                v = v.view(torch.int16)
            arrays[k] = v.contiguous().numpy().copy()
        return cls(arrays, tuple(bf16))

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors viewing the arrays (read-only memory is fine: ``load_state_dict`` copies)."""
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": never written to
            for k, a in self.arrays.items():
                t = torch.from_numpy(a)
                out[k] = t.view(torch.bfloat16) if k in self.bf16 else t
        return out

    def load_into(self, model: nn.Module, *, staging: FlatStaging | None = None) -> None:
        """Load into ``model`` (strict); on a GPU in one copy per dtype (:func:`load_state_flat`)."""
        load_state_flat(model, self.state_dict(), what="weights", staging=staging)

    def save(self, path: str) -> str:
        """Atomically write a safetensors file."""
        return save_weights(self.state_dict(), path)

    @classmethod
    def load(cls, path: str) -> Weights:
        from safetensors.torch import load_file

        storage.fetch(path)  # an object-store directory's file not in this node's cache yet
        return cls.from_state_dict(load_file(path, device="cpu"))

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for k in sorted(self.arrays):
            a = self.arrays[k]
            h.update(f"{k}:{a.shape}:{a.dtype}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()
