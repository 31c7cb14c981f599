"""The plain worker classes in-process (no Ray): scoring units, selecting, bad data, the refresh."""

from __future__ import annotations

import copy
import dataclasses
import os

import numpy as np
import pytest
import torch
from composer.core import Callback

from curation.core.losses import target_valid
from curation.core.refresh_data import RecentMasks
from curation.core.schedule import Schedule
from curation.core.selection import excess_loss, num_selected, select_top_fraction
from curation.core.stream import CandidateStream
from curation.engine.plan import PROXY, REFERENCE, ScoringDataError, WorkUnit
from curation.engine.refresh_runner import RefreshRunner, RefreshSpec
from curation.engine.weights import Weights
from curation.engine.workers import BatchOrder, ScoringWorker, WorkerSpec
from curation.io.bad_shards import blamed
from curation.io.models import build_causal_lm, build_scorer
from curation.io.shards import ShardReader, merge_part_indexes, open_shards, write_part
from schemas.shards import CANDIDATE, validate_shard_dir
from schemas.train_config import ModelConfig, ScorerConfig, TrainConfig, demo_model_config
from tests.conftest import cuda_syncs

B = 8
SCHED = Schedule(2, 4, 14)


def _model(seed: int = 0) -> ModelConfig:
    m = demo_model_config(512, hidden=32, layers=1)
    return m.model_copy(update={"init_seed": seed})


def _weights(seed: int) -> Weights:
    return Weights.from_state_dict(build_causal_lm(_model(seed)))


def _spec(root: str, out: str, *, candidates: str | None = None, vocab: int = 512, **kw) -> WorkerSpec:
    cand = candidates or os.path.join(root, "data", "candidates")
    n = len(open_shards(cand))
    kw.setdefault("device", "cpu")  # compared with CPU float32 values, also on a machine with a GPU
    return WorkerSpec(candidates=cand, out_dir=out, model=_model(), order=BatchOrder("stream", n, B, seed=0),
                      vocab_size=vocab, schedule=SCHED, **kw)


@pytest.fixture(scope="module")
def weights():
    return {(REFERENCE, 0): _weights(1), (PROXY, 2): _weights(2), (PROXY, 0): _weights(2)}


def _rows(path):
    r = ShardReader(path)
    return [r[i] for i in range(len(r))]


def test_scored_unit_holds_the_reference_scorer_losses(engine_demo, tmp_path, weights):
    out = str(tmp_path / "scored")
    worker = ScoringWorker(_spec(engine_demo, out, needs_proxy=False), 3)
    res = worker.run(WorkUnit(2, 4, "scored", 0), lambda k, v: weights[(k, v)])
    assert res.name == "worker-03/steps-000000002-000000004" and res.samples == 2 * B
    validate_shard_dir(os.path.join(out, res.name), "scored")
    scorer = build_scorer(ScorerConfig(model=_model(), device="cpu", batch_size=B))
    scorer.load_weights(weights[(REFERENCE, 0)].state_dict(), 0)
    rows = _rows(os.path.join(out, res.name))
    for j, t in enumerate((2, 3)):
        tokens, _, _ = worker.read_step(t)
        got = rows[j * B:(j + 1) * B]
        assert np.array_equal(np.stack([r["tokens"] for r in got]), tokens)
        assert np.array_equal(np.stack([r["ref_loss"] for r in got]), scorer(tokens))
        assert {r["episode"] for r in got} == {0}


def test_selected_unit_is_the_top_gamma_of_each_step(engine_demo, tmp_path, weights):
    out = str(tmp_path / "selected")
    worker = ScoringWorker(_spec(engine_demo, out, gamma=0.5, needs_proxy=True), 0)
    res = worker.run(WorkUnit(2, 4, "selected", 0, 2), lambda k, v: weights[(k, v)])
    validate_shard_dir(os.path.join(out, res.name), "selected")
    scorers = {}
    for kind in (REFERENCE, PROXY):
        scorers[kind] = build_scorer(ScorerConfig(model=_model(), device="cpu", batch_size=B))
        scorers[kind].load_weights(weights[(kind, 0 if kind == REFERENCE else 2)].state_dict())
    rows = _rows(os.path.join(out, res.name))
    for j, t in enumerate((2, 3)):
        tokens, _, _ = worker.read_step(t)
        tt = torch.from_numpy(tokens.astype(np.int64))
        valid = target_valid(tt)
        delta = excess_loss(scorers[PROXY].losses(tt), scorers[REFERENCE].losses(tt).half())
        want = select_top_fraction(delta, valid, 0.5)
        got = rows[j * B:(j + 1) * B]
        mask = np.stack([r["loss_mask"] for r in got]).astype(bool)
        assert np.array_equal(mask, want.numpy()) and mask.sum() == num_selected(0.5, int(valid.sum()))
        assert np.array_equal(np.stack([r["score"] for r in got]), delta.numpy().astype(np.float16))
        assert {(r["step"], r["episode"]) for r in got} == {(t, SCHED.episode(t))}
    assert res.kept_tokens == sum(int(r["loss_mask"].sum()) for r in rows)
    warm = worker.run(WorkUnit(0, 2, "selected"), lambda k, v: pytest.fail("warm-up needs no weights"))
    rows = _rows(os.path.join(out, warm.name))
    assert all(r["loss_mask"][1:].all() and not r["loss_mask"][0] and np.isnan(r["score"]).all() for r in rows)
    assert {r["episode"] for r in rows} == {-1}


