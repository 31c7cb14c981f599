"""Loaders and data checks: the candidate stream by step, clear errors for bad shards/tokenizers/vocab."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from curation.io.atomic import write_manifest
from curation.io.shards import check_tokenizer, merge_part_indexes, shard_dir_info, write_part
from curation.io.stream_reader import StreamReader
from schemas.manifest import Manifest
from schemas.shards import CANDIDATE, ShardSchemaError
from training.blocks.data import StreamBatches, annotate_batch


def _cand(demo_root: str) -> str:
    return os.path.join(demo_root, "data", "candidates")


def test_stream_batches_follow_the_stream_and_resume_by_step(demo_root):
    reader = StreamReader.open(_cand(demo_root), batch_size=8, seed=3)
    ds = StreamBatches(reader, stop_step=6)
    batches = list(ds)
    assert [b["step"] for b in batches] == list(range(6))
    for b in batches:
        ids = reader.stream.batch_ids(b["step"])
        assert b["sample_id"].tolist() == ids.tolist()
        assert b["tokens"].dtype == torch.int64 and b["tokens"].shape == (8, 128)
        assert torch.equal(b["tokens"][0], torch.from_numpy(np.asarray(reader.dataset[int(ids[0])]["tokens"]).astype(np.int64)))
    state = ds.state_dict(num_samples=4 * 8, from_beginning=True)
    resumed = StreamBatches(reader, stop_step=6)
    resumed.load_state_dict(state)
    assert [b["step"] for b in resumed] == [4, 5]
    assert torch.equal(next(iter(resumed))["tokens"], batches[4]["tokens"])
    other = StreamBatches(StreamReader.open(_cand(demo_root), batch_size=8, seed=4), stop_step=6)
    with pytest.raises(ValueError, match="same candidates, batch_size and seed"):
        other.load_state_dict(state)


def test_an_id_outside_the_vocabulary_blames_the_shards_that_hold_it(tmp_path):
    """The trainer's loaders (the candidate stream, validation and selected rows) name the step or sample and blame
    the shard files of the rows holding such an id (curation.io.bad_shards): a run stopped on it records them, and
    the rerun accepts those shards fixed (curation.io.inputs)."""
    from curation.io.bad_shards import blamed
    from training.blocks.data import TokenRows

    cand = str(tmp_path / "cand")
    for k, part in enumerate(("part-a", "part-b")):
        rows = [{"tokens": np.arange(i, i + 8, dtype=np.uint16), "source": "s"} for i in range(4)]
        if k == 1:
            rows[3]["tokens"][2] = 600
        write_part(os.path.join(cand, part), CANDIDATE, rows, vocab_size=1000)
    merge_part_indexes(cand, ["part-a", "part-b"])
    reader = StreamReader.open(cand, batch_size=4, seed=0)
    stream = StreamBatches(reader, stop_step=2, model_vocab=512)
    bad = next(t for t in range(2) if 7 in reader.stream.batch_ids(t))
    stream.batch(1 - bad)  # the other step reads
    with pytest.raises(ValueError, match=rf"{cand} \(step {bad}\): token id 600 .* outside the model's vocabulary") \
            as e:
        stream.batch(bad)
    shard = os.path.join(cand, "part-b", "shard.00000.mds.zstd")
    assert blamed(e.value) == [shard]
    rows = TokenRows(cand, "candidate", model_vocab=512)
    assert rows[3]["tokens"].shape == (8,)
    with pytest.raises(ValueError, match=rf"{cand} \(sample 7\): token id 600 at position 2") as e:
        rows[7]
    assert blamed(e.value) == [shard]


def test_annotate_batch_counts_kept_loss_positions():
    tokens = torch.zeros(2, 5, dtype=torch.long)
    assert annotate_batch({"tokens": tokens})["kept_total"] == 8  # position 0 never counts
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    out = annotate_batch({"tokens": tokens, "loss_mask": mask})
    assert out["kept_total"] == 4 and out["rows_total"] == 2


def test_bad_shard_schema_error_names_directory_shard_and_column(tmp_path, demo_root):
    bad = str(tmp_path / "bad")
    rows = [{"tokens": np.arange(4, dtype=np.uint16), "source": "x"}]
    write_part(os.path.join(bad, "p"), CANDIDATE, rows, vocab_size=100)
    merge_part_indexes(bad, ["p"])
    with pytest.raises(ShardSchemaError) as e:
        shard_dir_info(bad, "selected")  # candidate shards where selected-token shards are expected
    assert bad in str(e.value) and "loss_mask" in str(e.value) and "shard.00000.mds" in str(e.value)
    # a pickle column is refused outright
    index = json.load(open(os.path.join(bad, "index.json")))
    index["shards"][0]["column_encodings"][1] = "pkl"
    json.dump(index, open(os.path.join(bad, "index.json"), "w"))
    with pytest.raises(ShardSchemaError, match="pickle"):
        shard_dir_info(bad, "candidate")


def test_tokenizer_mismatch_names_both_files(tmp_path, demo_root):
    cand, val = _cand(demo_root), os.path.join(demo_root, "data", "validation")
    infos = [shard_dir_info(cand, "candidate"), shard_dir_info(val, "candidate")]
    tok = os.path.join(demo_root, "data", "tokenizer", "tokenizer.json")
    assert check_tokenizer(infos, tok) == infos[0].tokenizer_fingerprint
    other = str(tmp_path / "val")
    shutil.copytree(val, other)
    m = Manifest.load(other)
    m.tokenizer_fingerprint = "0" * 64
    write_manifest(other, m)
    with pytest.raises(ValueError, match="tokenizer mismatch") as e:
        check_tokenizer([infos[0], shard_dir_info(other, "candidate")], None)
    assert Manifest.path_in(other) in str(e.value) and Manifest.path_in(cand) in str(e.value)
    wrong_tok = tmp_path / "tokenizer.json"
    wrong_tok.write_text(open(tok).read().replace("<|endoftext|>", "<|end|>"))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        check_tokenizer(infos, str(wrong_tok))


def test_annotate_batch_takes_a_non_bool_validity_mask():
    tokens = torch.zeros(2, 4, dtype=torch.long)
    valid = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.uint8)  # position 0 never counts anyway
    assert annotate_batch({"tokens": tokens, "valid": valid})["kept_total"] == 2 + 3
    assert valid.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]  # the batch's own mask is left alone


class _NoEngine:
    def wait_part(self, step, timeout_s):
        raise AssertionError("the resume protocol reads no part")


def _feed(out_dir, stream):
    from curation.core.schedule import Schedule
    from curation.engine.handle import EngineFeed
    from curation.engine.plan import TrainingPlan

    return EngineFeed(_NoEngine(), out_dir, stream, TrainingPlan(Schedule(0, 2, 6), "pipelined", True))


def test_engine_batches_resume_by_step_with_the_same_protocol(demo_root, tmp_path):
    from training.runs.engine_feed import EngineMaskedBatches

    reader = StreamReader.open(_cand(demo_root), batch_size=8, seed=3)
    engine = EngineMaskedBatches(_feed(str(tmp_path), reader.stream), 6)
    local = StreamBatches(reader, stop_step=6)
    for num_samples, from_beginning in [(4 * 8, True), (2 * 8 + 3, True)]:
        assert engine.state_dict(num_samples, from_beginning) == local.state_dict(num_samples, from_beginning)
    engine.load_state_dict(local.state_dict(num_samples=3 * 8, from_beginning=True))
    assert engine.start_step == 3
    assert engine.state_dict(num_samples=2 * 8, from_beginning=False)["step"] == 5  # counted from the resumed step
    other = StreamReader.open(_cand(demo_root), batch_size=4, seed=3).stream
    with pytest.raises(ValueError, match="same candidates, batch_size and seed"):
        EngineMaskedBatches(_feed(str(tmp_path), other), 6).load_state_dict(engine.state_dict(0, False))


def _counting(stream: StreamBatches) -> list[int]:
    """The steps the stream's reader reads from the shards, in order (its read method, wrapped)."""
    reads: list[int] = []
    read = stream.reader.read

    def counted(step: int):
        reads.append(step)
        return read(step)

    stream.reader.read = counted
    return reads


