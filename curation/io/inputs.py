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
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import xxhash
from pydantic import BaseModel

from curation.io import storage
from curation.io.atomic import atomic_write_text
from curation.io.outdir import INPUTS_NAME, InputsChanged, OutputDirLock
from schemas.records import as_dict, input_keys, leaves

__all__ = ["INPUTS_NAME", "input_paths", "fingerprint", "check_inputs", "watch_inputs"]

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


def _stat(file: str) -> list[int]:
    st = os.stat(file)
    return [st.st_size, st.st_mtime_ns]


def check_inputs(lock: OutputDirLock, inputs: Mapping[str, str], *, record: bool = True) -> None:
    """Compare ``inputs`` (``{key: path}``) with the record in ``lock``'s directory (see the module docstring); with
    ``record``, record them when there is none (or it lacks one of them), and the fingerprints taken over a touch
    or a copy.

    Raises:
        InputsChanged: one line naming the first changed input, its path and what to do.
    """
    path = os.path.join(lock.directory, INPUTS_NAME)
    old = {} if lock.replaced else _recorded(path, lock.name)  # (a record that produced no output is replaced)
    new = dict(old)
    for key, where in inputs.items():
        if not os.path.exists(where):
            continue  # gone: the job says so when it reads it
        was = old.get(key) if isinstance(old.get(key), dict) else None
        now = {"path": storage.canonical(where),
               **fingerprint(where, was if was and was.get("path") == storage.canonical(where) else None)}
        if was is not None and was.get("xxh3") != now["xxh3"]:
            what = {"shards": "its index.json, which lists every shard's hash, differs",
                    "file": "its bytes differ"}.get(now["kind"], "its files differ")
            raise InputsChanged(
                f"{key} ({storage.display(where)}) is not the input this run was started with ({what} from what "
                f"{lock.name}/{INPUTS_NAME} recorded from {was.get('path')}): a resumed or extended run reads the "
                "inputs it started with; restore them, or use a new output_dir for the new ones")
        new[key] = now
    if record and new != old:
        atomic_write_text(path, json.dumps({"inputs": new}, indent=1) + "\n")
        if lock.on_record is not None:
            lock.on_record(path)


def _recorded(path: str, name: str) -> dict[str, Any]:
    """The inputs recorded at ``path`` (``{}``: none yet)."""
    storage.refresh(path)  # an object-store output_dir: the bucket's record
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            inputs = json.load(f)["inputs"]
        if not isinstance(inputs, dict):
            raise TypeError(f"'inputs' is {type(inputs).__name__}, not a mapping")
        return inputs
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputsChanged(f"{name}/{INPUTS_NAME}: cannot read the record of this run's inputs ({e}); restore it, "
                            "or use a new output_dir") from None


def watch_inputs(lock: OutputDirLock, records: Mapping[str, BaseModel | Mapping[str, Any]]) -> None:
    """Check the inputs named by ``records`` against those the run was started with now (a resumed run is refused
    before it loads anything), and have ``lock`` record them before it writes its records (the job's first write:
    by then a job that prepares its data, the main job's demo, has it)."""
    inputs = input_paths(records)
    if not inputs:
        return
    try:
        check_inputs(lock, inputs, record=False)
    except BaseException:
        lock.release()
        raise
    lock.before_records.append(lambda: check_inputs(lock, inputs))
