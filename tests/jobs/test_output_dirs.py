"""Every job: locked output directories, config records (refusal naming the differing keys, records never
rewritten), clear OS errors; and the job scripts themselves (checkout-first imports, --help; README's
commands: tests/jobs/test_readme.py)."""

from __future__ import annotations

import ast
import errno
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from curation.ingest.demo import DEMO_FILES
from curation.ingest.prepare import prepare
from curation.io.outdir import (
    ConfigMismatch,
    OutputDirBusy,
    OutputDirLock,
    open_output_dir,
)
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
from schemas.engine_config import CurateAndTrainConfig
from schemas.train_config import TrainConfig
from tests.conftest import load_job

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "jobs"
CONFIG_JOBS = ("prepare", "train", "replay", "curate", "curate_and_train")


def _small_prepare(tmp_path: Path, **kw) -> PrepareConfig:
    raw = tmp_path / "mine"
    raw.mkdir(exist_ok=True)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": " ".join(words[i % 8:] + words[:i % 8])}) + "\n"
                                         for i in range(200)))
    base = dict(sources=[SourceConfig(name="a", paths=[str(raw / "a.jsonl")])], tokenizer=TokenizerConfig(vocab_size=300),
                output_dir=str(tmp_path / "out"), seq_len=16, sequences_per_part=50, progress=False)
    return PrepareConfig(**{**base, **kw})


# ------------------------------------------------------------------------------------------------
# prepare
# ------------------------------------------------------------------------------------------------
def test_prepare_refuses_a_second_writer_and_a_changed_config_without_touching_the_directory(tmp_path):
    cfg = _small_prepare(tmp_path)
    with OutputDirLock(cfg.output_dir, "prepare"):  # another prepare (e.g. seed 1) still running
        with pytest.raises(OutputDirBusy, match=f"pid {os.getpid()}"):
            prepare(cfg.model_copy(update={"seed": 1}))
        assert os.listdir(cfg.output_dir) == [".lock"]
    prepare(cfg)
    record = (Path(cfg.output_dir) / "config.yaml").read_text()
    assert yaml.safe_load(record) == cfg.model_dump(mode="json")
    snapshot = {p: p.stat().st_mtime_ns for p in Path(cfg.output_dir).rglob("*") if p.name != ".lock"}
    changed = cfg.model_copy(update={"seed": 1, "progress": True,
                                     "tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": 400})})
    with pytest.raises(ConfigMismatch) as err:
        prepare(changed)
    assert err.value.keys == ["seed", "tokenizer.vocab_size"]
    assert {p: p.stat().st_mtime_ns for p in Path(cfg.output_dir).rglob("*") if p.name != ".lock"} == snapshot
    prepare(cfg.model_copy(update={"progress": True}))  # an operational key may differ: resumes (finished)


def test_overriding_the_demo_sources_writes_no_demo_corpus_into_the_users_folder(tmp_path):
    own = _small_prepare(tmp_path)
    demo = PrepareConfig.demo_default(str(tmp_path / "demo"))
    cfg = demo.model_copy(update={"sources": own.sources, "validation": [], "seq_len": 16, "progress": False,
                                  "tokenizer": own.tokenizer})
    prepare(cfg)
    assert sorted(os.listdir(tmp_path / "mine")) == ["a.jsonl"]
    assert not (tmp_path / "demo" / "raw").exists()
    # the demo's validation kept: its file is generated in the demo's folder, still none in the user's
    prepare(cfg.model_copy(update={"validation": demo.validation, "output_dir": str(tmp_path / "out2")}))
    assert sorted(os.listdir(tmp_path / "mine")) == ["a.jsonl"]
    assert sorted(os.listdir(tmp_path / "demo" / "raw")) == sorted(DEMO_FILES)


# ------------------------------------------------------------------------------------------------
# curate_and_train: refused before Ray starts
# ------------------------------------------------------------------------------------------------
def test_curate_and_train_refuses_a_changed_config_and_a_second_writer_before_starting(tmp_path):
    from training.runs.engine_job import curate_and_train

    cfg = CurateAndTrainConfig.demo_default(str(tmp_path))
    out = cfg.train.output_dir
    open_output_dir(out, "curate_and_train", {"engine_config.yaml": cfg, "config.yaml": cfg.train}).write_records()
    Path(out, "summary.json").write_text("{}")  # an output the records protect (a record alone is replaced)
    before = {n: (Path(out) / n).read_text() for n in ("engine_config.yaml", "config.yaml")}
    data = cfg.model_dump(mode="json")
    data["engine"]["mode"] = "pipelined"
    data["train"]["batch_size"] = 8
    data["workers"]["count"] = 4  # operational: the exact engine's outputs do not depend on it
    with pytest.raises(ConfigMismatch) as err:
        curate_and_train(CurateAndTrainConfig.model_validate(data))
    assert err.value.keys == ["engine.mode", "train.batch_size"]
    assert {n: (Path(out) / n).read_text() for n in before} == before
    assert not (tmp_path / "data").exists()  # nothing prepared, no Ray started
    with OutputDirLock(out, "curate_and_train"):
        with pytest.raises(OutputDirBusy, match="in use by another run: curate_and_train pid"):
            curate_and_train(cfg)


