"""Where object-store URLs are cached on this machine, and the way back from a cache path to its URL.

A URL ``s3://<bucket>/<key>`` is worked on through its *cache path* ``<cache>/s3/<bucket>/<key>`` (``<cache>``:
``BLADE_CACHE_DIR``, default ``~/.cache/blade-curation``; :mod:`curation.io.storage` moves the bytes). Messages name
the URL the user gave, never the cache path: :func:`display` for one path, :func:`urls_in_text` for a message that
may hold several (the jobs' error lines, :func:`curation.io.outdir.report_job_errors`, and stop messages,
:class:`curation.io.stop.StopRequested`). Standard library only: the jobs import it before their config is parsed.
"""

from __future__ import annotations

import os

__all__ = ["cache_root", "url_of", "display", "urls_in_text"]


def cache_root() -> str:
    """Where URLs are cached: ``BLADE_CACHE_DIR``, default ``~/.cache/blade-curation`` (absolute)."""
    root = os.environ.get("BLADE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "blade-curation")
    return os.path.abspath(root)


def url_of(path: str) -> str | None:
    """The URL whose cache path ``path`` is (or is under); ``None`` for any other path."""
    root = os.path.join(cache_root(), "s3") + os.sep
    full = os.path.abspath(path)
    if not full.startswith(root):
        return None
    rel = full[len(root):].replace(os.sep, "/")
    return f"s3://{rel}" if "/" in rel or rel else None


def display(path: str) -> str:
    """A path as shown in messages: its URL for a cache path, else as given."""
    return url_of(path) or path


def urls_in_text(text: str) -> str:
    """``text`` with every cache path in it (``<cache>/s3/<bucket>/...``) written as its URL ``s3://<bucket>/...``."""
    root = os.path.join(cache_root(), "s3") + os.sep
    return text.replace(root, "s3://") if root in text else text
