import re

import pytest
import yaml

from curation.io.cli import parse_job_config
from schemas.config import ConfigError, PrepareConfig, apply_override, load_config, load_yaml


def test_demo_default_validates_and_round_trips(tmp_path):
    cfg = PrepareConfig.demo_default(str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    again = load_config(PrepareConfig, path=str(path))
    assert again == cfg


def test_overrides_parse_yaml_values_and_list_indices(tmp_path):
    cfg = load_config(
        PrepareConfig,
        default=lambda: PrepareConfig.demo_default(str(tmp_path)),
        overrides=["seq_len=256", "sources.1.text_field=body", "skip_bad_records=true", "tokenizer.path=/x.json"],
    )
    assert cfg.seq_len == 256 and isinstance(cfg.seq_len, int)
    assert cfg.sources[1].text_field == "body"
    assert cfg.skip_bad_records is True
    assert cfg.tokenizer.path == "/x.json"


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer\.vocab_sise: unknown key"):
        load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                    overrides=["tokenizer.vocab_sise=100"])


def test_wrong_type_is_named_with_value(tmp_path):
    with pytest.raises(ConfigError, match=r"seq_len: .*integer.*'abc'"):
        load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                    overrides=["seq_len=abc"])


def test_yaml_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: []\noutput_dir: x\nbogus: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(PrepareConfig, path=str(bad))
    msg = str(e.value)
    assert str(bad) in msg and "bogus: unknown key" in msg and "sources" in msg


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_override({}, "seq_len")
    with pytest.raises(ConfigError, match="not an index"):
        apply_override({"sources": [{}]}, "sources.3.name=x")


def test_print_config_exits_with_yaml(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_job_config(PrepareConfig, description="t", default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                         argv=["--set", "seq_len=64", "--print-config"])
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["seq_len"] == 64 and printed["sources"][0]["name"] == "target"


def test_aliases_and_a_default_made_from_the_overrides(tmp_path):
    """``--set`` takes a job's short keys (``aliases``), and ``default_for`` builds the embedded default from the
    overrides given (the last one of a key wins), after the aliases are resolved: jobs/train.py's default output
    directory names the policy set."""
    from schemas.train_config import TrainConfig

    seen = []

    def default_for(sets):
        seen.append(dict(sets))
        return TrainConfig.demo_default(str(tmp_path), policy=sets.get("selection.policy", "blade"))

    cfg, args = parse_job_config(TrainConfig, description="t", default_for=default_for,
                                 aliases={"policy": "selection.policy", "gamma": "selection.gamma"},
                                 argv=["--set", "policy=full", "--set=gamma=0.5", "--set", " policy = rho1",
                                       "--set", "max_steps=7"])
    assert args.overrides == ["selection.policy=full", "selection.gamma=0.5", "selection.policy= rho1", "max_steps=7"]
    assert seen == [{"selection.policy": "rho1", "selection.gamma": "0.5", "max_steps": "7"}]
    assert (cfg.selection.policy, cfg.selection.gamma, cfg.max_steps) == ("rho1", 0.5, 7)
    assert cfg.output_dir == str(tmp_path / "train" / "rho1")


def test_config_error_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_job_config(PrepareConfig, description="t", default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                         argv=["--set", "seq_len=1"])
    assert e.value.code == 2
    assert "seq_len" in capsys.readouterr().err


def test_duplicate_source_names_rejected(tmp_path):
    with pytest.raises(ConfigError, match="duplicate source names"):
        load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                    overrides=["sources.1.name=target"])


@pytest.mark.parametrize("model,override,key", [
    ("train", "batch_size=true", "batch_size"),
    ("train", "selection.gamma=true", "selection.gamma"),
    ("train", "optim.lr='0.001'", "optim.lr"),
    ("train", "progress_bar=1", "progress_bar"),
    ("prepare", "seq_len='256'", "seq_len"),
    ("prepare", "seq_len=2.5", "seq_len"),
    ("prepare", "skip_bad_records=yes_please", "skip_bad_records"),
    ("prepare", "output_dir=7", "output_dir"),
])
def test_a_wrong_kind_of_value_is_refused_not_coerced(tmp_path, model, override, key):
    from schemas.train_config import TrainConfig

    cls, default = {"train": (TrainConfig, lambda: TrainConfig.demo_default(str(tmp_path))),
                    "prepare": (PrepareConfig, lambda: PrepareConfig.demo_default(str(tmp_path)))}[model]
    with pytest.raises(ConfigError, match="  " + re.escape(key) + r": .*\(got "):
        load_config(cls, default=default, overrides=[override])


