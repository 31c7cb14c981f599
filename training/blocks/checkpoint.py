"""Loading Composer checkpoints without unpickling arbitrary objects.

Composer 0.32 calls ``torch.load(..., weights_only=False)`` when it resumes. A checkpoint of this
project holds only tensors and plain Python values (the BLADE state is built that way), plus a few
value types Composer itself writes: ``datetime.timedelta`` (wall-clock times), numpy arrays and
dtypes (its RNG snapshot) and ``TorchVersion`` (metadata). :func:`weights_only_loading` makes every
``torch.load`` inside it run with ``weights_only=True`` (torch's documented
``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` switch) with exactly those types allow-listed, so a checkpoint
carrying any other pickled object is refused instead of executed.

Before a rerun resumes, :func:`checkpoint_damage` checks each candidate checkpoint: a cut or changed
file (its zip CRCs), and content that is not plain data (a pickled object whose loading could run code,
e.g. ``os.system``) or not a Composer checkpoint at all. Such a file is refused with one line naming it,
never unpickled outside ``weights_only=True``, and :func:`resume_checkpoint` falls back to the previous
intact checkpoint (also when a kill while Composer re-linked ``latest-rank0.pt`` left no link).
"""

from __future__ import annotations

import datetime
import errno
import os
import pickle
import random
import re
import shutil
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from curation.io.paths import inside

__all__ = ["SAFE_GLOBALS", "CheckpointRefused", "weights_only_loading", "load_checkpoint",
           "checkpoint_damage", "check_link", "checkpoint_files", "resume_checkpoint", "checkpoint_write_errors", "rng_state", "set_rng_state"]


def _safe_globals() -> list[Any]:
    from torch.torch_version import TorchVersion

    core = getattr(np, "_core", None) or np.core
    return [datetime.timedelta, np.dtype, np.ndarray, core.multiarray._reconstruct, TorchVersion,
            *{type(np.dtype(t)) for t in ("uint8", "uint32", "int64", "float32", "float64")}]


#: Value types (no behaviour) allowed in a checkpoint besides tensors and builtins.
SAFE_GLOBALS = _safe_globals()


class CheckpointRefused(ValueError, pickle.UnpicklingError):
    """A checkpoint whose content is not plain data (loading it could run code) was refused; nothing in it ran.

    A ``ValueError`` (bad input: jobs print it as one line) and still the ``UnpicklingError`` torch raised.
    """


def _refusal_reason(err: pickle.UnpicklingError) -> str:
    """The line of torch's many-line ``weights_only`` refusal that says what was refused."""
    lines = [ln.strip() for ln in str(err).splitlines()]
    for ln in lines:
        if "GLOBAL" in ln:
            return re.sub(r"^WeightsUnpickler error: ", "", ln).split(". Please use")[0].rstrip(".")
    for ln in lines:
        if ln.startswith("WeightsUnpickler error:"):
            return ln.removeprefix("WeightsUnpickler error:").strip().rstrip(".")
    return lines[0] if lines else type(err).__name__


@contextmanager
def weights_only_loading() -> Iterator[None]:
    """Within the block, ``torch.load`` runs with ``weights_only=True`` and :data:`SAFE_GLOBALS` allowed.

    Raises:
        CheckpointRefused: a load inside the block met pickled content that is not plain data (one line
            instead of torch's many-line ``UnpicklingError``; :func:`resume_checkpoint` checks the files
            first, so this is met only when a file changes after that check).
    """
    old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            yield
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(f"a checkpoint was refused by torch.load(weights_only=True): {_refusal_reason(e)} "
                                "(not plain data; nothing in it was run); rerun to check the checkpoints again") from e
    finally:
        if old is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a Composer checkpoint with ``weights_only=True`` (for inspection and tests)."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True)


def check_link(link: str) -> None:
    """Refuse the link ``latest-rank0.pt`` when it does not point at a checkpoint file beside it.

    Composer links it to ``ep{e}-ba{b}-rank0.pt`` in the same folder (a relative name); the link is read back
    from disk, or restored from a bucket's ``.symlinks.json``, so it is untrusted: a target elsewhere (absolute,
    up through ``..``, through another link) would have the run read, and Composer later replace, a file outside
    the run.

    Raises:
        ValueError: one line naming the link and its target.
    """
    if not os.path.islink(link):
        return
    target = os.readlink(link)
    folder = os.path.dirname(link)
    if not _CHECKPOINT_NAME.fullmatch(os.path.basename(target)) or os.path.dirname(os.path.normpath(target)) \
            or not inside(folder, link):
        raise ValueError(f"{link}: its target {target!r:.120} is not a checkpoint file beside it "
                         "(ep<e>-ba<b>-rank0.pt); refused: delete the link to resume from the newest intact checkpoint")


#: Composer's checkpoint file names (``save_filename`` default): ``ep{epoch}-ba{batch}-rank0.pt``.
_CHECKPOINT_NAME = re.compile(r"ep\d+-ba(\d+)-rank0\.pt")


