"""Every example in jobs/configs loads and validates as its job's config, and says what it claims to."""

from __future__ import annotations

from pathlib import Path

import pytest

from curation.io.objects import is_url
from curation.io.outputs import URL_FIELDS
from schemas.config import PrepareConfig, load_config
from schemas.engine_config import CurateAndTrainConfig
from schemas.train_config import ReplayConfig, TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "jobs" / "configs"

#: Every file of jobs/configs and the config model of the job that reads it.
MODELS = {
    "curate_and_train_demo.yaml": CurateAndTrainConfig,
    "curate_and_train_s3.yaml": CurateAndTrainConfig,
    "own_corpus_own_model.yaml": CurateAndTrainConfig,
    "prepare_gsm8k.yaml": PrepareConfig,
    "prepare_own_tokens.yaml": PrepareConfig,
    "replay_demo.yaml": ReplayConfig,
    "train_data_parallel.yaml": TrainConfig,
    "train_demo.yaml": TrainConfig,
}


def _load(name: str):
    """The config as its job reads it: the file merged onto the job's embedded default."""
    return load_config(MODELS[name], path=str(CONFIGS / name), default=MODELS[name].demo_default)


#: The examples that list only what differs from their job's default (``--config`` merges onto it).
PARTIAL = {"own_corpus_own_model.yaml"}


@pytest.mark.parametrize("name", sorted(set(MODELS) - PARTIAL))
def test_a_complete_example_means_the_same_merged_onto_the_default_or_alone(name):
    """Each complete example names every key its outputs depend on: merging it onto the default changes nothing (its
    records, and the outputs a rerun resumes, stay as they were)."""
    assert _load(name) == load_config(MODELS[name], path=str(CONFIGS / name))


def test_every_shipped_config_is_listed_and_validates():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(MODELS)
    for name in MODELS:
        assert isinstance(_load(name), MODELS[name]), name


def test_the_main_jobs_example_is_its_embedded_default():
    assert _load("curate_and_train_demo.yaml") == CurateAndTrainConfig.demo_default()


def _urls(node, key=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _urls(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from _urls(v, key)
    elif isinstance(node, str) and is_url(node):
        yield key, node


def test_the_object_storage_example_keeps_every_directory_in_the_bucket_and_only_where_urls_are_taken():
    cfg = _load("curate_and_train_s3.yaml")
    urls = dict(_urls(cfg.model_dump(mode="json")))
    assert urls == {"candidates": "s3://my-bucket/demo/data/candidates",
                    "validation": "s3://my-bucket/demo/data/validation",
                    "tokenizer": "s3://my-bucket/demo/data/tokenizer/tokenizer.json",
                    "output_dir": "s3://my-bucket/demo/curate_and_train/blade"}
    assert set(urls) <= URL_FIELDS and cfg.prepare is None  # what localize() accepts; nothing prepared locally
    demo = CurateAndTrainConfig.demo_default()
    same = cfg.model_copy(update={"train": cfg.train.model_copy(update={"data": demo.train.data,
                                                                        "output_dir": demo.train.output_dir}),
                                  "prepare": demo.prepare})
    assert same == demo  # otherwise the demo: only the locations differ


def test_the_bring_your_own_tokens_example_reads_mds_and_parquet_ids_with_their_tokenizer():
    cfg = _load("prepare_own_tokens.yaml")
    by_name = {s.name: s for s in [*cfg.sources, *cfg.validation]}
    assert by_name["c4"].format == by_name["c4_val"].format == "mds" and by_name["c4"].pre_tokenized
    assert by_name["code"].tokens_field == "input_ids" and by_name["code"].token_rows == "documents"
    assert by_name["code"].pre_tokenized and cfg.tokenizer.path and cfg.seq_len == 2048


def test_the_data_parallel_example_is_the_demo_with_two_workers():
    cfg = _load("train_data_parallel.yaml")
    assert cfg.parallel.workers == 2 and cfg.batch_size % cfg.parallel.workers == 0
    demo = TrainConfig.demo_default()
    assert cfg.model_copy(update={"parallel": demo.parallel, "output_dir": demo.output_dir}) == demo
    assert cfg.output_dir != demo.output_dir  # another config: its own directory (a rerun would be refused)


@pytest.mark.parametrize("name", ["curate_and_train_s3.yaml", "train_data_parallel.yaml"])
def test_examples_print_as_they_load(name, capsys):
    """``--config`` of the job itself accepts them (the path a user takes)."""
    from tests.conftest import load_job

    job = {"curate_and_train_s3.yaml": "curate_and_train", "train_data_parallel.yaml": "train"}[name]
    with pytest.raises(SystemExit) as done:
        load_job(job, "_configs").main(["--config", str(CONFIGS / name), "--print-config"])
    assert done.value.code == 0, capsys.readouterr().err


def _file_leaves(node, prefix=""):
    """The keys a YAML file sets (a list is one value: it replaces the default's whole)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _file_leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_a_partial_example_sets_only_keys_that_differ_from_the_default(name):
    """issue 57: the worked example is short because it says only what differs from the job's default."""
    import yaml

    default = MODELS[name].demo_default().model_dump(mode="json")
    same = []
    for key, value in _file_leaves(yaml.safe_load((CONFIGS / name).read_text())):
        node = default
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node == value:
            same.append(key)
    assert not same, f"{name} repeats the default's value of {same}"


def test_the_own_corpus_own_model_example_reads_three_formats_with_the_models_tokenizer():
    cfg = _load("own_corpus_own_model.yaml")
    assert [s.paths[0].rsplit(".", 1)[1] for s in cfg.prepare.sources] == ["jsonl", "parquet", "txt"]
    assert cfg.prepare.tokenizer.path == cfg.train.model.path == cfg.train.data.tokenizer == "my-model"
    assert cfg.train.model.hf_config is None and not cfg.prepare.demo
    assert cfg.train.data.candidates == f"{cfg.prepare.output_dir}/candidates"  # (the main job prepares into it)
