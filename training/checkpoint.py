"""Loading Composer checkpoints without unpickling arbitrary objects.

Composer 0.32 calls ``torch.load(..., weights_only=False)`` when it resumes. A checkpoint of this
project holds only tensors and plain Python values (the BLADE state is built that way), plus a few
value types Composer itself writes: ``datetime.timedelta`` (wall-clock times), numpy arrays and
dtypes (its RNG snapshot) and ``TorchVersion`` (metadata). :func:`weights_only_loading` makes every
``torch.load`` inside it run with ``weights_only=True`` (torch's documented
``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` switch) with exactly those types allow-listed, so a checkpoint
carrying any other pickled object is refused instead of executed.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = ["SAFE_GLOBALS", "weights_only_loading", "load_checkpoint", "latest_checkpoint"]


def _safe_globals() -> list[Any]:
    from torch.torch_version import TorchVersion

    core = getattr(np, "_core", None) or np.core
    return [datetime.timedelta, np.dtype, np.ndarray, core.multiarray._reconstruct, TorchVersion,
            *{type(np.dtype(t)) for t in ("uint8", "uint32", "int64", "float32", "float64")}]


#: Value types (no behaviour) allowed in a checkpoint besides tensors and builtins.
SAFE_GLOBALS = _safe_globals()


@contextmanager
def weights_only_loading() -> Iterator[None]:
    """Within the block, ``torch.load`` runs with ``weights_only=True`` and :data:`SAFE_GLOBALS` allowed."""
    old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            yield
    finally:
        if old is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a Composer checkpoint with ``weights_only=True`` (for inspection and tests)."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True)


def latest_checkpoint(folder: str) -> str | None:
    """``folder/latest-rank0.pt`` (Composer's symlink to the newest checkpoint) when it exists."""
    path = os.path.join(folder, "latest-rank0.pt")
    return path if os.path.exists(path) else None
