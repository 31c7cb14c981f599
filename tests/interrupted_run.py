"""Run by tests/test_interrupt.py in a pytest of its own, which it then interrupts (not collected by the suite: no
``test_`` prefix). Each test starts what the suite's tests start, says so with a file in ``$BLADE_INTERRUPT_READY``
and waits to be interrupted: an S3 test server (the session fixture), a job in a session of its own with the local
Ray instance it started (as the end-to-end tests run jobs), and a Ray instance in the test process (``ray_local``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager

#: a job's stand-in: a local Ray instance started in the process, then waiting
_JOB = """
import sys, time, ray
ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False)
open(sys.argv[1], "w").close()
time.sleep(3600)
"""


def _ready(name: str) -> None:
    with open(os.path.join(os.environ["BLADE_INTERRUPT_READY"], name), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)  # until interrupted


@contextmanager
def _starting(name: str):
    """What fails while ``name``'s processes start is written to ``failed-<name>`` at once (the traceback): the
    interrupting test reports it, rather than waiting out its limit while the other test sleeps."""
    try:
        yield
    except BaseException:
        folder = os.environ["BLADE_INTERRUPT_READY"]
        with open(os.path.join(folder, f".failed-{name}"), "w") as f:
            f.write(traceback.format_exc())
        os.replace(os.path.join(folder, f".failed-{name}"), os.path.join(folder, f"failed-{name}"))  # (seen whole)
        raise


def test_an_s3_server_and_a_job_with_its_ray_instance(request, tmp_path):
    with _starting("s3-and-job"):
        request.getfixturevalue("s3_server")
        up, log = tmp_path / "job-up", tmp_path / "job.log"
        with open(log, "wb") as out:
            job = subprocess.Popen([sys.executable, "-c", _JOB, str(up)], start_new_session=True,
                                   stdout=out, stderr=subprocess.STDOUT)
        while not up.exists():
            assert job.poll() is None, f"the job ended (exit {job.returncode}): {log.read_text()[-3000:]}"
            time.sleep(0.1)
    _ready("s3-and-job")


def test_a_ray_instance_in_the_test_process(request):
    with _starting("ray"):
        request.getfixturevalue("ray_local")
    _ready("ray")
