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

Credentials and the endpoint come from the environment and boto3's usual chain only (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws/credentials``, instance roles; ``S3_ENDPOINT_URL`` for an
S3-compatible store); nothing here writes them anywhere. Failures (unreachable endpoint, missing or refused
credentials, missing bucket) raise :class:`StorageError`, one line naming the URL and what to do.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SCHEMES", "StorageError", "is_url", "check_scheme", "cache_root", "local_path", "url_of", "canonical", "display",
    "split_url", "fetch", "refresh", "publish", "unpublish", "pull", "push", "list_objects", "ObjectInfo", "StoredObject",
    "read_object", "write_object", "delete_object", "file_etag", "client", "forget_clients", "guard", "SYMLINKS",
]

#: URL schemes served through the S3 API.
SCHEMES = ("s3",)
#: A synced directory's symbolic links (Composer's ``latest-rank0.pt``) are kept in this object: S3 has none.
SYMLINKS = ".symlinks.json"
#: Single-PUT uploads up to this size keep the ETag the file's MD5 (S3's limit is 5 GiB); bigger files go in
#: parts of ``_PART`` bytes, whose ETag is computed the same way by :func:`file_etag`.
_SINGLE_PUT = 4 << 30
_PART = 64 << 20
_LOCAL_ONLY = {".lock"}  # never uploaded, never deleted by a pull
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")


class StorageError(OSError):
    """An object-store operation failed: the message names the URL, the cause and what to do."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(errno.EIO, message)
        self.url = url

    def __str__(self) -> str:
        return str(self.strerror)


# ------------------------------------------------------------------------------------------------
# URLs and the cache
# ------------------------------------------------------------------------------------------------
def is_url(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is an object-store URL (``s3://``)."""
    if path is None:
        return False
    m = _URL.match(os.fspath(path))
    return m is not None and m.group(1) in SCHEMES


def check_scheme(path: str) -> None:
    """Refuse a URL of a store this project cannot write (``gs://``, ``az://``...), saying what to use instead.

    Raises:
        ValueError: naming the path.
    """
    m = _URL.match(path)
    if m is None or m.group(1) in SCHEMES:
        return
    hint = (" (Google Cloud Storage: use its S3-compatible API, s3://bucket/prefix with "
            "S3_ENDPOINT_URL=https://storage.googleapis.com and HMAC keys as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
            if m.group(1) in ("gs", "gcs") else "")
    raise ValueError(f"{path}: {m.group(1)}:// paths are not supported; use a local path or s3://bucket/prefix{hint}")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")`` (no leading or trailing slash)."""
    m = _URL.match(url)
    if m is None or m.group(1) not in SCHEMES:
        raise ValueError(f"{url}: not an s3:// URL")
    bucket, _, key = m.group(2).partition("/")
    if not bucket:
        raise ValueError(f"{url}: no bucket name")
    return bucket, key.strip("/")


def cache_root() -> str:
    """Where URLs are cached: ``BLADE_CACHE_DIR``, default ``~/.cache/blade-curation`` (absolute)."""
    root = os.environ.get("BLADE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "blade-curation")
    return os.path.abspath(root)


def local_path(path: str) -> str:
    """The cache path of a URL (``<cache>/s3/<bucket>/<key>``); any other path is returned as it is."""
    if not is_url(path):
        return path
    bucket, key = split_url(path)
    parts = [p for p in key.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"{path}: '.' and '..' are not allowed in an object-store path")
    return os.path.join(cache_root(), "s3", bucket, *parts)


def url_of(path: str) -> str | None:
    """The URL whose cache path ``path`` is (or is under); ``None`` for any other path."""
    root = os.path.join(cache_root(), "s3") + os.sep
    full = os.path.abspath(path)
    if not full.startswith(root):
        return None
    rel = full[len(root):].replace(os.sep, "/")
    return f"s3://{rel}" if "/" in rel or rel else None


def canonical(path: str) -> str:
    """A path as recorded in run keys: its URL for a cache path, else the absolute path."""
    return url_of(path) or os.path.abspath(path)


def display(path: str) -> str:
    """A path as shown in messages: its URL for a cache path, else as given."""
    return url_of(path) or path


# ------------------------------------------------------------------------------------------------
# the client and errors
# ------------------------------------------------------------------------------------------------
_clients: dict[tuple[int, str | None], Any] = {}
_clients_lock = threading.Lock()


def client() -> Any:
    """This process's boto3 S3 client (``S3_ENDPOINT_URL`` for an S3-compatible store; credentials from
    boto3's chain). Short connect timeout and few retries, so an unreachable endpoint fails in seconds."""
    endpoint = os.environ.get("S3_ENDPOINT_URL") or None
    key = (os.getpid(), endpoint)  # a forked process makes its own (boto3 clients are not fork-safe)
    with _clients_lock:
        if key not in _clients:
            import boto3
            from botocore.config import Config

            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            cfg = Config(connect_timeout=5, read_timeout=120, retries={"max_attempts": 4, "mode": "standard"},
                         s3={"addressing_style": "path"} if endpoint else {})
            _clients[key] = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region,
                                                           config=cfg)
        return _clients[key]


