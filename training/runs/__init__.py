"""The ways to run a trainer: :mod:`~training.runs.wiring` (one trainer process of a config, and how every run
finishes), :mod:`~training.runs.single` (``jobs/train.py`` and ``jobs/replay.py`` in one process),
:mod:`~training.runs.group` (the data-parallel Ray Train worker group), :mod:`~training.runs.engine_feed` (the
trainer fed by the Ray engine) and :mod:`~training.runs.engine_job` (``jobs/curate_and_train.py``)."""
