"""The run inspector (``jobs/show_selection.py``): one self-contained HTML page of what a run selected.

* :mod:`~curation.inspector.run`: a run's output directory (train, the main job, batch curation, replay; local or
  ``s3://``): its records, selected shards and tokenizer.
* :mod:`~curation.inspector.scan`: the selected shards read step by step within a budget of tokens.
* :mod:`~curation.inspector.stats`: what is gathered per step (kept share per source, Δ threshold, Δ per episode,
  token counts, the token view's rows); :mod:`~curation.inspector.compare`: two runs on the same candidates.
* :mod:`~curation.inspector.svg`, :mod:`~curation.inspector.figures`, :mod:`~curation.inspector.tokens`,
  :mod:`~curation.inspector.page`: the charts, the token view and the page.
* :mod:`~curation.inspector.show`: :func:`show_selection`, the whole of it, with a progress bar and a one-line
  summary.

It imports no torch, Composer or Ray: a page of a run on a bucket can be made on a laptop with the shards.
"""
