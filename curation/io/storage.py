"""Object storage (S3 API) behind local paths: every shard or output directory may be ``s3://bucket/prefix``.

The rest of the project reads and writes local files only. A URL is worked on through its *cache path*,
``<cache>/s3/<bucket>/<prefix>`` (``<cache>``: ``BLADE_CACHE_DIR``, default ``~/.cache/blade-curation``), and
this module moves bytes between the two at the boundaries:

* :func:`local_path` maps a URL to its cache path (a local path is returned as it is), :func:`url_of` maps
  a path under the cache back to its URL, so a job resolves its config once (:func:`localize`) and every
  function below it keeps taking paths; for a path outside the cache every function here is a no-op.
* Reading: :func:`fetch` downloads one object into the cache when it is not there (shards, lazily, as they
  are read: :class:`curation.io.shards.ShardReader` checks their ``xxh64`` hashes as for local files);
  :func:`refresh` downloads it again when the bucket's copy changed (an index, a manifest).
* Writing: :func:`publish` uploads a finished file or directory (a part: its shard files before its
  ``index.json``), :func:`unpublish` deletes one; :func:`pull` makes a cache directory equal to the bucket
  (what a job does when it opens its output directory), :func:`push` uploads what changed under a cache
  directory (objects whose ETag is not the local file's MD5).

The objects themselves (client, credentials from the environment only, errors) are :mod:`curation.io.objects`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence

from curation.io.cache import cache_root, display, url_of
from curation.io.objects import (
    delete_many,
    delete_object,
    download,
    file_etag,
    head_object,
    is_url,
    list_objects,
    read_object,
    split_url,
    upload,
    uploads,
    write_object,
)
from curation.io.outdir import LOCK_NAME
from curation.io.paths import UnsafeNameError, check_relative, inside, safe_key

__all__ = [
    "cache_root", "local_path", "url_of", "canonical", "display", "fetch", "refresh", "publish", "unpublish",
    "remove", "pull", "push", "push_all", "SYMLINKS", "tokenizer_json_path",
]

#: A synced directory's symbolic links (Composer's ``latest-rank0.pt``) are kept in this object: S3 has none.
SYMLINKS = ".symlinks.json"
_LOCAL_ONLY = {LOCK_NAME}  # the run's lock: never uploaded, downloaded or deleted
_TEMPORARY = (".tmp-", ".dl-")  # a file being written (atomic_write_text, download): renamed into place when done


def _local_only(rel: str) -> bool:
    """Whether ``rel`` (an object key or a path under a synced directory, ``/``-separated) is local to this machine:
    any component is the lock file or a temporary file (``.tmp-*``, ``.dl-*``), or lies in a ``*.tmp`` folder (a
    part being written). A sync never uploads, downloads nor deletes one: downloading the bucket's lock object over
    the local ``.lock`` would replace the inode a process holds its ``flock`` on (another process could then take
    the lock), and a temporary is renamed, or removed, by the process writing it."""
    parts = rel.split("/")
    return (any(p in _LOCAL_ONLY or p.startswith(_TEMPORARY) for p in parts)
            or any(p.endswith(".tmp") for p in parts[:-1]))


_USABLE_CACHES: set[str] = set()  # cache roots checked to hold directories (once per process)


def _usable_cache_root() -> str:
    """:func:`cache_root`, checked (once) to be a directory this process can create folders in.

    Raises:
        ValueError: one line naming ``BLADE_CACHE_DIR`` (or the default) and what is wrong with it.
    """
    root = cache_root()
    if root not in _USABLE_CACHES:
        try:
            os.makedirs(os.path.join(root, "s3"), exist_ok=True)
            if not os.access(os.path.join(root, "s3"), os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            setting = (f"BLADE_CACHE_DIR={os.environ['BLADE_CACHE_DIR']}" if os.environ.get("BLADE_CACHE_DIR")
                       else f"the default cache {root} (BLADE_CACHE_DIR unset)")
            raise ValueError(f"{setting} cannot hold the object-store cache ({e.strerror or e}: {e.filename or root}); "
                             "set BLADE_CACHE_DIR to a directory this user can write") from None
        _USABLE_CACHES.add(root)
    return root


def local_path(path: str) -> str:
    """The cache path of a URL (``<cache>/s3/<bucket>/<key>``); any other path is returned as it is.

    Raises:
        ValueError: '.' or '..' in the URL, or the cache cannot hold directories (naming ``BLADE_CACHE_DIR``).
    """
    if not is_url(path):
        return path
    bucket, key = split_url(path)
    parts = [p for p in key.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"{path}: '.' and '..' are not allowed in an object-store path")
    return os.path.join(_usable_cache_root(), "s3", bucket, *parts)


def canonical(path: str) -> str:
    """A path as recorded in run keys: its URL for a cache path, else the absolute path."""
    return url_of(path) or os.path.abspath(path)


# ------------------------------------------------------------------------------------------------
# cache paths ↔ objects
# ------------------------------------------------------------------------------------------------
def fetch(path: str) -> bool:
    """Make the file ``path`` present: for a cache path not there yet, download its object. Returns whether
    the file exists afterwards (``False``: no such object either)."""
    if os.path.exists(path):
        return True
    url = url_of(path)
    if url is None:
        return False
    try:
        download(url, path)
    except FileNotFoundError:
        return False
    return True


def refresh(path: str) -> bool:
    """For a cache path: download the object again when the bucket's copy differs from the cached one (or
    the cache has none). Returns whether the file exists afterwards; a local path: whether it exists."""
    url = url_of(path)
    if url is None:
        return os.path.exists(path)
    head = head_object(url)
    if head is None:
        if os.path.exists(path):
            os.unlink(path)
        return False
    if not os.path.exists(path) or head.etag != file_etag(path):
        download(url, path)
    return True


def _order(rel: str) -> int:
    """Upload order inside one publish: data first, then part indexes, then the records naming them."""
    name = rel.rsplit("/", 1)[-1]
    if name in ("manifest.json", "config.yaml", "engine_config.yaml"):
        return 3
    if name == "index.json":
        return 2 if "/" not in rel else 1
    return 0


def _walk(root: str) -> tuple[dict[str, str], dict[str, str]]:
    """Files (rel → path) and symbolic links (rel → target) under ``root``; the lock and temporary files left out
    (:func:`_local_only`)."""
    files, links = {}, {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = os.path.relpath(dirpath, root).replace(os.sep, "/")
        here = "" if here == "." else f"{here}/"
        dirnames[:] = [d for d in dirnames if not _local_only(f"{here}{d}/")]
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            path = os.path.join(dirpath, name)
            rel = f"{here}{name}"
            if name == SYMLINKS or _local_only(rel):
                continue
            if os.path.islink(path):
                links[rel] = os.readlink(path)
            elif os.path.isfile(path):
                files[rel] = path
    return files, links


def publish(path: str) -> None:
    """Upload the finished file or directory ``path`` when it is a cache path (else nothing): a directory's
    files in the order data, part ``index.json``, root ``index.json``, manifest, so a reader of the bucket
    never sees an index naming a missing file."""
    url = url_of(path)
    if url is None:
        return
    if os.path.isdir(path):
        files, _ = _walk(path)
        for rel in sorted(files, key=lambda r: (_order(r), r)):
            upload(files[rel], f"{url}/{rel}")
    else:
        upload(path, url)


def unpublish(path: str) -> None:
    """Delete the objects of the file or directory ``path`` when it is a cache path (else nothing)."""
    url = url_of(path)
    if url is None:
        return
    under = list_objects(url)
    if under:
        delete_many(url, under)
    else:
        delete_object(url)


def remove(path: str) -> None:
    """Delete the file or directory ``path`` and, for a cache path, its objects (a ``.tmp`` leftover was never
    uploaded)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    if not path.rstrip("/").endswith(".tmp"):
        unpublish(path)


