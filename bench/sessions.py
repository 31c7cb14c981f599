"""Processes and ports of the experiments that start Ray nodes and jobs in sessions of their own (the soak, the
simulated two-node cluster; tests/two_nodes.py too): Linux's /proc, standard library only."""

from __future__ import annotations

import os
import random
import socket

__all__ = ["command", "free_ports", "session_pids"]

#: Ray's worker processes take their ports from 10002–19999 (the defaults of ``--min-worker-port`` and
#: ``--max-worker-port``); the free ports handed out here lie above them.
_LOWEST = 20000
_PICK = random.SystemRandom()  # (not the random module's generator: a test seeding it would repeat the picks)


def _kernels_low() -> int:
    """The lowest port Linux hands out by itself (a bind to port 0, every outgoing connection): the start of
    ip_local_port_range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # (Linux's default)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports of 127.0.0.1 nobody has bound now, for a server started next that is told its ports.

    A port is free only until someone binds it, and the server binds it some seconds later (SeaweedFS binds its S3
    port once its filer is up). The ports are therefore taken below the range the kernel hands out by itself
    (``_kernels_low``), where no other process's bind to port 0 or outgoing connection lands meanwhile, nor Ray's
    own choice of a free port (at or above that range's start), and above Ray's worker ports. Another test process
    picking at the same moment may still pick one of them (rare: random picks among ≈ 12,000): a server that then
    cannot bind is started again on new ports (tests/s3server.py, tests/two_nodes.py). Where the kernel's range
    leaves no room below it, the kernel picks."""
    low = _kernels_low()
    ports: list[int] = []
    while len(ports) < n:
        if low - _LOWEST >= 1000:
            port = _PICK.randrange(_LOWEST, low)
            if port not in ports and _bindable(port):
                ports.append(port)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                if (port := s.getsockname()[1]) not in ports:
                    ports.append(port)
    return ports


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
