"""A Ray cluster of two nodes on this machine that share only an object store, for the tests.

A head (``ray start --head``) and a second node (``ray start --address``), each in the foreground of its own session
(``--block``: ending that process ends the node's processes; never ``ray stop``, which ends every Ray instance of the
machine), every port a free one, each node's Ray session under a temporary directory of its own (as on two
machines: with one, a ``ray job submit --working-dir`` package unpacked by the second node's runtime-env agent
replaced the directory the job's driver on the head was running in). Each node's processes
(its raylet, every Ray worker it starts, and the drivers a test runs "on" it) have their own ``BLADE_CACHE_DIR`` and
working directory, a custom resource named after the node (``{"node_a": 100}``) plus the role resources the test
gives (``{"rank": 1, "scorer": 1}`` on each, so two of a role land on two nodes), and ``tests/node_guard`` on their
``PYTHONPATH``: a process of one node that opens, lists or writes the other node's directories (or the test's own)
fails with ``PermissionError`` and the event is logged in its node's ``guard.log``. The object store
(``tests/s3server.py``, its endpoint and credentials in every node's environment) is all they share.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from bench.sessions import command, free_ports, session_pids
from tests import timing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARD = os.path.join(REPO, "tests", "node_guard")


class Node:
    """One node: its directories, its environment, its ``ray start --block`` process."""

    def __init__(self, cluster: TwoNodes, name: str, resources: Mapping[str, float], cpus: int) -> None:
        self.cluster, self.name, self.resources, self.cpus = cluster, name, dict(resources), cpus
        self.root = os.path.join(cluster.root, name)
        self.cache, self.work = os.path.join(self.root, "cache"), os.path.join(self.root, "work")
        self.guard_log = os.path.join(cluster.root, f"guard-{name}.log")  # (outside every node's directories)
        self.proc: subprocess.Popen | None = None

    def env(self, **more: str) -> dict[str, str]:
        """The environment of this node's processes (a driver the test runs on this node takes it too)."""
        others = [n.root for n in self.cluster.nodes.values() if n is not self] + self.cluster.private
        return {**self.cluster.base_env, "BLADE_CACHE_DIR": self.cache, "BLADE_NODE_GUARD": os.pathsep.join(others),
                "BLADE_NODE_GUARD_LOG": self.guard_log, "PYTHONPATH": os.pathsep.join([GUARD, REPO]),
                "RAY_worker_niceness": "0", **more}

    def start(self, head: bool) -> None:
        os.makedirs(self.cache, exist_ok=True)
        os.makedirs(self.work, exist_ok=True)
        c = self.cluster
        ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"]
        # every port of this start in one pick (distinct), new at each start; the head's include the cluster's
        picked = free_ports(len(ports) + (3 if head else 0))
        cmd = ["ray", "start", "--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
               "--num-cpus", str(self.cpus), "--object-store-memory", str(200 << 20),
               "--resources", json.dumps({self.name: 100, **self.resources}),
               "--temp-dir", os.path.join(c.root, f"ray-{self.name}"),
               *[a for p, port in zip(ports, picked[:len(ports)], strict=True) for a in (p, str(port))]]
        if head:
            c.port, c.dashboard_port, client = picked[len(ports):]
            cmd += ["--head", "--port", str(c.port),
                    "--ray-client-server-port", str(client), "--include-dashboard", "true",
                    "--dashboard-host", "127.0.0.1", "--dashboard-port", str(c.dashboard_port)]
        else:
            cmd += ["--address", c.address]
        log = open(c._log_path(self.name), "ab")  # noqa: SIM115 - handed to the process
        # (no drain on SIGTERM: after a Ray Train job it waited out its 30 s on the head at every stop; the head's GCS
        # checks each raylet every second, not every 3: a lost node is declared dead after 5 failed checks in a row,
        # ≈ 5 s, not 15, which the tests that kill node B waited through)
        env = self.env(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
                       **({"RAY_health_check_period_ms": "1000"} if head else {}))
        self.proc = subprocess.Popen(cmd, cwd=self.work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()

    def raylet_pid(self) -> int | None:
        for pid in session_pids(self.proc.pid) if self.proc else []:
            cmd = command(pid)
            if cmd and os.path.basename(cmd[0]) == "raylet":
                return pid
        return None

    def kill_raylet(self) -> None:
        """SIGKILL this node's raylet, then at once every other process of its session (the node is lost, as a
        machine that loses power: its Ray workers stop where they are, not when they notice the raylet is gone)."""
        pid = self.raylet_pid()
        assert pid is not None, f"{self.name} has no raylet"
        os.kill(pid, signal.SIGKILL)
        for other in session_pids(self.proc.pid):
            try:
                os.kill(other, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # `ray start --block` ends its node's processes
            try:
                timing.wait(self.proc, timeout=10)  # (then at once: whatever it did not end by then)
            except subprocess.TimeoutExpired:
                pass
        for pid in session_pids(self.proc.pid):  # whatever of that session is left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None


class TwoNodes:
    """Two Ray nodes, ``node_a`` (the head) and ``node_b`` (module docstring).

    Args:
        env: what every node's environment adds to this process's (the object store's endpoint and credentials).
        resources: custom resources of each node besides its own name's.
        cpus: CPUs each node declares.
    """

    def __init__(self, env: Mapping[str, str], resources: Mapping[str, float], cpus: int = 2) -> None:
        # A short root: Ray's socket paths under its session directory must stay under 107 bytes.
        self.root = tempfile.mkdtemp(prefix="blade-2n-", dir="/tmp")
        self.private = [os.path.join(self.root, "test")]  # the test process's own files: no node reads them
        os.makedirs(self.private[0])
        self.port = self.dashboard_port = 0  # (picked at each start of the head: Node.start)
        self.base_env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "BLADE_CACHE_DIR")},
                         **env, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.nodes = {name: Node(self, name, resources, cpus) for name in ("node_a", "node_b")}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout: float = 300.0) -> None:  # (nominal seconds, load-scaled: tests.timing)
        self._start_node("node_a", 1, timeout)
        self._start_node("node_b", 2, timeout)

    def restart(self, name: str, timeout: float = 300.0, *, wipe: bool = True) -> None:
        """Start node ``name`` again (a new machine: with ``wipe``, its cache directory empty)."""
        if wipe:
            shutil.rmtree(self.nodes[name].cache, ignore_errors=True)
        self._start_node(name, 2, timeout)

    def _start_node(self, name: str, count: int, timeout: float, attempts: int = 3) -> None:
        """Start a node until the cluster counts ``count`` nodes. ``ray start`` gives a raylet 30 s to register
        (Ray's own constant): on a loaded machine it may give up; it is then started again (new ports)."""
        node, head = self.nodes[name], name == "node_a"
        for _ in range(attempts):
            offset = len(self.log(name)) if os.path.exists(self._log_path(name)) else 0
            node.start(head=head)
            if self._wait(count, timeout, node, offset):
                return
            node.stop()
        raise AssertionError(f"{name} did not start in {attempts} attempts; its log: {self.log(name)[-3000:]}")

    def _alive(self) -> int:
        """Alive nodes as the GCS counts them (asked from a process of its own: this one stays out of Ray)."""
        code = (f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
                "print(sum(n['Alive'] for n in ray.nodes()))")
        try:
            done = timing.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env=self.nodes["node_a"].env(), cwd=self.nodes["node_a"].work)
        except subprocess.TimeoutExpired:  # (the head's GCS is not up yet: ray.init waits for it)
            return 0
        return int(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else 0

    def _wait(self, count: int, timeout: float, node: Node, offset: int) -> bool:
        """Whether the cluster counts ``count`` alive nodes before ``timeout`` nominal seconds, load-scaled
        (:mod:`tests.timing`; False: ``node``'s start gave up). The GCS is asked once ``ray start`` has printed, after
        ``offset`` characters of its log, that its node is up (it does once the GCS has the node registered), not
        polled before: an ask is a Ray driver's start, seconds of CPU each."""
        deadline = timing.Deadline(timeout)
        while node.proc is not None and node.proc.poll() is None:
            if "Ray runtime started." in self.log(node.name)[offset:] and self._alive() == count:
                return True
            assert not deadline.expired(), f"the cluster did not reach {count} nodes in {deadline}"
            time.sleep(1)
        return False

    def _log_path(self, name: str) -> str:
        return os.path.join(self.root, f"{name}.log")

    def log(self, name: str) -> str:
        with open(self._log_path(name), errors="replace") as f:
            return f.read()

    def worker_tracebacks(self, since: float = 0.0) -> str:
        """The Python tracebacks in the Ray worker logs of both nodes written after ``since`` (``time.time()``), each
        with its file's name: what a failed job's message truncates (for an assertion's message)."""
        out = []
        for path in sorted(glob.glob(os.path.join(self.root, "ray-node_*", "session_*", "logs", "worker-*.err"))):
            if os.path.getmtime(path) < since:
                continue
            with open(path, errors="replace") as f:
                text = f.read()
            if "Traceback" in text:
                out.append(f"--- {path}\n{text[text.index('Traceback'):][-4000:]}")
        return "\n".join(out)

    def guard_events(self) -> list[str]:
        """Every access a node's process made to another node's directories (should be none)."""
        out = []
        for node in self.nodes.values():
            if os.path.exists(node.guard_log):
                with open(node.guard_log, encoding="utf-8") as f:
                    out += [f"{node.name}: {line.rstrip()}" for line in f]
        return out

    def run(self, node: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run ``python *args`` as a driver on ``node`` (its environment and working directory); ``timeout``: nominal
        seconds, load-scaled (:mod:`tests.timing`)."""
        return timing.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                              env=self.nodes[node].env(), cwd=self.nodes[node].work)

    def stop(self) -> None:
        nodes = [self.nodes[name] for name in ("node_b", "node_a")]
        for node in nodes:  # both asked at once: each node's processes end in parallel
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)
