"""Jobs' directories that may be object-store URLs: resolve a config to cache paths, open an output directory.

* :func:`localize`: a config whose shard and output directories (``output_dir``, ``candidates``,
  ``validation``, ``scored``, ``selected``) and files (``tokenizer``, ``reference_weights``, ``proxy_weights``)
  may be ``s3://`` URLs → the same config with their cache paths
  (:func:`curation.io.storage.local_path`); a URL anywhere else is refused naming the key. Everything below a
  job's entry takes that config; records and run keys keep the URLs (:func:`urls_in`, ``storage.canonical``).
* :func:`open_output`: :func:`curation.io.outdir.open_output_dir` for a local directory; for a URL, the same on its
  cache directory (one process per machine: ``flock`` on ``<cache>/.lock``) plus the bucket's lock object
  (:class:`RemoteLock`), then the cache is made equal to the bucket (:func:`curation.io.storage.pull`) before
  the config records are compared: a rerun on any machine, with an empty cache or a stale one, resumes from
  what is in the bucket. Config records are uploaded as they are written.

**The lock object** ``<url>/.lock`` holds the holder (pid, host, job, start time, command line: never a
credential). It is created with a conditional write (``If-None-Match: *``), so of two runs starting together
exactly one gets it, and renewed every ``lease/3`` seconds by a background thread (``If-Match`` on its ETag).
A killed holder cannot release it, so a lock is *stale*, and taken over (conditionally again), when its holder
is on this host and its process is gone, or when it was not renewed for ``lease`` seconds by the server's
clock (``BLADE_LOCK_LEASE_S``, default 120: another host's holder may be alive but cut off). A holder that
finds its lock taken over (it stalled longer than the lease) stops uploading: its next upload raises.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from curation.io import objects, storage
from curation.io.inputs import watch_inputs
from curation.io.outdir import LOCK_NAME, OutputDirBusy, OutputDirError, OutputDirLock, open_output_dir

__all__ = ["URL_FIELDS", "localize", "relocalize", "local_paths", "urls_in", "open_output", "RemoteLock", "lease_seconds"]

#: Config keys (at any depth) whose value may be an object-store URL: shard and output directories, and files
#: other jobs write into theirs (the tokenizer, weights), which :func:`localize` downloads into the cache; a prepare
#: source's input paths (``paths``, each item; globs listed from the bucket); and the prefix its local inputs are
#: uploaded to (``stage_inputs``: always a URL, left as it is).
_FILE_FIELDS = frozenset({"tokenizer", "reference_weights", "proxy_weights"})
_KEPT_FIELDS = frozenset({"stage_inputs"})
URL_FIELDS = frozenset({"output_dir", "candidates", "validation", "scored", "selected", "paths"}) | _FILE_FIELDS \
    | _KEPT_FIELDS

M = TypeVar("M", bound=BaseModel)


def lease_seconds() -> float:
    """How long a remote lock lives without renewal: ``BLADE_LOCK_LEASE_S`` (default 120 s)."""
    return float(os.environ.get("BLADE_LOCK_LEASE_S") or 120.0)


# ------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------
def localize(cfg: M) -> M:
    """``cfg`` with every object-store URL of a :data:`URL_FIELDS` key replaced by its cache path (``cfg``
    itself when it holds none); a file (tokenizer, weights) is brought into the cache.

    Raises:
        ValueError: a URL in another key, or of an unsupported scheme (names the key and the value).
    """
    data = cfg.model_dump(mode="json")
    changed = False

    def walk(node: Any, prefix: str, listed: str | None = None) -> None:
        nonlocal changed
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in list(items):
            key, field = f"{prefix}{k}", listed if isinstance(node, list) else str(k)  # (a list's items: its key)
            if isinstance(v, dict | list):
                walk(v, key + ".", field if isinstance(v, list) else None)
            elif isinstance(v, str) and "://" in v:
                if field in URL_FIELDS:
                    objects.check_scheme(v)
                if objects.is_url(v) and field not in _KEPT_FIELDS:
                    if field not in URL_FIELDS:
                        raise ValueError(f"{key}: object-store URLs are supported for shard and output directories "
                                         f"and inputs only ({', '.join(sorted(URL_FIELDS))}); got {v}")
                    node[k] = storage.local_path(v)
                    changed = True
                    if field in _FILE_FIELDS:
                        storage.refresh(node[k])  # absent: its reader says so (or a prepare writes it first)

    walk(data, "")
    return type(cfg).model_validate_json(json.dumps(data)) if changed else cfg


def relocalize(cfg: M) -> M:
    """A config localized by another process (another node's cache paths, or this node's after
    :mod:`curation.io.carried`) localized again here: its cache paths as URLs, then :func:`localize`: this
    process's cache paths, and the files of :data:`URL_FIELDS` (tokenizer, weights) brought into this cache."""
    recorded = _with_urls(cfg)
    assert isinstance(recorded, BaseModel)
    return localize(recorded)


