"""The data-parallel trainer: 2 Ray Train workers with gloo on the (small) demo against the single-process run.

Few runs, many assertions (each 2-worker group costs tens of CPU-seconds of start-up): one single-process run, one
uninterrupted 2-worker run (shared by the tests of this process), one 2-worker run stopped by SIGTERM and rerun,
the rerun's rank-1 process killed (SIGKILL) mid-run and restarted by Ray Train from the last checkpoint.
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


def _kill_rank1_after_a_new_checkpoint(out: str, done: threading.Event, old: str | None, channels: list) -> dict:
    """Wait for a complete checkpoint of the run in ``out`` other than ``old`` (the file ``latest-rank0.pt`` links to
    when the run starts: a rerun's own checkpoint), then SIGKILL the rank-1 trainer process of the group run whose
    channel is the first of ``channels`` (its pid as the rank recorded it there before fitting: the driver copies
    the records to the attempt log only every half second, in which a fast rerun can write its last checkpoint)."""
    import ray

    seen: dict = {}
    latest = os.path.join(out, "checkpoints", "latest-rank0.pt")  # a link, made once the checkpoint is written
    while not done.is_set():
        try:
            target = os.path.basename(os.readlink(latest)) if os.path.exists(latest) else old
        except OSError:  # the link re-made
            target = old
        ones = [a for a in ray.get(channels[0]._actor.attempts_from.remote(0)) if a["rank"] == 1] if (
            target != old and channels) else []
        if ones:
            os.kill(ones[0]["pid"], signal.SIGKILL)
            seen.update(killed=ones[0]["pid"], checkpoint=target)
            return seen
        time.sleep(0.02)
    return seen


def _train_killing_rank1(cfg, seen: dict | None = None):
    """``train(cfg)`` with its rank-1 process killed after the first complete checkpoint this run writes (a rerun:
    after its checkpoint, not the one it resumes from); ``seen`` receives the killed pid and that checkpoint's
    name."""
    from unittest import mock

    from curation.engine.ray_backend.train_group import GroupChannel

    latest = os.path.join(cfg.output_dir, "checkpoints", "latest-rank0.pt")
    old = os.path.basename(os.readlink(latest)) if os.path.islink(latest) else None
    channels: list = []
    opened = GroupChannel.open

    def open_and_keep() -> GroupChannel:
        channels.append(opened())
        return channels[-1]

    done, seen = threading.Event(), {} if seen is None else seen
    killer = threading.Thread(target=lambda: seen.update(_kill_rank1_after_a_new_checkpoint(cfg.output_dir, done,
                                                                                           old, channels)))
    killer.start()
    try:
        with mock.patch.object(GroupChannel, "open", open_and_keep):
            out = train(cfg)
    finally:
        done.set()
        killer.join()
    assert "killed" in seen, "the run finished before the kill"
    return out


_TWO_BLADE: dict = {}


@pytest.fixture
def two_blade(demo_root, tmp_path_factory, ray_local):
    """The uninterrupted 2-worker blade run of :func:`tiny_config` (12 steps) through the job's command line,
    ``jobs/train.py --config two.yaml --set parallel.workers=2``, made once per test process (one group start for
    the equality with the single-process run and for the stopped, killed and rerun one): its config (as the job
    resolved it) and outputs."""
    if demo_root not in _TWO_BLADE:
        root = tmp_path_factory.mktemp("two-blade")
        cfg = tiny_config(demo_root, str(root / "two"), "blade", max_steps=STEPS)
        path = root / "two.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")), encoding="utf-8")
        assert load_job("train").main(["--config", str(path), "--set", "parallel.workers=2"]) == 0
        cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"workers": 2})})
        out = cfg.output_dir
        _TWO_BLADE[demo_root] = SimpleNamespace(
            cfg=cfg, selected=os.path.join(out, "selected"), summary=os.path.join(out, "summary.json"),
            final_weights=os.path.join(out, "final", "model.safetensors"))
    return _TWO_BLADE[demo_root]


def test_two_workers_equal_the_single_process_run(two_blade, single_blade_12):
    single, two = single_blade_12, two_blade  # make_config("blade", max_steps=STEPS), in 1 and 2 processes
    par_cfg, out = two.cfg, two.cfg.output_dir
    # the job's command line set the workers: jobs/train.py --set parallel.workers=2
    with open(os.path.join(out, "config.yaml"), encoding="utf-8") as f:
        assert yaml.safe_load(f)["parallel"]["workers"] == 2

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

    # the group started Ray Train's controller and workers, but no Ray Data DatasetManager (no datasets), no
    # placement-group cleaner (this process's own local instance has no dashboard, whose state API the cleaner
    # polls: curation.engine.ray_backend.train_group) and no preemption watcher (off in the tests' environment:
    # tests/conftest.py)
    import ray._private.state

    classes = {a["ActorClassName"] for a in ray._private.state.actors().values()}
    assert {"TrainController", "RayTrainWorker"} <= classes
    assert not classes & {"DatasetManager", "PlacementGroupCleaner", "PreemptionWatcher"}, classes


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


#: The steps of the 2-worker ``random`` run with ``selection.scope: rank`` (past warm-up, every step checks each
#: rank's block).
RANDOM_STEPS = 24


_TWO_RANDOM: dict = {}


@pytest.fixture
def two_random(demo_root, tmp_path_factory, ray_local):
    """The uninterrupted 2-worker ``random`` run with ``selection.scope: rank``, made once per test process:
    ``train``'s :class:`~training.runs.finish.Finished`."""
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


def _signal_once_the_group_starts(out: str, done: threading.Event) -> None:
    """SIGTERM to this process (the driver, as a scheduler preempting the job) once the run in ``out`` has started its
    Ray Train group (its storage directory exists; the ranks are still importing): the driver sets the stop on the
    group's channel long before the ranks end their first step, so they stop after one of the first steps."""
    group = os.path.join(out, "parallel", "ray_train")
    while not done.is_set():
        if os.path.isdir(group):
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.02)


