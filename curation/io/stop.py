"""Graceful stop on SIGTERM / SIGINT (preemption, Ctrl-C): jobs stop between units of work, resumable.

A job wraps its body in :class:`GracefulStop`; its loops poll between units (a finished part, a finished
work unit) with :func:`check_stop`, which raises :class:`StopRequested` once a signal came. Work already
recorded stays; the unit in progress is finished (or dropped) by the loop before it polls, so a rerun of
the same command continues exactly where it says. A second signal stops the process at once (the first
one resets the handlers to the default action, so the kernel ends the process even inside C code); the
job is kill-safe anyway, and a rerun resumes from the last recorded unit::

    with GracefulStop() as stop:            # in the job's main thread
        for unit in units:
            do(unit)                        # finish and record the unit
            stop.check(f"after {unit}")     # or check_stop(...) deep inside a library loop

Standard library only (no torch, no ray): every package may use it. Outside a :class:`GracefulStop`
(or in another thread than the main one, where signal handlers cannot be set) :func:`check_stop` does
nothing, so library code can poll unconditionally.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

from curation.io.cache import urls_in_text

__all__ = ["StopRequested", "GracefulStop", "check_stop", "stop_requested", "stop_signal", "exit_code", "interruptible"]


class StopRequested(Exception):  # noqa: N818 (named for what happened, like KeyboardInterrupt)
    """A stop signal came and the job stopped between units; the message says where a rerun resumes.

    Attributes:
        signum: the signal received (``signal.SIGTERM``, ``signal.SIGINT``).
        where: where the job stopped, e.g. ``"after part runs/x/candidates/a/part-00003"``.
    """

    def __init__(self, signum: int, where: str) -> None:
        self.signum = signum
        self.where = where
        super().__init__(f"stopped on {signal.Signals(signum).name} {urls_in_text(where)}".rstrip())  # (URLs, not caches)


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by ``signum`` (128 + signum: 143 for SIGTERM, 130 for SIGINT)."""
    return 128 + int(signum)


#: The innermost active :class:`GracefulStop` (the one :func:`check_stop` polls).
_ACTIVE: list[GracefulStop] = []


class GracefulStop:
    """Within the block, the first SIGTERM / SIGINT only sets :attr:`signum`; :meth:`check` then raises.

    Args:
        signals: the signals to catch.
        what: what is finished before stopping, for the notice printed when the first signal comes
            (e.g. ``"the part in progress"``).

    The previous handlers are restored on exit. Entered outside the main thread, it installs nothing.
    """

    def __init__(self, *, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
                 what: str = "the unit in progress") -> None:
        self.signals = tuple(signals)
        self.what = what
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self.waiting: str | None = None  # inside interruptible(): what the job waits for (a signal stops it there)

    @property
    def requested(self) -> bool:
        """Whether a stop signal came."""
        return self.signum is not None

    def check(self, where: str = "") -> None:
        """Raise :class:`StopRequested` (naming ``where``) when a stop signal came; else do nothing."""
        if self.signum is not None:
            raise StopRequested(self.signum, where)
        self.reinstall()

    def reinstall(self) -> None:
        """Put this block's handler back where a library replaced it since :meth:`__enter__` (Composer installs its
        own, which exits at once, when first imported): polled with every :meth:`check`. Nothing once a signal
        came (the handlers are then the default, on purpose) or outside the main thread."""
        if self.signum is not None or not self._previous or threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            if signal.getsignal(s) != self._handle:
                signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            for s in self.signals:  # a second signal: the default action, at once (also inside C code)
                signal.signal(s, signal.SIG_DFL)
            if self.waiting is not None:  # maybe blocked in a system call Python retries (PEP 475): stop it now
                raise StopRequested(signum, f"while {self.waiting}")
            name = signal.Signals(signum).name
            # os.write, not print: a handler may run while the main thread is inside a print
            os.write(2, f"\n{name} received: finishing {self.what}, then stopping (send it again to stop at "
                        "once; a rerun resumes from the last finished unit)\n".encode())

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _ACTIVE.remove(self)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


@contextlib.contextmanager
def interruptible(what: str) -> Iterator[None]:
    """Within the block, a stop signal raises :class:`StopRequested` at once, also inside a blocking system call that
    Python would otherwise retry after the handler (opening a FIFO waits for a writer for ever): for waits that leave
    nothing half written (``what``: e.g. ``"opening input x.jsonl"``). Nothing outside a :class:`GracefulStop` or
    outside the main thread."""
    active = _ACTIVE[-1] if _ACTIVE and threading.current_thread() is threading.main_thread() else None
    if active is None or active.waiting is not None:
        yield
        return
    active.check(f"before {what}")
    active.waiting = what
    try:
        yield
    finally:
        active.waiting = None


def stop_requested() -> bool:
    """Whether the innermost active :class:`GracefulStop` received a stop signal (False outside one)."""
    return bool(_ACTIVE) and _ACTIVE[-1].requested


def stop_signal() -> int | None:
    """The signal the innermost active :class:`GracefulStop` received (None: none yet, or outside one); its handlers
    are put back where a library replaced them (:meth:`GracefulStop.reinstall`)."""
    if not _ACTIVE:
        return None
    _ACTIVE[-1].reinstall()
    return _ACTIVE[-1].signum


def check_stop(where: str = "") -> None:
    """:meth:`GracefulStop.check` of the innermost active one; nothing outside a :class:`GracefulStop`."""
    if _ACTIVE:
        _ACTIVE[-1].check(where)
