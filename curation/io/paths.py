"""Names read back from disk or a bucket are untrusted: checked, joined and resolved before they are used.

A unit record, a manifest, an MDS ``index.json``, a checkpoint link or an object key is data anyone who can write
the output directory (or its bucket) controls. Like Python's ``tarfile`` extraction filters (PEP 706), every name
taken from one is checked before a path is built from it: each component follows the rule of config names
(:func:`schemas.config.check_path_name`: no ``..``, ``.``, hidden or absolute name, no separator, no control
character), the joined path is resolved (symbolic links followed) and must stay inside the directory it was
read for. A name that fails raises :class:`UnsafeNameError`, one line naming the file it was read from, the field
and the value. Nothing is opened, written or deleted through a name that did not pass.

Object keys of a bucket keep their own files (``.symlinks.json``, ``.lock``, ``config.yaml``): :func:`safe_key`
checks them with the looser rule of one file name (no ``.``/``..``/empty component, no control character, no
backslash) and the same containment.
"""

from __future__ import annotations

import os
import stat

from schemas.config import check_path_name

__all__ = ["UnsafeNameError", "check_relative", "safe_join", "safe_key", "inside"]

#: At most this many components in a relative name read back (``<source>/part-00000-00001/shard.00000.mds.zstd``).
MAX_DEPTH = 8


class UnsafeNameError(ValueError):
    """A name read back from a file or a bucket would leave its directory (or is not a plain name)."""


def _shown(name: object) -> str:
    text = repr(name)
    return text if len(text) <= 120 else text[:117] + "..."


def _refuse(name: object, what: str, source_file: str, why: str) -> UnsafeNameError:
    return UnsafeNameError(f"{source_file}: {what} {_shown(name)} {why}; refused (nothing was opened or deleted "
                           "through it): restore the file or delete the directory")


def check_relative(name: object, *, what: str, source_file: str, loose: bool = False) -> list[str]:
    """The components of ``name``, a relative ``/``-separated path whose every component is one safe path component
    (the rule of config names; ``loose``: the rule of one file name, see the module docstring)."""
    if not isinstance(name, str):
        raise _refuse(name, what, source_file, "is not a string")
    if name.startswith("/") or os.path.isabs(name):
        raise _refuse(name, what, source_file, "is an absolute path")
    parts = name.split("/")
    if not 0 < len(parts) <= MAX_DEPTH:
        raise _refuse(name, what, source_file, f"has more than {MAX_DEPTH} components")
    for p in parts:
        if loose:
            if p in ("", ".", "..") or len(p.encode("utf-8", "surrogatepass")) > 255 or "\\" in p \
                    or any(ord(c) < 32 or ord(c) == 127 for c in p):
                raise _refuse(name, what, source_file, "is not a relative path of plain file names")
        else:
            try:
                check_path_name(p, what)
            except ValueError:
                raise _refuse(name, what, source_file, "is not a relative path of plain names (letters, digits, "
                              "'-', '_', '.', no '..', not starting with '.' or '-')") from None
    return parts


def inside(root: str, path: str) -> bool:
    """Whether ``path``, resolved (symbolic links followed), is ``root`` (resolved) or under it."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def _no_link_below(root: str, parts: list[str]) -> bool:
    """Whether no component of ``root/parts`` after ``root`` is a symbolic link (False where one is, or where it
    cannot say): then, ``parts`` being plain names (no ``..``), the path resolves under ``root`` resolved, which
    :func:`inside` would confirm by resolving both, every component of ``root`` again (two ``realpath`` of a
    shard's path cost ≈ 25 ``lstat`` calls; a reader resolves each shard's file names)."""
    path = root
    for part in parts:
        path = os.path.join(path, part)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return False
        except FileNotFoundError:  # nor anything below it: nothing to follow
            return True
        except OSError:
            return False
    return True


def safe_join(root: str, name: object, *, what: str, source_file: str, loose: bool = False) -> str:
    """``root/name`` for a ``name`` read from ``source_file``, checked (:func:`check_relative`) and resolved: a path
    that leaves ``root`` (through a symbolic link on the way, or one at its end) is refused.

    Returns:
        The joined path (not resolved: messages and object-store mapping keep working on it).

    Raises:
        UnsafeNameError: one line naming ``source_file``, ``what`` and the value.
    """
    parts = check_relative(name, what=what, source_file=source_file, loose=loose)
    path = os.path.join(root, *parts)
    if not (_no_link_below(root, parts) or inside(root, path)):
        raise _refuse(name, what, source_file, f"leads outside {root} (through a symbolic link)")
    return path


def safe_key(root: str, key: object, *, what: str, source_file: str) -> str:
    """:func:`safe_join` with the looser rule of object keys (bucket files such as ``.symlinks.json``)."""
    return safe_join(root, key, what=what, source_file=source_file, loose=True)