def test_a_redone_unit_replaces_the_leftover_of_the_crashed_attempt(engine_demo, tmp_path, weights):
    out = str(tmp_path / "scored")
    worker = ScoringWorker(_spec(engine_demo, out, needs_proxy=False), 0)
    unit = WorkUnit(2, 3, "scored", 0)
    tmp = os.path.join(out, "worker-00", unit.name + ".tmp")
    os.makedirs(tmp)
    open(os.path.join(tmp, "shard.00000.mds.zstd"), "wb").write(b"half written")
    res = worker.run(unit, lambda k, v: weights[(k, v)])
    assert sorted(os.listdir(os.path.join(out, "worker-00"))) == [unit.name] and res.samples == B
    assert worker.stats["weight_loads"] == 1
    worker.run(WorkUnit(3, 4, "scored", 0), lambda k, v: pytest.fail("version unchanged: no fetch"))


def test_bad_token_names_the_shard_and_record(engine_demo, tmp_path, weights):
    rows = [{"tokens": np.full(16, i % 7, dtype=np.uint16), "source": "s"} for i in range(20)]
    rows[13]["tokens"][5] = 900  # outside the model's 512 ids
    cand = str(tmp_path / "cand")
    write_part(os.path.join(cand, "part-00000"), CANDIDATE, rows[:10], vocab_size=1000)
    write_part(os.path.join(cand, "part-00001"), CANDIDATE, rows[10:], vocab_size=1000)
    merge_part_indexes(cand, ["part-00000", "part-00001"])
    spec = _spec(engine_demo, str(tmp_path / "out"), candidates=cand, vocab=1000, needs_proxy=True)
    spec = dataclasses.replace(spec, order=BatchOrder("blocks", 20, 4), schedule=None)
    worker = ScoringWorker(spec, 0)
    worker.run(WorkUnit(0, 3, "selected", 0, 0), lambda k, v: weights[(k, v)])  # records 0..11 are fine
    with pytest.raises(ScoringDataError, match=r"cand: shard part-00001/shard.00000.mds.zstd, record 3 "
                                               r"\(sample 13, step 3\): token id 900 at position 5") as e:
        worker.run(WorkUnit(3, 5, "selected", 0, 0), lambda k, v: weights[(k, v)])
    assert blamed(e.value) == [os.path.join(cand, "part-00001", "shard.00000.mds.zstd")]  # (what the run failed on)
    # the bad step after a good one (its rows already in the part's .tmp): the part is not completed
    with pytest.raises(ScoringDataError, match="token id 900"):
        worker.run(WorkUnit(2, 4, "selected", 0, 0), lambda k, v: weights[(k, v)])
    assert "steps-000000002-000000004" not in os.listdir(os.path.join(str(tmp_path / "out"), "worker-00"))


