"""The recent trained steps and their masks on disk (the engine hands them to its refresh actor through files)."""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import load_file, save_file

from curation.core.refresh_data import RecentMasks
from curation.io import storage

__all__ = ["save_recent", "load_recent"]


def save_recent(recent: RecentMasks, path: str) -> None:
    """Write ``recent`` to a safetensors file (atomically: a temporary file renamed into place)."""
    data = {"steps": np.asarray(recent.steps, dtype=np.int64)}
    if recent.masks is not None:
        data["masks"] = np.ascontiguousarray(recent.masks, dtype=np.uint8)
    tmp = path + ".tmp"
    save_file(data, tmp)
    os.replace(tmp, path)
    storage.publish(path)  # an object-store directory: uploaded now


def load_recent(path: str, *, missing_ok: bool = False) -> RecentMasks:
    """Inverse of :func:`save_recent`; with ``missing_ok`` a file that does not exist reads as no recent steps."""
    if not storage.fetch(path) and missing_ok:  # (from the bucket when this node's cache lacks it)
        return RecentMasks()
    data = load_file(path)
    return RecentMasks([int(s) for s in data["steps"]], data.get("masks"))
