"""Experiments on the product, not part of it: the quality benchmark (``bench.quality``, ``jobs/bench_quality.py``),
the chaos soak of the main job (``bench.soak``, ``jobs/soak.py``), and the benchmarks of docs/DESIGN.md §6 (``bench.selection``,
``bench.training``, ``bench.scoring``, ``bench.prepare``, ``bench.scaling``: the ``jobs/bench_*.py`` of the same name
parse their arguments and call ``run``).

A top floor beside ``jobs/``: it imports ``training``, ``curation`` and ``schemas``; nothing of theirs imports it
(``tests/test_import_rules.py``). It is not installed with the package: the jobs put their checkout on ``sys.path``.
"""
