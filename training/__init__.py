"""training package."""

from curation.io.deferred_imports import install as _defer_imports

_defer_imports()  # before Composer or transformers is imported (curation/io/deferred_imports.py)
