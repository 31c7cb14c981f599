"""The tests' simulated second machine: a process of one node of ``tests/two_nodes.py``'s cluster may not read or
write another node's directories (nodes of a real cluster cannot: they share only the object store).

Python imports this module at start-up in every process that has this folder on its ``PYTHONPATH``; the cluster puts
it there for the processes of its nodes (raylets, Ray workers, the drivers it runs). With ``BLADE_NODE_GUARD`` set to
the directories the node must not touch (``os.pathsep``-separated), an audit hook (PEP 578) refuses every ``open``,
listing, creation, removal, rename and link of a path below them with ``PermissionError`` (as a machine without
that path would fail), and appends the event to ``BLADE_NODE_GUARD_LOG``, so a test fails loudly even where the
code catches the error. ``os.stat`` raises no audit event: a stat of a forbidden path is not seen (its open is).

One kind of access is refused without being logged: the import system's (``importlib``: finding modules, reading
distributions' metadata) on a ``sys.path`` entry. Ray puts the driver's working directory on every worker's
``sys.path`` (``py_driver_sys_path``); on another machine that directory does not exist and the import system passes
over it, as it passes over the refused one here.
"""

import os
import sys
import threading

_FORBID = tuple(os.path.join(os.path.realpath(d), "") for d in os.environ.get("BLADE_NODE_GUARD", "").split(os.pathsep)
                if d)
_LOG = os.environ.get("BLADE_NODE_GUARD_LOG")
_EVENTS = {"open": 1, "os.listdir": 1, "os.scandir": 1, "os.mkdir": 1, "os.rmdir": 1, "os.remove": 1,
           "os.rename": 2, "os.replace": 2, "os.symlink": 2, "os.link": 2, "os.chmod": 1, "os.utime": 1,
           "os.truncate": 1, "shutil.rmtree": 1, "shutil.copyfile": 2, "shutil.copytree": 2, "shutil.move": 2,
           "os.chdir": 1}
_inside = threading.local()


def _forbidden(path) -> str | None:
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str) or not path:
        return None
    full = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    return full if any(full.startswith(d) or full + os.sep == d for d in _FORBID) else None


def _importing() -> bool:
    """Whether the import system is the caller (its path finder, ``importlib.metadata``)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib") or f"{os.sep}importlib{os.sep}" in name:
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """The innermost frames outside this module, as ``file:line`` (where the access came from)."""
    frame, out = sys._getframe(2), []
    while frame is not None and len(out) < 4:
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(out)


def _hook(event: str, args: tuple) -> None:
    n = _EVENTS.get(event)
    if n is None or getattr(_inside, "busy", False):
        return
    _inside.busy = True
    try:
        for path in args[:n]:
            hit = _forbidden(path)
            if hit is not None:
                if _importing():
                    raise PermissionError(13, "another node's directory (tests/node_guard)", hit)
                if _LOG:
                    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    try:
                        os.write(fd, f"pid {os.getpid()} {' '.join(sys.argv)[:80]}: {event} {hit} (from {_caller()})\n"
                                 .encode())
                    finally:
                        os.close(fd)
                raise PermissionError(13, "another node's directory (tests/node_guard)", hit)
    finally:
        _inside.busy = False


if _FORBID:
    sys.addaudithook(_hook)
