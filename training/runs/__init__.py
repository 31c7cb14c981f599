"""The ways to run a trainer: :mod:`~training.runs.wiring` (one trainer process of a config, for any rank),
:mod:`~training.runs.rank` (the one body every trainer process runs: ``run_rank`` → ``RankResult``),
:mod:`~training.runs.launch` (the one launcher: in this process, or the data-parallel Ray Train worker group of
:mod:`~training.runs.group`), :mod:`~training.runs.finish` (the one writer of ``final/`` and ``summary.json``),
:mod:`~training.runs.engine_feed` (the trainer fed by the Ray engine), and the jobs as library functions:
:mod:`~training.runs.train_job` (``jobs/train.py``, ``jobs/replay.py``), :mod:`~training.runs.engine_job`
(``jobs/curate_and_train.py``)."""
