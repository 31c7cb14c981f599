"""Output directories: one writer at a time, and a rerun resumes only with the config it was written with.

Every job (prepare, train, replay, curate, curate_and_train) opens its output directory with
:func:`open_output_dir`, which

1. takes an exclusive lock, ``output_dir/.lock``: ``fcntl.flock`` on a file descriptor held for the
   job's lifetime. The kernel releases it when the process ends, however it ends (kill -9 included), so
   a killed run never leaves a stale lock behind; the file keeps the holder's pid, host and start time
   for the message a second writer gets;
2. compares the resolved config with the record the directory was written with (``config.yaml``, or
   ``engine_config.yaml``): a rerun resumes only when they are equal except for the *operational* keys
   (fields marked with :data:`schemas.records.OPERATIONAL`, e.g. progress bars, which cannot change the outputs) and for
   keys the record does not have whose value is their field's default (a setting added to the config
   after the run was recorded, left at its default, is the behaviour the run was recorded with), and
   for *extendable* keys (fields marked with :data:`schemas.records.EXTENDABLE`: ``max_steps``) raised above the
   recorded value: the run is then extended (:attr:`OutputDirLock.extended`) and its record rewritten; else it is
   refused naming exactly the keys that differ (a lowered extendable key too), and the record is left as
   it was; the keys that name the directory itself (its ``output_dir``, spelled any way) are not compared
   (:func:`location_keys`: a copied or moved run directory resumes);
3. writes the record when the job is about to act (:meth:`OutputDirLock.write_records`), and only when
   there was none, the run is extended or moved: an equal record is not rewritten;
4. leaves nothing behind when it was the directory's first run and failed before its first output (e.g. a
   prepare on a missing input): its record, the lock file, the folders it made and the directory itself are
   removed (:meth:`OutputDirLock.discard_unstarted`), so the directory does not look started.

No torch, no ray: stdlib + pydantic only (the jobs open their output directory before they import Composer). The
comparison of two configs is pure and lives with the configs (:mod:`schemas.records`).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from curation.io.atomic import atomic_write_text
from curation.io.cache import urls_in_text
from curation.io.live_locks import LOCK_NAME, live_locks  # (the lock file's name: defined there, used here)
from schemas.config import load_record_yaml
from schemas.records import as_dict, config_diff, extendable_keys, leaves, operational_keys

T = TypeVar("T")

__all__ = [
    "report_job_errors",
    "LOCK_NAME",
    "INPUTS_NAME",
    "OutputDirError",
    "OutputDirBusy",
    "ConfigMismatch",
    "InputsChanged",
    "OutputDirLock",
    "check_config_record",
    "write_config_record",
    "open_output_dir",
    "location_keys",
    "describe_os_error",
    "live_locks",
]

#: The record of the inputs a run was started with (:mod:`curation.io.inputs`), beside its config records.
INPUTS_NAME = "inputs.json"


class OutputDirError(ValueError):
    """An output directory cannot be used (busy, written with another config, not writable)."""


class OutputDirBusy(OutputDirError):
    """Another process holds the output directory's lock."""


class ConfigMismatch(OutputDirError):
    """The output directory was written with a different config; ``keys`` are the differing ones."""

    def __init__(self, message: str, keys: list[str]) -> None:
        super().__init__(message)
        self.keys = keys


class InputsChanged(OutputDirError):
    """An input the run was started with (shards, tokenizer, weights) has other content now
    (:mod:`curation.io.inputs`)."""