def checkpoint_damage(path: str) -> str | None:
    """Why the checkpoint file at ``path`` cannot be resumed from, or None when it is intact.

    ``torch.save`` writes a zip archive with a CRC-32 per member: a cut file has no central directory and
    a changed byte fails its CRC, both found without unpickling anything (one read of the file). An intact
    archive is then checked for content: its pickle's globals are listed statically (nothing is imported)
    and refused unless allow-listed (:data:`SAFE_GLOBALS` and torch's own), then it is loaded with
    ``weights_only=True`` (tensors memory-mapped, not read) and must be a Composer checkpoint (a dict with
    a ``state`` entry). A pickled object that would run code when loaded is never executed.
    """
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except FileNotFoundError:
        return "missing"
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"unreadable, probably truncated ({e})"
    if bad:
        return f"damaged (member {bad} fails its CRC check)"
    return _content_refusal(path)


def _content_refusal(path: str) -> str | None:
    """Why the content of the intact archive at ``path`` is refused (not plain data, not a Composer
    checkpoint), or None."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except (ValueError, RuntimeError, KeyError, pickle.UnpicklingError, EOFError) as e:  # no data.pkl, ...
            return f"refused: not a torch.save checkpoint ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        if unsafe:
            return (f"refused: it holds pickled objects that are not plain data ({', '.join(sorted(unsafe))}), "
                    "whose loading could run code (nothing in it was run)")
        try:  # globals pushed dynamically are not listed statically: the weights-only unpickler has the last word
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            return f"refused: not plain data ({_refusal_reason(e)}, nothing in it was run)"
        except (RuntimeError, OSError, EOFError, ValueError, KeyError) as e:
            return f"unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if not isinstance(obj, dict) or not isinstance(obj.get("state"), dict):
        return "refused: not a Composer checkpoint (no 'state' entry)"
    return None


def checkpoint_files(folder: str) -> list[str]:
    """The checkpoint files in ``folder`` (Composer's ``ep{e}-ba{b}-rank0.pt``), newest (highest step) first."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := _CHECKPOINT_NAME.fullmatch(name))]
    return [os.path.join(folder, name) for _, name in sorted(found, reverse=True)]


def _link_refusal(path: str) -> str | None:
    """Why the checkpoint file at ``path`` is refused for being a symbolic link (Composer writes none: one could
    have the run read a file outside it), or None."""
    if not os.path.islink(path):
        return None
    return (f"refused: a symbolic link (to {os.readlink(path)!r:.120}), not a checkpoint file (it could lead outside "
            "the run; nothing was read through it)")


def resume_checkpoint(folder: str) -> str | None:
    """The checkpoint a rerun resumes from: ``latest-rank0.pt`` when intact, else the newest intact one.

    A damaged latest checkpoint (a full disk or a kill while Composer wrote it) or one whose content is
    refused (a pickled object that would run code, a foreign file: :func:`checkpoint_damage`; a checkpoint name
    that is a symbolic link, which could lead outside the run and is never read) falls back to the previous
    intact checkpoint with a warning naming both; the steps after it are redone exactly.

    Composer writes a checkpoint in place, then removes the ``latest-rank0.pt`` link and links it anew: a job
    killed in between (a second SIGTERM, a SIGKILL) leaves checkpoint files and no link. The newest intact file
    is then resumed from, with a warning; when none is intact (the job died while it wrote its first
    checkpoint: Composer removes the old link only after the new file is written) the run starts over
    (``None``), with a warning naming the cut files, which the new run overwrites.

    Raises:
        ValueError: the link exists but no checkpoint is intact (names each file and what is wrong with it).
    """
    latest = os.path.join(folder, "latest-rank0.pt")
    newest = None
    check_link(latest)
    if os.path.lexists(latest):
        # (check_link: the link's target is a checkpoint name beside it)
        target = os.path.join(folder, os.path.basename(os.readlink(latest))) if os.path.islink(latest) else latest
        damage = (_link_refusal(target) if target != latest else None) or checkpoint_damage(latest)
        if damage is None:
            return latest
        newest = target
        bad = [f"{newest}: {damage}"]
        why = f"the latest checkpoint {newest} is {damage}"
    else:
        bad = []
        why = f"{latest} is missing (the job was stopped while it saved a checkpoint)"
    for path in checkpoint_files(folder):
        if path == newest:
            continue
        damage = _link_refusal(path) or checkpoint_damage(path)
        if damage is None:
            if newest is not None:
                also = f"; skipped as well: {'; '.join(bad[1:])}" if len(bad) > 1 else ""
                warnings.warn(f"{why}; resuming from the previous intact checkpoint {path} (the steps after it are "
                              f"redone){also}", stacklevel=2)
            else:
                cut = f" (the steps after it are redone; skipped: {'; '.join(bad)})" if bad else ""
                warnings.warn(f"{why}; resuming from the newest intact checkpoint {path}{cut}", stacklevel=2)
            return path
        bad.append(f"{path}: {damage}")
    if newest is None:
        if bad:
            warnings.warn(f"{why} and no checkpoint in it is intact ({'; '.join(bad)}): the job was stopped while "
                          "it wrote its first checkpoint; starting the run over", stacklevel=2)
        return None
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


def set_rng_state(state: Mapping[str, object]) -> None:
    """Restore the RNG states captured by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    meta = state["numpy_meta"]
    np.random.set_state((meta[0], state["numpy_keys"].numpy().astype(np.uint32), meta[1], meta[2], meta[3]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
