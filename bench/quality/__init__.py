"""The quality benchmark of ``jobs/bench_quality.py``: its settings (``setting``), runs (``runs``) and report
(``report``)."""
