"""Ray nodes started on this machine for a benchmark (``jobs/bench_prepare.py --two-nodes N``): a head and more
``ray start --address`` nodes, each in the foreground of a session of its own with its own temporary directory and
free ports, ended by their process ids (never ``ray stop``, which ends every Ray instance of the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.sessions import free_ports, session_pids

__all__ = ["LocalNodes"]


class LocalNodes:
    """Ray nodes on this machine (``ray start --block``, one session each), ``node_a`` the head.

    Args:
        resources: ``{node name: {resource: amount}}`` (each node also has ``{its name: 100}``); the first is the head.
        cpus: CPUs each node declares.
    """

    def __init__(self, resources: dict[str, dict[str, float]], cpus: int) -> None:
        self.root = tempfile.mkdtemp(prefix="blade-nodes-", dir="/tmp")  # (short: Ray's socket paths)
        self.port, self.resources, self.cpus = 0, resources, cpus  # (the head's port: picked at its start)
        self.procs: dict[str, subprocess.Popen] = {}
        # Ray 2.60 secures a cluster `ray start` makes with a token (~/.ray/auth_token): its drivers send it only with
        # RAY_AUTH_MODE=token (a process that joins it needs that before it imports ray: jobs/bench_prepare.py)
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_worker_niceness": "0",
                    "RAY_AUTH_MODE": "token"}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"]
        for i, (name, res) in enumerate(self.resources.items()):
            picked = free_ports(len(ports) + (1 if i == 0 else 0))  # (one pick: distinct; the head's with the cluster's)
            if i == 0:
                self.port = picked[-1]
            cmd = ["ray", "start", "--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
                   "--num-cpus", str(self.cpus), "--resources", json.dumps({name: 100, **res}),
                   "--temp-dir", os.path.join(self.root, name),
                   *[a for p, port in zip(ports, picked[:len(ports)], strict=True) for a in (p, str(port))]]
            cmd += (["--head", "--port", str(self.port), "--include-dashboard", "false"] if i == 0
                    else ["--address", self.address])
            with open(os.path.join(self.root, f"{name}.log"), "ab") as log:
                self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)
            self._wait(i + 1, timeout)

    def _wait(self, count: int, timeout: float) -> None:
        code = (f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
                "print(sum(n['Alive'] for n in ray.nodes()))")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs.values()):
                break  # a node's `ray start` gave up
            try:
                done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=self.env)
                if done.returncode == 0 and done.stdout.split() and int(done.stdout.split()[-1]) == count:
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(1)
        logs = ""
        for name in self.procs:
            with open(os.path.join(self.root, f"{name}.log"), errors="replace") as f:
                logs += f.read()[-1500:]
        raise RuntimeError(f"the local Ray cluster did not reach {count} nodes in {timeout:.0f} s; its logs end:\n{logs}")

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()  # `ray start --block` ends its node's processes
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            for pid in session_pids(proc.pid):  # whatever of that session is left
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)