def local_paths(cfg: BaseModel) -> dict[str, str]:
    """The local paths a (localized) config names in its :data:`URL_FIELDS` keys, by dotted setting, made absolute:
    what every process of a job on another node would have to reach on a shared filesystem (an object-store URL's
    cache path is not one: each node works on the bucket through its own cache)."""
    found: dict[str, str] = {}

    def walk(node: Any, prefix: str, listed: str | None = None) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            key, field = f"{prefix}{k}", listed if isinstance(node, list) else str(k)
            if isinstance(v, dict | list):
                walk(v, key + ".", field if isinstance(v, list) else None)
            elif isinstance(v, str) and v and field in URL_FIELDS and field not in _KEPT_FIELDS \
                    and not objects.is_url(v) and storage.url_of(os.path.abspath(v)) is None:
                found[key] = os.path.abspath(v)

    walk(cfg.model_dump(mode="json"), "")
    return found


def urls_in(data: Any) -> Any:
    """``data`` (JSON-like) with every string that is a cache path replaced by its URL (for what is recorded)."""
    if isinstance(data, dict):
        return {k: urls_in(v) for k, v in data.items()}
    if isinstance(data, list):
        return [urls_in(v) for v in data]
    if isinstance(data, str) and os.path.isabs(data):
        return storage.url_of(data) or data
    return data


def _with_urls(cfg: BaseModel | Mapping[str, Any]) -> BaseModel | Mapping[str, Any]:
    """A config as recorded: the URLs of a localized config's cache paths (of the same model type)."""
    if isinstance(cfg, BaseModel):
        return type(cfg).model_validate_json(json.dumps(urls_in(cfg.model_dump(mode="json"))))
    return urls_in(json.loads(json.dumps(dict(cfg))))


