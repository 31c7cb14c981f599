"""Model weights as numpy arrays: what goes into the object store once per version, saved as safetensors.

Between a GPU and the host they cross in one piece per dtype (:mod:`curation.core.flat_weights`).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from curation.core.flat_weights import FlatStaging, device_to_host, load_state_flat
from curation.io import storage
from curation.io.models import save_weights


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
