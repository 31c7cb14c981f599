"""The local Ray instance a job starts (``ray_session``): its workers at the driver's priority, and no idle workers
started before the job's own (they could never run its actors or tasks: those carry the job's runtime env)."""

from __future__ import annotations

import os

import pytest

from bench.sessions import command
from curation.engine.ray_backend.session import ray_session
from tests import processes

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _children(pid: int) -> list[tuple[int, str]]:
    return [(child, " ".join(command(child))) for child, (ppid, _, _) in processes.table().items() if ppid == pid]


def test_a_local_instance_starts_no_idle_workers_and_runs_its_actors_at_the_drivers_priority(own_ray):
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self) -> tuple[int, int, str]:
            return os.getppid(), os.nice(0), os.environ.get("PYTHONPATH", "")

    with ray_session("local", num_cpus=4) as started:
        assert started
        probes = [Probe.remote() for _ in range(2)]
        answers = ray.get([p.where.remote() for p in probes])
        raylet = answers[0][0]
        assert {a[0] for a in answers} == {raylet}
        assert [a[1] for a in answers] == [os.nice(0)] * 2  # (Ray's default lowers its workers by 15)
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert all(repo in a[2].split(os.pathsep) for a in answers)  # they import this checkout
        workers = [cmd for _, cmd in _children(raylet) if cmd.startswith("ray::")]
        # the raylet's children: its two agents and the two actors; Ray's default would add one idle worker per CPU
        assert sorted(w for w in workers if not w.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))) == \
            ["ray::Probe", "ray::Probe"], workers
    assert not ray.is_initialized()
