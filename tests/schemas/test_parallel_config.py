"""The `parallel` section and `selection.scope` of the training config (schemas.train_config)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from curation.io.outdir import ConfigMismatch, check_config_record, write_config_record
from schemas.engine_config import CurateAndTrainConfig
from schemas.train_config import TrainConfig


def _cfg(**updates) -> TrainConfig:
    data = TrainConfig.demo_default("/tmp/none").model_dump(mode="json")
    for k, v in updates.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) else v
    return TrainConfig.model_validate(data)


def test_defaults_are_the_single_process_trainer():
    cfg = _cfg()
    assert cfg.parallel.workers == 1 and cfg.parallel.strategy == "ddp" and cfg.selection.scope == "global"
    assert cfg.parallel.resolved_backend == "gloo"
    assert _cfg(parallel={"gpus_per_worker": 1}).parallel.resolved_backend == "nccl"


@pytest.mark.parametrize(("updates", "message"), [
    ({"parallel": {"workers": 3}}, r"batch_size \(16\) must be a multiple of parallel.workers \(3\)"),
    ({"parallel": {"workers": 2}, "microbatch_size": 4},
     r"microbatch_size \(4\) with parallel.workers=2: each worker trains its 8 rows .* set microbatch_size to null or 8"),
    ({"parallel": {"backend": "nccl"}}, r"parallel.backend=nccl needs GPUs"),
    ({"parallel": {"backend": "gloo", "gpus_per_worker": 1}}, r"backend=gloo with parallel.gpus_per_worker > 0"),
    ({"parallel": {"strategy": "fsdp"}}, r"parallel.strategy=fsdp shards the model over the trainer workers: set "
     r"parallel.workers >= 2"),
    ({"parallel": {"workers": 2}, "device": "cuda"}, r"device=cuda with parallel.workers > 1 needs parallel.gpus_per_worker"),
    ({"parallel": {"workers": 0}}, r"parallel.workers"),
    ({"selection": {"scope": "node"}}, r"selection.scope"),
])
def test_bad_parallel_settings_are_refused_naming_them(updates, message):
    with pytest.raises(ValidationError, match=message):
        _cfg(**updates)


def test_microbatch_equal_to_the_rows_per_worker_is_accepted():
    assert _cfg(parallel={"workers": 4}, microbatch_size=4).parallel.workers == 4


def test_resuming_with_another_worker_count_is_refused_naming_the_key(tmp_path):
    path = str(tmp_path / "config.yaml")
    write_config_record(path, _cfg(parallel={"workers": 2}))
    # resources, backend, retries and the timeout may change between runs; the worker count may not
    assert check_config_record(path, _cfg(parallel={"workers": 2, "cpus_per_worker": 2, "max_failures": 5}))
    with pytest.raises(ConfigMismatch, match=r"differs in: parallel.workers\)") as e:
        check_config_record(path, _cfg())
    assert "parallel.workers: 2 → 1" in str(e.value)


def test_curate_and_train_takes_the_section_under_train():
    cfg = CurateAndTrainConfig.demo_default()
    data = cfg.model_dump(mode="json")
    data["train"]["parallel"]["workers"] = 2
    assert CurateAndTrainConfig.model_validate(data).train.parallel.workers == 2


def test_pipelined_engine_mode_with_several_trainer_workers_is_refused():
    data = CurateAndTrainConfig.demo_default().model_dump(mode="json")
    data["train"]["parallel"]["workers"] = 2
    data["engine"]["mode"] = "pipelined"
    with pytest.raises(ValidationError, match="train.parallel.workers > 1 runs with engine.mode=exact only"):
        CurateAndTrainConfig.model_validate(data)


def test_fsdp_with_the_engine_is_refused_and_accepted_for_the_train_job():
    data = CurateAndTrainConfig.demo_default().model_dump(mode="json")
    data["train"]["parallel"].update(workers=2, strategy="fsdp")
    with pytest.raises(ValidationError, match="train.parallel.strategy=fsdp is for jobs/train.py .* use strategy=ddp"):
        CurateAndTrainConfig.model_validate(data)
    assert _cfg(parallel={"workers": 2, "strategy": "fsdp"}).parallel.strategy == "fsdp"
