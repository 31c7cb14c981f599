"""Time limits of the tests' waits, scaled by the machine's measured load (issue 57: on a busy 2-core machine two
main-job tests failed on their own fixed 300-s limit, not on a wrong result).

A limit is given as its *nominal* seconds: what the wait may take on an idle machine running the suite as CI does
(``-n 2``, with margin). It holds for ``nominal × slowdown`` seconds, where the slowdown is the machine's mean run-queue
length per core over the wait (the 1-minute load average, sampled every second by a daemon thread, divided by the
cores this process may use), at least 1. A hung test is still caught (after its nominal time on an idle machine); a
test on a loaded machine is not failed for being slow: with 2 cores and a load of 14 a nominal 300 s waits 35 min.

The same rule scales pytest-timeout's limits (pyproject's ``timeout`` and ``@pytest.mark.timeout``): tests/conftest.py
arms its timer through :func:`arm_pytest_timeout`.

    from tests import timing
    done = timing.run([sys.executable, JOB, ...], timeout=300, capture_output=True, text=True)  # subprocess.run's
    out, err = timing.communicate(proc, timeout=120)
    timing.wait(proc, timeout=60)
    timing.until(lambda: os.path.exists(ckpt), timeout=240, proc=proc)  # False: proc ended or the limit passed
    deadline = timing.Deadline(240)
    while ... and not deadline.expired(): ...
"""

from __future__ import annotations

import bisect
import os
import signal
import subprocess
import threading
import time

