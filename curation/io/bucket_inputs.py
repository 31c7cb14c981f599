"""Corpus inputs in an object store, for ``prepare`` on nodes that share no filesystem.

A source's ``paths`` may name objects (``s3://bucket/raw/*.jsonl``, an MDS dataset's prefix). As for every other
URL of a config (:mod:`curation.io.outputs`), the code below the job works on their cache paths; here:

* :func:`resolve` expands a pattern that is a cache path against the bucket's listing (``*``, ``?`` and ``[...]``
  within one path component, ``**`` across them), giving the cache paths of the matching objects (nothing is
  downloaded);
* :func:`fetch_input` makes one input present in this process's cache, as the bucket has it now (downloaded when
  missing or changed; an MDS dataset's prefix: each of its objects). A copy gets the modification time of the file
  it was uploaded from (or the object's Last-Modified), so the fingerprint a work unit records of its input
  (size, mtime, hash) is the same on every node;
* :func:`stage` uploads a local input to the bucket (``stage_inputs``: the inputs of a driver whose filesystem the
  other nodes do not share), with its modification time, and keeps a copy in the local cache.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable

from curation.io import objects, storage

__all__ = ["resolve", "fetch_input", "fetch_inputs", "stage", "staged_url"]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A glob over ``/``-separated keys: ``**/`` any folders (or none), ``**`` anything, ``*`` and ``?`` within one
    component, ``[...]`` a character class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + re.escape(body[1:]) if body[:1] == "!" else re.escape(body)) + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def resolve(pattern: str, *, datasets: bool = False) -> list[str] | None:
    """The cache paths of the objects a cache-path ``pattern`` names (a glob, or one object), sorted; ``datasets``:
    of the MDS datasets it names instead (prefixes holding an ``index.json``; the pattern may also name the
    ``index.json`` itself). ``None`` when ``pattern`` is not a cache path."""
    url = storage.url_of(pattern)
    if url is None:
        return None
    magic = re.search(r"[*?\[]", url)
    if magic is None:
        if datasets:
            url = url.removesuffix("/index.json")
            return [storage.local_path(url)] if objects.head_object(f"{url}/index.json") is not None else []
        return [pattern] if objects.head_object(url) is not None else []
    base = url[:magic.start()].rpartition("/")[0]  # the folder above the first wildcard
    regex = _pattern_regex(url[len(base) + 1:])
    found = set()
    for rel in objects.list_objects(base):
        if not datasets:
            found.update([f"{base}/{rel}"] if regex.fullmatch(rel) else [])
        elif rel == "index.json" or rel.endswith("/index.json"):  # an MDS dataset's prefix, or its index named
            folder = rel.rpartition("/")[0]
            if regex.fullmatch(folder) or regex.fullmatch(rel):
                found.add(f"{base}/{folder}".rstrip("/"))
    return sorted(storage.local_path(u) for u in found)


def fetch_input(path: str) -> bool:
    """Make the input ``path`` present in this process's cache as the bucket has it now (see the module docstring);
    a local path is left alone. Returns whether it exists afterwards."""
    url = storage.url_of(path)
    if url is None:
        return os.path.exists(path)
    head = objects.head_object(url)
    if head is not None:
        _fetch(url, path, head)
        return True
    under = objects.list_objects(url)  # an MDS dataset's prefix
    for rel in sorted(under):
        _fetch(f"{url}/{rel}", os.path.join(path, *rel.split("/")), None)
    return bool(under)


def fetch_inputs(paths: Iterable[str]) -> None:
    """:func:`fetch_input` each of ``paths`` (once each)."""
    for path in dict.fromkeys(paths):
        fetch_input(path)


def _fetch(url: str, path: str, head: objects.ObjectInfo | None) -> None:
    head = head or objects.head_object(url)
    if head is None:
        return
    if not (os.path.isfile(path) and os.path.getsize(path) == head.size and objects.file_etag(path) == head.etag):
        objects.download(url, path, mtime=True)
    elif head.mtime_ns is not None and os.stat(path).st_mtime_ns != head.mtime_ns:
        os.utime(path, ns=(head.mtime_ns, head.mtime_ns))  # (the same bytes, staged again from a touched file)


def staged_url(stage_dir: str, path: str) -> str:
    """The URL a local input ``path`` is staged at under ``stage_dir`` (a cache path): its path below it (an absolute
    path, or one leading up with ``..``, as its absolute path without the leading ``/``)."""
    rel = os.path.normpath(path)
    if os.path.isabs(rel) or rel.split(os.sep)[0] == "..":
        rel = os.path.abspath(rel).lstrip(os.sep)
    url = storage.url_of(stage_dir)
    assert url is not None, f"{stage_dir} is not a cache path"
    return f"{url}/{rel.replace(os.sep, '/')}"


def stage(path: str, stage_dir: str) -> str:
    """Upload the local input ``path`` (a file, or a directory's files: an MDS dataset) under ``stage_dir`` (a cache
    path) unless the bucket holds the same bytes, and keep a copy in this machine's cache; returns the copy's cache
    path (what the units read and their records name, as its URL)."""
    url = staged_url(stage_dir, path)
    files = ([(path, url)] if not os.path.isdir(path) else
             [(os.path.join(d, n), f"{url}/{os.path.relpath(os.path.join(d, n), path).replace(os.sep, '/')}")
              for d, _, names in sorted(os.walk(path)) for n in sorted(names)])
    for file, target in files:
        head = objects.head_object(target)
        if head is None or head.size != os.path.getsize(file) or head.etag != objects.file_etag(file):
            objects.upload(file, target, mtime=True)
            head = objects.head_object(target)
        copy = storage.local_path(target)
        if not (os.path.isfile(copy) and objects.file_etag(copy) == head.etag):
            os.makedirs(os.path.dirname(copy), exist_ok=True)
            tmp = f"{copy}.tmp-stage"
            shutil.copyfile(file, tmp)
            os.replace(tmp, copy)
        if head.mtime_ns is not None:
            os.utime(copy, ns=(head.mtime_ns, head.mtime_ns))
    return storage.local_path(url)
