"""Files written whole or not at all: a kill, a full disk or a reader at the wrong moment never sees half a file.

:func:`atomic_write_text` writes a temporary file beside the target, fsyncs it and renames it over the target
(``os.replace``); the manifests and work-unit records of :mod:`schemas.manifest` are saved through it
(:func:`write_manifest`, :func:`write_unit_record`). The file gets the modes of any newly created file (0666 less
the process's umask), not the 0600 of a temporary file.

Standard library only (and the record models): the jobs may use it before they import torch.
"""

from __future__ import annotations

import os
import tempfile

from schemas.manifest import Manifest, UnitRecord

__all__ = ["atomic_write_text", "write_manifest", "write_unit_record", "umask_mode"]


def umask_mode() -> int:
    """The modes a newly created regular file gets: ``0o666`` less the process's umask (read from
    ``/proc/self/status``, else by setting and restoring it: ``os.umask`` can only be read that way)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def atomic_write_text(path: str, text: str, *, temp: str | None = None) -> None:
    """Write ``text`` to ``path`` so that readers see either the old or the new file, never half.

    ``temp``: the temporary file's path (default: a new ``.tmp-*`` beside ``path``); a writer that owns a fixed
    one (a work unit's record) can find and remove what a kill left of it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if temp is None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    else:
        fd, tmp = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), temp
    try:
        os.fchmod(fd, umask_mode())  # mkstemp's 0600 would otherwise become the file's modes
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a failed write (full disk): name the file
            raise type(e)(e.errno, e.strerror or str(e), path) from e
        raise


def write_manifest(directory: str, manifest: Manifest) -> str:
    """Save ``directory/manifest.json`` atomically; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = Manifest.path_in(directory)
    atomic_write_text(path, manifest.model_dump_json(indent=2))
    return path


def write_unit_record(path: str, record: UnitRecord) -> None:
    """Save a work unit's record atomically through ``<path>.tmp`` (only the unit's task writes it: a rerun removes
    what a kill left of it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, record.model_dump_json(indent=1), temp=path + ".tmp")
