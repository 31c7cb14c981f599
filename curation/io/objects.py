"""Objects of an S3-compatible store, one call each: the client, errors as one line, list / read / write
(conditional) / delete, transfers with their checks, the ETag of a local file. :mod:`curation.io.storage` maps
them to local cache paths; nothing else in the project calls boto3.

Credentials and the endpoint come from the environment and boto3's usual chain only (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws/credentials``, instance roles; ``S3_ENDPOINT_URL`` for an
S3-compatible store); nothing here writes them anywhere. Failures (unreachable endpoint, missing or refused
credentials, missing bucket) raise :class:`StorageError`, one line naming the URL and what to do.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SCHEMES", "StorageError", "is_url", "check_scheme", "split_url", "client", "forget_clients", "guard",
    "uploads", "upload_mark",
    "ObjectInfo", "StoredObject", "list_objects", "head_object", "read_object", "write_object", "delete_object", "delete_many",
    "file_etag", "upload", "download", "MTIME_KEY", "arrow_filesystem",
]

#: URL schemes served through the S3 API.
SCHEMES = ("s3",)
#: Single-PUT uploads up to this size keep the ETag the file's MD5 (S3's limit is 5 GiB); bigger files go in
#: parts of ``_PART`` bytes, whose ETag is computed the same way by :func:`file_etag`.
_SINGLE_PUT = 4 << 30
_PART = 64 << 20
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")  # any case: an upper-case s3 is refused, never a folder
#: A bucket name boto accepts (botocore's VALID_BUCKET, without its ARN forms).
_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")

class StorageError(OSError):
    """An object-store operation failed: the message names the URL, the cause and what to do."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(errno.EIO, message)
        self.url = url

    def __str__(self) -> str:
        return str(self.strerror)


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
    if m.group(1).lower() in SCHEMES:  # read as a local folder named "S3:" otherwise
        raise ValueError(f"{path}: write the scheme in lower case ({m.group(1).lower()}://{m.group(2)}): "
                         f"{m.group(1)}:// is not read as the object store")
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
    if not _BUCKET.fullmatch(bucket):  # boto's own rule, said in one line (not its regular expressions)
        raise ValueError(f"{url}: {bucket!r:.80} is not a valid bucket name (1 to 255 letters, digits, '.', '-', '_'; "
                         "S3 itself wants 3 to 63 lowercase letters, digits, '.' and '-')")
    return bucket, key.strip("/")


# ------------------------------------------------------------------------------------------------
# the client and errors
# ------------------------------------------------------------------------------------------------
_clients: dict[tuple[int, str | None], Any] = {}
_clients_lock = threading.Lock()


def client() -> Any:
    """This process's boto3 S3 client (``S3_ENDPOINT_URL`` for an S3-compatible store; credentials from
    boto3's chain). Short connect timeout and few retries, so an unreachable endpoint fails in seconds; the
    retries are botocore's own settings where the user gave them (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``, or
    ``max_attempts`` / ``retry_mode`` of the AWS config file), which a ``retries`` entry of the client's config
    would override."""
    endpoint = os.environ.get("S3_ENDPOINT_URL") or None
    key = (os.getpid(), endpoint)  # a forked process makes its own (boto3 clients are not fork-safe)
    with _clients_lock:
        if key not in _clients:
            import boto3
            import botocore.session
            from botocore.config import Config

            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            core = botocore.session.get_session()
            retries = {key: value for key, setting, value in (("max_attempts", "max_attempts", 4),
                                                              ("mode", "retry_mode", "standard"))
                       if not _user_setting(core, setting)}
            cfg = Config(connect_timeout=5, read_timeout=120, retries=retries,
                         s3={"addressing_style": "path"} if endpoint else {})
            c = boto3.session.Session(botocore_session=core).client("s3", endpoint_url=endpoint, region_name=region,
                                                                     config=cfg)
            c.meta.events.register("before-send.s3.PutObject", _no_continue_for_an_empty_body)
            _clients[key] = c
        return _clients[key]


def _user_setting(core: Any, setting: str) -> Any:
    """A botocore setting as the user gave it: ``AWS_<SETTING>`` or the AWS config file's profile (None: not
    given; botocore's own default is not counted)."""
    from botocore.exceptions import BotoCoreError

    if os.environ.get(f"AWS_{setting.upper()}"):
        return os.environ[f"AWS_{setting.upper()}"]
    try:
        return core.get_scoped_config().get(setting)
    except BotoCoreError:  # a profile that does not exist: the client's credentials lookup names it
        return None


