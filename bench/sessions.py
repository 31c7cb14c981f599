"""Processes and ports of the experiments that start Ray nodes and jobs in sessions of their own (the soak, the
simulated two-node cluster; tests/two_nodes.py too): Linux's /proc, standard library only."""

from __future__ import annotations

import os
import socket

__all__ = ["command", "free_port", "session_pids"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int, *, running: bool = False) -> list[int]:
    """The processes of session ``sid`` still alive (its leader included); with ``running``, the zombies (ended, not
    yet reaped) left out, from the same read of /proc."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                state, _, _, session = f.read().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session) == sid and not (running and state == "Z"):
            out.append(int(entry))
    return out


def command(pid: int) -> list[str]:
    """The command line of process ``pid``, one string per argument ([] once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []
