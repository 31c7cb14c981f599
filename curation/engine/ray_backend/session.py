"""The Ray session helper alone: importing it does not import torch, Ray Train or the engine's actors.

``jobs/prepare.py``'s Ray pool (:mod:`curation.engine.ray_backend.prepare_pool`) needs only a Ray session; through
:mod:`~curation.engine.ray_backend.actors` it imported the scoring workers, torch and Ray Train as well (hundreds of
MB resident in the job process, for nothing). ``actors`` re-exports :func:`ray_session` from here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import ray

__all__ = ["ray_session", "start_local", "started_without_dashboard"]

#: the raylet's setting of its workers' niceness (Ray's default: 15)
WORKER_NICENESS = "RAY_worker_niceness"
#: A local instance starts no idle workers for the first driver (Ray's default starts one per CPU): the engine's
#: actors and the pool's tasks run in this job's runtime env (``PYTHONPATH``), so Ray never hands them a worker
#: started before it, and each of those idle ones cost a second of CPU at every job start (2 to 4 per instance).
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
#: the logger of Ray's notice that a new local instance uses token authentication (Ray 2.60)
AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
#: the GCS addresses of the local instances this process started without a dashboard (so without Ray's state API)
_WITHOUT_DASHBOARD: set[str] = set()


@contextlib.contextmanager
def ray_session(address: str | None = None, *, num_cpus: int | None = None, include_dashboard: bool = False,
                need_cpus: int = 1) -> Iterator[bool]:
    """Ray for the ``with`` block: yields whether a new local instance was started, and shuts that one down.

    ``address=None`` joins the cluster a ``ray job submit`` runs in (``RAY_ADDRESS``; the job's
    ``--working-dir`` carries the code) and otherwise starts a local instance with
    ``max(os.cpu_count(), need_cpus)`` CPUs (or ``num_cpus``) whose workers import this checkout;
    ``"local"`` always starts one; anything else is a cluster address (its nodes need the packages).
    Already connected (e.g. tests): nothing is started or shut down.

    A new local instance is secured with Ray's token authentication, Ray's own default since 2.60 (a token in
    ``~/.ray/auth_token``, made on first use; ``RAY_AUTH_MODE=disabled`` turns it off); the notice Ray prints about
    that choice at the start of every run is left out (README, "Set-up", explains it once).

    A local instance runs its workers at the driver's priority (``RAY_worker_niceness=0``, unless set): Ray's
    default lowers them by 15, so a scoring worker's host side (reading, staging, writing a part) lost the CPU to
    any busy process on the node and scored at half speed on a loaded one (a CPU run beside another job: 1.0 s per
    unit against 0.54 s in-process, the same CPU time). A cluster's nodes take it from their own start
    (``RAY_worker_niceness=0 ray start ...``); the workers report theirs (``niceness`` in their stats).
    It starts no idle workers ahead of the job (:data:`LOCAL_SYSTEM_CONFIG`).
    """
    started = _connect(address, num_cpus=num_cpus, include_dashboard=include_dashboard, need_cpus=need_cpus)
    try:
        yield started
    finally:
        if started:
            ray.shutdown()


def _connect(address: str | None, *, num_cpus: int | None, include_dashboard: bool, need_cpus: int) -> bool:
    if ray.is_initialized():
        return False
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = "auto"
    if address in (None, "local"):
        start_local(num_cpus or max(os.cpu_count() or 1, need_cpus), include_dashboard=include_dashboard)
        return True
    ray.init(address=address, log_to_driver=True, configure_logging=False)
    return False


def start_local(num_cpus: int, *, include_dashboard: bool = False, log_to_driver: bool = True) -> None:
    """``ray.init`` of a new local instance as :func:`ray_session` starts one (tests start theirs with it too): its
    workers import this checkout (``PYTHONPATH``) at the driver's priority, no idle workers started ahead, Ray's
    token-authentication notice left out."""
    # The actors import this checkout's packages, whatever else is installed (like the jobs do).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ours = WORKER_NICENESS not in os.environ
    os.environ.setdefault(WORKER_NICENESS, "0")  # read by the raylet ray.init starts
    notice = logging.getLogger(AUTH_NOTICE_LOGGER)
    level = notice.level
    notice.setLevel(logging.ERROR)  # its warning "Token authentication is enabled for this Ray cluster ..."
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=include_dashboard, log_to_driver=log_to_driver,
                 configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
                 _system_config=LOCAL_SYSTEM_CONFIG)
    finally:
        notice.setLevel(level)
        if ours:
            os.environ.pop(WORKER_NICENESS, None)
    if not include_dashboard:
        _WITHOUT_DASHBOARD.add(ray.get_runtime_context().gcs_address)


def started_without_dashboard() -> bool:
    """Whether this process runs on a local instance it started (:func:`start_local`) without a dashboard: one
    without Ray's state API, which ends with this process."""
    return ray.is_initialized() and ray.get_runtime_context().gcs_address in _WITHOUT_DASHBOARD