#: seconds between two samples of the load average
PERIOD = 1.0


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _LoadMeter:
    """The 1-minute load average sampled every PERIOD seconds; ``mean(since)``: its time-weighted mean since then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times: list[float] = []
        self._area: list[float] = []  # ∫ load dt from the first sample to each sample
        self._load: list[float] = []
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # (no load average on this system: no scaling)
            load = 0.0
        now = time.monotonic()
        with self._lock:
            if self._times:
                self._area.append(self._area[-1] + self._load[-1] * (now - self._times[-1]))
            else:
                self._area.append(0.0)
            self._times.append(now)
            self._load.append(load)

    def _run(self) -> None:
        while True:
            time.sleep(PERIOD)
            self._sample()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="tests.timing load meter", daemon=True)
        self._sample()
        self._thread.start()

    def mean(self, since: float) -> float:
        """Mean load over [since, now] (the newest sample's value holds until now)."""
        self.start()
        now = time.monotonic()
        with self._lock:
            times, area, load = self._times, self._area, self._load
            if now - since < 1e-6:
                return load[-1]
            i = bisect.bisect_right(times, since) - 1  # the sample in force at `since`
            if i < 0:  # before the first sample: the first one's value back to `since`
                start_area, i = -load[0] * (times[0] - since), 0
            else:
                start_area = area[i] + load[i] * (since - times[i])
            end_area = area[-1] + load[-1] * (now - times[-1])
        return (end_area - start_area) / (now - since)


METER = _LoadMeter()


def slowdown(since: float) -> float:
    """How many times slower than on an idle machine work has run since ``since`` (``time.monotonic()``): the mean
    load per core over that time, at least 1."""
    return max(1.0, METER.mean(since) / cores())


def scaled(nominal_s: float) -> float:
    """``nominal_s`` times the slowdown of the last minute, for an API that takes a fixed number of seconds (a
    ``threading.Barrier``, an engine call's ``timeout_s``) where a :class:`Deadline` cannot be polled."""
    return nominal_s * max(1.0, (os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0) / cores())


class Deadline:
    """A limit of ``nominal_s`` idle-machine seconds from now, stretched by the slowdown measured while it runs."""

    def __init__(self, nominal_s: float) -> None:
        METER.start()
        self.nominal = float(nominal_s)
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allowed(self) -> float:
        """The seconds allowed so far: the nominal ones times the slowdown measured since the start."""
        return self.nominal * slowdown(self.start)

    def left(self) -> float:
        return self.allowed() - self.elapsed()

    def expired(self) -> bool:
        return self.left() <= 0

    def __str__(self) -> str:
        return (f"{self.elapsed():.0f} s ({self.nominal:.0f} s on an idle machine × the measured slowdown "
                f"{slowdown(self.start):.1f})")


def communicate(proc: subprocess.Popen, *, timeout: float, input=None):  # noqa: ANN001 - Popen.communicate's input
    """``proc.communicate(input)`` within ``timeout`` nominal seconds, load-scaled; past them the process is killed
    and :class:`subprocess.TimeoutExpired` raised."""
    d = Deadline(timeout)
    while True:
        try:
            return proc.communicate(input, timeout=max(0.1, min(d.left(), 5.0)))
        except subprocess.TimeoutExpired as e:
            input = None  # (sent by the first call)
            if d.expired():
                proc.kill()
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(proc.args, d.elapsed(), output=out, stderr=err) from e


def wait(proc: subprocess.Popen, *, timeout: float) -> int:
    """``proc.wait()`` within ``timeout`` nominal seconds, load-scaled (past them :class:`subprocess.TimeoutExpired`;
    the process is left to the caller, as ``Popen.wait`` leaves it)."""
    d = Deadline(timeout)
    while True:
        try:
            return proc.wait(timeout=max(0.1, min(d.left(), 5.0)))
        except subprocess.TimeoutExpired:
            if d.expired():
                raise


def run(args, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:  # noqa: ANN001 - subprocess.run's
    """``subprocess.run(args, timeout=..., **kwargs)`` (``capture_output``, ``input``, ``check``, ...) with ``timeout``
    as nominal seconds, load-scaled."""
    check, data = kwargs.pop("check", False), kwargs.pop("input", None)
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if data is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(args, **kwargs) as proc:
        out, err = communicate(proc, timeout=timeout, input=data)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def until(condition, *, timeout: float, proc: subprocess.Popen | None = None, interval: float = 0.02) -> bool:
    """Poll ``condition()`` until it holds (True), ``proc`` ends or ``timeout`` nominal seconds, load-scaled, pass
    (False)."""
    d = Deadline(timeout)
    while True:
        if condition():
            return True
        if (proc is not None and proc.poll() is not None) or d.expired():
            return bool(condition())
        time.sleep(interval)


# ------------------------------------------------------------------------------------------------
# pytest-timeout's timer, stretched the same way
# ------------------------------------------------------------------------------------------------
def arm_pytest_timeout(item, settings) -> None:  # noqa: ANN001 - pytest's item, pytest-timeout's Settings
    """pytest-timeout's timer for ``item`` with ``settings.timeout`` as nominal seconds: when they have passed, it
    fires only once ``nominal × slowdown`` have (checked again then); firing is pytest-timeout's own (stacks dumped,
    the test failed; the whole process ended with the ``thread`` method)."""
    import pytest_timeout

    d = Deadline(settings.timeout)

    def late() -> float:  # > 0: seconds still allowed
        return d.left()

    def fire_settings():
        # pytest-timeout's message: "Timeout (>600 × slowdown 2.3 = 1380s) from pytest-timeout."
        return settings._replace(timeout=f"{settings.timeout:g} × slowdown {slowdown(d.start):.1f} = "
                                         f"{d.elapsed():.0f}")

    method = settings.method
    if method == "signal" and threading.current_thread() is not threading.main_thread():
        method = "thread"
    if method == "signal":
        def handler(signum, frame):  # noqa: ANN001
            __tracebackhide__ = True
            left = late()
            if left > 0:
                signal.setitimer(signal.ITIMER_REAL, left + 0.5)
                return
            pytest_timeout.timeout_sigalrm(item, fire_settings())

        def cancel() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)

        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    else:
        stop = threading.Event()

        def watch() -> None:
            wait_s = settings.timeout
            while not stop.wait(wait_s):
                wait_s = late()
                if wait_s <= 0:
                    pytest_timeout.timeout_timer(item, fire_settings())
                    return
                wait_s += 0.5

        timer = threading.Thread(target=watch, name=f"tests.timing timeout {item.nodeid}", daemon=True)

        def cancel() -> None:
            stop.set()
            timer.join()

        timer.start()
    item.cancel_timeout = cancel