def pull(root: str) -> list[str]:
    """Make the cache directory ``root`` equal to its bucket prefix: download objects the cache lacks or holds
    differently (ETag ≠ MD5 of the cached file), delete cached files the bucket does not have (the local lock
    file and temporary files excepted), restore symbolic links. The bucket's lock object and temporary objects
    (:func:`_local_only`) are never downloaded, nor a link made in their place. Returns the files downloaded
    (relative)."""
    url = url_of(root)
    if url is None:
        return []
    remote = {rel: info for rel, info in list_objects(url).items() if not _local_only(rel)}
    files, links = _walk(root) if os.path.isdir(root) else ({}, {})
    for rel, path in {**files, **{r: os.path.join(root, r) for r in links}}.items():
        if rel not in remote:
            os.unlink(path)
    for rel in remote:  # keys are untrusted (anyone who can write the bucket): none may lead out of the cache
        safe_key(root, rel, what="object key", source_file=f"{url}/")
    got = []
    for rel, info in sorted(remote.items()):
        if rel.rsplit("/", 1)[-1] == SYMLINKS:
            continue
        path = safe_key(root, rel, what="object key", source_file=f"{url}/")
        if rel in links or not (os.path.isfile(path) and os.path.getsize(path) == info.size
                                and file_etag(path) == info.etag):
            if os.path.islink(path):
                os.unlink(path)
            download(f"{url}/{rel}", path)
            got.append(rel)
    for rel in sorted(r for r in remote if r.rsplit("/", 1)[-1] == SYMLINKS):
        stored = read_object(f"{url}/{rel}")
        base = os.path.join(root, *rel.split("/")[:-1])
        for name, target in _link_table(f"{url}/{rel}", stored.body if stored else b"{}").items():
            link = safe_key(base, name, what="link name", source_file=f"{url}/{rel}")
            if _local_only(f"{rel.rpartition('/')[0]}/{name}".lstrip("/")):
                continue  # (push never records one: the lock or a temporary file is not replaced by a link)
            # The target: a relative path of plain names from the link's folder (Composer's latest-rank0.pt →
            # ep0-ba8-rank0.pt), never absolute or up through '..', and inside the cache directory once resolved.
            check_relative(target, what=f"target of link {name!r}", source_file=f"{url}/{rel}", loose=True)
            if not inside(root, os.path.join(os.path.dirname(link), target)):
                raise UnsafeNameError(f"{url}/{rel}: target of link {name!r} {target!r} leads outside {root}; refused")
            if os.path.lexists(link):
                os.unlink(link)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(target, link)
    return got


