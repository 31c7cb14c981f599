"""Fingerprints of a work unit's input (issue 32): a changed input is refused, or its units redone, never mixed.

A unit record keeps, per span, ``[size, mtime_ns, hash]`` of its file when the unit started
(:meth:`curation.ingest.units.WorkUnit.fingerprints`); a rerun compares them
(:meth:`~curation.ingest.units.WorkUnit.changed_input`): the same size and mtime is taken as unchanged, else the
bytes the unit reads are hashed again (xxh3-128), so a touch or a copy keeps a unit, a same-length edit does not.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import xxhash

from curation.ingest.corpus import FileSpan
from curation.ingest.jsonstream import skip_line

__all__ = ["span_fingerprint", "stat_input"]


def stat_input(path: str) -> tuple[int, int]:
    """Size and newest mtime (ns) of an input file or input directory (an MDS dataset)."""
    if os.path.isdir(path):
        stats = [os.stat(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names]
        return sum(st.st_size for st in stats), max((st.st_mtime_ns for st in stats), default=0)
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


_whole_hashes: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) → hash: a file shared by units, once


def span_fingerprint(span: FileSpan, fmt: str | None) -> list:
    """``[size, mtime_ns, hash]`` of a span's input (:func:`_span_fingerprint`); a read error names the input."""
    try:
        return _span_fingerprint(span, fmt)
    except OSError as e:
        e.filename = e.filename or span.path
        raise


def _span_fingerprint(span: FileSpan, fmt: str | None) -> list:
    """``[size, mtime_ns, hash]`` of a span's input: the xxh3-128 of the bytes the unit reads for a ``.jsonl`` byte
    span (from the byte before ``start``, which decides where its first line starts, to the end of the line that
    holds byte ``stop - 1``), else of the whole file (an MDS directory: its files' names, sizes and index)."""
    size, mtime = stat_input(span.path)
    if fmt == "jsonl" and not span.whole:
        with open(span.path, "rb") as f:
            lo = max(span.start - 1, 0)
            if span.stop is None:
                hi = size
            else:
                f.seek(span.stop - 1)
                skip_line(f)
                hi = f.tell()
            return [size, mtime, _hash_range(f, lo, hi)]
    key = (os.path.abspath(span.path), size, mtime)
    if key not in _whole_hashes:
        if os.path.isdir(span.path):
            h = xxhash.xxh3_128()
            for d, _, names in sorted(os.walk(span.path)):
                for name in sorted(names):
                    path = os.path.join(d, name)
                    h.update(f"{os.path.relpath(path, span.path)}\0{os.path.getsize(path)}\n".encode())
                    if name == "index.json":
                        with open(path, "rb") as f:
                            h.update(f.read())
            _whole_hashes[key] = h.hexdigest()
        else:
            with open(span.path, "rb") as f:
                _whole_hashes[key] = _hash_range(f, 0, size)
    return [size, mtime, _whole_hashes[key]]


def _hash_range(f: BinaryIO, lo: int, hi: int) -> str:
    h = xxhash.xxh3_128()
    f.seek(lo)
    left = hi - lo
    while left > 0:
        chunk = f.read(min(left, 1 << 22))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()