def test_curate_refuses_a_changed_config_and_a_second_writer_before_starting(tmp_path):
    from curation.engine.batch_curation import curate
    from schemas.engine_config import CurateConfig

    cfg = CurateConfig.demo_default(str(tmp_path))
    open_output_dir(cfg.output_dir, "curate", {"config.yaml": cfg}).write_records()
    Path(cfg.output_dir, "summary.json").write_text("{}")  # an output the record protects
    record = (Path(cfg.output_dir) / "config.yaml").read_text()
    changed = cfg.model_copy(update={"gamma": 0.4, "progress": False,
                                     "workers": cfg.workers.model_copy(update={"count": 8, "range_steps": 5})})
    with pytest.raises(ConfigMismatch) as err:
        curate(changed)
    assert err.value.keys == ["gamma", "workers.range_steps"]
    assert (Path(cfg.output_dir) / "config.yaml").read_text() == record
    assert sorted(os.listdir(cfg.output_dir)) == [".lock", "config.yaml", "summary.json"]
    with OutputDirLock(cfg.output_dir, "curate"):
        with pytest.raises(OutputDirBusy, match="in use by another run: curate pid"):
            curate(cfg)


# ------------------------------------------------------------------------------------------------
# OS errors at the job level: what failed and where, exit 1, no traceback
# ------------------------------------------------------------------------------------------------
def test_prepare_job_on_a_full_disk_names_the_file_and_a_rerun_completes(tmp_path, monkeypatch, capsys, full_disk):
    cfg = _small_prepare(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    full_disk(lambda text: '"schema_version"' in text)  # the disk fills up when the first manifest is saved
    assert load_job("prepare", "_outdirs").main(["--config", str(path)]) == 1
    err = capsys.readouterr().err
    manifest = os.path.join(cfg.output_dir, "candidates", "manifest.json")
    assert err.startswith(f"error: preparing into {cfg.output_dir} failed ({manifest}): No space left on device; "
                          "the disk is full: free space")
    assert "Traceback" not in err and not os.path.exists(manifest)
    monkeypatch.undo()  # space freed: the rerun completes
    assert load_job("prepare", "_outdirs").main(["--config", str(path)]) == 0


def test_train_into_a_read_only_directory_names_it(tmp_path, monkeypatch):
    from training.runs.train_job import train

    out = tmp_path / "ro"
    out.mkdir()

    def refuse(path, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr("curation.io.outdir.os.open", refuse)  # as root, chmod 555 would not stop the write
    cfg = TrainConfig.demo_default(str(tmp_path)).model_copy(update={"output_dir": str(out)})
    with pytest.raises(ValueError) as err:
        train(cfg)
    assert str(err.value) == (f"cannot open the output directory {out} ({out}/.lock): Permission denied; "
                              "no permission: make the directory writable (or use another output_dir) and rerun")


# ------------------------------------------------------------------------------------------------
# the job scripts
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIG_JOBS)
def test_each_job_imports_this_checkouts_packages_first(name):
    tree = ast.parse((JOBS / f"{name}.py").read_text())
    first_insert = first_project_import = None
    for i, node in enumerate(tree.body):
        if (first_insert is None and isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "sys.path.insert"):
            first_insert = i
        if (first_project_import is None and isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] in ("curation", "training", "schemas")):
            first_project_import = i
    assert first_insert is not None and first_project_import is not None and first_insert < first_project_import


@pytest.mark.parametrize("name", CONFIG_JOBS)
def test_each_jobs_help_shows_an_example_of_its_own_config(name, capsys):
    with pytest.raises(SystemExit):
        load_job(name, "_outdirs").main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    example = re.search(r"e\.g\. --set (\S+)=", text)
    assert example, text
    key = example.group(1)
    job = load_job(name, "_outdirs")
    with pytest.raises(SystemExit):
        job.main(["--print-config"])
    resolved = yaml.safe_load(capsys.readouterr().out)
    node = resolved
    for part in key.split("."):  # the example's key exists in this job's config
        node = node[int(part)] if isinstance(node, list) else node[part]


def test_demo_files_are_the_ones_the_demo_default_reads():
    cfg = PrepareConfig.demo_default("root")
    names = {os.path.basename(p) for s in [*cfg.sources, *cfg.validation] for p in s.paths}
    assert names == set(DEMO_FILES)


def test_the_main_job_refuses_to_prepare_where_its_trainer_does_not_read(tmp_path, monkeypatch, capsys):
    """issue 57: a file that gives its own ``train.data`` is merged onto the default, whose ``prepare`` makes the demo
    corpus: with the shards missing, preparing the demo would be for nothing. Refused in one line before Ray starts;
    the failed first run leaves no output directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("train:\n  data: {candidates: mine/candidates, validation: mine/validation, "
                                        "tokenizer: null}\n  output_dir: out\n")
    assert load_job("curate_and_train", "_guard").main(["--config", "mine.yaml"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: train.data.candidates: mine/candidates holds no candidate shards, and `prepare` writes "
        f"{os.path.join('runs', 'demo', 'data', 'candidates')}: set train.data.candidates (and validation) to its "
        "output, or prepare.output_dir to the folder above it, or prepare: null"]
    assert sorted(os.listdir(tmp_path)) == ["mine.yaml"]