def test_a_step_is_read_whole_and_a_record_it_cannot_read_whole_is_still_named(engine_demo, tmp_path):
    """read_step decodes a step's records a shard at a time; where that cannot be done (a row of another length)
    it reads row by row, which names the record."""
    rows = [{"tokens": np.arange(i, i + 16, dtype=np.uint16) % 500, "source": f"src{i % 3}"} for i in range(20)]
    rows[17]["tokens"] = rows[17]["tokens"][:15]
    cand = str(tmp_path / "cand")
    write_part(os.path.join(cand, "part-00000"), CANDIDATE, rows[:10], vocab_size=1000)
    write_part(os.path.join(cand, "part-00001"), CANDIDATE, rows[10:], vocab_size=1000)
    merge_part_indexes(cand, ["part-00000", "part-00001"])
    spec = _spec(engine_demo, str(tmp_path / "out"), candidates=cand, vocab=1000, needs_proxy=False)
    worker = ScoringWorker(dataclasses.replace(spec, order=BatchOrder("stream", 20, 6, seed=3)), 0)
    ids = worker.order.ids(1)
    assert len({worker.candidates.locate(i)[0] for i in ids}) == 2  # this step spans both parts
    tokens, sources, got_ids = worker.read_step(1)
    assert tokens.dtype == np.uint16 and tokens.shape == (6, 16)
    assert np.array_equal(tokens, np.stack([rows[i]["tokens"] for i in ids])) and np.array_equal(got_ids, ids)
    assert sources == [rows[i]["source"] for i in ids]
    bad = next(t for t in range(20) if 17 in worker.order.ids(t)[1:])  # (rows are held to the first one's length)
    with pytest.raises(ScoringDataError, match=r"shard part-00001/shard.00000.mds.zstd, record 7 \(sample 17, "
                                               rf"step {bad}\): sequence of shape \(15,\), expected \(16,\)") as e:
        worker.read_step(bad)
    assert blamed(e.value) == [os.path.join(cand, "part-00001", "shard.00000.mds.zstd")]


def test_the_refresh_names_a_validation_id_outside_the_vocabulary_and_blames_its_shard(engine_demo, tmp_path,
                                                                                       tiny_train):
    """The refresh actor reads validation (and candidate) rows itself: an id the model does not embed is named with
    its sample and blames its shard, as in the trainer's loaders (it was an embedding's IndexError)."""
    val = str(tmp_path / "val")
    for k, part in enumerate(("part-a", "part-b")):
        rows = [{"tokens": np.arange(i, i + 16, dtype=np.uint16), "source": "v"} for i in range(8)]
        if k == 1:
            rows[2]["tokens"][4] = 600
        write_part(os.path.join(val, part), CANDIDATE, rows, vocab_size=1000)
    merge_part_indexes(val, ["part-a", "part-b"])
    cfg = TrainConfig.model_validate(tiny_train(str(tmp_path / "train"), selection={"policy": "rho1"}))
    spec = RefreshSpec(model=cfg.model.architecture, validation=val, candidates=cfg.data.candidates,
                       stream=CandidateStream(len(open_shards(cfg.data.candidates)), cfg.batch_size, cfg.seed),
                       selection=cfg.selection, ref_lr=cfg.optim.lr, refresh_batch_size=cfg.refresh_batch_size,
                       engine_dir=str(tmp_path / "engine"), schedule=Schedule.of(cfg), device="cpu")
    runner = RefreshRunner(spec)
    assert runner._tokens(runner.validation, np.array([0, 9])).shape == (2, 16)
    with pytest.raises(ValueError, match=rf"{val} \(sample 10\): token id 600 at position 4 is outside the model's "
                                         "vocabulary") as e:
        runner._tokens(runner.validation, np.array([1, 10, 11]))
    assert blamed(e.value) == [os.path.join(val, "part-b", "shard.00000.mds.zstd")]


# ------------------------------------------------------------------------------------------------
# the refresh computes what the single-process trainer computes
# ------------------------------------------------------------------------------------------------
class _Snap(Callback):
    def __init__(self, holder, step):
        self.holder, self.step = holder, step

    def batch_start(self, state, logger):
        if int(state.timestamp.batch) == self.step:
            alg = self.holder["alg"]
            self.holder["proxy"] = copy.deepcopy(state.model.model.state_dict())
            self.holder["recent"] = list(alg.recent)

    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == self.step + 1:
            self.holder["reference"] = copy.deepcopy(self.holder["alg"].reference.module.state_dict())


@pytest.mark.parametrize("policy", ["blade", "rho1"])
def test_refresh_runner_computes_the_single_process_reference(engine_demo, tmp_path, tiny_train, policy):
    from training.runs.wiring import build_training

    cfg = TrainConfig.model_validate(tiny_train(str(tmp_path / "train"), max_steps=3, write_selected=False,
                                                selection={"policy": policy}))
    holder = {}
    run = build_training(cfg, callbacks=[_Snap(holder, cfg.selection.warmup_steps)])
    holder["alg"] = run.algorithm
    run.trainer.fit()
    run.trainer.close()
    spec = RefreshSpec(model=cfg.model.architecture, validation=cfg.data.validation,
                       candidates=cfg.data.candidates, stream=CandidateStream(len(open_shards(cfg.data.candidates)),
                                                                              cfg.batch_size, cfg.seed),
                       selection=cfg.selection, ref_lr=cfg.optim.lr,
                       refresh_batch_size=cfg.refresh_batch_size, engine_dir=str(tmp_path / "engine"),
                       schedule=Schedule.of(cfg), device="cpu")  # the trainer's device (tiny_train)
    os.makedirs(spec.engine_dir)
    runner = RefreshRunner(spec)
    if policy == "blade":
        w, log = runner.refresh(0, Weights.from_state_dict(holder["proxy"]), RecentMasks.from_pairs(holder["recent"]),
                                source_step=2)
        assert log["step"] == 2 and log["staleness"] == 0 and log["recent_steps"] == [0, 1]
    else:
        w, log = runner.static()
    got = w.state_dict()
    assert all(torch.equal(got[k], v) for k, v in holder["reference"].items())
    assert os.path.exists(os.path.join(spec.engine_dir, "reference-0000.safetensors"))
    assert os.path.exists(os.path.join(spec.engine_dir, "reference-0000.json"))