def _link_table(url: str, body: bytes) -> dict[str, str]:
    """A ``.symlinks.json`` object's table (link name → target), or :class:`UnsafeNameError` naming it."""
    try:
        table = json.loads(body)
    except ValueError:
        table = None
    if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise UnsafeNameError(f"{url}: not a table of link names and targets; refused (no link was made)")
    return table


def push_all(root: str, *, since: int = 0, elsewhere: int = 0, skip: Sequence[str] = ()) -> str | None:
    """:func:`push` a finished output directory and say so: ``uploaded N files to s3://…; it holds M objects (X MiB)``
    read back from the bucket (``None``, and nothing done, for a local directory). ``N`` counts every object this
    process uploaded under it (after the mark ``since``, :func:`~curation.io.objects.upload_mark`: the job's start),
    as it was written and now, plus ``elsewhere`` (those the job's other processes did: Ray tasks and actors). Jobs print it, so an object-store run ends with its URL and the bucket's own count, not a
    cache path. ``skip``: folders under ``root`` (relative) that other processes write and upload themselves
    (:func:`push`)."""
    url = url_of(root)
    if url is None:
        return None
    push(root, skip=skip)
    n = uploads(url, since) + elsewhere
    held = {k: o for k, o in list_objects(url).items() if not _local_only(k)}  # (the run's lock object: not an output)
    size = sum(o.size for o in held.values())
    return (f"uploaded {n} file{'s' if n != 1 else ''} to {url}; it holds {len(held)} objects "
            f"({size / 2**20:.1f} MiB)")


def push(root: str, subdir: str = "", *, delete: bool = False, skip: Sequence[str] = ()) -> list[str]:
    """Upload what changed under ``root/subdir`` (a cache directory) since the bucket last saw it: files whose
    object is missing or has another ETag, in :func:`publish` order, and the symbolic links (as a
    ``.symlinks.json`` in their folder). ``delete``: also delete objects under ``subdir`` that have no file (or link) any more
    (for a folder only this process writes, e.g. ``checkpoints/`` that Composer prunes). Returns the uploaded
    files (relative to ``root``).

    ``skip``: folders (relative to ``root/subdir``) left alone: ones that processes of other nodes write and upload
    themselves (a Ray engine's ``engine/`` and parts), where this cache may hold an older copy than the bucket
    (read earlier) or a file the bucket no longer has (pruned by a process elsewhere): uploading it would undo
    their work."""
    url = url_of(root)
    if url is None:
        return []
    base = os.path.join(root, subdir) if subdir else root
    prefix = f"{url}/{subdir.strip('/')}" if subdir else url
    remote = list_objects(prefix)
    files, links = _walk(base) if os.path.isdir(base) else ({}, {})
    if skip:
        folders = tuple(f"{s.strip('/')}/" for s in skip)
        remote = {r: o for r, o in remote.items() if not r.startswith(folders)}
        files = {r: p for r, p in files.items() if not r.startswith(folders)}
        links = {r: t for r, t in links.items() if not r.startswith(folders)}
    sent = []
    for rel in sorted(files, key=lambda r: (_order(r), r)):
        info = remote.get(rel)
        if info is None or info.size != os.path.getsize(files[rel]) or info.etag != file_etag(files[rel]):
            upload(files[rel], f"{prefix}/{rel}")
            sent.append(f"{subdir}/{rel}" if subdir else rel)
    by_dir: dict[str, dict[str, str]] = {}  # each folder's links go to its own .symlinks.json
    for rel, target in links.items():
        folder, _, name = rel.rpartition("/")
        by_dir.setdefault(folder, {})[name] = target
    tables = {(f"{d}/{SYMLINKS}" if d else SYMLINKS): t for d, t in by_dir.items()}
    for rel, table in sorted(tables.items()):
        body = json.dumps(dict(sorted(table.items())), indent=1).encode()
        if rel not in remote or remote[rel].etag != hashlib.md5(body, usedforsecurity=False).hexdigest():
            write_object(f"{prefix}/{rel}", body)
    gone = [r for r in remote if r not in files and r not in tables and not _local_only(r)]  # (never a lock, at any depth)
    if delete and gone:
        delete_many(prefix, gone)
    return sent


def tokenizer_json_path(path: str) -> str:
    """``path`` itself if it is a file, else ``path/tokenizer.json``."""
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            raise FileNotFoundError(f"tokenizer directory {path} has no tokenizer.json")
        return candidate
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    return path