def test_each_step_is_read_from_the_shards_once_whoever_asks(demo_root):
    stream = StreamBatches(StreamReader.open(_cand(demo_root), batch_size=8, seed=3), stop_step=20)
    reads = _counting(stream)
    first = stream.batch(5)
    assert torch.equal(stream.batch(5)["tokens"], first["tokens"]) and reads == [5]  # asked twice in a step
    for t in range(5, 9):  # the reference scoring the coming steps of its episode
        stream.batch(t)
    assert [stream.batch(t)["step"] for t in (6, 7, 8)] == [6, 7, 8] and reads == [5, 6, 7, 8]  # then trained
    stream.release_before(8)  # the loader is at step 8: the steps before it are dropped (read again if asked)
    stream.batch(5)
    assert reads == [5, 6, 7, 8, 5] and sorted(stream._read) == [5, 8]


@pytest.mark.parametrize("policy", ["blade", "rho1"])
def test_a_run_reads_every_candidate_batch_once(make_config, policy):
    """The loader, the in-process reference scoring its episode ahead and the record share one read per step."""
    from training.runs.wiring import build_training

    cfg = make_config(policy, max_steps=9, eval={"interval": 100}, write_selected=False)
    run = build_training(cfg)
    reads = _counting(run.algorithm.stream)
    run.fit()
    assert reads == list(range(9)) and run.algorithm.counts["score_steps"] == 9 - cfg.selection.warmup_steps


