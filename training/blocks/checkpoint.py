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
import errno
import os
import random
import re
import shutil
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = ["SAFE_GLOBALS", "weights_only_loading", "load_checkpoint", "latest_checkpoint", "checkpoint_damage",
           "resume_checkpoint", "checkpoint_write_errors", "rng_state", "set_rng_state"]


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


#: Composer's checkpoint file names (``save_filename`` default): ``ep{epoch}-ba{batch}-rank0.pt``.
_CHECKPOINT_NAME = re.compile(r"^ep\d+-ba(\d+)-rank0\.pt$")


def checkpoint_damage(path: str) -> str | None:
    """Why the checkpoint file at ``path`` cannot be loaded (truncated, not a zip, a CRC mismatch), or None.

    ``torch.save`` writes a zip archive with a CRC-32 per member: a cut file has no central directory and
    a changed byte fails its CRC, both found here without unpickling anything (one read of the file).
    """
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except FileNotFoundError:
        return "missing"
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"unreadable, probably truncated ({e})"
    return f"damaged (member {bad} fails its CRC check)" if bad else None


def resume_checkpoint(folder: str) -> str | None:
    """The checkpoint a rerun resumes from: ``latest-rank0.pt`` when intact, else the newest intact one.

    A damaged latest checkpoint (a full disk or a kill while Composer wrote it) falls back to the previous
    intact checkpoint with a warning naming both; the steps after it are redone exactly.

    Raises:
        ValueError: checkpoints exist but none is intact (names each file and what is wrong with it).
    """
    latest = os.path.join(folder, "latest-rank0.pt")
    if not os.path.lexists(latest):
        return None
    damage = checkpoint_damage(latest)
    if damage is None:
        return latest
    newest = os.path.realpath(latest)
    bad = [f"{newest}: {damage}"]
    found = []
    for name in os.listdir(folder):
        m = _CHECKPOINT_NAME.match(name)
        path = os.path.join(folder, name)
        if m and os.path.realpath(path) != newest:
            found.append((int(m.group(1)), path))
    for _, path in sorted(found, reverse=True):
        damage = checkpoint_damage(path)
        if damage is None:
            warnings.warn(f"the latest checkpoint {newest} is {bad[0].split(': ', 1)[1]}; resuming from the "
                          f"previous intact checkpoint {path} (the steps after it are redone)", stacklevel=2)
            return path
        bad.append(f"{path}: {damage}")
    raise ValueError(
        f"{folder}: no intact checkpoint to resume from ({'; '.join(bad)}); delete {folder} to start the run over "
        "(the other outputs of the run are then redone as well), or restore a checkpoint from a backup"
    )


#: Free space (bytes) under which a failed checkpoint write is reported as a full disk.
_NEARLY_FULL = 64 << 20


@contextmanager
def checkpoint_write_errors(folder: str) -> Iterator[None]:
    """Turn torch's zip-writer failure while Composer saves a checkpoint into ``folder`` into an ``OSError``
    naming the folder (``ENOSPC`` when the disk is nearly full, else ``EIO``).

    ``torch.save`` into a file object reports a failed write (a full disk) as a bare
    ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`` that names no file.
    """
    try:
        yield
    except RuntimeError as e:
        msg = str(e)
        if "inline_container" not in msg and "PytorchStreamWriter" not in msg:
            raise
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = 0
        code = errno.ENOSPC if free < _NEARLY_FULL else errno.EIO
        raise OSError(code, f"{os.strerror(code)} while writing a checkpoint ({free / 2**20:.0f} MiB free; "
                            f"torch: {msg.strip().splitlines()[0]})", folder) from e


def rng_state() -> dict[str, Any]:
    """The global torch / numpy / Python (and CUDA) RNG states as tensors and plain values (so a checkpoint
    holding them loads with ``weights_only=True``); :func:`set_rng_state` restores them."""
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "numpy_meta": [str(np_state[0]), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states captured by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    meta = state["numpy_meta"]
    np.random.set_state((meta[0], state["numpy_keys"].numpy().astype(np.uint32), meta[1], meta[2], meta[3]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