def test_a_non_finite_reference_loss_names_the_record_and_leaves_no_part(engine_demo, tmp_path, weights):
    """The finite-loss flag travels with the results of each step; a failing step is named (its first row) after
    the next step was already launched, and the part is not completed."""
    out = str(tmp_path / "scored")
    worker = ScoringWorker(_spec(engine_demo, out, needs_proxy=False), 0)
    bad = weights[(REFERENCE, 0)].state_dict()
    bad = {k: (torch.full_like(v, float("nan")) if k == "model.norm.weight" else v) for k, v in bad.items()}
    unit = WorkUnit(2, 5, "scored", 0)
    sample = int(worker.order.ids(2)[0])
    with pytest.raises(ScoringDataError, match=rf"record \d+ \(sample {sample}, step 2\): reference reference loss is "
                                               r"not finite at \(row, position\) \(0, 1\)"):
        worker.run(unit, lambda k, v: Weights.from_state_dict(bad))
    assert unit.name not in os.listdir(os.path.join(out, "worker-00"))


def _cuda_worker(engine_demo, out, **kw):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the pipelined scoring path: pinned buffers, events)")
    return ScoringWorker(_spec(engine_demo, out, device="cuda", **kw), 0)


@pytest.mark.gpu
def test_pipelined_scoring_on_cuda_waits_once_per_step_and_equals_the_synchronous_path(engine_demo, tmp_path, weights):
    """Designed bound: one host wait per step (an event: that step's results alone) and no synchronising call."""
    out = str(tmp_path / "scored")
    worker = _cuda_worker(engine_demo, out, needs_proxy=False)
    fetch = lambda k, v: weights[(k, v)]  # noqa: E731
    worker.run(WorkUnit(0, 2, "scored", 0), fetch)  # warm-up: weights on the device, kernels, pinned blocks
    waits = worker.stats["host_waits"]
    torch.cuda.synchronize()
    with cuda_syncs() as syncs:  # every synchronising CUDA call
        res = worker.run(WorkUnit(2, 6, "scored", 0), fetch)
    assert worker.stats["host_waits"] - waits == 4 and not syncs, syncs
    scorer = worker.scorers[REFERENCE]  # the synchronous path: the checked losses, copied back at once
    rows = _rows(os.path.join(out, res.name))
    for j, t in enumerate(range(2, 6)):
        tokens, _, _ = worker.read_step(t)
        want = scorer.losses(torch.from_numpy(tokens.astype(np.int64))).to("cpu", torch.float16).numpy()
        assert np.array_equal(np.stack([r["ref_loss"] for r in rows[j * B:(j + 1) * B]]), want)


@pytest.mark.gpu
def test_pipelined_selection_on_cuda_equals_the_synchronous_path(engine_demo, tmp_path, weights):
    out = str(tmp_path / "selected")
    worker = _cuda_worker(engine_demo, out, gamma=0.5, needs_proxy=True)
    res = worker.run(WorkUnit(2, 5, "selected", 0, 2), lambda k, v: weights[(k, v)])
    rows = _rows(os.path.join(out, res.name))
    for j, t in enumerate(range(2, 5)):
        tokens, _, _ = worker.read_step(t)
        tt = torch.from_numpy(tokens.astype(np.int64))
        ref = worker.scorers[REFERENCE].losses(tt).half()  # on the device, as the worker selects
        delta = excess_loss(worker.scorers[PROXY].losses(tt), ref)
        want = select_top_fraction(delta, target_valid(tt).cuda(), 0.5).cpu().numpy()
        got = rows[j * B:(j + 1) * B]
        assert np.array_equal(np.stack([r["loss_mask"] for r in got]).astype(bool), want)
        assert np.array_equal(np.stack([r["score"] for r in got]), delta.cpu().numpy().astype(np.float16))
