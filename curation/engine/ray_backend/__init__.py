"""The engine and the trainer group on Ray: the only package of the project that imports ray (plumbing only).

* :mod:`~curation.engine.ray_backend.actors`: the Ray session, the coordinator / scoring-worker / refresh
  actors around the Ray-free engine (:mod:`curation.engine.state` makes every decision), :class:`RayEngine` and
  :class:`EngineClient` (the engine's handles: :class:`curation.engine.handle.EngineHandle`).
* :mod:`~curation.engine.ray_backend.train_group`: the data-parallel trainer as a Ray Train worker group.
"""

from curation.engine.ray_backend.actors import RayEngine, ray_session
from curation.engine.ray_backend.client import EngineClient
from curation.engine.ray_backend.train_group import run_trainer_group

__all__ = ["RayEngine", "ray_session", "EngineClient", "run_trainer_group"]