def forget_clients() -> None:
    """Drop the cached clients (the environment changed: another endpoint or other credentials)."""
    with _clients_lock:
        _clients.clear()


_guards: dict[str, Callable[[], None]] = {}


def guard(url: str, check: Callable[[], None] | None) -> None:
    """Run ``check`` before every upload or deletion under ``url`` in this process (``None``: stop). The lock of
    an output directory uses it: a run that lost its lock raises there instead of overwriting the new holder's
    objects."""
    if check is None:
        _guards.pop(url, None)
    else:
        _guards[url] = check


def _check_guards(url: str) -> None:
    for prefix, check in list(_guards.items()):
        if url == prefix or url.startswith(prefix + "/"):
            check()


def _endpoint() -> str:
    return os.environ.get("S3_ENDPOINT_URL") or "the AWS default endpoint"


def _error(e: Exception, url: str, action: str) -> StorageError:
    """One line for a failed ``action`` on ``url`` (never a credential)."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    what = f"cannot {action} {url}"
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        return StorageError(f"{what}: no object-store credentials found: set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / ~/.aws/credentials) in the environment of every "
                            "process of the job, then rerun", url)
    if isinstance(e, EndpointConnectionError | ConnectionClosedError) or type(e).__name__ in (
            "ConnectTimeoutError", "ReadTimeoutError"):
        return StorageError(f"{what}: the object store at {_endpoint()} cannot be reached ({e}); check "
                            "S3_ENDPOINT_URL and the network, then rerun (what is in the bucket is kept and the job "
                            "resumes from it)", url)
    if isinstance(e, ClientError):
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket",):
            return StorageError(f"{what}: the bucket {split_url(url)[0]} does not exist at {_endpoint()}; create it "
                                "or fix the URL", url)
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "ExpiredToken",
                    "InvalidToken"):
            return StorageError(f"{what}: the object store refused the credentials ({code}); check "
                                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's "
                                "permissions, then rerun", url)
        return StorageError(f"{what}: {code or 'error'} ({e})", url)
    return StorageError(f"{what}: {type(e).__name__}: {e}", url)


@contextmanager
def _errors(url: str, action: str) -> Iterator[None]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError) as e:
        raise _error(e, url, action) from None


def _not_found(e: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(e, ClientError) and e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")


# ------------------------------------------------------------------------------------------------
# objects
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str  # without quotes


def list_objects(url: str) -> dict[str, ObjectInfo]:
    """Objects under the prefix ``url`` (a "directory"), by key relative to it."""
    bucket, key = split_url(url)
    prefix = key + "/" if key else ""
    out: dict[str, ObjectInfo] = {}
    with _errors(url, "list"):
        for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(prefix):]] = ObjectInfo(int(obj["Size"]), obj["ETag"].strip('"'))
    return out


@dataclass(frozen=True)
class StoredObject:
    body: bytes
    etag: str
    age_s: float  # since it was last written, by the server's clock (its Date header - Last-Modified)


def read_object(url: str) -> StoredObject | None:
    """One object (``None`` when it does not exist)."""
    from email.utils import parsedate_to_datetime

    bucket, key = split_url(url)
    with _errors(url, "read"):
        try:
            r = client().get_object(Bucket=bucket, Key=key)
        except Exception as e:
            if _not_found(e):
                return None
            raise
        body = r["Body"].read()
    date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    age = (parsedate_to_datetime(date) - r["LastModified"]).total_seconds() if date else 0.0
    return StoredObject(body, r["ETag"].strip('"'), max(0.0, age))


def write_object(url: str, body: bytes, **conditions: str) -> str:
    """Put ``body`` at ``url`` (``IfMatch`` / ``IfNoneMatch`` conditions as S3 has them); returns the ETag.

    Raises:
        FileExistsError: a condition did not hold (someone else wrote the object).
    """
    from botocore.exceptions import ClientError

    bucket, key = split_url(url)
    with _errors(url, "write"):
        try:
            return client().put_object(Bucket=bucket, Key=key, Body=body, **conditions)["ETag"].strip('"')
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise FileExistsError(errno.EEXIST, "precondition failed", url) from None
            raise


def delete_object(url: str) -> None:
    bucket, key = split_url(url)
    with _errors(url, "delete"):
        client().delete_object(Bucket=bucket, Key=key)


def _delete_many(url: str, rels: Iterable[str]) -> None:
    _check_guards(url)
    bucket, key = split_url(url)
    keys = [f"{key}/{r}" if key else r for r in rels]
    with _errors(url, "delete under"):
        for i in range(0, len(keys), 1000):
            client().delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                           "Quiet": True})


def file_etag(path: str) -> str:
    """The ETag this module's upload gives ``path``: its MD5, or S3's multipart form above ``_SINGLE_PUT``."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= _SINGLE_PUT:
            h = hashlib.md5(usedforsecurity=False)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return h.hexdigest()
        digests = [hashlib.md5(chunk, usedforsecurity=False).digest() for chunk in iter(lambda: f.read(_PART), b"")]
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def _upload(path: str, url: str) -> None:
    _check_guards(url)
    bucket, key = split_url(url)
    with _errors(url, "upload to"):
        if os.path.getsize(path) <= _SINGLE_PUT:
            with open(path, "rb") as f:
                client().put_object(Bucket=bucket, Key=key, Body=f)
        else:
            from boto3.s3.transfer import TransferConfig

            client().upload_file(path, bucket, key, Config=TransferConfig(multipart_threshold=_SINGLE_PUT,
                                                                         multipart_chunksize=_PART))


