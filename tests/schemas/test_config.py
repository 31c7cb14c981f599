import pytest
import yaml

from schemas.config import ConfigError, PrepareConfig, apply_override, load_config, parse_job_config


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
