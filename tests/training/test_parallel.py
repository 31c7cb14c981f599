"""The data-parallel trainer: 2 Ray Train workers with gloo on the (small) demo against the single-process run.

Few runs, many assertions (each 2-worker group costs tens of seconds of start-up on 2 cores): one
single-process run, one uninterrupted 2-worker run, one 2-worker run whose rank-1 process is killed
(SIGKILL) mid-run and restarted by Ray Train from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from curation.core.selection import num_selected
from curation.io.shards import read_column
from schemas.manifest import Manifest
from tests.conftest import load_job
from tests.training.conftest import tiny_config
from training.runs.group import ATTEMPTS_FILE
from training.runs.train_job import train

pytestmark = [pytest.mark.slow, pytest.mark.ray]


STEPS, B, W = 12, 8, 2  # tiny_config: W=2, τ=3 (refreshes before steps 2, 5, 8, 11), checkpoints every 4 steps


def _columns(path: str) -> dict[str, list]:
    return {c: read_column(path, c) for c in ("step", "tokens", "loss_mask", "score", "source")}


def _attempts(out: str) -> list[dict]:
    with open(os.path.join(out, ATTEMPTS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _kill_rank1_after_first_checkpoint(out: str, done: threading.Event) -> dict:
    """Wait for the first complete checkpoint of the run in ``out``, then SIGKILL the rank-1 trainer process."""
    seen: dict = {}
    latest = os.path.join(out, "checkpoints", "latest-rank0.pt")  # a link, made once the checkpoint is written
    while not done.is_set():
        if os.path.exists(latest) and os.path.exists(os.path.join(out, ATTEMPTS_FILE)):
            pid = next(a["pid"] for a in _attempts(out) if a["rank"] == 1)
            os.kill(pid, signal.SIGKILL)
            seen["killed"] = pid
            return seen
        time.sleep(0.02)
    return seen


def _train_killing_rank1(cfg) -> dict:
    """``train(cfg)`` with its rank-1 process killed after the first complete checkpoint."""
    done, seen = threading.Event(), {}
    killer = threading.Thread(target=lambda: seen.update(_kill_rank1_after_first_checkpoint(cfg.output_dir, done)))
    killer.start()
    try:
        out = train(cfg)
    finally:
        done.set()
        killer.join()
    assert "killed" in seen, "the run finished before the kill"
    return out


def test_two_workers_equal_the_single_process_run_and_recover_from_a_killed_worker(make_config, ray_local, tmp_path,
                                                                                  single_blade_12):
    single = single_blade_12  # make_config("blade", max_steps=STEPS)
    # the uninterrupted 2-worker run through the job's command line: jobs/train.py --set parallel.workers=2
    par_cfg = make_config("blade", "two", max_steps=STEPS)
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(par_cfg.model_dump(mode="json")), encoding="utf-8")
    assert load_job("train").main(["--config", str(path), "--set", "parallel.workers=2"]) == 0
    assert yaml.safe_load((tmp_path / "two" / "config.yaml").read_text(encoding="utf-8"))["parallel"]["workers"] == 2
    par_cfg = par_cfg.model_copy(update={"parallel": par_cfg.parallel.model_copy(update={"workers": 2})})
    out = par_cfg.output_dir
    two = SimpleNamespace(selected=os.path.join(out, "selected"), summary=os.path.join(out, "summary.json"),
                          final_weights=os.path.join(out, "final", "model.safetensors"))

    # --- masks, k, shards against the single-process run ---------------------------------------------
    a, b = _columns(single.selected), _columns(two.selected)
    rows_of_steps = [t for t in range(STEPS) for _ in range(B)]
    assert b["step"] == rows_of_steps  # every step written once, full batch, single-process row order: no duplicates
    assert all(np.array_equal(x, y) for x, y in zip(a["tokens"], b["tokens"], strict=True))
    assert a["source"] == b["source"]
    ma, mb = np.stack(a["loss_mask"]).astype(bool), np.stack(b["loss_mask"]).astype(bool)
    first = slice(W * B, (W + 1) * B)  # the first selecting step: exactly the single-process masks
    assert np.array_equal(ma[first], mb[first])
    assert (ma == mb).mean() >= 0.99
    per_step = mb.reshape(STEPS, B, -1)
    valid = B * (per_step.shape[-1] - 1)  # every position but the first of each row is a loss position
    for t in range(STEPS):  # global k exact at every step (warm-up: everything)
        assert int(per_step[t].sum()) == (valid if t < W else num_selected(par_cfg.selection.gamma, valid)), t
    assert Manifest.load(two.selected).extra["world_size"] == 2
    assert Manifest.load(single.selected).extra["world_size"] == 1

    sa, sb = (json.load(open(o.summary, encoding="utf-8")) for o in (single, two))
    assert sa["validation"][-1]["step"] == sb["validation"][-1]["step"] == STEPS
    assert abs(sa["validation"][-1]["loss"] - sb["validation"][-1]["loss"]) < 1e-3
    assert sb["tokens"]["kept"] == int(mb.sum())
    wa, wb = load_file(single.final_weights), load_file(two.final_weights)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4  # same training, summation order aside
    assert [r["step"] for r in sb["refreshes"]] == [r["step"] for r in sa["refreshes"]] == [2, 5, 8, 11]
    assert {x["rank"] for x in _attempts(par_cfg.output_dir)} == {0, 1}
    with open(os.path.join(par_cfg.output_dir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        logged = [json.loads(line) for line in f]
    assert sum("blade/kept_tokens" in x for x in logged) == STEPS  # one metrics log (rank 0's), not two

    # --- a killed worker: Ray Train restarts the group from the last checkpoint -------------------------
    kill_cfg = make_config("blade", "killed", max_steps=STEPS, parallel={"workers": 2})
    killed = _train_killing_rank1(kill_cfg)
    attempts = _attempts(kill_cfg.output_dir)
    assert len(attempts) == 4 and any(x["resumed_from"] for x in attempts[2:]), attempts
    c = _columns(killed.selected)
    assert c["step"] == rows_of_steps
    for col in ("tokens", "loss_mask", "source"):
        assert all(np.array_equal(x, y) for x, y in zip(b[col], c[col], strict=True)), col
    assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(b["score"], c["score"], strict=True))
    wk = load_file(killed.final_weights)
    assert all(torch.equal(wb[k], wk[k]) for k in wb)  # bitwise equal to the uninterrupted 2-worker run
    assert json.load(open(killed.summary, encoding="utf-8"))["validation"] == sb["validation"]

    # the groups (three worker-group starts) started Ray Train's controller and workers, but no Ray Data
    # DatasetManager (no datasets: curation.engine.ray_backend.train_group) and no preemption watcher (off in the
    # tests' environment: tests/conftest.py)
    import ray._private.state

    classes = {a["ActorClassName"] for a in ray._private.state.actors().values()}
    assert {"TrainController", "RayTrainWorker"} <= classes and not classes & {"DatasetManager", "PreemptionWatcher"}


def test_fsdp_workers_with_activation_checkpointing_equal_the_single_process_run_and_resume_after_a_killed_worker(
        make_config, ray_local, tmp_path, single_blade_12):
    """``parallel.strategy: fsdp``: the proxy sharded by Composer's FSDP2 and the reference sharded like it
    (every refresh, score and ‖u − w̃‖ from the shards), with activation checkpointing (issue 22: Composer's FSDP
    config checkpoints the blocks), equals the single-process run (which has none); a killed worker restarts the
    group from the full checkpoint, whose reference is loaded back into the shards. (One run of the FSDP group with
    activation checkpointing for both: test_parallel_options had a third.)"""
    single = single_blade_12  # make_config("blade", max_steps=STEPS)
    one_dir = os.path.dirname(single.summary)
    checkpointed = {"activation_checkpointing": True}
    cfg = make_config("blade", "fsdp", max_steps=STEPS, model=checkpointed)
    assert cfg.model.activation_checkpointing
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")), encoding="utf-8")
    assert load_job("train").main(["--config", str(path), "--set", "parallel.workers=2",
                                   "--set", "parallel.strategy=fsdp"]) == 0
    out = cfg.output_dir
    a, b = _columns(single.selected), _columns(os.path.join(out, "selected"))
    assert b["step"] == [t for t in range(STEPS) for _ in range(B)]
    ma, mb = np.stack(a["loss_mask"]).astype(bool), np.stack(b["loss_mask"]).astype(bool)
    first = slice(W * B, (W + 1) * B)
    assert np.array_equal(ma[first], mb[first]) and (ma == mb).mean() >= 0.99
    sa, sb = (json.load(open(os.path.join(o, "summary.json"), encoding="utf-8")) for o in (one_dir, out))
    assert abs(sa["validation"][-1]["loss"] - sb["validation"][-1]["loss"]) < 1e-3
    assert [r["step"] for r in sb["refreshes"]] == [2, 5, 8, 11]
    final = {k: load_file(os.path.join(out, "final", f"{k}.safetensors")) for k in ("model", "reference")}
    for k, want in (("model", load_file(single.final_weights)), ("reference", load_file(single.final_reference))):
        assert final[k].keys() == want.keys()  # gathered to full tensors, not shards
        assert max(float((final[k][n] - want[n]).abs().max()) for n in want) < 1e-4, k
    # ‖u − w̃‖ pairs the shards by name: the reference is wrapped like the proxy
    with open(os.path.join(out, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        dist = [x["blade/param_distance"] for x in map(json.loads, f) if "blade/param_distance" in x]
    with open(os.path.join(one_dir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        want_dist = [x["blade/param_distance"] for x in map(json.loads, f) if "blade/param_distance" in x]
    assert len(dist) == len(want_dist) > 0 and np.allclose(dist, want_dist, rtol=1e-4)  # summed over the shards

    kill_cfg = make_config("blade", "fsdp-killed", max_steps=STEPS, parallel={"workers": 2, "strategy": "fsdp"},
                           model=checkpointed)
    killed = _train_killing_rank1(kill_cfg)
    assert any(x["resumed_from"] for x in _attempts(kill_cfg.output_dir)[2:])
    c = _columns(killed.selected)
    assert all(np.array_equal(x, y) for x, y in zip(b["loss_mask"], c["loss_mask"], strict=True))
    wk = load_file(killed.final_weights)
    assert all(torch.equal(final["model"][k], wk[k]) for k in wk)  # bitwise equal to the uninterrupted run


def test_fsdp_blade_nosync_resumes_its_sharded_adamw_state_after_a_killed_worker(make_config, ray_local):
    """blade-nosync under fsdp: its reference AdamW state, carried across refreshes, is sharded; the checkpoints
    hold it gathered by parameter name, and a restarted group loads it back into the shards: the run still
    equals the single-process one."""
    one = make_config("blade-nosync", "nosync-single", max_steps=STEPS)
    single = train(one)
    killed = _train_killing_rank1(make_config("blade-nosync", "nosync-fsdp-killed", max_steps=STEPS,
                                              parallel={"workers": 2, "strategy": "fsdp"}))
    a, b = _columns(single.selected), _columns(killed.selected)
    ma, mb = np.stack(a["loss_mask"]).astype(bool), np.stack(b["loss_mask"]).astype(bool)
    assert np.array_equal(ma[W * B:(W + 1) * B], mb[W * B:(W + 1) * B]) and (ma == mb).mean() >= 0.99
    wa, wb = load_file(single.final_weights), load_file(killed.final_weights)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    ra, rb = load_file(single.final_reference), load_file(killed.final_reference)
    assert max(float((ra[k] - rb[k]).abs().max()) for k in ra) < 1e-4  # the continued reference, resumed
    sa, sb = (json.load(open(o.summary, encoding="utf-8")) for o in (single, killed))
    assert abs(sa["validation"][-1]["loss"] - sb["validation"][-1]["loss"]) < 1e-3


#: The steps of the 2-worker ``random`` runs (scope: rank) that the rank-scope and SIGTERM tests share: the driver
#: hands a signal on within 0.5 s, so the run must outlast that after its first checkpoint (step 4).
RANDOM_STEPS = 80


_TWO_RANDOM: dict = {}


@pytest.fixture
def two_random(demo_root, tmp_path_factory, ray_local):
    """The uninterrupted 2-worker ``random`` run with ``selection.scope: rank``, made once per test process (one
    group start for two tests): ``train``'s :class:`~training.runs.finish.Finished`."""
    if demo_root not in _TWO_RANDOM:
        out = str(tmp_path_factory.mktemp("two-random") / "two-rank")
        _TWO_RANDOM[demo_root] = train(tiny_config(demo_root, out, "random", max_steps=RANDOM_STEPS,
                                                   parallel={"workers": 2}, selection={"scope": "rank"}))
    return _TWO_RANDOM[demo_root]