def _no_continue_for_an_empty_body(request: Any, **_: Any) -> None:
    """botocore asks for ``100 Continue`` before every file-like body, an empty one too; SeaweedFS answers an empty
    PUT without it, and the connection's next request then waits the whole read timeout (120 s) for an answer and is
    sent again (measured: the object after every empty file, e.g. the ``.validate_storage_marker`` Ray Train writes
    into a data-parallel run's output). With nothing to send there is nothing to wait for: the header is dropped
    (it is not signed)."""
    if request.headers.get("Content-Length") in ("0", b"0"):
        request.headers.pop("Expect", None)


def arrow_filesystem(url: str):  # noqa: ANN201 - (pyarrow.fs.S3FileSystem, str); pyarrow imported here
    """The same store as :func:`client`, for a library that takes a ``pyarrow`` filesystem (Ray Train's
    ``storage_path``): ``(filesystem, "bucket/key")`` for ``url``. The endpoint is ``S3_ENDPOINT_URL`` (path-style
    addressing, as :func:`client`); credentials are *not* set on it: each process that uses it (a Ray Train worker
    on another node, which receives it pickled) takes them from its own environment through the AWS SDK's usual
    chain, so no credential travels with it."""
    import pyarrow.fs as pafs

    bucket, key = split_url(url)
    endpoint = os.environ.get("S3_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    options: dict[str, Any] = {"region": region, "connect_timeout": 5, "request_timeout": 120}
    if endpoint:
        scheme, _, rest = endpoint.partition("://")
        options.update(endpoint_override=rest.rstrip("/") if rest else endpoint, scheme=scheme if rest else "https",
                       force_virtual_addressing=False)
    return pafs.S3FileSystem(**options), f"{bucket}/{key}".rstrip("/")


def forget_clients() -> None:
    """Drop the cached clients (the environment changed: another endpoint or other credentials)."""
    with _clients_lock:
        _clients.clear()
    _buckets_seen.clear()


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


def _unless_missing(url: str, action: str, call: Callable[[], Any]) -> Any:
    """``call()`` (an S3 request about ``url``) with its errors as :class:`StorageError`; ``None`` when the object
    does not exist."""
    with _errors(url, action):
        try:
            return call()
        except Exception as e:
            if _not_found(e):
                _check_bucket(url)  # the object is missing, or its whole bucket (then: a StorageError)
                return None
            raise


_buckets_seen: set[tuple[str | None, str]] = set()


def _check_bucket(url: str) -> None:
    """After a "not found" on an object: raise :class:`StorageError` when it is the bucket that does not exist (an
    object request cannot tell; a missing bucket otherwise reads as an empty directory)."""
    bucket, _ = split_url(url)
    key = (os.environ.get("S3_ENDPOINT_URL"), bucket)
    if key in _buckets_seen:
        return
    from botocore.exceptions import ClientError

    with _errors(url, "read"):
        try:
            client().head_bucket(Bucket=bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchBucket", "404", "NotFound"):
                raise StorageError(f"cannot read {url}: the bucket {bucket} does not exist at {_endpoint()}; create "
                                   "it or fix the URL", url) from None
            raise
    _buckets_seen.add(key)


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
    mtime_ns: int | None = None  # head_object: the MTIME_KEY metadata, else Last-Modified (see download)


def list_objects(url: str) -> dict[str, ObjectInfo]:
    """Objects under the prefix ``url`` (a "directory"), by key relative to it. Folder markers are left out: an
    empty object whose key ends in ``/`` (what ``pyarrow``'s ``create_dir`` writes, e.g. Ray Train's under a
    data-parallel run's ``parallel/ray_train/``, and what S3 consoles make for a "folder") holds no file."""
    bucket, key = split_url(url)
    prefix = key + "/" if key else ""
    out: dict[str, ObjectInfo] = {}
    with _errors(url, "list"):
        for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                if obj["Key"].endswith("/") and int(obj["Size"]) == 0:
                    continue
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
    r = _unless_missing(url, "read", lambda: client().get_object(Bucket=bucket, Key=key))
    if r is None:
        return None
    with _errors(url, "read"):
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


def head_object(url: str) -> ObjectInfo | None:
    """Size and ETag of one object (``None`` when it does not exist)."""
    bucket, key = split_url(url)
    r = _unless_missing(url, "read", lambda: client().head_object(Bucket=bucket, Key=key))
    if r is None:
        return None
    return ObjectInfo(int(r["ContentLength"]), r["ETag"].strip('"'), _mtime_ns(r))


def _mtime_ns(response: dict[str, Any]) -> int:
    """The modification time a downloaded copy gets: the :data:`MTIME_KEY` metadata, else Last-Modified (whole
    seconds, as the store keeps it)."""
    given = (response.get("Metadata") or {}).get(MTIME_KEY, "")
    return int(given) if given.isdigit() else int(response["LastModified"].timestamp()) * 1_000_000_000


def delete_object(url: str) -> None:
    _check_guards(url)
    bucket, key = split_url(url)
    with _errors(url, "delete"):
        client().delete_object(Bucket=bucket, Key=key)


def delete_many(url: str, rels: Iterable[str]) -> None:
    _check_guards(url)
    bucket, key = split_url(url)
    keys = [f"{key}/{r}" if key else r for r in rels]
    with _errors(url, "delete under"):
        for i in range(0, len(keys), 1000):
            client().delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                           "Quiet": True})


