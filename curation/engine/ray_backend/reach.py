"""Refuse, before any work starts, a local path that some node of a Ray cluster cannot reach.

A job whose tasks or actors run on several nodes reads and writes its ``s3://`` directories through each node's own
cache (:mod:`curation.io.storage`); a *local* path it names (an output directory, an input, a tokenizer) must then be
one every node sees the same: a shared filesystem. Nothing can tell a shared mount from a node-local directory of
the same name but the other nodes themselves, so :func:`check_shared` asks them: the driver writes a token into
each directory it names (a file: it reads its first bytes), and a task pinned to every other node that could run
the job's work reads it back. A node that cannot (no such path, another file, no permission) fails the job at once,
in one line naming the setting, the path and the node, instead of a worker failing, or writing where nobody reads,
in the middle of the run. A cluster of one node has nothing to check.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Mapping

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["check_shared", "other_nodes"]

_TOKEN = ".blade-reach-"  # a probe file's name prefix in a directory the job writes (removed after the check)


def other_nodes(resources: Mapping[str, float] | None = None) -> list[dict]:
    """The alive nodes of the cluster other than this process's that have every custom resource of ``resources``
    (where the job's tasks may run)."""
    here = ray.get_runtime_context().get_node_id()
    return [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != here
            and all(n["Resources"].get(k, 0) > 0 for k in (resources or {}))]


def _digest(path: str) -> str:
    """What a node must read at ``path``: a directory's probe file, a file's first 64 KiB (as a hash)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(1 << 16)).hexdigest()


def _read(paths: dict[str, str]) -> dict[str, str]:
    """On a node: what it reads at each path (``"error: ..."`` when it cannot)."""
    seen = {}
    for key, path in paths.items():
        try:
            seen[key] = _digest(path)
        except OSError as e:
            seen[key] = f"error: {e.strerror or e}"
    return seen


def check_shared(needs: Mapping[str, str], *, resources: Mapping[str, float] | None = None,
                 hint: str = "") -> None:
    """Refuse a local path of ``needs`` (``{setting: path}``) that a node of the cluster able to run the job's work
    (:func:`other_nodes`) cannot reach (module docstring). Call it in a Ray session, before the work starts.

    Raises:
        ValueError: one line naming the setting, the path, the node and what to do (``hint`` added).
    """
    nodes = other_nodes(resources)
    if not needs or not nodes:
        return
    probes: dict[str, str] = {}
    made: list[str] = []
    expected: dict[str, str] = {}
    try:
        for key, path in needs.items():
            if os.path.isdir(path):
                probe = os.path.join(path, f"{_TOKEN}{uuid.uuid4().hex}")
                with open(probe, "w", encoding="utf-8") as f:
                    f.write(uuid.uuid4().hex)
                made.append(probe)
            elif os.path.exists(path):
                probe = path
            else:
                continue  # (created later, under one that is checked, or reported by its reader)
            probes[key], expected[key] = probe, _digest(probe)
        task = ray.remote(_read)
        seen = ray.get([task.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(probes) for n in nodes])
    finally:
        for probe in made:
            os.remove(probe)
    for node, answer in zip(nodes, seen, strict=True):
        for key, digest in answer.items():
            if digest != expected[key]:
                why = digest.removeprefix("error: ") if digest.startswith("error: ") else "it holds another file there"
                raise ValueError(
                    f"{key} = {needs[key]} cannot be reached from the Ray node {node['NodeManagerAddress']} "
                    f"(node {node['NodeID'][:12]}: {why}), which runs this job's work: every node must see it the "
                    "same. Use an s3:// URL (each node reads and writes the bucket through its own cache) or a path "
                    f"on a filesystem every node mounts{hint}")