# ------------------------------------------------------------------------------------------------
# the bucket's lock object
# ------------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RemoteLock:
    """The lock object ``<url>/.lock`` (module docstring), held until :meth:`release`.

    Raises:
        OutputDirBusy: a live holder has it (names it, and when its lease runs out).
        StorageError: the bucket cannot be reached or refuses the credentials.
    """

    def __init__(self, url: str, holder: Mapping[str, Any], *, lease: float | None = None) -> None:
        self.url = url
        self.key = f"{url}/{LOCK_NAME}"
        self.lease = lease if lease is not None else lease_seconds()
        self.holder = {**holder, "token": uuid.uuid4().hex, "lease_s": self.lease}
        self.lost: str | None = None
        self.etag = self._acquire()
        self._stop = threading.Event()
        self._renewed = time.monotonic()
        objects.guard(url, self.check)
        self._thread = threading.Thread(target=self._renew, name=f"lock {url}", daemon=True)
        self._thread.start()

    def _body(self) -> bytes:
        return (json.dumps({**self.holder, "renewed": time.time()}) + "\n").encode()

    def _acquire(self) -> str:
        for _ in range(3):  # the holder may release between our two calls: try again
            try:
                return objects.write_object(self.key, self._body(), IfNoneMatch="*")
            except FileExistsError:
                pass
            current = objects.read_object(self.key)
            if current is None:
                continue
            try:
                info = json.loads(current.body)
            except ValueError:
                info = {}
            stale = self._stale(info, current.age_s)
            if stale is None:
                left = max(0.0, float(info.get("lease_s", self.lease)) - current.age_s)
                raise OutputDirBusy(
                    f"{self.url} is in use by another run: {info.get('job', 'a job')} pid {info.get('pid')} on host "
                    f"{info.get('host')}, started {info.get('started')} ({info.get('command', '')}); its lock was "
                    f"renewed {current.age_s:.0f} s ago. Wait for it to finish or stop it; if it was killed, its "
                    f"lock is taken over {left:.0f} s from now (at once from its own host), or use another output_dir")
            try:
                etag = objects.write_object(self.key, self._body(), IfMatch=current.etag)
            except FileExistsError:
                continue  # another run took it over first
            print(f"note: took over the lock of {self.url} from {info.get('job')} pid {info.get('pid')} on host "
                  f"{info.get('host')} ({stale})", flush=True)
            return etag
        raise OutputDirBusy(f"{self.url} is in use by another run (its lock object changed while this run tried to "
                            "take it); rerun")

    def _stale(self, info: Mapping[str, Any], age: float) -> str | None:
        """Why the lock held as ``info``, last written ``age`` seconds ago, is stale (``None``: it is not)."""
        if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int) \
                and not _alive(info["pid"]):
            return "its process is gone"
        lease = float(info.get("lease_s", self.lease))
        if age > lease:
            return f"not renewed for {age:.0f} s, past its {lease:.0f} s lease"
        if not info:
            return "unreadable holder"
        return None

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 3):
            try:
                self.etag = objects.write_object(self.key, self._body(), IfMatch=self.etag)
                self._renewed = time.monotonic()
            except FileExistsError:
                self.lost = "another run took it over (this one did not renew it within its lease)"
                return
            except OSError as e:  # unreachable for now: keep trying until the lease is gone
                if time.monotonic() - self._renewed > self.lease:
                    self.lost = f"it could not be renewed for {self.lease:.0f} s ({e})"
                    return

    def check(self) -> None:
        """Raise when the lock was lost (called before every upload under :attr:`url`)."""
        if self.lost is not None:
            raise OutputDirError(f"{self.url}: this run lost its lock ({self.lost}); it stops without writing more. "
                                 "Rerun when the other run is done")

    def release(self) -> None:
        """Stop renewing and delete the lock object if it is still this run's."""
        self._stop.set()
        self._thread.join(timeout=30)
        objects.guard(self.url, None)
        if self.lost is None:
            current = objects.read_object(self.key)
            if current is not None and current.etag == self.etag:
                objects.delete_object(self.key)


# ------------------------------------------------------------------------------------------------
# output directories
# ------------------------------------------------------------------------------------------------
def open_output(directory: str, job: str, records: Mapping[str, BaseModel | Mapping[str, Any]] | None = None,
                ) -> OutputDirLock:
    """:func:`curation.io.outdir.open_output_dir` for a local path or an ``s3://`` URL (module docstring).

    Raises:
        OutputDirBusy, ConfigMismatch, OutputDirError: see :mod:`curation.io.outdir` (naming the URL).
        StorageError: the bucket cannot be reached or refuses the credentials.
    """
    objects.check_scheme(directory)
    directory = storage.url_of(directory) or directory  # a localized config's cache path: its URL
    if not objects.is_url(directory):
        lock = open_output_dir(directory, job, records)
        watch_inputs(lock, records or {})  # checked, and recorded, when the job writes its records
        return lock
    local = storage.local_path(directory)
    given, records = records or {}, {name: _with_urls(cfg) for name, cfg in (records or {}).items()}

    def attach(lock: OutputDirLock) -> None:
        remote = RemoteLock(directory, lock.holder)
        lock.on_release.append(remote.release)
        storage.pull(local)  # the cache = the bucket (the records, manifests, parts, checkpoints to resume from)

    lock = open_output_dir(local, job, records, name=directory, after_lock=attach)
    lock.on_record = storage.publish
    lock.on_discard = storage.unpublish  # a failed first run's record leaves the bucket too
    watch_inputs(lock, given)  # (the inputs at their cache paths)
    return lock
