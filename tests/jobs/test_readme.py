"""README and docs/REFERENCE.md as a user reads them: every job command resolves (each config in its own output
directory), every link and anchor resolves, and the snippets run as written after the two set-up commands."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from schemas.config import PrepareConfig
from schemas.engine_config import CurateAndTrainConfig
from schemas.records import config_diff, operational_keys
from schemas.train_config import TrainConfig
from tests import timing
from tests.conftest import SHARED_DATA, load_job

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", REPO / "docs" / "REFERENCE.md")
CONFIG_JOBS = ("prepare", "train", "replay", "curate", "curate_and_train")


def _blocks(lang: str) -> list[tuple[Path, str]]:
    return [(doc, block) for doc in DOCS for block in re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), re.S)]


def _readme_runs() -> list[tuple[str, list[str]]]:
    """(job, argv) of every documented command that runs a config job (no --print-config, no user files),
    ``ray job submit ... -- python jobs/...`` included."""
    runs = []
    for _, block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():  # continuation lines joined
            line = line.split("  #", 1)[0].strip()
            for cmd in line.split("&&"):
                words = shlex.split(cmd)
                if "--" in words and words[0] == "ray":  # the job ray runs
                    words = words[words.index("--") + 1:]
                if len(words) < 2 or words[0] != "python" or not words[1].startswith("jobs/"):
                    continue
                name = Path(words[1]).stem
                if name in CONFIG_JOBS and "--print-config" not in words and "my.yaml" not in words:
                    runs.append((name, words[2:]))
    return runs


def test_readme_examples_run_in_order_each_in_its_own_directory(capsys):
    runs = _readme_runs()
    assert {name for name, _ in runs} == set(CONFIG_JOBS)
    assert ("curate_and_train", ["--set", "train.output_dir=$D/submitted", "--set", "prepare.output_dir=$D/data",
                                 "--set", "train.data.candidates=$D/data/candidates", "--set",
                                 "train.data.validation=$D/data/validation", "--set",
                                 "train.data.tokenizer=$D/data/tokenizer/tokenizer.json"]) in runs  # ray job submit
    resolved: dict[str, list[tuple[list[str], dict]]] = {}
    for name, argv in runs:
        job = load_job(name, "_readme")
        with pytest.raises(SystemExit) as done:
            job.main([*argv, "--print-config"])
        assert done.value.code == 0, (name, argv, capsys.readouterr().err)
        resolved.setdefault(name, []).append((argv, yaml.safe_load(capsys.readouterr().out)))
    models = {"prepare": PrepareConfig, "curate_and_train": CurateAndTrainConfig, "train": TrainConfig}
    for name, items in resolved.items():
        for i, (argv_a, a) in enumerate(items):
            for argv_b, b in items[i + 1:]:
                out_a = a["train"]["output_dir"] if name == "curate_and_train" else a["output_dir"]
                out_b = b["train"]["output_dir"] if name == "curate_and_train" else b["output_dir"]
                ignore = operational_keys(models[name]) if name in models else set()
                if config_diff(a, b, ignore):  # another config must not reuse a directory (it would be refused)
                    assert out_a != out_b, f"{name} {argv_a} and {argv_b} both write {out_a}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces → hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_and_anchors_resolve():
    assert "issue notes" not in DOCS[0].read_text()
    anchors = {doc: {_anchor(h) for h in re.findall(r"^#+ (.*)$", doc.read_text(), re.M)} for doc in DOCS}
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)]+)\)", doc.read_text()):
            if target.startswith(("http", "../shared")):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.exists(), f"{doc.name}: {target}"
            if anchor and file in anchors:
                assert anchor in anchors[file], f"{doc.name}: {target} (no such heading)"


def test_the_quick_start_comes_first():
    """Set-up (with your own corpus and model: issue 57), the three uses and reading the output within the first
    ~110 lines of README."""
    lines = DOCS[0].read_text().splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("## ")]
    titles = [lines[i] for i in heads]
    assert titles[:5] == ["## Set-up (two commands)", "## 1. The main job: curation on Ray, training with Composer",
                          "## 2. The selected tokens in another trainer", "## 3. Batch curation with given checkpoints",
                          "## Reading the output"]
    assert heads[5] <= 110, heads


def test_the_set_up_commands_are_the_two_documented_ones():
    setup = _blocks("bash")[0][1]
    commands = [line for line in setup.splitlines() if line and not line.startswith("#")]
    assert commands == ['pip install -e ".[dev]" && python jobs/curate_and_train.py', "python -m pytest --all"]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1800)
def test_the_snippets_run_as_written_after_the_set_up(tmp_path):
    """Set-up command 1 (the main job, shortened to 40 steps: 30 warm-up, 10 selecting), then every Python snippet
    of README and REFERENCE in order, each in its own process in the same directory; the llm-foundry YAML's
    ``dataset`` section builds our streaming dataset over the same shards."""
    from curation.io.selected_dataset import StreamingSelectedTokens
    from training.blocks.foundry import NAME

    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": str(REPO)}
    main = timing.run([sys.executable, str(REPO / "jobs" / "curate_and_train.py"), "--set", "train.max_steps=40",
                           "--set", "train.progress_bar=false"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert main.returncode == 0, main.stdout[-2000:] + main.stderr[-3000:]
    snippets = _blocks("python")
    assert len(snippets) >= 3
    for i, (doc, code) in enumerate(snippets):
        if "../shared/data" in code and not SHARED_DATA.is_dir():
            continue  # (none today; a user's clone has no ../shared/data)
        script = tmp_path / f"snippet_{i}.py"
        script.write_text(code)
        out = timing.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, f"{doc.name} snippet {i}:\n{code}\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
    loaders = [yaml.safe_load(b)["train_loader"] for _, b in _blocks("yaml") if "train_loader:" in b]
    assert loaders and all(cfg["name"] == NAME for cfg in loaders)
    accepted = set(inspect.signature(StreamingSelectedTokens).parameters) | {"max_seq_len"}
    selected = tmp_path / "runs" / "demo" / "curate_and_train" / "blade" / "selected"
    for j, cfg in enumerate(loaders):
        assert set(cfg["dataset"]) <= accepted, cfg
        ds = StreamingSelectedTokens(**{**cfg["dataset"], "remote": str(selected), "local": str(tmp_path / f"c{j}"),
                                        "batch_size": 8})
        assert len(ds) == 40 * 16 and set(ds[0]) == {"input_ids", "labels"}
