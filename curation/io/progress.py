"""Progress of a job's loop, as its output goes: a tqdm bar on a terminal, plain lines anywhere else.

Under a pipe or in a log file (``> log``, ``ray job submit``, CI) a bar's ``\\r`` frames pile up into one line of
hundreds of characters; there :func:`progress` prints a line instead, every tenth of the work (or every ``every``
items) and at the end, on stdout, like the trainer's progress lines (:mod:`training.blocks.throughput`)::

    prepare data: 3/4 units (75%) | 1.2 units/s | eta 1s | tokens=51200

Every job's loop goes through here (no other module imports tqdm: ``tests/curation/io/test_progress.py``).
Standard library and tqdm only.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

__all__ = ["interactive", "progress", "progress_iter", "ProgressLines"]

T = TypeVar("T")

#: Lines printed over a whole loop (besides the last): one every tenth of it.
LINES = 10


def interactive() -> bool:
    """Whether stdout and stderr are both terminals: a bar is shown (else progress lines are printed)."""
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def _seconds(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ProgressLines:
    """tqdm's small API (``update``, ``n``, ``set_postfix``, ``refresh``, ``close``, ``with``) printing whole lines:
    one each time ``n`` reaches the next multiple of ``every`` (default: a tenth of ``total``), and one at the end.

    Args:
        total: items of the loop.
        desc: what is counted, at the start of each line.
        unit: the items' name (``unit``, ``part``, ``batch``).
        every: items between lines (None: ``ceil(total / 10)``).
        stream: where lines go (None: stdout at the time of writing).
        clock: seconds (tests pass their own).
    """

    def __init__(self, total: int, *, desc: str = "", unit: str = "it", every: int | None = None,
                 stream: TextIO | None = None, clock: Any = time.monotonic) -> None:
        self.total = max(0, int(total))
        self.desc, self.unit = desc, unit
        self.units = unit + ("es" if unit.endswith(("ch", "sh", "s", "x")) else "s")  # "3/4 units", "2/9 batches"
        self.every = max(1, every if every is not None else math.ceil(self.total / LINES))
        self.stream, self.clock = stream, clock
        self.start = clock()
        self.postfix = ""
        self._n = 0
        self._shown = 0  # n at the last line

    @property
    def n(self) -> int:
        return self._n

    @n.setter
    def n(self, value: int) -> None:
        self._n = int(value)

    def update(self, k: int = 1) -> None:
        self._n += k
        self.refresh()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def refresh(self) -> None:
        """Print a line when ``n`` passed the next multiple of ``every`` (the last one: at :meth:`close`)."""
        if self._n // self.every > self._shown // self.every and self._n < self.total:
            self._line()

    def line(self) -> str:
        """``desc: n/total unit (p%) | rate | eta | postfix``."""
        elapsed = self.clock() - self.start
        parts = [f"{self.desc + ': ' if self.desc else ''}{self._n}/{self.total} {self.units}"
                 + (f" ({self._n / self.total:.0%})" if self.total else "")]
        if elapsed > 0 and self._n:
            rate = self._n / elapsed
            parts.append(f"{rate:.3g} {self.units}/s")
            if self.total > self._n:
                parts.append(f"eta {_seconds((self.total - self._n) / rate)}")
            else:
                parts.append(f"{_seconds(elapsed)} in all")
        if self.postfix:
            parts.append(self.postfix)
        return " | ".join(parts)

    def _line(self) -> None:
        self._shown = self._n
        print(self.line(), file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        """The last line, unless the current count was shown already."""
        if self._n != self._shown or self._n == 0:
            self._line()

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Off:
    """A bar that shows nothing (``enabled=False``)."""

    n = 0

    def update(self, k: int = 1) -> None: ...
    def set_postfix(self, **values: Any) -> None: ...
    def refresh(self) -> None: ...
    def close(self) -> None: ...

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: object) -> None: ...


def progress(total: int, *, desc: str = "", unit: str = "it", enabled: bool = True, leave: bool = True,
             stream: TextIO | None = None) -> Any:
    """A tqdm bar on a terminal (:func:`interactive`), else :class:`ProgressLines`; nothing when not ``enabled``.
    ``stream``: where either goes (None: tqdm's stderr, the lines' stdout; a job whose stdout is its answer, like
    ``jobs/show_selection.py``'s summary line, passes ``sys.stderr``)."""
    if not enabled:
        return _Off()
    if interactive():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=leave, file=stream)
    return ProgressLines(total, desc=desc, unit=unit, stream=stream)


def progress_iter(items: Iterable[T], *, total: int, desc: str = "", unit: str = "it", enabled: bool = True,
                  leave: bool = True) -> Iterator[T]:
    """``items``, with :func:`progress` advanced by one per item."""
    with progress(total, desc=desc, unit=unit, enabled=enabled, leave=leave) as bar:
        for item in items:
            yield item
            bar.update(1)