def test_the_trainer_steps_adamw_without_a_closure_and_counts_one_process_time_on_the_host(make_config):
    """LeanTrainer: no optimizer closure (its ``.item()`` waited for the backward before AdamW was queued) and, in one
    process, a step's samples and tokens counted without a round trip through the device; the counts a run keeps
    are those of its rows."""
    import datetime

    from training.blocks.trainer import LeanTrainer
    from training.runs.wiring import build_training

    cfg = make_config("full", max_steps=3, eval={"interval": 100}, write_selected=False)
    run = build_training(cfg)
    assert isinstance(run.trainer, LeanTrainer) and run.trainer._use_closures() is False
    dt = datetime.timedelta(seconds=0.25)
    assert run.trainer._accumulate_time_across_ranks(8.0, 256, dt) == (8, 256, dt)
    run.fit()
    ts = run.trainer.state.timestamp
    assert (int(ts.batch), int(ts.sample)) == (3, 3 * cfg.batch_size)


def test_building_a_trainer_starts_no_process(make_config, monkeypatch):
    """Composer's Trainer asks for the processor's name at each start, which py-cpuinfo found by running a Python
    process (≈ 1.2 s of CPU in every process that trains): it is read from /proc/cpuinfo instead."""
    import subprocess

    from composer.utils.collect_env import get_composer_env_dict

    from training.blocks.trainer import _cpu_model
    from training.runs.wiring import build_training

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    build_training(make_config("full", max_steps=1, eval={"interval": 100}, write_selected=False))
    assert get_composer_env_dict()["cpu_model"] == _cpu_model() != ""


