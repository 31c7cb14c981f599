"""An interrupted test run ends every server and job it started (issue 57: interrupting ``pytest --all`` left two
S3 test servers running): Ctrl-C in a terminal (SIGINT to the run's process group) and SIGTERM to pytest alone,
each with two xdist workers running tests/interrupted_run.py (an S3 test server, a job in a session of its own with
its local Ray instance, a Ray instance in the test process): once everything is up, the run is signalled; it
exits as interrupted and no process of its tree or of its processes' sessions is left (tests/processes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests import processes, timing
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_run_ends_every_server_job_and_ray_instance_it_started(tmp_path, how):
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "RAY_ADDRESS"}
    env.update(BLADE_INTERRUPT_READY=str(ready), PYTHONPATH=str(REPO))
    log = tmp_path / "pytest.log"
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "pytest", "-n", "2", "--dist", "load", "-p", "no:cacheprovider",
                                "--all", "--basetemp", str(tmp_path / "inner"), str(REPO / "tests" / "interrupted_run.py")],
                               cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def seen() -> set[str]:
            return {p.name for p in ready.iterdir()}

        up = timing.until(lambda: seen() == {"s3-and-job", "ray"} or any(n.startswith("failed-") for n in seen()),
                          timeout=240, proc=run)
        failed = {n: (ready / n).read_text() for n in seen() if n.startswith("failed-")}
        failures = "".join(f"{name}: {trace}" for name, trace in failed.items())
        assert up and not failed, f"the run ended or did not start everything: {failures}\n{log.read_text()[-3000:]}"
        procs = processes.table()
        tree = processes.descendants(run.pid, procs)
        sessions = {sid for _, sid, _ in tree.values()} - {run.pid}
        started = {pid: st[2] for pid, st in procs.items() if pid in tree or st[1] in sessions}
        names = {pid: _name(pid) for pid in started}
        for what in ("weed server", "raylet", "gcs_server"):  # what the tests started is in the snapshot
            assert any(what in n for n in names.values()), (what, names)
        assert sum("raylet" in n for n in names.values()) == 2 and len(sessions) >= 2, (names, sessions)

        if how == "ctrl-c":
            os.killpg(run.pid, signal.SIGINT)  # the terminal's: every process of the run's process group
        else:
            run.send_signal(signal.SIGTERM)  # pytest alone, as a scheduler or `kill` sends it
        timing.wait(run, timeout=120)
    finally:
        if run.poll() is None:  # (the test failed before the run ended: every session its processes made too)
            tree = processes.descendants(run.pid)
            for sid in {run.pid} | {sid for _, sid, _ in tree.values()}:
                processes.kill_session(sid)
            run.wait()
    output = log.read_text()
    assert run.returncode == pytest.ExitCode.INTERRUPTED, output[-3000:]

    def left() -> dict[int, str]:
        now = processes.table()
        return {pid: names.get(pid, _name(pid)) for pid, st in now.items()
                if started.get(pid) == st[2] or (st[1] in sessions and pid not in started)}

    timing.until(lambda: not left(), timeout=30)  # (pytest has returned: what it signalled is being reaped)
    assert not left(), f"left running after the {how}: {left()}\n{output[-3000:]}"
