"""The engine and the trainer group on Ray: the only package of the project that imports ray (plumbing only).

* :mod:`~curation.engine.ray_backend.session`: :func:`ray_session`, the Ray session (alone: no torch).
* :mod:`~curation.engine.ray_backend.actors`: the coordinator / scoring-worker / refresh actors around the Ray-free
  engine (:mod:`curation.engine.state` makes every decision), :class:`RayEngine` and :class:`EngineClient` (the
  engine's handles: :class:`curation.engine.handle.EngineHandle`).
* :mod:`~curation.engine.ray_backend.train_group`: the data-parallel trainer as a Ray Train worker group.
* :mod:`~curation.engine.ray_backend.reach`: :func:`check_shared`, a local path every node of a cluster must reach.

The names below are imported when first used (PEP 562): ``prepare``'s Ray pool imports a submodule of this package,
which runs this file, and must not import torch and Ray Train with the actors (~hundreds of MB in its process).
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from curation.engine.ray_backend.actors import RayEngine
    from curation.engine.ray_backend.client import EngineClient
    from curation.engine.ray_backend.reach import check_shared
    from curation.engine.ray_backend.session import ray_session
    from curation.engine.ray_backend.train_group import GroupChannel, run_trainer_group

__all__ = ["RayEngine", "ray_session", "EngineClient", "run_trainer_group", "GroupChannel", "check_shared"]

_HOMES = {"RayEngine": "actors", "ray_session": "session", "EngineClient": "client", "run_trainer_group": "train_group",
          "GroupChannel": "train_group",
          "check_shared": "reach"}


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