def test_mixed_batches_replace_the_last_rows_with_every_validation_row_once_per_pass(demo_root):
    """data.validation_share (the full+val baseline): floor(t · b · share) mixed rows up to step t, in the last
    rows of each batch, the other rows the same seed's stream rows; each pass over the validation rows shows
    every row once; the order depends on (seed, slot) only, so a resumed loader mixes the same rows."""
    from training.blocks.data import MixedBatches, TokenRows

    val = TokenRows(os.path.join(demo_root, "data", "validation"), "candidate")
    n = len(val)
    reader = StreamReader.open(_cand(demo_root), batch_size=8, seed=3)
    plain = list(StreamBatches(reader, stop_step=9))
    for share, per_two_steps in ((1 / 16, 1), (1 / 8, 2), (1 / 4, 4)):
        mixed = list(MixedBatches(reader, stop_step=9, rows=val, share=share, seed=3))
        counts = [int((b["sample_id"] < 0).sum()) for b in mixed]
        assert [sum(counts[:t]) for t in range(10)] == [t * per_two_steps // 2 for t in range(10)]
        for m, p, k in zip(mixed, plain, counts, strict=True):
            assert torch.equal(m["tokens"][:8 - k], p["tokens"][:8 - k]) and m["tokens"].shape == (8, 128)
            assert m["sample_id"][:8 - k].tolist() == p["sample_id"][:8 - k].tolist()
            assert all(i < 0 for i in m["sample_id"][8 - k:].tolist())
            for row, sid in zip(m["tokens"][8 - k:], m["sample_id"][8 - k:].tolist(), strict=True):
                assert torch.equal(row, val[-1 - sid]["tokens"])
            assert m["source"][8 - k:] == [val[-1 - i]["source"] for i in m["sample_id"][8 - k:].tolist()]
    # the first n slots are a permutation of the rows, the next n another one
    mixed = MixedBatches(reader, stop_step=40, rows=val, share=1 / 4, seed=3)
    order = [mixed.row_of(j) for j in range(2 * n)]
    assert sorted(order[:n]) == list(range(n)) == sorted(order[n:]) and order[:n] != order[n:]
    again = MixedBatches(reader, stop_step=40, rows=val, share=1 / 4, seed=3)
    assert [again.row_of(j) for j in reversed(range(2 * n))] == order[::-1]  # any order of asking: the same rows
    assert [MixedBatches(reader, stop_step=40, rows=val, share=1 / 4, seed=4).row_of(j) for j in range(n)] != order[:n]
    state = mixed.state_dict(num_samples=37 * 8, from_beginning=True)
    resumed = MixedBatches(reader, stop_step=40, rows=val, share=1 / 4, seed=3)
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    assert first["step"] == 37 and torch.equal(first["tokens"], mixed.batch(37)["tokens"])
    with pytest.raises(ValueError, match="share must be in"):
        MixedBatches(reader, stop_step=4, rows=val, share=1.0, seed=0)


def test_validation_share_is_refused_outside_a_plain_full_run(demo_root, tmp_path):
    """The mixed rows are the stream's rows of no engine part and no rank slice: a selecting policy (the engine-fed
    trainer's, jobs/curate_and_train.py, included), a worker group or scored shards refuse the setting in one line
    naming it, before anything runs."""
    from schemas.engine_config import CurateAndTrainConfig
    from schemas.train_config import TrainConfig

    base = TrainConfig.demo_default(demo_root, policy="full").model_dump(mode="json")
    engine = CurateAndTrainConfig.demo_default(demo_root).model_dump(mode="json")
    engine["train"]["data"]["validation_share"] = 0.125
    with pytest.raises(ValueError, match=r"data.validation_share \(0.125\) mixes .* needs selection.policy=full, .*\(got policy blade"):
        CurateAndTrainConfig.model_validate(engine)
    ok = TrainConfig.model_validate({**base, "data": {**base["data"], "validation_share": 0.125}})
    assert ok.data.validation_share == 0.125
    for bad in ({"selection": {**base["selection"], "policy": "blade"}},
                {"parallel": {**base["parallel"], "workers": 2}, "batch_size": 16}):
        with pytest.raises(ValueError, match="data.validation_share .* needs selection.policy=full"):
            TrainConfig.model_validate({**base, **bad, "data": {**base["data"], "validation_share": 0.125}})
    with pytest.raises(ValueError, match="less than 1"):
        TrainConfig.model_validate({**base, "data": {**base["data"], "validation_share": 1.0}})
