"""``--config`` is merged onto the job's embedded default (sections key by key, lists and free-form mappings replaced,
exclusive keys clearing each other), ``--set`` applies after it, and what the job records is the merged config."""

from __future__ import annotations

import pytest
import yaml

from curation.io.cli import parse_job_config
from schemas.config import ConfigError, PrepareConfig, load_config
from schemas.engine_config import CurateAndTrainConfig, CurateConfig
from schemas.merging import merge_config
from schemas.train_config import ReplayConfig, TrainConfig


def _file(tmp_path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_file_of_two_keys_changes_those_two_and_keeps_every_other_default(tmp_path):
    path = _file(tmp_path, "train:\n  max_steps: 20\n  selection: {gamma: 0.5}\n")
    cfg = load_config(CurateAndTrainConfig, path=path, default=CurateAndTrainConfig.demo_default)
    want = CurateAndTrainConfig.demo_default()
    want.train.max_steps, want.train.selection.gamma = 20, 0.5
    assert cfg == want


def test_set_applies_after_the_file(tmp_path):
    path = _file(tmp_path, "train: {max_steps: 20, selection: {gamma: 0.5}}\n")
    cfg = load_config(CurateAndTrainConfig, path=path, default=CurateAndTrainConfig.demo_default,
                      overrides=["train.max_steps=7", "train.selection.tau=5"])
    assert (cfg.train.max_steps, cfg.train.selection.gamma, cfg.train.selection.tau) == (7, 0.5, 5)


def test_a_list_in_the_file_replaces_the_default_list_whole(tmp_path):
    path = _file(tmp_path, "sources:\n  - {name: mine, paths: [a.jsonl]}\n")
    cfg = load_config(PrepareConfig, path=path, default=lambda: PrepareConfig.demo_default(str(tmp_path)))
    assert [s.name for s in cfg.sources] == ["mine"] and cfg.sources[0].template is None  # not the demo's item 0
    assert [s.name for s in cfg.validation] == ["target_val"]  # not in the file: the default's


def test_a_free_form_mapping_is_replaced_not_merged(tmp_path):
    """``model.hf_config`` of a GPT-2 is not the demo Llama's with keys added (``intermediate_size`` would stay)."""
    path = _file(tmp_path, "model:\n  hf_config: {model_type: gpt2, vocab_size: 2048, n_embd: 32, n_layer: 1, "
                           "n_head: 2, n_positions: 128}\n")
    cfg = load_config(TrainConfig, path=path, default=lambda: TrainConfig.demo_default(str(tmp_path)))
    assert cfg.model.hf_config == {"model_type": "gpt2", "vocab_size": 2048, "n_embd": 32, "n_layer": 1, "n_head": 2,
                                   "n_positions": 128}


@pytest.mark.parametrize("how", ["file", "set"])
def test_model_path_alone_replaces_the_default_hf_config(tmp_path, how):
    args = ({"path": _file(tmp_path, "train: {model: {path: /models/mine}}\n")} if how == "file"
            else {"overrides": ["train.model.path=/models/mine"]})
    cfg = load_config(CurateAndTrainConfig, default=CurateAndTrainConfig.demo_default, **args)
    assert cfg.train.model.path == "/models/mine" and cfg.train.model.hf_config is None
    assert cfg.train.model.init_seed == 0  # the rest of the section is the default's


def test_the_exclusive_keys_clear_each_other_in_either_direction_and_the_last_layer_wins(tmp_path):
    path = _file(tmp_path, "model: {path: /models/mine}\n")
    back = load_config(TrainConfig, path=path, default=lambda: TrainConfig.demo_default(str(tmp_path)),
                       overrides=["model.hf_config={model_type: gpt2, n_embd: 32}"])
    assert back.model.path is None and back.model.hf_config == {"model_type": "gpt2", "n_embd": 32}
    for what in (["replay", ReplayConfig, "model.path=/m"], ["curate", CurateConfig, "model.path=/m"]):
        cfg = load_config(what[1], default=what[1].demo_default, overrides=[what[2]])
        assert cfg.model.hf_config is None, what[0]


def test_a_layer_that_sets_both_exclusive_keys_is_refused_naming_them(tmp_path):
    path = _file(tmp_path, "model: {path: /m, hf_config: {model_type: gpt2}}\n")
    with pytest.raises(ConfigError, match="exactly one of model.hf_config .* or model.path"):
        load_config(TrainConfig, path=path, default=lambda: TrainConfig.demo_default(str(tmp_path)))


def test_a_file_naming_every_key_is_the_config_it_names_whatever_the_default(tmp_path):
    """Merging is the identity on a complete file: a full config written before merging existed still means the
    same (its record, and so its resumable outputs, unchanged)."""
    for cfg in (TrainConfig.demo_default(str(tmp_path), policy="rho1").model_copy(update={"max_steps": 9}),
                CurateAndTrainConfig.demo_default(str(tmp_path)).model_copy(update={"prepare": None})):
        path = _file(tmp_path, yaml.safe_dump(cfg.model_dump(mode="json")))
        for default in (type(cfg).demo_default, None):
            assert load_config(type(cfg), path=path, default=default) == cfg


def test_merge_config_leaves_its_inputs_as_they_were():
    base = {"a": {"b": 1, "c": [1, 2]}, "d": None}
    layer = {"a": {"b": 2}, "d": {"e": 1}}
    assert merge_config(base, layer) == {"a": {"b": 2, "c": [1, 2]}, "d": {"e": 1}}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": None} and layer == {"a": {"b": 2}, "d": {"e": 1}}


def test_an_unknown_key_in_a_partial_file_is_named_with_the_file(tmp_path):
    path = _file(tmp_path, "train: {selection: {gama: 0.5}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(CurateAndTrainConfig, path=path, default=CurateAndTrainConfig.demo_default)
    assert path in str(e.value) and "train.selection.gama: unknown key (did you mean gamma?)" in str(e.value)


def test_print_config_prints_the_merged_config(tmp_path, capsys):
    path = _file(tmp_path, "seq_len: 64\n")
    with pytest.raises(SystemExit):
        parse_job_config(PrepareConfig, description="t", default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                         argv=["--config", path, "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == PrepareConfig.demo_default(str(tmp_path)).model_copy(update={"seq_len": 64}).model_dump(mode="json")
