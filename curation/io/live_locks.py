"""The output directories live runs of this host hold: the ``flock`` s of ``/proc/locks`` on an output directory's lock
file, found among their holders' open files (:func:`curation.io.outdir.OutputDirLock` refuses a directory inside or
around one). Standard library only."""

from __future__ import annotations

import os

__all__ = ["LOCK_NAME", "live_locks"]

#: An output directory's lock file (curation.io.outdir takes the lock; its name is defined here, once).
LOCK_NAME = ".lock"


def live_locks() -> list[tuple[str, int]]:
    """``(path, pid)`` of every output directory's lock file (:data:`LOCK_NAME`) a live process of this host holds:
    the ``flock`` s of ``/proc/locks``, found among their holders' open files (none where ``/proc`` cannot say)."""
    held: dict[tuple[int, int], int] = {}
    try:
        with open("/proc/locks", encoding="ascii") as f:
            for line in f:  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF" (a waiter: "1: -> FLOCK ...")
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[3] == "WRITE" and parts[4].isdigit():
                    major, minor, inode = parts[5].split(":")
                    held[(os.makedev(int(major, 16), int(minor, 16)), int(inode))] = int(parts[4])
    except (OSError, ValueError):
        return []
    found = []
    for pid in sorted(set(held.values())):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                if os.path.basename(path) != LOCK_NAME:
                    continue
                st = os.stat(path)
            except OSError:
                continue
            if held.get((st.st_dev, st.st_ino)) == pid:
                found.append((path, pid))
    return found
