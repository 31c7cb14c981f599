"""The processes a test run started, found from ``/proc``, and their end when the run ends (issue 57: interrupting
``pytest --all`` left two S3 test servers running).

Tests start servers and jobs in sessions of their own (``start_new_session=True``: the S3 server, job processes and
the local Ray instance each job starts), so Ctrl-C in a terminal, which signals the terminal's process group,
does not reach them, and Python's default SIGTERM ends pytest without any teardown. tests/conftest.py therefore

- turns SIGTERM into the KeyboardInterrupt that SIGINT raises (fixtures are torn down: the S3 server stopped, Ray
  shut down), after noting every process descending from this one and their sessions (:func:`note`: xdist's
  controller notes its workers' whole trees while they are still its descendants), and
- at the end of every pytest process (``pytest_unconfigure``; normal end or interrupted) ends what is left
  (:func:`end_started`): each noted or current descendant and every process of their sessions, SIGTERM first,
  SIGKILL after a grace period. A pytest process killed with SIGKILL cleans nothing up.

A process is named by its pid and its start time (``/proc/<pid>/stat`` field 22), so a pid reused since is left alone.
"""

from __future__ import annotations

import os
import signal
import time

_NOTED: dict[int, int] = {}  # pid → start time
_SESSIONS: set[int] = set()


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, session id, start time) of a live process, else None (gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields after the command: state, ppid, pgrp, session, tty, tpgid, flags, minflt, cminflt, majflt, cmajflt,
    # utime, stime, cutime, cstime, priority, nice, threads, itrealvalue, starttime
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[3]), int(fields[19])


def table() -> dict[int, tuple[int, int, int]]:
    """Every live process: pid → (ppid, session id, start time)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            out[int(entry)] = st
    return out


def descendants(root: int, procs: dict[int, tuple[int, int, int]] | None = None) -> dict[int, tuple[int, int, int]]:
    """The live descendants of ``root`` (children, their children, ...)."""
    procs = table() if procs is None else procs
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = procs[pid]
            todo.extend(children.get(pid, []))
    return out


def session_members(sid: int, procs: dict[int, tuple[int, int, int]] | None = None) -> list[int]:
    procs = table() if procs is None else procs
    return [pid for pid, (_, s, _) in procs.items() if s == sid]


def kill_session(sid: int) -> None:
    """SIGKILL every process of the session ``sid`` (a job started with ``start_new_session=True``: its Ray
    processes included), the way a killed job dies."""
    for pid in session_members(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def note() -> None:
    """Remember this process's descendants and their sessions (those other than this process's own)."""
    own = os.getsid(0)
    for pid, (_, sid, start) in descendants(os.getpid()).items():
        _NOTED[pid] = start
        if sid != own:
            _SESSIONS.add(sid)


def _targets() -> dict[int, int]:
    """pid → start time of what :func:`end_started` ends: the noted processes still alive, the current
    descendants, and every process of the noted and current descendants' sessions (not this one's session)."""
    procs, me, own = table(), os.getpid(), os.getsid(0)
    out = {pid: start for pid, start in _NOTED.items() if pid in procs and procs[pid][2] == start}
    now = descendants(me, procs)
    out.update((pid, st[2]) for pid, st in now.items())
    sessions = _SESSIONS | {st[1] for st in now.values()}
    sessions.discard(own)
    out.update((pid, st[2]) for pid, st in procs.items() if st[1] in sessions)
    out.pop(me, None)
    return out


def _signal(targets: dict[int, int], signum: int) -> None:
    for pid, start in targets.items():
        st = _stat(pid)
        if st is not None and st[2] == start:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


def _alive(targets: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in targets.items() if (st := _stat(pid)) is not None and st[2] == start}


def end_started(grace_s: float = 10.0) -> list[int]:
    """End what this process started and left running: SIGTERM, then SIGKILL after ``grace_s`` for what is still
    alive. Returns the pids it signalled (nothing after a clean run)."""
    targets = _targets()
    if not targets:
        return []
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(targets) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _alive(targets)
    _signal(left, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while _alive(left) and time.monotonic() < deadline:
        time.sleep(0.1)
    _NOTED.clear()
    _SESSIONS.clear()
    return sorted(targets)


def on_signal(signum, frame):  # noqa: ANN001 - a signal handler
    """SIGTERM and SIGINT in a test process: note the descendants, then raise KeyboardInterrupt (pytest stops and
    tears the fixtures down)."""
    note()
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def install() -> None:
    """:func:`on_signal` for SIGTERM and SIGINT, where another handler replaced it: importing Composer installs
    one that calls ``sys.exit(128 + signal)`` (composer/core/engine.py), which pytest reports as the running test's
    failure and then goes on with the next test. Main thread only (Python's rule)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(signum) is not on_signal:
            signal.signal(signum, on_signal)
