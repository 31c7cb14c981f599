"""Every job on a Ray cluster of two nodes that share only the object store (``tests/two_nodes.py``: two Ray nodes on
this machine, each node's processes with their own cache and working directory and barred from the other's, SeaweedFS
as the one thing they share; issue 56).

One cluster and one prepared corpus for the module, used in order: a job that names a local path some node cannot
reach is refused before it starts; ``prepare.py`` with its units on both nodes, inputs in the bucket and local ones
staged into it, equals an in-process run object for object; ``curate.py`` (``ray job submit`` from this process) with
its scoring workers on node B selects what one scoring worker in this process selects; ``replay.py``
submitted to run on the second node trains what an in-process replay trains; ``train.py`` with a worker group
(``parallel.workers = 2``) and a local output_dir node B cannot read is refused naming it; the group with one rank
per node and an s3:// output_dir, node B's raylet killed mid-run and the same command rerun (node B started again
with an empty cache), trains byte for byte what the group with both ranks on node A trains (that group, its ranks
sharing node A's cache, holds its run in the bucket and its first steps are a single process's);
``curate_and_train.py`` with a trainer rank and a scoring worker on each node selects the rows and trains the weights
of ``train.py``'s group with both ranks on node A; ``prepare.py`` with node B's raylet killed mid-run, node B started
again with an empty cache and the same command rerun, equals an uninterrupted in-process run. Afterwards no process
of a node touched the other node's directories (the guard's log is empty) and each node's cache holds only the
bucket's objects it worked on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from curation.io import objects
from tests import timing
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


# ------------------------------------------------------------------------------------------------
# ray job submit: batch curation and replay
# ------------------------------------------------------------------------------------------------
def _submit(cluster, job: str, *sets: str, resources: dict | None = None) -> str:  # noqa: ANN001 - a TwoNodes
    """``ray job submit`` of ``jobs/<job>.py --set ...`` from this process (a third machine) to the head's job server,
    on the node that has ``resources`` (the head when none); its logs, once it succeeded. A submission the job server
    did not take (its agent not up yet on a loaded machine: no job id printed) is made again, as a user would."""
    env = {**cluster.base_env, "BLADE_CACHE_DIR": cluster.private[0]}
    where = ["--entrypoint-resources", json.dumps(resources)] if resources else []
    cmd = ["ray", "job", "submit", "--address", cluster.dashboard, "--working-dir", REPO, *where, "--", "python",
           f"jobs/{job}.py", *[a for s in sets for a in ("--set", s)]]
    deadline, logs = timing.Deadline(180), ""
    while True:
        done = timing.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        logs = done.stdout + done.stderr
        ids = [w.strip("'") for w in logs.split() if w.strip("'").startswith("raysubmit_")]
        if ids or deadline.expired():
            break
        time.sleep(5)
    assert ids, f"ray job submit never printed a job id:\n{logs[-3000:]}"
    # (the submission waits for the job's end and then prints its status, as `ray job status` would)
    assert f"Job '{ids[0]}' succeeded" in logs, logs[-5000:]
    return logs


def _model() -> dict:
    from schemas.train_config import demo_model_config

    return demo_model_config(ENGINE_VOCAB, hidden=32, layers=1).model_dump(mode="json")


@pytest.fixture(scope="module")
def reference_weights(env, tmp_path_factory):
    """A reference for batch curation: the tiny model of another seed, in the bucket."""
    from curation.engine.weights import Weights
    from curation.io.models import build_causal_lm
    from schemas.train_config import ModelConfig

    path = str(tmp_path_factory.mktemp("weights") / "reference.safetensors")
    Weights.from_state_dict(build_causal_lm(ModelConfig.model_validate({**_model(), "init_seed": 1}))).save(path)
    objects.upload(path, _url(env, "weights/reference.safetensors"))
    return _url(env, "weights/reference.safetensors")


def _curate_settings(env: dict, out: str, workers: dict, reference: str) -> dict:
    return {"candidates": _url(env, "two/data/candidates"), "tokenizer": _url(env, "two/data/tokenizer/tokenizer.json"),
            "model": _model(), "reference_weights": reference, "proxy_weights": None, "gamma": 0.5,
            "batch_size": 8, "output_dir": out, "progress": False, "workers": workers}


def _rows(url: str) -> dict[str, np.ndarray]:
    """Every column of the shards under ``url`` (pulled into this process's cache), rows in index order."""
    from curation.io import storage
    from curation.io.shards import ShardReader

    local = storage.local_path(url)
    storage.pull(local)
    reader = ShardReader(local)
    return _columns([reader[i] for i in range(len(reader))])


def _columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """Rows (a shard reader's dicts) as one array per column."""
    return {k: np.stack([r[k] for r in rows]) for k in rows[0] if k != "source"} | {
        "source": np.array([r["source"] for r in rows])}


def _curated_here(env: dict, reference: str) -> dict[str, np.ndarray]:
    """What batch curation with :func:`_curate_settings` selects, computed in this process: one scoring worker's rows of
    every step, in step order (the engine's own in-process path, as tests/curation/engine/test_ray_backend.py takes
    it), in :func:`_rows`'s form."""
    from curation.engine.plan import PROXY, REFERENCE, WorkUnit
    from curation.engine.weights import Weights
    from curation.engine.workers import BatchOrder, ScoringWorker, WorkerSpec
    from curation.io import storage
    from curation.io.models import build_causal_lm
    from curation.io.shards import open_shards
    from schemas.engine_config import CurateConfig

    cfg = CurateConfig.model_validate(_curate_settings(env, _url(env, "unused"), {}, reference))
    candidates, weights = storage.local_path(cfg.candidates), storage.local_path(cfg.reference_weights)
    storage.pull(candidates)
    storage.pull(weights)
    order = BatchOrder("blocks", len(open_shards(candidates)), cfg.batch_size, seed=cfg.seed, shuffle=cfg.shuffle)
    worker = ScoringWorker(WorkerSpec(candidates=candidates, out_dir="/nonexistent", model=cfg.model, order=order,
                                      vocab_size=ENGINE_VOCAB, policy="blade", gamma=cfg.gamma, schedule=None,
                                      device="cpu", threads=1, needs_proxy=True, precision=cfg.precision), 0)
    fixed = {REFERENCE: Weights.load(weights), PROXY: Weights.from_state_dict(build_causal_lm(cfg.model))}
    rows = []
    for step in range(order.num_steps):
        unit = WorkUnit(step, step + 1, "selected", 0, 0)
        worker._ensure(unit, lambda kind, version: fixed[kind])
        rows += [row for block in worker.rows(unit, {}) for row in block]
    return _columns(rows)


def test_batch_curation_submitted_with_its_scoring_workers_on_the_other_node_selects_what_one_process_selects(
        cluster, env, prepared, reference_weights):
    """``ray job submit`` of ``curate.py`` from this process, its driver (the job's entrypoint) on the head, node A,
    and both scoring workers on node B: they write their parts through node B's cache into the bucket, a coordinator
    on either node merges them, and the rows selected equal, column for column, those one scoring worker computes in
    this process. (Both on node B, not one on each node: the workers pull units as they become free, so one that
    starts late may get none, and a check that each node's worker wrote parts would depend on the start-up order; the
    curate_and_train test below has a scoring worker on each node.)"""
    settings = _curate_settings(env, _url(env, "two/curate"), {"count": 2, "range_steps": 5,
                                                               "resources": {"node_b": 1}}, reference_weights)
    logs = _submit(cluster, "curate", *[f"{k}={json.dumps(v)}" for k, v in settings.items()])
    assert f"selected-token shards: {_url(env, 'two/curate/selected')}" in logs, logs[-3000:]
    two, one = _rows(_url(env, "two/curate/selected")), _curated_here(env, reference_weights)
    assert sorted(two) == sorted(one) and all(
        np.array_equal(two[k], one[k], equal_nan=two[k].dtype.kind == "f") for k in two)
    assert int(two["loss_mask"].sum()) > 0
    written = [f for f in _cache_files(cluster.nodes["node_b"]) if "/two/curate/selected/worker-" in f]
    assert written, _cache_files(cluster.nodes["node_b"])  # (a coordinator on either node reads them)


def test_replay_submitted_to_the_other_node_trains_what_this_process_trains(cluster, env, prepared):
    from schemas.train_config import ReplayConfig
    from training.runs.train_job import replay

    def settings(out: str) -> dict:
        return {"selected": _url(env, "two/curate/selected"), "validation": _url(env, "two/data/validation"),
                "tokenizer": _url(env, "two/data/tokenizer/tokenizer.json"), "model": _model(), "output_dir": out,
                "batch_size": 8, "max_steps": 4, "progress_bar": False, "threads": 1, "device": "cpu",
                "eval": {"interval": 2, "batch_size": 16, "max_batches": 1}, "checkpoint": {"interval": 2}}

    # (its logs are node B's: with each node's Ray session in a directory of its own, the head's job server does not
    # stream them, so the run is judged by what it wrote to the bucket)
    _submit(cluster, "replay", *[f"{k}={json.dumps(v)}" for k, v in settings(_url(env, "two/replay")).items()],
            resources={"node_b": 1})
    replay(ReplayConfig.model_validate(settings(_url(env, "one/replay"))))
    two, one = _objects(_url(env, "two/replay")), _objects(_url(env, "one/replay"))
    assert two["final/model.safetensors"] == one["final/model.safetensors"]
    assert {k for k in two if k.startswith("checkpoints/")} == {k for k in one if k.startswith("checkpoints/")}
    assert any("/two/replay/" in f for f in _cache_files(cluster.nodes["node_b"]))
    assert not any("/two/replay/" in f for f in _cache_files(cluster.nodes["node_a"]))


# ------------------------------------------------------------------------------------------------
# a data-parallel trainer group spanning the nodes
# ------------------------------------------------------------------------------------------------
TRAIN = os.path.join(REPO, "jobs", "train.py")
#: checkpoints every 4: node B is lost after the first, with 28 steps of the run to do; W = 2, τ = 4: refreshes at
#: steps 2, 6, ..., 30 (the main job's group trains the same steps: one reference for both)
GROUP_STEPS = 32


def _train_settings(env: dict, out: str, resources: dict, steps: int = GROUP_STEPS) -> dict:
    """A training config with a worker group of 2 (``parallel.resources`` places its ranks), data and output in the
    bucket; the group is not restarted after a failure (``max_failures = 0``: a lost node ends the run, and the
    same command is rerun)."""
    data = _url(env, "two/data")
    return {"data": {"candidates": f"{data}/candidates", "validation": f"{data}/validation",
                     "tokenizer": f"{data}/tokenizer/tokenizer.json"},
            "model": _model(), "output_dir": out, "batch_size": 8, "max_steps": steps, "threads": 1,
            "device": "cpu", "progress_bar": False, "plots": False,
            "selection": {"warmup_steps": 2, "tau": 4, "refresh_steps": 2, "refresh_batch_size": 2, "rho1_steps": 3,
                          "refresh_candidate_batches": 2},
            "eval": {"interval": min(32, steps), "batch_size": 16, "max_batches": 1},
            "checkpoint": {"interval": 4, "keep": -1},
            "parallel": {"workers": 2, "resources": resources, "max_failures": 0}}


def _train_command(env: dict, out: str, resources: dict) -> list[str]:
    """``jobs/train.py`` with :func:`_train_settings`."""
    sets = _train_settings(env, out, resources)
    return [TRAIN, *[a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]]


def _train_on_node_a(cluster, env: dict, out: str, resources: dict) -> subprocess.CompletedProcess:  # noqa: ANN001
    node_a = cluster.nodes["node_a"]
    return timing.run([sys.executable, *_train_command(env, out, resources)], capture_output=True, text=True,
                      timeout=600, env={**node_a.env(), "RAY_ADDRESS": cluster.address}, cwd=node_a.work)


def _same_outputs(a: str, b: str) -> None:
    """The runs ``a`` and ``b`` (URLs) wrote the same model, selected-token shards and checkpoints."""
    x, y = _objects(a), _objects(b)
    assert x["final/model.safetensors"] == y["final/model.safetensors"]
    assert x["final/reference.safetensors"] == y["final/reference.safetensors"]
    shards = sorted(k for k in x if k.startswith("selected/") and k != "selected/manifest.json")
    assert shards and shards == sorted(k for k in y if k.startswith("selected/") and k != "selected/manifest.json")
    assert [x[k] for k in shards] == [y[k] for k in shards]
    ma, mb = (_json(f"{u}/selected/manifest.json") for u in (a, b))
    ma.pop("config"), mb.pop("config")  # (the runs' settings: their output_dir and parallel.resources)
    assert ma == mb
    assert {k for k in x if k.startswith("checkpoints/")} == {k for k in y if k.startswith("checkpoints/")}


def test_a_trainer_group_with_a_local_output_dir_another_node_cannot_reach_is_refused_before_it_starts(
        cluster, env, prepared):
    """What a group still needs on a shared path is what its config names as a local path: node B, which could host
    a rank, cannot read node A's output_dir, and train.py refuses in one line naming the setting."""
    out = os.path.join(cluster.nodes["node_a"].work, "local-group")
    command = _train_command(env, _url(env, "unused"), {"rank": 1})
    command[command.index(f"output_dir={json.dumps(_url(env, 'unused'))}")] = f"output_dir={out}"
    node_a = cluster.nodes["node_a"]
    done = timing.run([sys.executable, *command], capture_output=True, text=True, timeout=600,
                      env={**node_a.env(), "RAY_ADDRESS": cluster.address}, cwd=node_a.work)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    line = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert line and f"output_dir = {out} cannot be reached from the Ray node " in line[0], done.stderr[-3000:]
    assert "(parallel.workers > 1: a rank on that node reads and writes it" in line[0]
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # refused before any rank started
    events = cluster.guard_events()  # the probe of node B is what the guard refused, and all it refused
    assert events and all(e.startswith("node_b: ") and f": open {out}/" in e for e in events), "\n".join(events)
    os.remove(cluster.nodes["node_b"].guard_log)


@pytest.fixture(scope="module")
def group_on_node_a(cluster, env, prepared) -> str:
    """``train.py``'s group (:func:`_train_settings`) with both ranks on node A, uninterrupted: its URL."""
    out = _url(env, "one/group")
    one = _train_on_node_a(cluster, env, out, {"node_a": 1})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-5000:]
    return out