def test_strict_values_still_take_the_natural_yaml_spellings(tmp_path):
    from schemas.train_config import TrainConfig

    cfg = load_config(TrainConfig, default=lambda: TrainConfig.demo_default(str(tmp_path)),
                      overrides=["batch_size=32", "selection.gamma=1", "optim.lr=3e-4", "optim.betas=[0.9, 0.95]",
                                 "progress_bar=false", "threads=null"])
    assert cfg.batch_size == 32 and cfg.selection.gamma == 1.0 and isinstance(cfg.selection.gamma, float)
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.9, 0.95) and cfg.progress_bar is False
    with pytest.raises(ConfigError, match=r"optim\.betas\.0: "):
        load_config(TrainConfig, default=lambda: TrainConfig.demo_default(str(tmp_path)),
                    overrides=["optim.betas=[true, 0.95]"])


def test_scientific_notation_is_a_number_in_files_and_overrides(tmp_path):
    from schemas.train_config import TrainConfig

    data = TrainConfig.demo_default(str(tmp_path)).model_dump(mode="json")
    text = yaml.safe_dump(data).replace("lr: 0.001", "lr: 1e-3").replace("eps: 1.0e-08", "eps: 1e-8")
    assert "lr: 1e-3" in text and "eps: 1e-8" in text  # PyYAML alone reads both as strings
    path = tmp_path / "t.yaml"
    path.write_text(text)
    cfg = load_config(TrainConfig, path=str(path), overrides=["selection.ref_lr=5E-4"])
    assert (cfg.optim.lr, cfg.optim.eps, cfg.selection.ref_lr) == (1e-3, 1e-8, 5e-4)


@pytest.mark.parametrize("name", [".", "..", "a/b", "../x", "a\\b", "/abs", ".lock", ".hidden", "-rf", "",
                                  "index.json", "manifest.json", "config.yaml", "a b", "x" * 101])
def test_a_source_name_that_is_no_safe_folder_name_is_refused_with_the_rule(tmp_path, name):
    for group in ("sources", "validation"):
        with pytest.raises(ConfigError) as e:
            load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                        overrides=[f"{group}.0.name='{name}'"])
        msg = str(e.value)
        assert f"{group}.0.name" in msg and f"source name {name!r} is used as a folder name" in msg
        assert "not starting with '.' or '-'" in msg and "no path separator" in msg
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize("name", ["target", "gsm8k_v1.2", "Wiki-103", "a", "x" * 100, "données", "_misc", "2024"])
def test_ordinary_source_names_are_accepted(tmp_path, name):
    cfg = load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                      overrides=[f"sources.0.name='{name}'"])
    assert cfg.sources[0].name == name


def test_a_dot_source_name_stops_the_prepare_job_in_one_line_before_writing(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_job_config(PrepareConfig, description="t", default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                         argv=["--set", "sources.0.name=.."])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "sources.0.name" in err and "source name '..' is used as a folder name" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["..", ".", "a/b", "hf/../../x"])
def test_an_evaluated_model_name_is_a_safe_folder_name(tmp_path, name):
    from schemas.eval_config import EvaluateConfig

    with pytest.raises(ConfigError, match=rf"models.0.name: .*model name {re.escape(repr(name))} is used as a folder"):
        load_config(EvaluateConfig, default=lambda: EvaluateConfig.demo_default(str(tmp_path)),
                    overrides=[f"models.0.name='{name}'", "models.0.path=some/dir"])


def test_text_sources_record_no_pre_tokenized_keys_so_older_records_still_resume(tmp_path):
    """The keys of pre-tokenized sources appear in a record only when set: a text source dumps exactly the keys
    it had before them, so config.yaml files and manifests written then still equal the config resuming them."""
    from schemas.config import SourceConfig

    keys_before = ["name", "paths", "format", "text_field", "template", "txt_split", "skip_documents",
                   "max_documents"]
    assert list(SourceConfig(name="a", paths=["x"]).model_dump(mode="json")) == keys_before
    cfg = load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                      overrides=["tokenizer.path=/t.json", "sources.0={name: c4, format: mds, paths: [/d/train], "
                                 "token_rows: documents, token_encoding_type: int32}"])
    dumped = cfg.model_dump(mode="json")["sources"][0]
    assert dumped["token_rows"] == "documents" and dumped["token_encoding_type"] == "int32"
    assert "tokens_field" not in dumped  # at its default
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert load_config(PrepareConfig, path=str(path)) == cfg


@pytest.mark.parametrize("override, message", [
    ("sources.0={name: s, paths: [x], format: mds}", r"sources\.0 \('s'\) is pre-tokenized: set tokenizer\.path"),
    ("sources.0={name: s, paths: [x], format: mds, template: '{a}'}", "template: a pre-tokenized source"),
    ("sources.0={name: s, paths: [x.jsonl], tokens_field: ids, format: jsonl}",
     "tokens_field: token ids are read from mds, parquet or arrow input, not jsonl"),
    ("sources.0={name: s, paths: [x], format: mds, token_encoding_type: float32}", "token_encoding_type: Input should"),
])
def test_pre_tokenized_source_settings_are_checked(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)), overrides=[override])


def test_an_evaluation_set_is_text(tmp_path):
    from schemas.eval_config import EvaluateConfig

    with pytest.raises(ConfigError, match=r"sets.0 \('target_val'\): evaluation sets are read as text"):
        load_config(EvaluateConfig, default=lambda: EvaluateConfig.demo_default(str(tmp_path)),
                    overrides=["sets.0.template=null", "sets.0.format=mds"])