# ------------------------------------------------------------------------------------------------
# lock
# ------------------------------------------------------------------------------------------------
class OutputDirLock:
    """An exclusive ``flock`` on ``directory/.lock``, held until :meth:`release` (or process exit).

    Raises:
        OutputDirBusy: naming the holder (pid, host, start time, job) when another process holds it.
        OutputDirError: the directory cannot be created or written (names it and the OS error).
    """

    def __init__(self, directory: str, job: str, *, name: str | None = None) -> None:
        self.directory = directory
        self.name = name or directory  # how messages name it (an object-store URL for its local cache)
        self.path = os.path.join(directory, LOCK_NAME)
        self.on_release: list[Callable[[], None]] = []  # run once when the lock is released
        _refuse_nested(directory, self.name)  # before anything is created there
        self.on_record: Callable[[str], None] | None = None  # run after each record is written (its path)
        # run by write_records before it writes anything (the check of the run's inputs: curation.io.inputs)
        self.before_records: list[Callable[[], None]] = []
        self.replaced = False  # a record that produced no output is replaced: so is its record of inputs
        # run with the error when the job fails holding the directory (the record of the input shards it blames:
        # curation.io.inputs), before anything is released or discarded
        self.on_failure: list[Callable[[BaseException], None]] = []
        self.on_discard: Callable[[str], None] | None = None  # run before a file is removed by discard_unstarted
        self.fresh = False  # the directory held nothing but its lock when this run took it (open_output_dir)
        self.records: set[str] = set()  # the names of the directory's config records
        self._fd: int | None = None
        for _ in range(100):  # a run that removed the lock file while holding it (discard_unstarted): open anew
            fd = self._open()
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise OutputDirError(f"cannot lock {self.path}: it was removed and made again 100 times in a row")
        self._fd = fd
        self.pending: dict[str, BaseModel | Mapping[str, Any]] = {}  # records to write (none on disk yet)
        self.extended: dict[str, tuple[int, int]] = {}  # extendable key → (recorded, raised) value of this rerun
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(), "job": job,
                       "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "command": " ".join(sys.argv)}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(self.holder) + "\n").encode(), 0)
        except OSError as e:
            self.release()
            raise OutputDirError(describe_os_error(e, f"cannot write the lock file {self.path}")) from e

    def _open(self) -> int:
        """The lock file's descriptor, locked (the directory is made when missing)."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputDirError(describe_os_error(e, f"cannot open the output directory {self.name}")) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputDirBusy(
                f"{self.name} is in use by another run: {holder}. Wait for it to finish or stop it (its lock is "
                f"released when it exits, also when killed), or use another output_dir"
            ) from None
        return fd

    def discard_unstarted(self) -> bool:
        """Remove what this run wrote when the directory was new (:attr:`fresh`) and still holds no output (only
        its config records, the lock, empty folders and manifests that list no shard): a failed first run then
        leaves no directory that looks started. The lock file goes last, while it is held (a run waiting to open
        it opens the new one: the loop in ``__init__``), then the lock is released. Returns whether it did; an OS
        error leaves the rest as it is (a rerun replaces a record without outputs)."""
        if not self.fresh or self._fd is None or _holds_outputs(self.directory, self.records):
            return False
        try:
            for root, dirs, files in os.walk(self.directory, topdown=False):
                for f in files:
                    if root != self.directory or f != LOCK_NAME:
                        if self.on_discard is not None:
                            self.on_discard(os.path.join(root, f))
                        os.remove(os.path.join(root, f))
                for d in dirs:
                    os.rmdir(os.path.join(root, d))
            os.remove(self.path)
            self.release()
            os.rmdir(self.directory)
        except OSError:
            return False
        return True

    def write_records(self) -> None:
        """Run the :attr:`before_records` checks (they may refuse the run: nothing is written then), then write the
        config records the directory did not have yet (an equal record is not rewritten)."""
        while self.before_records:
            self.before_records.pop(0)()
        for name, cfg in list(self.pending.items()):
            write_config_record(os.path.join(self.directory, name), cfg)
            if self.on_record is not None:
                self.on_record(os.path.join(self.directory, name))
            del self.pending[name]

    def release(self) -> None:
        """Release the lock (the file stays: removing it would let two writers lock different inodes)."""
        while getattr(self, "on_release", None):
            self.on_release.pop()()
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object) -> None:
        if exc is not None:  # the job failed (or was stopped) holding the directory
            for hook in self.on_failure:
                try:
                    hook(exc)
                except Exception as e:  # noqa: BLE001 - the job's own error is the one to report
                    print(f"warning: {self.name}: could not record what the run failed on ({e})", file=sys.stderr)
            self.discard_unstarted()
        self.release()

    def __del__(self) -> None:
        self.release()


def _refuse_nested(directory: str, name: str) -> None:
    """Refuse ``directory`` when it is inside, or holds, the output directory of a live run of another process on
    this host (a job writing into another run's folder, or around it, can overwrite or delete its files).

    Raises:
        OutputDirBusy: naming the other run's directory and holder.
    """
    here = os.path.realpath(directory)
    for path, pid in live_locks():
        other = os.path.dirname(os.path.realpath(path))
        if pid == os.getpid() or other == here:  # (this process's own: the main job's prepare inside its run)
            continue
        inside, around = here.startswith(other + os.sep), other.startswith(here + os.sep)
        if inside or around:
            try:
                with open(path, "rb") as f:
                    holder = _holder_text(f.read(1 << 16))
            except OSError:
                holder = f"pid {pid}"
            where = f"is inside {other}" if inside else f"holds {other}"
            raise OutputDirBusy(f"{name} {where}, the output directory of a live run ({holder}): a job must not write "
                                "into another run's directory or around it; use an output_dir outside it")


def _read_holder(fd: int) -> str:
    try:
        data = os.pread(fd, 1 << 16, 0)
    except OSError:
        data = b""
    return _holder_text(data)


def _holder_text(data: bytes) -> str:
    try:
        info = json.loads(data.decode() or "{}")
    except ValueError:
        info = {}
    if not info or not isinstance(info, dict):
        return "holder unknown (its lock file is being written)"
    return (f"{info.get('job', 'a job')} pid {info.get('pid')} on host {info.get('host')}, "
            f"started {info.get('started')} ({info.get('command', '')})")


# ------------------------------------------------------------------------------------------------
# config records
# ------------------------------------------------------------------------------------------------
def check_config_record(path: str, cfg: BaseModel | Mapping[str, Any], ignore: set[str] | None = None,
                        name: str | None = None, extended: dict[str, tuple[int, int]] | None = None) -> bool:
    """Compare ``cfg`` with the record at ``path``; True when there is an equal record, False when none.

    ``ignore`` defaults to the :func:`operational_keys` of ``cfg``'s model; ``name``: how messages name the
    record (default ``path``). Two absolute paths of the same existing file are equal (a checkout-relative path and
    its resolved one). A key the record does not have is equal when ``cfg`` (a model) holds its default
    (:func:`config_diff`). With ``extended`` (a dict), an :func:`extendable_keys` key of ``cfg``'s model raised
    above its recorded value is not a difference: it is added to ``extended`` as ``key → (recorded, raised)``.

    Raises:
        ConfigMismatch: the record differs; the message names each differing key with both values (a lowered
            extendable key says it can only be raised).
    """
    if not os.path.exists(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            old = load_record_yaml(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise OutputDirError(f"{path}: cannot read the config record of this output directory ({e})") from e
    model = type(cfg) if isinstance(cfg, BaseModel) else None
    if ignore is None:
        ignore = operational_keys(model) if model is not None else set()
    diff = config_diff(old, as_dict(cfg), ignore, model=model)
    if diff:  # the same existing file named another way (``<checkout>/../shared/x`` and ``/data/x``) is the same input
        was, now = leaves(old), leaves(as_dict(cfg))
        diff = [d for d in diff if not _same_file(was.get(k := d.split(":", 1)[0]), now.get(k))]
    if extended is not None and model is not None:
        diff = _extensions(diff, extendable_keys(model), old, as_dict(cfg), extended)
    if diff:
        keys = [d.split(":", 1)[0] for d in diff]
        name = name or path
        raise ConfigMismatch(
            f"{os.path.dirname(name) or '.'} was written with a different config (differs in: {', '.join(keys)}):\n  "
            + "\n  ".join(diff)
            + f"\nrerun with the config recorded in {name} to resume, or use a new output_dir "
            "(nothing was changed in this one)",
            keys,
        )
    return True


def _same_file(a: Any, b: Any) -> bool:
    """Two recorded values that are absolute paths of one existing file or directory."""
    if not (isinstance(a, str) and isinstance(b, str) and os.path.isabs(a) and os.path.isabs(b)):
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _leaf(config: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, Mapping) else None
    return config


def _extensions(diff: list[str], keys: set[str], old: Mapping[str, Any], new: Mapping[str, Any],
                extended: dict[str, tuple[int, int]]) -> list[str]:
    """``diff`` without the extendable ``keys`` raised from ``old`` to ``new`` (added to ``extended``); a lowered
    one says it can only be raised."""
    rest = []
    for line in diff:
        key = line.split(":", 1)[0]
        a, b = _leaf(old, key), _leaf(new, key)
        if key in keys and all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)):
            if b > a:
                extended[key] = (a, b)
                continue
            line += " (it can only be raised: a run is extended, never shortened)"
        rest.append(line)
    return rest


def write_config_record(path: str, cfg: BaseModel | Mapping[str, Any]) -> None:
    """Write the resolved config record atomically (errors name the file)."""
    try:
        atomic_write_text(path, yaml.safe_dump(as_dict(cfg), sort_keys=False))
    except OSError as e:
        raise OutputDirError(describe_os_error(e, f"cannot write {path}")) from e


def open_output_dir(directory: str, job: str, records: Mapping[str, BaseModel | Mapping[str, Any]] | None = None,
                    *, name: str | None = None, after_lock: Callable[[OutputDirLock], None] | None = None,
                    ) -> OutputDirLock:
    """Lock ``directory`` for ``job`` and check its config records (file name → config).

    ``name``: how messages name the directory (the object-store URL whose local cache ``directory`` is);
    ``after_lock(lock)`` runs once the lock is held, before the records are checked (it brings the records of
    an object-store directory into its cache, and adds what :meth:`OutputDirLock.release` must undo).

    Nothing is written but the lock file: the caller calls :meth:`OutputDirLock.write_records` once its
    own checks passed, right before its first output, so neither a refused rerun nor a run stopped by
    bad settings leaves a record behind. The caller keeps the lock for the job's lifetime
    (``with open_output_dir(...) as lock:``).

    Raises:
        OutputDirBusy, ConfigMismatch, OutputDirError: see the classes.
    """
    lock = OutputDirLock(directory, job, name=name)
    lock.records = set(records or {})
    try:
        if after_lock is not None:
            after_lock(lock)
        lock.fresh = set(os.listdir(directory)) <= {LOCK_NAME}  # (an object store's: once its cache is the bucket)
        for record, cfg in (records or {}).items():
            path, shown = os.path.join(directory, record), f"{name}/{record}" if name else None
            here = location_keys(cfg, directory, name)
            ignore = (operational_keys(type(cfg)) if isinstance(cfg, BaseModel) else set()) | set(here)
            extended: dict[str, tuple[int, int]] = {}
            try:
                if not check_config_record(path, cfg, ignore=ignore, name=shown, extended=extended) \
                        or extended:  # (an extended run's record is rewritten with the raised values)
                    lock.pending[record] = cfg
                    lock.extended.update(extended)
                    continue
            except ConfigMismatch as e:  # the suggested rerun must write here, not where the record was written
                moved = _moved(path, here)
                if not moved:
                    if _holds_outputs(directory, set(records or {})):
                        raise
                    # the record protects outputs; with none yet (a run that failed before its first one, e.g. on
                    # a token id outside the vocabulary) the corrected rerun replaces it instead of being refused
                    print(f"note: {shown or path} records a config that produced no output yet (differs in: "
                          f"{', '.join(e.keys)}): replacing it with this run's", file=sys.stderr)
                    lock.pending[record] = cfg
                    lock.replaced = True
                    continue
                sets = " ".join(f"--set {k}={v}" for k, v in moved.items())
                raise ConfigMismatch(str(e).replace(" to resume, or", f" and {sets} to resume, or"), e.keys) from None
            if _moved(path, here):  # a copied or moved directory resumes; its record then names where it is now
                lock.pending[record] = cfg
    except BaseException:
        lock.release()
        raise
    return lock


def _holds_outputs(directory: str, records: set[str]) -> bool:
    """Whether ``directory`` holds any file but its lock, its config ``records`` and manifests that list no shard
    (a failed prepare records that nothing was finished); empty folders are no output. Conservative: a file that
    cannot be read as such an empty manifest is an output."""
    for root, _, files in os.walk(directory):
        for f in files:
            if root == directory and f in records | {LOCK_NAME, INPUTS_NAME}:
                continue
            if f == "manifest.json" and _lists_no_shard(os.path.join(root, f)):
                continue
            return True
    return False


def _lists_no_shard(path: str) -> bool:
    try:
        if os.path.getsize(path) > 1 << 20:
            return False
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("shards") == [] and not data.get("complete")


def location_keys(cfg: BaseModel | Mapping[str, Any], directory: str, name: str | None = None) -> dict[str, str]:
    """The keys of ``cfg`` that name ``directory`` itself (its ``output_dir``), spelled any way (a trailing ``/``, a
    relative path, a link; ``name``: its object-store URL), with their values. A directory is where its record is:
    these keys are not compared with the record, so a copied or moved run directory resumes from its new place."""
    where = os.path.realpath(directory)
    url = name.rstrip("/") if name and "://" in name else None
    return {k: v for k, v in leaves(as_dict(cfg)).items() if isinstance(v, str) and v
            and (v.rstrip("/") == url if "://" in v else os.path.realpath(v) == where)}


def _moved(path: str, here: Mapping[str, str]) -> dict[str, str]:
    """The keys of ``here`` whose value in the record at ``path`` is spelled otherwise (the run was recorded
    elsewhere, or the same place another way)."""
    if not here or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            old = leaves(load_record_yaml(f) or {})
    except (OSError, yaml.YAMLError):
        return {}
    return {k: v for k, v in here.items() if old.get(k) != v}


# ------------------------------------------------------------------------------------------------
# OS errors → messages
# ------------------------------------------------------------------------------------------------
_HINTS = {
    errno.ENOSPC: "the disk is full: free space (or use an output_dir on another disk) and rerun; finished "
                  "work is kept and the job resumes",
    errno.EDQUOT: "the disk quota is exceeded: free space and rerun; finished work is kept and the job resumes",
    errno.EACCES: "no permission: make the directory writable (or use another output_dir) and rerun",
    errno.EPERM: "no permission: make the directory writable (or use another output_dir) and rerun",
    errno.EROFS: "the file system is read-only: use an output_dir on a writable one",
}


def describe_os_error(e: OSError, what: str) -> str:
    """``what`` + the OS error (with the file it names) + what to do about it."""
    where = f" ({e.filename})" if e.filename and str(e.filename) not in what else ""
    hint = _HINTS.get(e.errno or 0)
    return f"{what}{where}: {e.strerror or e}" + (f"; {hint}" if hint else "")


def report_job_errors(body: Callable[[], T], what: str, expected: tuple[type[BaseException], ...] = ()) -> T | None:
    """Run a job's body; an error the user can act on becomes one ``error: ...`` line on stderr and ``None``.

    Bad input (``ValueError`` and its subclasses: bad records, shard schemas, settings), a missing file, and
    the ``expected`` error types are printed as they are; any other ``OSError`` (a full disk, a read-only
    directory, ...) through :func:`describe_os_error` with ``what`` (e.g. ``"training into runs/x failed"``).
    Anything else is a bug and propagates with its traceback. An object-store output's cache paths are named by
    their URLs (:func:`curation.io.cache.urls_in_text`): the message says what the user gave.
    """
    try:
        return body()
    except (ValueError, FileNotFoundError, *expected) as e:
        print(f"error: {urls_in_text(str(e))}", file=sys.stderr)
    except OSError as e:
        print(f"error: {urls_in_text(describe_os_error(e, what))}", file=sys.stderr)
    return None