def test_a_trainer_group_on_one_node_reads_and_writes_the_bucket_and_its_first_steps_are_one_processs(
        env, group_on_node_a, tmp_path):
    """The group with both ranks on node A (they share its cache; data and output_dir in the bucket, as on one
    machine): the bucket holds its run, and its first 6 steps (the constant learning rate makes a 6-step run the
    first 6 of any) read the candidate stream of a single-process run and select, at the first selecting step
    (after W = 2 warm-up steps), the single-process masks (tests/training/test_parallel.py compares whole
    data-parallel runs)."""
    from schemas.train_config import TrainConfig
    from training.runs.train_job import train

    stored = objects.list_objects(group_on_node_a)
    assert {"config.yaml", "selected/manifest.json", "final/model.safetensors", "summary.json",
            "checkpoints/.symlinks.json", "logs/metrics.jsonl"} <= set(stored) and ".lock" not in stored
    steps, b = 6, 8
    single = {**_train_settings(env, str(tmp_path / "single"), {}, steps=steps), "parallel": {"workers": 1}}
    train(TrainConfig.model_validate(single))
    a, g = _rows(str(tmp_path / "single" / "selected")), _rows(f"{group_on_node_a}/selected")
    assert len(g["tokens"]) == GROUP_STEPS * b and len(a["tokens"]) == steps * b
    assert np.array_equal(a["tokens"], g["tokens"][:steps * b])  # the same candidate stream
    first = slice(2 * b, 3 * b)  # the first selecting step: the single-process masks
    assert np.array_equal(a["loss_mask"][first], g["loss_mask"][first])