def _download(url: str, path: str) -> None:
    """Download one object to ``path`` atomically (a temporary file in the same folder, then a rename), so
    processes sharing the cache never read half a file; a single-PUT object's MD5 is checked."""
    bucket, key = split_url(url)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".dl-", dir=os.path.dirname(path))
    try:
        with _errors(url, "download"), os.fdopen(fd, "wb") as f:
            try:
                r = client().get_object(Bucket=bucket, Key=key)
            except Exception as e:
                if _not_found(e):
                    raise FileNotFoundError(errno.ENOENT, "no such object", url) from None
                raise
            etag, h = r["ETag"].strip('"'), hashlib.md5(usedforsecurity=False)
            for chunk in r["Body"].iter_chunks(1 << 20):
                f.write(chunk)
                h.update(chunk)
        if "-" not in etag and len(etag) == 32 and h.hexdigest() != etag:
            raise StorageError(f"cannot download {url}: the bytes received do not match the object's MD5 "
                               f"({h.hexdigest()} ≠ ETag {etag}); rerun", url)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
        _download(url, path)
    except FileNotFoundError:
        return False
    return True


def refresh(path: str) -> bool:
    """For a cache path: download the object again when the bucket's copy differs from the cached one (or
    the cache has none). Returns whether the file exists afterwards; a local path: whether it exists."""
    url = url_of(path)
    if url is None:
        return os.path.exists(path)
    bucket, key = split_url(url)
    with _errors(url, "read"):
        try:
            head = client().head_object(Bucket=bucket, Key=key)
        except Exception as e:
            if _not_found(e):
                if os.path.exists(path):
                    os.unlink(path)
                return False
            raise
    if not os.path.exists(path) or head["ETag"].strip('"') != file_etag(path):
        _download(url, path)
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
    """Files (rel → path) and symbolic links (rel → target) under ``root``; temporary files left out."""
    files, links = {}, {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.endswith(".tmp")]
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if name in _LOCAL_ONLY or name == SYMLINKS or name.startswith((".tmp-", ".dl-")):
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
            _upload(files[rel], f"{url}/{rel}")
    else:
        _upload(path, url)