_etags: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) → ETag: a checkpoint is hashed once


def file_etag(path: str) -> str:
    """The ETag this module's upload gives ``path``: its MD5, or S3's multipart form above ``_SINGLE_PUT``."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _etags:
        _etags[key] = _md5_etag(path, st.st_size)
    return _etags[key]


def _md5_etag(path: str, size: int) -> str:
    with open(path, "rb") as f:
        if size <= _SINGLE_PUT:
            h = hashlib.md5(usedforsecurity=False)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return h.hexdigest()
        digests = [hashlib.md5(chunk, usedforsecurity=False).digest() for chunk in iter(lambda: f.read(_PART), b"")]
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


_UPLOADED: dict[str, int] = {}  # object → number of this process's upload of it, the latest (for the jobs' last line)
_UPLOADED_LOCK = threading.Lock()


def upload_mark() -> int:
    """How many uploads this process made so far: :func:`uploads` ``since`` it counts what came after."""
    with _UPLOADED_LOCK:
        return max(_UPLOADED.values(), default=0)


def uploads(under: str | None = None, since: int = 0) -> int:
    """How many objects this process uploaded (:func:`upload`; each once, however often) after the mark ``since``
    (:func:`upload_mark`), all or ``under`` a URL."""
    prefix = None if under is None else under.rstrip("/") + "/"
    with _UPLOADED_LOCK:
        return sum(n > since and (prefix is None or u.startswith(prefix)) for u, n in _UPLOADED.items())


#: An object's metadata key holding the modification time (ns) of the file it was uploaded from (an input staged
#: for other nodes: their copies get it back, so a unit's input fingerprint is the same on every node).
MTIME_KEY = "mtime-ns"


def upload(path: str, url: str, *, mtime: bool = False) -> None:
    """Upload the file ``path`` to ``url``; ``mtime``: with its modification time as :data:`MTIME_KEY` metadata."""
    _check_guards(url)
    bucket, key = split_url(url)
    extra = {"Metadata": {MTIME_KEY: str(os.stat(path).st_mtime_ns)}} if mtime else {}
    with _errors(url, "upload to"):
        if os.path.getsize(path) <= _SINGLE_PUT:
            with open(path, "rb") as f:
                client().put_object(Bucket=bucket, Key=key, Body=f, **extra)
        else:
            from boto3.s3.transfer import TransferConfig

            client().upload_file(path, bucket, key, ExtraArgs=extra or None,
                                 Config=TransferConfig(multipart_threshold=_SINGLE_PUT, multipart_chunksize=_PART))
    with _UPLOADED_LOCK:
        _UPLOADED[url] = max(_UPLOADED.values(), default=0) + 1


def download(url: str, path: str, *, mtime: bool = False) -> None:
    """Download one object to ``path`` atomically (a temporary file in the same folder, then a rename), so
    processes sharing the cache never read half a file; a single-PUT object's MD5 is checked. ``mtime``: the file
    gets the object's :data:`MTIME_KEY` metadata (the time of the file it was uploaded from) as its modification
    time, else the object's Last-Modified: the same on every machine that downloads it."""
    bucket, key = split_url(url)
    r = _unless_missing(url, "download", lambda: client().get_object(Bucket=bucket, Key=key))
    if r is None:
        raise FileNotFoundError(errno.ENOENT, "no such object", url)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".dl-", dir=os.path.dirname(path))
    try:
        with _errors(url, "download"), os.fdopen(fd, "wb") as f:
            etag, h = r["ETag"].strip('"'), hashlib.md5(usedforsecurity=False)
            for chunk in r["Body"].iter_chunks(1 << 20):
                f.write(chunk)
                h.update(chunk)
        if "-" not in etag and len(etag) == 32 and h.hexdigest() != etag:
            raise StorageError(f"cannot download {url}: the bytes received do not match the object's MD5 "
                               f"({h.hexdigest()} ≠ ETag {etag}); rerun", url)
        if mtime:
            ns = _mtime_ns(r)
            os.utime(tmp, ns=(ns, ns))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