# ------------------------------------------------------------------------------------------------
# bounded parsing (issue 32): aliases, duplicate keys, long values, typos
# ------------------------------------------------------------------------------------------------
#: The 319-byte "billion laughs" of issue 32: nine levels of nine aliases, 9⁹ strings once expanded.
ALIAS_BOMB = "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n" + "".join(
    f"{c}: &{c} [" + ",".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


def test_a_yaml_alias_is_refused_at_once_naming_its_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    with pytest.raises(ConfigError) as e:
        load_config(PrepareConfig, path=str(bomb))
    msg = str(e.value)
    assert "the alias *a is not accepted in a config" in msg and "line 2" in msg and len(msg) < 600, msg
    with pytest.raises(ConfigError, match=r"alias \*x is not accepted"):
        load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                    overrides=["sources.0.paths=[&x a, *x]"])


@pytest.mark.parametrize("levels", [65, 5000])
def test_a_deeply_nested_or_binary_config_is_one_line(tmp_path, levels):
    """P29 (issue 55): 5,000 nested mappings gave a 3,000-line RecursionError; a binary file a UnicodeDecodeError."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("".join("  " * i + f"k{i}:\n" for i in range(levels)) + "  " * levels + "v: 1\n")
    flow = tmp_path / "flow.yaml"
    flow.write_text("model: " + "{a: " * levels + "1" + "}" * levels + "\n")
    for path in (deep, flow):
        with pytest.raises(ConfigError) as e:
            load_config(PrepareConfig, path=str(path))
        assert str(e.value) == f"{path}: not valid YAML: mappings and lists nested more than 64 levels deep (a config " \
                               "nests a few)"
    with pytest.raises(ConfigError, match=r"^--set 'seq_len': value .* is not valid YAML \(mappings and lists nested "
                                          r"more than 64 levels deep \(a config nests a few\)\)$"):
        load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                    overrides=["seq_len=" + "[" * levels + "]" * levels])
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError) as e:
        load_config(PrepareConfig, path=str(binary))
    assert str(e.value) == f"{binary}: not valid YAML: not UTF-8 text (byte 0x80): a config is a YAML text " \
                           "file"
    assert load_yaml("{a: " * 63 + "[1]" + "}" * 63) is not None  # 64 levels are read


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    cfg = PrepareConfig.demo_default(str(tmp_path)).model_dump(mode="json")
    text = yaml.safe_dump(cfg, sort_keys=False) + "seq_len: 64\n"
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    first = 1 + next(i for i, line in enumerate(text.splitlines()) if line.startswith("seq_len:"))
    last = len(text.splitlines())
    with pytest.raises(ConfigError) as e:
        load_config(PrepareConfig, path=str(path))
    assert f"key 'seq_len' is given twice in this mapping (first on line {first}); keep one" in str(e.value)
    assert f"line {last}" in str(e.value)


def test_errors_quote_at_most_a_few_hundred_characters_of_a_value(tmp_path):
    huge = "x" * 50_000
    for override in (f"seq_len={huge}", f"sources.0.name={huge}", f"{huge}=1", f"seq_len=[{huge}"):
        with pytest.raises(ConfigError) as e:
            load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)),
                        overrides=[override])
        msg = str(e.value)
        assert len(msg) < 2000 and "50,0" in msg, (override[:20], len(msg), msg[:300])


@pytest.mark.parametrize(("override", "line"), [
    ("seq_lem=64", "  seq_lem: unknown key (did you mean seq_len?)"),
    ("tokenizer.vocab_sise=64", "  tokenizer.vocab_sise: unknown key (did you mean vocab_size?)"),
    ("sources.1.txt_field=body", "  sources.1.txt_field: unknown key (did you mean text_field?)"),
    ("completely_unrelated=1", "  completely_unrelated: unknown key (got 1)"),
])
def test_an_unknown_key_names_the_nearest_valid_one(tmp_path, override, line):
    with pytest.raises(ConfigError) as e:
        load_config(PrepareConfig, default=lambda: PrepareConfig.demo_default(str(tmp_path)), overrides=[override])
    assert line in str(e.value).splitlines(), str(e.value)


def test_an_unknown_key_of_a_nested_job_section_names_the_nearest_key_of_that_section(tmp_path):
    from schemas.engine_config import CurateAndTrainConfig

    with pytest.raises(ConfigError) as e:
        load_config(CurateAndTrainConfig, default=lambda: CurateAndTrainConfig.demo_default(str(tmp_path)),
                    overrides=["train.max_step=5", "train.selection.ref_lrr=0.1"])
    lines = str(e.value).splitlines()
    assert "  train.max_step: unknown key (did you mean max_steps?)" in lines, lines
    assert "  train.selection.ref_lrr: unknown key (did you mean ref_lr?)" in lines, lines