def unpublish(path: str) -> None:
    """Delete the objects of the file or directory ``path`` when it is a cache path (else nothing)."""
    url = url_of(path)
    if url is None:
        return
    under = list_objects(url)
    if under:
        _delete_many(url, under)
    else:
        _check_guards(url)
        delete_object(url)


def pull(root: str, *, keep: Iterable[str] = ()) -> list[str]:
    """Make the cache directory ``root`` equal to its bucket prefix: download objects the cache lacks or holds
    differently (ETag ≠ MD5 of the cached file), delete cached files the bucket does not have (``keep``:
    top-level names left alone), restore symbolic links. Returns the files downloaded (relative)."""
    url = url_of(root)
    if url is None:
        return []
    remote = list_objects(url)
    files, links = _walk(root) if os.path.isdir(root) else ({}, {})
    keep = set(keep) | _LOCAL_ONLY
    for rel, path in {**files, **{r: os.path.join(root, r) for r in links}}.items():
        if rel not in remote and rel.split("/", 1)[0] not in keep:
            os.unlink(path)
    got = []
    for rel, info in sorted(remote.items()):
        if rel.rsplit("/", 1)[-1] == SYMLINKS:
            continue
        path = os.path.join(root, *rel.split("/"))
        if rel in links or not (os.path.isfile(path) and os.path.getsize(path) == info.size
                                and file_etag(path) == info.etag):
            if os.path.islink(path):
                os.unlink(path)
            _download(f"{url}/{rel}", path)
            got.append(rel)
    for rel in sorted(r for r in remote if r.rsplit("/", 1)[-1] == SYMLINKS):
        stored = read_object(f"{url}/{rel}")
        base = os.path.join(root, *rel.split("/")[:-1])
        for name, target in (json.loads(stored.body) if stored else {}).items():
            link = os.path.join(base, *name.split("/"))
            if os.path.lexists(link):
                os.unlink(link)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(target, link)
    return got


def push(root: str, subdir: str = "", *, delete: bool = False) -> list[str]:
    """Upload what changed under ``root/subdir`` (a cache directory) since the bucket last saw it: files whose
    object is missing or has another ETag, in :func:`publish` order, and the symbolic links (as a
    ``.symlinks.json`` in their folder). ``delete``: also delete objects under ``subdir`` that have no file (or link) any more
    (for a folder only this process writes, e.g. ``checkpoints/`` that Composer prunes). Returns the uploaded
    files (relative to ``root``)."""
    url = url_of(root)
    if url is None:
        return []
    base = os.path.join(root, subdir) if subdir else root
    prefix = f"{url}/{subdir.strip('/')}" if subdir else url
    remote = list_objects(prefix)
    files, links = _walk(base) if os.path.isdir(base) else ({}, {})
    sent = []
    for rel in sorted(files, key=lambda r: (_order(r), r)):
        info = remote.get(rel)
        if info is None or info.size != os.path.getsize(files[rel]) or info.etag != file_etag(files[rel]):
            _upload(files[rel], f"{prefix}/{rel}")
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
    gone = [r for r in remote if r not in files and r not in tables and r.split("/", 1)[0] not in _LOCAL_ONLY]
    if delete and gone:
        _delete_many(prefix, gone)
    return sent
