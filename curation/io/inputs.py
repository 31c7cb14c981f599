"""The inputs a run depends on, identified by their content: a resumed or extended run whose inputs changed is
refused (issue 55), never trained on a mix of two datasets or two tokenizers.

The config fields marked :data:`schemas.records.INPUT` name a job's inputs (the candidate, validation, scored or
selected shard directories, the tokenizer, the reference or proxy weights, a model directory or the weights loaded
over it). When a job is about to write (:meth:`curation.io.outdir.OutputDirLock.write_records`), each of them is
fingerprinted and compared with ``output_dir/inputs.json``; the first run records them there. What a fingerprint
covers, kept cheap for big datasets:

* a **shard directory** (one holding an ``index.json``): the bytes of its ``index.json``, which lists every shard
  file's name, size and xxh64 hash, so a re-prepared dataset (another seed, tokenizer, corpus) differs. A shard file
  changed without its index is caught when it is read: readers check every shard against its index's hashes;
* a **file** (a tokenizer, safetensors weights): its bytes (xxh3-128);
* **another directory** (a Hugging Face model or tokenizer directory): the names and bytes of all its files.

Reading every byte of large weights on each resume is avoided as the work units of ``prepare`` avoid it: the record
keeps each file's size and mtime, and a file whose size and mtime are unchanged is taken as unchanged (a copy or a
touch is hashed again, and keeps its fingerprint). An input that does not exist any more is not compared (the job
reports it when it reads it). The paths themselves are not compared (the config record is: a moved dataset is the
same input), only what is there.

**A run that stopped on bad data in an input's shard** (a token id outside the vocabulary, a corrupt shard: the
error blames the shard files, :mod:`curation.io.bad_shards`) records that failure beside the fingerprints
(:func:`record_failure`: the input's key, the shard names its ``index.json`` lists them under, a digest of the index
with those shards' sizes and hashes left out, and a digest of each of their entries). The rerun after the shards
were fixed accepts the input when its new ``index.json`` differs from the recorded one only in those shards' sizes
and hashes (the same shards, names and sample counts, every other entry and field as it was): it prints one note
naming the shards that changed and records the new fingerprint (the failure is then spent). Any other change is
refused as before. The record is untrusted: a shard name that is not a plain relative path is refused, and one that
is not in the index accepts nothing.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import xxhash
from pydantic import BaseModel

from curation.io import storage
from curation.io.atomic import atomic_write_text
from curation.io.bad_shards import blamed
from curation.io.outdir import INPUTS_NAME, InputsChanged, OutputDirLock
from curation.io.paths import UnsafeNameError, check_relative
from schemas.records import as_dict, input_keys, leaves

__all__ = ["INPUTS_NAME", "input_paths", "fingerprint", "check_inputs", "record_failure", "watch_inputs"]

_INDEX = "index.json"


def input_paths(records: Mapping[str, BaseModel | Mapping[str, Any]]) -> dict[str, str]:
    """``{dotted key: path}`` of the inputs the config ``records`` name (their :data:`~schemas.records.INPUT`
    fields that are set); a path named by two records (``train.data.candidates`` of ``engine_config.yaml`` and
    ``data.candidates`` of ``config.yaml``) once, by the first."""
    out: dict[str, str] = {}
    for cfg in records.values():
        if not isinstance(cfg, BaseModel):
            continue
        values = leaves(as_dict(cfg))
        for key in sorted(input_keys(type(cfg))):
            path = values.get(key)
            if isinstance(path, str) and path and path not in out.values():
                out[key] = path
    return out


def _files(path: str) -> list[tuple[str, str]]:
    """``(name, file)`` of what identifies the input at ``path`` (see the module docstring)."""
    if not os.path.isdir(path):
        return [("", path)]
    index = os.path.join(path, _INDEX)
    if storage.refresh(index):  # a shard directory (an object-store one: its index, as the bucket has it now)
        return [(_INDEX, index)]
    found = []
    for d, dirs, names in os.walk(path):
        dirs.sort()
        found += [(os.path.relpath(os.path.join(d, n), path), os.path.join(d, n)) for n in sorted(names)]
    return found


def fingerprint(path: str, recorded: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"kind", "stat", "xxh3"}`` of the input at ``path``; when ``recorded`` (its earlier fingerprint) has the
    same ``stat`` (each file's name, size and mtime), its hash is taken over instead of reading the files again."""
    files = _files(path)
    stat = [[name, *_stat(file)] for name, file in files]
    kind = "file" if files == [("", path)] else "shards" if [n for n, _ in files] == [_INDEX] else "directory"
    if recorded is not None and recorded.get("stat") == stat and recorded.get("kind") == kind:
        return {"kind": kind, "stat": stat, "xxh3": recorded.get("xxh3")}
    h = xxhash.xxh3_128()
    for name, file in files:
        h.update(f"{name}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return {"kind": kind, "stat": stat, "xxh3": h.hexdigest()}


def _index_hash(data: bytes) -> str:
    """A shard directory's fingerprint hash (:func:`fingerprint`) from the bytes of its ``index.json``."""
    return xxhash.xxh3_128(f"{_INDEX}\0".encode() + data).hexdigest()


def _stat(file: str) -> list[int]:
    st = os.stat(file)
    return [st.st_size, st.st_mtime_ns]


def check_inputs(lock: OutputDirLock, inputs: Mapping[str, str], *, record: bool = True) -> None:
    """Compare ``inputs`` (``{key: path}``) with the record in ``lock``'s directory (see the module docstring); with
    ``record``, record them when there is none (or it lacks one of them), and the fingerprints taken over a touch
    or a copy. A shard directory changed only in the shards the run failed on is accepted: one note line on stderr
    names them, and its new fingerprint is recorded now (also without ``record``).

    Raises:
        InputsChanged: one line naming the first changed input, its path and what to do; or a record that cannot
            be read or names a shard outside its input.
    """
    path = os.path.join(lock.directory, INPUTS_NAME)
    old, failed = ({}, {}) if lock.replaced else _recorded(path, lock.name)  # (a record without output is replaced)
    new = dict(old)
    fixed: dict[str, list[str]] = {}  # key → the failed shards whose entries changed
    for key, where in inputs.items():
        if not os.path.exists(where):
            continue  # gone: the job says so when it reads it
        was = old.get(key) if isinstance(old.get(key), dict) else None
        now = {"path": storage.canonical(where),
               **fingerprint(where, was if was and was.get("path") == storage.canonical(where) else None)}
        if was is not None and was.get("xxh3") != now["xxh3"]:
            changed = _fixed(where, was, failed.get(key)) if now["kind"] == "shards" else None
            if changed is None:
                what = {"shards": "its index.json, which lists every shard's hash, differs",
                        "file": "its bytes differ"}.get(now["kind"], "its files differ")
                raise InputsChanged(
                    f"{key} ({storage.display(where)}) is not the input this run was started with ({what} from what "
                    f"{lock.name}/{INPUTS_NAME} recorded from {was.get('path')}): a resumed or extended run reads the "
                    "inputs it started with; restore them, or use a new output_dir for the new ones")
            fixed[key] = changed
        new[key] = now
    if fixed:  # every input passed: the fixed ones are recorded now, their failures spent
        for key, changed in fixed.items():
            shards = ", ".join(changed) if changed else "none (its index.json was rewritten with the same entries)"
            print(f"note: {key} ({storage.display(inputs[key])}) changed only in the shards this run failed on, "
                  f"accepted: {shards}; every other entry of its index.json is as {lock.name}/{INPUTS_NAME} "
                  "recorded it, which now records the new one", file=sys.stderr, flush=True)
        _write(lock, path, new if record else {**old, **{k: new[k] for k in fixed}},
               {k: v for k, v in failed.items() if k not in fixed})
    elif record and new != old:
        _write(lock, path, new, failed)


def _write(lock: OutputDirLock, path: str, inputs: Mapping[str, Any], failed: Mapping[str, Any]) -> None:
    """Write the record of ``inputs`` (and of the ``failed`` shards, when any) atomically, then publish it."""
    data: dict[str, Any] = {"inputs": dict(inputs), **({"failed": dict(failed)} if failed else {})}
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    if lock.on_record is not None:
        lock.on_record(path)


def _recorded(path: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inputs recorded at ``path`` and the failures recorded with them (``{}``: none yet).

    Raises:
        InputsChanged: the record cannot be read, or a failure names a shard that is not a plain relative path.
    """
    storage.refresh(path)  # an object-store output_dir: the bucket's record
    if not os.path.exists(path):
        return {}, {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        inputs, failed = data["inputs"], data.get("failed", {})
        if not isinstance(inputs, dict):
            raise TypeError(f"'inputs' is {type(inputs).__name__}, not a mapping")
        if not isinstance(failed, dict):
            raise TypeError(f"'failed' is {type(failed).__name__}, not a mapping")
        for key, failure in failed.items():
            _check_failure(key, failure, f"{name}/{INPUTS_NAME}")
        return inputs, failed
    except UnsafeNameError as e:  # a failed shard named outside its input: hostile, refused in its own words
        raise InputsChanged(str(e)) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputsChanged(f"{name}/{INPUTS_NAME}: cannot read the record of this run's inputs ({e}); restore it, "
                            "or use a new output_dir") from None


def _check_failure(key: str, failure: object, source: str) -> None:
    """Raise ValueError / TypeError unless ``failure`` is a record of :func:`record_failure` whose shard names are
    plain relative paths (a name read back from the output directory is untrusted: curation.io.paths)."""
    if not isinstance(failure, dict) or not all(isinstance(failure.get(k), str) for k in ("xxh3", "rest")) \
            or not isinstance(failure.get("shards"), list) or not failure["shards"] \
            or not isinstance(failure.get("entries"), dict):
        raise TypeError(f"the record of what {key} failed on is not one this version writes")
    for shard in failure["shards"]:
        check_relative(shard, what=f"the shard {key} failed on", source_file=source)
        if not isinstance(failure["entries"].get(shard), str):
            raise TypeError(f"the record of what {key} failed on has no entry digest of {shard!r}")


def _load_index(where: str) -> tuple[bytes, dict[str, Any]] | None:
    """The bytes and the parsed ``index.json`` of the shard directory ``where`` (``None``: unreadable)."""
    try:
        with open(os.path.join(where, _INDEX), "rb") as f:
            data = f.read()
        index = json.loads(data)
    except (OSError, ValueError):
        return None
    return (data, index) if isinstance(index, dict) and isinstance(index.get("shards"), list) else None


def _name(entry: object) -> str | None:
    """The name an index lists a shard under: its (compressed, else raw) file's basename, as readers name it."""
    if not isinstance(entry, dict):
        return None
    for key in ("zip_data", "raw_data"):
        if isinstance(entry.get(key), dict) and isinstance(entry[key].get("basename"), str):
            return entry[key]["basename"]
    return None


def _digest(value: Any) -> str:
    return xxhash.xxh3_128(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _without(index: Mapping[str, Any], shards: Iterable[str]) -> str:
    """A digest of ``index`` with the sizes and hashes of the files of ``shards`` left out (everything else, the
    shards' names, order, sample counts and columns included, is in it)."""
    names = set(shards)

    def masked(entry: Any) -> Any:
        if _name(entry) not in names:
            return entry
        return {k: {**v, "bytes": None, "hashes": None} if k in ("raw_data", "zip_data") and isinstance(v, dict)
                else v for k, v in entry.items()}

    return _digest({**index, "shards": [masked(e) for e in index["shards"]]})


def _fixed(where: str, was: Mapping[str, Any], failure: Mapping[str, Any] | None) -> list[str] | None:
    """The failed shards whose entries changed, when the shard directory ``where`` differs from its recorded
    fingerprint ``was`` only in the sizes and hashes of the shards ``failure`` names; ``None`` otherwise (no
    failure recorded against that fingerprint, a failed shard not in the index, any other difference)."""
    if not failure or failure.get("xxh3") != was.get("xxh3") or was.get("kind") != "shards":
        return None
    loaded = _load_index(where)
    if loaded is None:
        return None
    entries = {n: e for e in loaded[1]["shards"] if (n := _name(e)) is not None}
    shards = list(failure["shards"])
    if any(s not in entries for s in shards) or _without(loaded[1], shards) != failure["rest"]:
        return None
    return [s for s in shards if _digest(entries[s]) != failure["entries"].get(s)]


def record_failure(lock: OutputDirLock, inputs: Mapping[str, str], files: Iterable[str]) -> None:
    """Record, beside the inputs' fingerprints in ``lock``'s directory, that the run stopped on bad data in the shard
    ``files`` (absolute paths: :func:`curation.io.bad_shards.blamed`, or the URLs of cache paths): for each shard directory of ``inputs`` that
    holds some of them and is still the one recorded (its ``index.json`` hashes to the recorded fingerprint), their
    names in its index (added to those of an earlier failure against the same fingerprint), a digest of the index
    without their sizes and hashes, and a digest of each of their entries (see the module docstring). Nothing is
    written without a record of the inputs, or when no file is a shard its index lists."""
    files = [os.path.realpath(storage.local_path(f)) for f in files]  # (a worker elsewhere blames by URL)
    path = os.path.join(lock.directory, INPUTS_NAME)
    if not files or not os.path.exists(path):
        return
    try:
        old, before = _recorded(path, lock.name)
    except InputsChanged:
        return  # an unreadable record is refused by the rerun: nothing is added to it
    failed = dict(before)
    for key, where in inputs.items():
        was = old.get(key)
        if not isinstance(was, dict) or was.get("kind") != "shards" or (loaded := _load_index(where)) is None:
            continue
        data, index = loaded
        if _index_hash(data) != was.get("xxh3"):
            continue  # not the recorded input any more: the rerun compares it as it is
        root = os.path.realpath(where)
        entries = {n: e for e in index["shards"] if (n := _name(e)) is not None}
        hit = {n for f in files if (n := os.path.relpath(f, root).replace(os.sep, "/")) in entries}
        if not hit:
            continue
        earlier = failed.get(key)
        if isinstance(earlier, dict) and earlier.get("xxh3") == was["xxh3"]:
            hit |= set(earlier["shards"]) & set(entries)
        shards = sorted(hit)
        failed[key] = {"xxh3": was["xxh3"], "shards": shards, "rest": _without(index, shards),
                       "entries": {s: _digest(entries[s]) for s in shards}}
    if failed != before:
        _write(lock, path, old, failed)


def watch_inputs(lock: OutputDirLock, records: Mapping[str, BaseModel | Mapping[str, Any]]) -> None:
    """Check the inputs named by ``records`` against those the run was started with now (a resumed run is refused
    before it loads anything), have ``lock`` record them before it writes its records (the job's first write:
    by then a job that prepares its data, the main job's demo, has it), and record the input shards a failure of
    the job blames (:func:`record_failure`)."""
    inputs = input_paths(records)
    if not inputs:
        return
    try:
        check_inputs(lock, inputs, record=False)
    except BaseException:
        lock.release()
        raise
    lock.before_records.append(lambda: check_inputs(lock, inputs))
    lock.on_failure.append(lambda error: record_failure(lock, inputs, blamed(error)))
