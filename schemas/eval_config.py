"""Validated config of ``jobs/evaluate.py``: which models, which evaluation sets, how.

No torch here. Evaluation sets use the same source spec as ``jobs/prepare.py``
(:class:`~schemas.config.SourceConfig`), read by the same corpus readers.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from schemas.config import (
    DEMO_ROOT,
    PATH_NAME_RULE,
    SourceConfig,
    StrictModel,
    check_path_name,
    check_unique_names,
)

__all__ = ["EvalModelSpec", "LmEvalConfig", "EvaluateConfig"]


class EvalModelSpec(StrictModel):
    """One model (or, with a glob, several) to evaluate."""

    path: str = Field(
        description="an HF model directory (save_pretrained), a training run's output_dir or its final/ "
        "(final/model.safetensors + final/config.json); a glob matches several (e.g. runs/demo/train/*)"
    )
    name: str | None = Field(None, description="label in the report and the folder of its lm_eval export "
                             "(output_dir/hf/<name>; default: the directory name; not with a glob): " + PATH_NAME_RULE)
    tokenizer: str | None = Field(
        None, description="tokenizer.json or directory (default: the model directory's, or the run's data.tokenizer)"
    )
    weights: str | None = Field(
        None, description="another safetensors file for the same architecture (e.g. final/reference.safetensors)"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return None if v is None else check_path_name(v, "model name")


class LmEvalConfig(StrictModel):
    """Optional accuracy through lm-evaluation-harness (``pip install -e ".[eval]"``), fully offline."""

    tasks: list[Literal["gsm8k_local"]] = Field(
        default_factory=lambda: ["gsm8k_local"], description="task YAMLs written by curation.lm_eval_tasks"
    )
    gsm8k_file: str = Field(description="local GSM8K test jsonl (question/answer)")
    limit: int | None = Field(None, ge=1, description="evaluate only the first N problems")
    num_fewshot: int = Field(0, ge=0, description="worked examples put before each problem")
    max_gen_toks: int = Field(256, ge=1, description="most tokens generated per answer")
    batch_size: int = Field(8, ge=1, description="problems per generation batch")


class EvaluateConfig(StrictModel):
    """Config of ``jobs/evaluate.py``."""

    models: list[EvalModelSpec] = Field(description="models to evaluate")
    sets: list[SourceConfig] = Field(description="evaluation sets (same source spec as jobs/prepare.py)")
    max_len: int = Field(128, ge=2, description="context window in tokens; longer documents are scored in windows")
    batch_size: int = Field(16, ge=1, description="windows per forward pass")
    bootstrap: int = Field(1000, ge=0, description="bootstrap resamples of the documents for the 95% intervals")
    seed: int = Field(0, description="seeds the bootstrap")
    eos_token: str = Field("<|endoftext|>", description="document separator (as in jobs/prepare.py)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, ge=1, description="torch CPU threads; None = torch's default")
    output_dir: str = Field(description="writes results.json and results.md")
    progress: bool = Field(True, description="a progress bar on a terminal; else (a pipe, a log file) a progress line "
                           "per tenth of the batches; false: neither")
    lm_eval: LmEvalConfig | None = Field(None, description="optional lm-evaluation-harness accuracy (the eval extra)")

    @field_validator("models", "sets")
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("at least one entry is required")
        return v

    @model_validator(mode="after")
    def _unique_set_names(self) -> EvaluateConfig:
        check_unique_names([s.name for s in self.sets], "sets: duplicate names")
        for i, s in enumerate(self.sets):
            if s.pre_tokenized:
                raise ValueError(f"sets.{i} ({s.name!r}): evaluation sets are read as text (each document is "
                                 "tokenized by each model's tokenizer); a pre-tokenized source is not accepted here")
        return self

    @classmethod
    def demo_default(cls, root: str = DEMO_ROOT) -> EvaluateConfig:
        """Every demo run trained by ``jobs/train.py`` on the demo's target set (``target_val``)."""
        return cls(
            models=[EvalModelSpec(path=os.path.join(root, "train", "*"))],
            sets=[SourceConfig(name="target_val", paths=[os.path.join(root, "raw", "target_val.jsonl")],
                               template="{question}\n{answer}")],
            output_dir=os.path.join(root, "eval"),
        )