def test_a_trainer_group_with_a_rank_on_each_node_lost_mid_run_and_rerun_equals_the_group_on_one_node(
        cluster, env, prepared, group_on_node_a):
    """``train.py`` with a worker group of 2, one rank per node (each its own cache; the driver's channel, Ray Train's
    state, checkpoints and selected shards through Ray and the bucket only). Node B is lost (its raylet and processes
    SIGKILLed) once the group's first checkpoint is in the bucket (``max_failures = 0``: the run fails), started
    again as a new machine (its cache empty), and the same command rerun: every rank resumes from the bucket, and
    the outputs equal byte for byte those of the group with both ranks on node A, uninterrupted. (One comparison
    for both claims, a group start fewer: a difference made by the ranks on two nodes, before the loss or after it,
    or by the resume, shows there.)"""
    node_a, node_b = cluster.nodes["node_a"], cluster.nodes["node_b"]
    out = _url(env, "two/group")
    cmd = [sys.executable, *_train_command(env, out, {"rank": 1})]
    run_env = {**node_a.env(), "RAY_ADDRESS": cluster.address}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env,
                            cwd=node_a.work)
    try:
        checkpointed = timing.until(lambda: any(k.startswith("ep0-ba") for k in _objects(f"{out}/checkpoints")),
                                    timeout=600, proc=proc, interval=0.05)
        assert checkpointed and proc.poll() is None, "the run ended before its first checkpoint reached the bucket"
        node_b.kill_raylet()
        first = timing.communicate(proc, timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, (proc.returncode, first[-5000:])  # the group failed (max_failures = 0)
    assert "final/model.safetensors" not in _objects(out), "node B was lost after the run had finished"
    cluster.restart("node_b")
    since = time.time()
    done = timing.run(cmd, capture_output=True, text=True, timeout=600, env=run_env, cwd=node_a.work)
    assert done.returncode == 0, "\n".join([done.stderr[-3000:], cluster.worker_tracebacks(since), *(
        f"{n.name}: {[f for f in _cache_files(n) if '/two/group/' in f]}" for n in cluster.nodes.values())])
    _same_outputs(group_on_node_a, out)
    summary = _json(f"{out}/summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == GROUP_STEPS
    attempts = [json.loads(x) for x in objects.read_object(f"{out}/parallel/attempts.jsonl").body.decode().splitlines()]
    first, rerun = attempts[:2], attempts[2:]
    assert [a["resumed_from"] for a in first] == [None, None] and len(rerun) == 2, attempts
    assert sorted(a["rank"] for a in first) == sorted(a["rank"] for a in rerun) == [0, 1]
    assert len({a["node"] for a in first}) == 2 and len({a["node"] for a in rerun}) == 2  # a rank on each node
    # both ranks of the rerun resumed from the bucket's checkpoint (Composer's link to the newest one), one of them on
    # the new node B (a node id the first run did not have) with an empty cache
    assert [a["resumed_from"] for a in rerun] == [f"{out}/checkpoints/latest-rank0.pt"] * 2, rerun
    assert {a["node"] for a in rerun} - {a["node"] for a in first}, attempts
    assert any(k.startswith("parallel/ray_train/") for k in _objects(out))  # Ray Train's state in the bucket
    for node in cluster.nodes.values():  # each node worked on the run in its own cache (node B's new one too)
        assert any("/two/group/checkpoints/" in f for f in _cache_files(node)), node.name
    # the rank on node B copied only the folders ranks write, not the driver's parallel/ (nor Ray Train's state there)
    assert not [f for f in _cache_files(node_b) if "/two/group/parallel/" in f]


# ------------------------------------------------------------------------------------------------
# the main job: the engine's scoring workers and the trainer group spanning the nodes
# ------------------------------------------------------------------------------------------------
CURATE_AND_TRAIN = os.path.join(REPO, "jobs", "curate_and_train.py")


def _curate_and_train(cluster, env: dict, name: str, ranks: dict, scorers: dict) -> str:  # noqa: ANN001 - TwoNodes
    """``jobs/curate_and_train.py`` driven from node A into ``s3://…/<name>/engine`` (everything in the bucket): a
    trainer group of 2 placed by ``ranks``, 2 scoring workers by ``scorers`` (the coordinator and the refresh actor
    wherever Ray puts them: they take no CPU); its URL, once it succeeded."""
    node_a, out = cluster.nodes["node_a"], _url(env, f"{name}/engine")
    cfg = _write_yaml(os.path.join(node_a.work, f"engine-{name}.yaml"), {
        "train": _train_settings(env, out, ranks), "prepare": None,
        "engine": {"lookahead": 4, "refresh_device": "cpu"},
        "workers": {"count": 2, "range_steps": 2, "device": "cpu", "resources": scorers}})
    done = timing.run([sys.executable, CURATE_AND_TRAIN, "--config", cfg], capture_output=True, text=True,
                      timeout=600, env={**node_a.env(), "RAY_ADDRESS": cluster.address}, cwd=node_a.work)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "trainer: 2 Ray Train workers" in done.stdout, done.stdout[-3000:]
    return out


def test_curate_and_train_with_a_rank_and_a_scoring_worker_on_each_node_equals_train_pys_group_on_one_node(
        cluster, env, prepared, group_on_node_a):
    """The engine-fed trainer group across the nodes: each rank reads the scores of its rows from ``scored/`` parts
    a scoring worker on either node wrote (through its own node's cache and the bucket), rank 0 publishes the proxy
    to the engine; it selects the same rows and trains the same weights (byte for byte) as ``train.py``'s group of
    the same settings with both ranks on node A, which scores its rows itself (exact mode: the engine's scores and
    references are the trainer's own)."""
    two = _curate_and_train(cluster, env, "two", {"rank": 1}, {"scorer": 1})
    _same_outputs(two, group_on_node_a)
    assert _rows(f"{two}/selected")["loss_mask"].sum() > 0
    summary = _json(f"{two}/summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == GROUP_STEPS and summary["engine"]["workers"] == 2
    # the refresh actor's references and logs, on whichever node it ran, reached the report (final/reference above)
    assert [r["version"] for r in summary["refreshes"]] == list(range(len(range(2, GROUP_STEPS, 4))))
    # the snapshots the coordinator pruned stay pruned (the driver uploads no stale copy)
    assert not [k for k in _objects(f"{two}/engine") if k.startswith("proxy-")]
    attempts = [json.loads(x) for x in objects.read_object(f"{two}/parallel/attempts.jsonl").body.decode().splitlines()]
    assert sorted(a["rank"] for a in attempts) == [0, 1] and len({a["node"] for a in attempts}) == 2  # two nodes
    for node in cluster.nodes.values():  # each node's rank read its rows' scored parts (whichever node's worker
        # wrote them: workers pull units as they become free) through its own cache
        assert any("/two/engine/scored/" in f for f in _cache_files(node)), node.name


# ------------------------------------------------------------------------------------------------
# the second node lost mid-run
# ------------------------------------------------------------------------------------------------
def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 600) -> None:  # noqa: ANN001 - a callable
    """Until ``predicate()`` holds, within ``timeout`` nominal seconds, load-scaled (:mod:`tests.timing`)."""
    if not timing.until(predicate, timeout=timeout, proc=proc, interval=0.05):
        assert proc.poll() is None, f"the run ended first:\n{proc.communicate()[0][-3000:]}"
        raise AssertionError("the run wrote nothing on node B in time")


def test_prepare_rerun_after_the_second_nodes_raylet_was_killed_mid_run_equals_an_uninterrupted_run(
        cluster, env, corpus, prepared):
    """Node B's raylet SIGKILLed once it wrote a part (its workers end; Ray runs their units again on node A), node B
    started again as a new machine (its cache empty), the same command rerun: the objects equal an in-process run's."""
    from curation.ingest.prepare import prepare
    from schemas.config import PrepareConfig

    node_a, node_b = cluster.nodes["node_a"], cluster.nodes["node_b"]
    small = {"unit_bytes": 2_000}  # (dozens of units: node B is lost with most of them to do)
    cfg = _write_yaml(os.path.join(node_a.work, "kill.yaml"), _prepare_config(
        env, corpus, _url(env, "kill/data"), workers=2, resources={"prep": 1}, ray={"address": cluster.address},
        **small))
    cmd = [PREPARE, "--config", cfg]
    proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=node_a.env(), cwd=node_a.work)
    try:
        _wait_for(lambda: any("/kill/data/candidates/" in f and "/part-" in f for f in _cache_files(node_b)), proc)
        node_b.kill_raylet()
        first = timing.communicate(proc, timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (0, 1), first  # (finished on node A, or failed naming the lost node: either is fine)
    cluster.restart("node_b")
    done = cluster.run("node_a", *cmd, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    prepare(PrepareConfig.model_validate(_prepare_config(env, corpus, _url(env, "one/kill"), workers=1, **small)))
    two, one = _objects(_url(env, "kill/data")), _objects(_url(env, "one/kill"))
    assert sorted(two) == sorted(one)
    assert [k for k in two if two[k] != one[k] and os.path.basename(k) not in {"config.yaml", "inputs.json",
                                                                                   "manifest.json"}] == []
    for group in ("candidates", "validation"):
        a, b = (_json(_url(env, f"{run}/{group}/manifest.json")) for run in ("kill/data", "one/kill"))
        a.pop("config"), b.pop("config")
        for m in (a, b):
            m["extra"].pop("tokenizer_path")
        assert a == b


def test_no_process_of_a_node_touched_the_other_nodes_directories_in_the_end(cluster):
    assert cluster.guard_events() == []