def test_rank_scope_selects_like_microbatches_of_one_process(make_config, two_random):
    """``selection.scope: rank``: each rank's b/N rows keep their own γ share, with no collective for the choice;
    that is the single-process run with microbatches of b/N rows. ``random`` scores do not depend on the model,
    so the masks must agree at every step (not only the first selecting one); each rank's block has its own k."""
    single = train(make_config("random", "single-mb", max_steps=RANDOM_STEPS, microbatch_size=B // 2))
    a, b = _columns(single.selected), _columns(two_random.selected)
    assert b["step"] == [t for t in range(RANDOM_STEPS) for _ in range(B)]
    ma, mb = np.stack(a["loss_mask"]).astype(bool), np.stack(b["loss_mask"]).astype(bool)
    assert np.array_equal(ma, mb)
    blocks = mb.reshape(RANDOM_STEPS, 2, B // 2, -1)
    valid = (B // 2) * (blocks.shape[-1] - 1)
    gamma = make_config("random").selection.gamma
    for t in range(W, RANDOM_STEPS):  # each rank's block keeps exactly its own share
        assert [int(blocks[t, r].sum()) for r in range(2)] == [num_selected(gamma, valid)] * 2, t
    sa, sb = (json.load(open(o.summary, encoding="utf-8")) for o in (single, two_random))
    assert abs(sa["validation"][-1]["loss"] - sb["validation"][-1]["loss"]) < 1e-3


def test_a_group_larger_than_the_cluster_is_refused(make_config, ray_local):
    cpus = int(ray_local.cluster_resources()["CPU"])  # (the test process's instance: 4)
    # more workers (1 CPU each) than the instance has CPUs, each a divisor of the batch (64 rows): a valid config
    workers = min(w for w in (8, 16, 32, 64) if w > cpus)
    cfg = make_config("full", "too-big", batch_size=64, parallel={"workers": workers})
    with pytest.raises(ValueError, match=rf"parallel.workers={workers} trainer workers .* do not fit the Ray "
                                         rf"cluster \(CPU {cpus}, GPU 0 in all\)"):
        train(cfg)


def _signal_after_first_checkpoint(out: str, done: threading.Event) -> None:
    latest = os.path.join(out, "checkpoints", "latest-rank0.pt")
    while not done.is_set():
        if os.path.exists(latest):
            os.kill(os.getpid(), signal.SIGTERM)  # to the driver (this process), as a scheduler preempting the job
            return
        time.sleep(0.02)


@pytest.mark.timeout(1200)  # two group start-ups (three with the shared run's); 370 s on a loaded 2-core machine
def test_sigterm_stops_both_workers_after_the_same_step_and_a_rerun_equals_an_uninterrupted_run(make_config,
                                                                                                 two_random):
    """Issue 24: the driver hands the signal to the ranks (parallel/stop.json), they agree on the step with one
    all_reduce, rank 0's checkpoint is written there, the driver raises StopRequested naming it; the rerun resumes
    from it and ends with the uninterrupted 2-worker run's weights, bit for bit."""
    from curation.io.stop import GracefulStop, StopRequested

    steps, full = RANDOM_STEPS, two_random  # the uninterrupted run of this config
    cfg = make_config("random", "two-stopped", max_steps=steps, parallel={"workers": 2}, selection={"scope": "rank"})
    done = threading.Event()
    sender = threading.Thread(target=_signal_after_first_checkpoint, args=(cfg.output_dir, done))
    sender.start()
    try:
        with GracefulStop(), pytest.raises(StopRequested) as e:
            train(cfg)
    finally:
        done.set()
        sender.join()
    step = int(re.search(r"after step (\d+) of", str(e.value)).group(1))  # rank 0's result said where
    ckpt = os.path.join(cfg.output_dir, "checkpoints", f"ep0-ba{step}-rank0.pt")
    assert 4 <= step < steps and e.value.signum == signal.SIGTERM
    assert str(e.value) == (f"stopped on SIGTERM after step {step} of {steps} (checkpoint {ckpt}); rerun the same "
                            f"command to resume from it at step {step + 1}")
    assert os.path.isfile(ckpt) and not os.path.exists(os.path.join(cfg.output_dir, "final"))

    resumed = train(cfg)
    assert all(a["resumed_from"] for a in _attempts(cfg.output_dir)[2:])  # both ranks resumed from the checkpoint
    with open(os.path.join(cfg.output_dir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        trained = [r["step"] for r in map(json.loads, f) if "loss/train/total" in r]
    assert trained == list(range(steps))  # no completed step redone
    wa, wb = load_file(full.final_weights), load_file(resumed.final_weights)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
