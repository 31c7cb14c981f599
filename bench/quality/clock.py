"""The quality benchmark's stage clock: wall and process-CPU seconds per stage, added up over the invocations
that ran it, with the time a stopped process spent set apart and logged (``out/pauses.jsonl``)."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import UTC, datetime

import psutil

from curation.io.atomic import atomic_write_text

__all__ = ["StageClock", "PAUSES"]

#: the pause log under ``--out`` (one JSON line per stopped interval the stage clock saw)
PAUSES = "pauses.jsonl"


def _cpu() -> float:
    """CPU seconds of this process, of its ended child processes and of the running ones (the worker pool lives
    through every stage, ``bench.quality.procs.shared_workers``: a stage counts what its workers did while it ran)."""
    t = os.times()
    live = 0.0
    for child in psutil.Process().children():
        try:
            c = child.cpu_times()
        except psutil.Error:  # ended since: its time is in children_user/system once it is reaped
            continue
        live += c.user + c.system + c.children_user + c.children_system
    return time.process_time() + t.children_user + t.children_system + live


class StageClock:
    """Wall and process-CPU seconds per stage, added up over the invocations that ran it
    (``out/stage_times.json``, flushed every :attr:`PERIOD` s so a killed piece keeps most of its time).

    Time the process spent stopped (``SIGSTOP``, e.g. paused while a shared machine runs something else) is not
    the stage's: the monotonic clock counts it, so a flush that comes more than :attr:`STOPPED_AFTER` seconds after
    the previous one counts its interval beyond one period as ``stopped`` (kept beside ``wall``, not in it) and
    appends it to the pause log (:data:`PAUSES`), one line per stopped interval."""

    PERIOD = 30.0
    STOPPED_AFTER = 90.0  # three periods late: only a stopped (or suspended) process is that late

    def __init__(self, out: str):
        self.path = os.path.join(out, "stage_times.json")
        self.times: dict[str, dict[str, float]] = json.load(open(self.path)) if os.path.exists(self.path) else {}
        self._lock = threading.Lock()
        self._open: tuple[str, float, float] | None = None

    def _flush(self, final: bool = False, now: float | None = None) -> None:
        with self._lock:
            if self._open is None:
                return
            name, t0, c0 = self._open
            now, cpu = time.perf_counter() if now is None else now, _cpu()
            entry = self.times.setdefault(name, {"wall": 0.0, "cpu": 0.0, "pieces": 0})
            gap = now - t0
            stopped = gap - self.PERIOD if gap > self.STOPPED_AFTER else 0.0
            entry["wall"] += gap - stopped
            entry["cpu"] += cpu - c0
            if stopped:
                entry["stopped"] = entry.get("stopped", 0.0) + stopped
                self._pause(name, stopped)
            if final:
                entry["pieces"] += 1
                self._open = None
            else:
                self._open = (name, now, cpu)
            atomic_write_text(self.path, json.dumps(self.times, indent=1))

    def _pause(self, name: str, seconds: float) -> None:
        """Append a stopped interval to the pause log (``out/pauses.jsonl``), which the report counts."""
        end = datetime.now(UTC)
        line = {"stage": name, "seconds": round(seconds, 1), "detected_at": end.isoformat(timespec="seconds"),
                "from": datetime.fromtimestamp(end.timestamp() - seconds - self.PERIOD, UTC).isoformat(
                    timespec="seconds")}
        with open(os.path.join(os.path.dirname(self.path), PAUSES), "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        print(f"[clock] {name}: {seconds / 60:.1f} min stopped (not counted), logged in {PAUSES}", flush=True)

    def stage(self, name: str):
        clock = self

        class _Stage:
            def __enter__(self):
                clock._open = (name, time.perf_counter(), _cpu())
                stop = threading.Event()
                self._stop = stop

                def tick():
                    while not stop.wait(clock.PERIOD):
                        clock._flush()

                self._thread = threading.Thread(target=tick, daemon=True)
                self._thread.start()

            def __exit__(self, *exc):
                self._stop.set()
                self._thread.join()
                clock._flush(final=True)
                return False

        return _Stage()
