"""BLADE curation: one sub-package per concern (docs/DESIGN.md §4).

* :mod:`curation.ingest`: corpus files → packed candidate / validation shards.
* :mod:`curation.core`: the algorithm, pure torch (no ray, no composer, no file formats).
* :mod:`curation.io`: MDS shards and model weights on disk.
* :mod:`curation.engine`: who scores which steps with which weights, where and when;
  :mod:`curation.engine.ray_backend` is the only package that imports ray.
* :mod:`curation.evaluation`: held-out losses, compute accounting, lm-evaluation-harness.
* :mod:`curation.inspector`: the run inspector's page (``jobs/show_selection.py``).
"""

from curation.io.deferred_imports import install as _defer_imports

_defer_imports()  # scikit-learn and SciPy imported by transformers only if called (curation/io/deferred_imports.py)
