"""Every job on a Ray cluster of two nodes that share only the object store (``tests/two_nodes.py``: two Ray nodes on
this machine, each node's processes with their own cache and working directory and barred from the other's, SeaweedFS
as the one thing they share; issue 56).

One cluster for the module, used in order: a job that names a local path some node cannot reach is refused before it
starts; ``prepare.py`` with its units on both nodes, inputs in the bucket and local ones staged into it, equals an
in-process run object for object; ``curate.py`` (``ray job submit`` from this process) with a scoring worker on each
node selects what a run with both workers on one node selects; ``replay.py`` submitted to run on the second node
trains what an in-process replay trains. Afterwards no process of a node touched the other node's directories (the
guard's log is empty) and each node's cache holds only the bucket's objects it worked on."""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest
import yaml

from curation.io import objects
from tests.conftest import ENGINE_SIZES, ENGINE_VOCAB
from tests.two_nodes import REPO, TwoNodes

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1500)]

PREPARE = os.path.join(REPO, "jobs", "prepare.py")
#: every node has one of each role: two tasks, workers or ranks of a role asking for one run on two nodes
ROLES = {"prep": 1, "scorer": 1, "rank": 1}


@pytest.fixture(scope="module")
def env(s3_server, tmp_path_factory):
    """This process's view of the object store (its own cache, as a third machine) for the module."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():
            mp.setenv(k, v)
        mp.setenv("BLADE_CACHE_DIR", str(tmp_path_factory.mktemp("test-cache")))
        objects.forget_clients()
        yield {"bucket": s3_server.new_bucket()}
    objects.forget_clients()


@pytest.fixture(scope="module")
def cluster(s3_server, env):
    c = TwoNodes(s3_server.env(), ROLES)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _url(env: dict, path: str) -> str:
    return f"s3://{env['bucket']}/{path}"


def _objects(url: str) -> dict[str, str]:
    """``{key: ETag}`` under ``url``, the run's lock object left out."""
    return {k: o.etag for k, o in objects.list_objects(url).items() if k != ".lock"}


def _json(url: str) -> dict:
    return json.loads(objects.read_object(url).body)


def _cache_files(node) -> list[str]:  # noqa: ANN001 - a tests.two_nodes.Node
    return sorted(os.path.relpath(os.path.join(d, f), node.cache) for d, _, fs in os.walk(node.cache) for f in fs)


def _write_yaml(path: str, data: dict) -> str:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f)
    return path


# ------------------------------------------------------------------------------------------------
# prepare
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(cluster, env):
    """The engine demo's corpus: its candidate sources uploaded to the bucket (read there by every node), its
    validation source a local file of node A's (staged into the bucket by the job)."""
    from curation.ingest.demo import write_demo_corpus

    raw = os.path.join(cluster.nodes["node_a"].work, "raw")
    write_demo_corpus(raw, sizes=ENGINE_SIZES)
    for name in ("target", "general", "noise"):
        objects.upload(os.path.join(raw, f"{name}.jsonl"), _url(env, f"raw/{name}.jsonl"))
    return raw


def _prepare_config(env: dict, raw: str, out: str, **more) -> dict:
    from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig

    qa = "{question}\n{answer}"
    cfg = PrepareConfig(
        sources=[SourceConfig(name="target", paths=[_url(env, "raw/target.jsonl")], template=qa),
                 SourceConfig(name="general", paths=[_url(env, "raw/gen*.jsonl")]),
                 SourceConfig(name="noise", paths=[_url(env, "raw/noise.jsonl")])],
        validation=[SourceConfig(name="target_val", paths=[os.path.join(raw, "target_val.jsonl")], template=qa)],
        tokenizer=TokenizerConfig(vocab_size=ENGINE_VOCAB), output_dir=out, seq_len=128, sequences_per_part=64,
        unit_bytes=16_000, progress=False, stage_inputs=_url(env, "staged"),
    )
    return {**cfg.model_dump(mode="json"), **more}


def test_a_local_path_another_node_cannot_reach_is_refused_before_the_job_starts(cluster, env, corpus):
    node_a = cluster.nodes["node_a"]
    out = os.path.join(node_a.work, "local-data")
    cfg = _write_yaml(os.path.join(node_a.work, "local.yaml"), _prepare_config(
        env, corpus, out, workers=2, resources={"prep": 1}, ray={"address": cluster.address}))
    done = cluster.run("node_a", PREPARE, "--config", cfg, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    line = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert line and f"output_dir = {out} cannot be reached from the Ray node " in line[0], done.stderr
    assert "Use an s3:// URL" in line[0] and "stage_inputs" in line[0]
    assert not os.path.exists(os.path.join(out, "candidates"))  # refused before any work unit started
    events = cluster.guard_events()  # the probe of node B is what the guard refused, and all it refused
    assert events and all(e.startswith("node_b: ") and f": open {out}/" in e for e in events), "\n".join(events) + "\n" + out
    os.remove(cluster.nodes["node_b"].guard_log)


@pytest.fixture(scope="module")
def prepared(cluster, env, corpus):
    """The corpus prepared on both nodes (2 tasks, one per node) by a driver on node A, and in this process alone."""
    from curation.ingest.prepare import prepare
    from schemas.config import PrepareConfig

    node_a = cluster.nodes["node_a"]
    cfg = _write_yaml(os.path.join(node_a.work, "prepare.yaml"), _prepare_config(
        env, corpus, _url(env, "two/data"), workers=2, resources={"prep": 1}, ray={"address": cluster.address}))
    t0 = time.monotonic()
    done = cluster.run("node_a", PREPARE, "--config", cfg, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    seconds = time.monotonic() - t0
    one = prepare(PrepareConfig.model_validate(_prepare_config(env, corpus, _url(env, "one/data"), workers=1)))
    return {"stdout": done.stdout, "seconds": seconds, "one": one}


def test_prepare_on_two_nodes_equals_one_process_object_for_object(cluster, env, prepared):
    assert "(2 workers)" in prepared["stdout"], prepared["stdout"]
    two, one = _objects(_url(env, "two/data")), _objects(_url(env, "one/data"))
    assert sorted(two) == sorted(one)
    records = {"config.yaml", "inputs.json"}  # (they name the output directory and the workers)
    differ = [k for k in two if two[k] != one[k] and os.path.basename(k) not in records | {"manifest.json"}]
    assert differ == []
    for group in ("candidates", "validation"):
        a, b = (_json(_url(env, f"{run}/data/{group}/manifest.json")) for run in ("two", "one"))
        assert a.pop("config")["workers"] == 2 and b.pop("config")["workers"] == 1
        for m, run in ((a, "two"), (b, "one")):  # (a trained tokenizer is in the output directory)
            assert m["extra"].pop("tokenizer_path") == _url(env, f"{run}/data/tokenizer/tokenizer.json")
        assert a == b
    units = _json(_url(env, "two/data/validation/target_val/unit-00000.json"))
    assert units["spans"][0][0] == _url(env, "staged/" + os.path.join(
        cluster.nodes["node_a"].work, "raw", "target_val.jsonl").lstrip("/"))  # the staged copy, by its URL
    # Both nodes prepared units: each node's cache holds parts it wrote (and only the bucket's objects).
    for node in cluster.nodes.values():
        files = _cache_files(node)
        assert any("/two/data/candidates/" in f and "/part-" in f for f in files), (node.name, files)
        assert all(f.startswith(f"s3/{env['bucket']}/") for f in files), (node.name, files)


def test_no_process_of_a_node_touched_the_other_nodes_directories(cluster, prepared):
    assert cluster.guard_events() == []