@pytest.mark.timeout(1200)  # three group start-ups (four with the shared run's)
def test_sigterm_stops_both_workers_after_the_same_step_and_a_rerun_that_loses_a_worker_equals_an_uninterrupted_run(
        two_blade, demo_root, tmp_path):
    """Issue 24: the driver hands the signal to the ranks (the group's channel), they agree on the step with one
    all_reduce, rank 0's checkpoint is written there, the driver raises StopRequested naming it; the rerun resumes
    from it (no completed step redone). In the rerun, rank 1 is killed (SIGKILL) after the first checkpoint it
    writes: Ray Train restarts the group, which resumes from that checkpoint. The rerun ends with the uninterrupted
    2-worker run's shards (every step once), validation and weights, bit for bit."""
    from curation.io.stop import GracefulStop, StopRequested

    full = two_blade  # the uninterrupted run of this config
    cfg = tiny_config(demo_root, str(tmp_path / "stopped"), "blade", max_steps=STEPS, parallel={"workers": 2})
    assert cfg.model_dump(exclude={"output_dir"}) == full.cfg.model_dump(exclude={"output_dir"})
    done = threading.Event()
    sender = threading.Thread(target=_signal_once_the_group_starts, args=(cfg.output_dir, done))
    sender.start()
    try:
        with GracefulStop(), pytest.raises(StopRequested) as e:
            train(cfg)
    finally:
        done.set()
        sender.join()
    step = int(re.search(r"after step (\d+) of", str(e.value)).group(1))  # rank 0's result said where
    ckpt = os.path.join(cfg.output_dir, "checkpoints", f"ep0-ba{step}-rank0.pt")
    # the ranks stop at the first step end after they read the signal on the channel (asked in the background, so a
    # step or so after it was set), all at the same one, before the rerun's last interval checkpoint (step 8)
    assert 1 <= step < 8 and e.value.signum == signal.SIGTERM
    assert str(e.value) == (f"stopped on SIGTERM after step {step} of {STEPS} (checkpoint {ckpt}); rerun the same "
                            f"command to resume from it at step {step + 1}")
    assert os.path.isfile(ckpt) and not os.path.exists(os.path.join(cfg.output_dir, "final"))
    log = os.path.join(cfg.output_dir, "logs", "metrics.jsonl")

    def trained() -> list[int]:
        with open(log, encoding="utf-8") as f:
            return [r["step"] for r in map(json.loads, f) if "loss/train/total" in r]

    assert trained() == list(range(step))
    assert len(_attempts(cfg.output_dir)) == 2

    seen: dict = {}
    resumed = _train_killing_rank1(cfg, seen)
    attempts = _attempts(cfg.output_dir)
    assert len(attempts) == 6, attempts  # 2 ranks: stopped run, rerun, rerun's group restarted after the kill
    assert all(a["resumed_from"] for a in attempts[2:])  # both ranks from the stop's checkpoint, then the rerun's
    again = int(re.fullmatch(r"ep0-ba(\d+)-rank0\.pt", seen["checkpoint"]).group(1))  # the rerun's first: 4
    assert step < again < STEPS
    t = trained()
    assert t[:again] == list(range(again))  # no completed step redone before the kill: not the stop's, not the rerun's
    assert t[-(STEPS - again):] == list(range(again, STEPS)) and sorted(set(t)) == list(range(STEPS))
    a, c = _columns(full.selected), _columns(resumed.selected)
    assert c["step"] == [t for t in range(STEPS) for _ in range(B)]  # every step written once (no duplicate rows)
    for col in ("tokens", "loss_mask", "source"):
        assert all(np.array_equal(x, y) for x, y in zip(a[col], c[col], strict=True)), col
    assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a["score"], c["score"], strict=True))
    with open(full.summary, encoding="utf-8") as f, open(resumed.summary, encoding="utf-8") as g:
        assert json.load(g)["validation"] == json.load(f)["validation"]
    wa, wb = load_file(full.final_weights), load_file(resumed.final_weights)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
