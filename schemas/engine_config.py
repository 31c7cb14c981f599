"""Validated configs of the Ray engine and of its jobs (``jobs/curate_and_train.py``, ``jobs/curate.py``).

No torch, no ray. Sections:

* :class:`RayConfig`: which Ray cluster (a local one by default, or the one a ``ray job submit`` runs in).
* :class:`WorkersConfig`: the scoring-worker pool (count, threads, device, GPUs, work-unit size, restarts).
* :class:`EngineConfig`: how the engine runs next to the trainer (exact / pipelined, look-ahead, proxy
  snapshot period ``P``, synchronous or overlapped refresh with its staleness ``δ``).
* :class:`CurateAndTrainConfig`: the main job (a :class:`~schemas.train_config.TrainConfig` + the above).
* :class:`CurateConfig`: batch curation of a corpus with given checkpoints.

Demo defaults (the embedded default of ``jobs/curate_and_train.py``): the demo training config of
:meth:`TrainConfig.demo_default` (tiny Llama, 150 steps of 16 × 128 tokens, τ = 30, K = 9, W = 30),
2 scoring workers and the trainer with one torch thread each, work units of 5 steps, look-ahead of one
episode (30 steps).
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from schemas.config import DEMO_ROOT, Gamma, PrepareConfig, RayConfig, StrictModel
from schemas.records import INPUT, OPERATIONAL
from schemas.train_config import ModelConfig, Precision, TrainConfig, demo_model_config

__all__ = [
    "ENGINE_POLICIES",
    "RayConfig",
    "WorkersConfig",
    "EngineConfig",
    "CurateAndTrainConfig",
    "CurateConfig",
]

#: Policies that need reference scores, i.e. the ones the Ray engine serves.
ENGINE_POLICIES = ("rho1", "blade", "blade-nosync")
Device = Literal["auto", "cpu", "cuda"]


class WorkersConfig(StrictModel):
    """The scoring-worker pool (Ray actors, one GPU each when the cluster has them)."""

    count: int = Field(2, ge=1, description="number of scoring workers", json_schema_extra=OPERATIONAL)
    threads: int = Field(1, ge=1, description="torch CPU threads per worker (also its Ray num_cpus)")
    device: Device = Field("auto", description="auto = cuda when the worker sees a GPU, else cpu")
    gpus: float | None = Field(
        None, ge=0, description="GPUs per worker; None = 1 when the cluster has one per worker (+1 for the "
        "refresh actor), a fractional share when it has fewer, 0 without GPUs"
    )
    score_batch_size: int | None = Field(
        None, ge=1, description="sequences per scoring forward; None = the whole candidate batch b"
    )
    range_steps: int = Field(5, ge=1, description="proxy steps per work unit (one MDS part per unit)")
    max_restarts: int = Field(3, ge=0, description="restarts of a crashed worker (its unit is redone once)",
                              json_schema_extra=OPERATIONAL)
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each worker asks for besides its CPUs and GPUs, to "
        "keep the workers on the nodes started with them (e.g. {scorer: 1}; ray start --resources "
        "'{\"scorer\": 2}')", json_schema_extra=OPERATIONAL)


class EngineConfig(StrictModel):
    """How the engine runs next to the trainer (docs/DESIGN.md §3)."""

    mode: Literal["exact", "pipelined"] = Field(
        "exact",
        description="exact: workers write ℓ(w̃) (scored shards), the trainer selects with its own ℓ(u); "
        "pipelined: workers also hold a proxy snapshot and write finished masks (selected-token shards)",
    )
    lookahead: int = Field(30, ge=1, description="max proxy steps the workers score ahead of the trainer",
                           json_schema_extra=OPERATIONAL)
    snapshot_period: int = Field(
        8, ge=1, description="P (pipelined): step t is scored with the proxy snapshot u^(W + P·⌊(t−W)/P⌋); "
        "P = 1 reproduces exact mode"
    )
    refresh: Literal["sync", "overlapped"] = Field(
        "sync", description="sync: the refresh starts from u^(W+eτ) (trainer waits); overlapped: from u^(W+eτ−δ)"
    )
    overlap_steps: int = Field(5, ge=1, description="δ of the overlapped refresh (staleness of its start point)")
    refresh_threads: int | None = Field(None, ge=1, description="torch threads of the refresh actor; None = workers.threads")
    refresh_device: Device = Field("auto", description="device of the refresh actor; auto = cuda when it sees a GPU")
    wait_timeout_s: float = Field(
        1800.0, gt=0, description="the trainer fails when the scores of a step do not arrive within this time",
        json_schema_extra=OPERATIONAL,
    )


class CurateAndTrainConfig(StrictModel):
    """Config of ``jobs/curate_and_train.py``: online curation on Ray + Composer training."""

    train: TrainConfig
    engine: EngineConfig = Field(default_factory=EngineConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    ray: RayConfig = Field(default_factory=RayConfig, json_schema_extra=OPERATIONAL)
    prepare: PrepareConfig | None = Field(
        None, description="prepare this corpus first when train.data.candidates has no index.json (demo); "
        "prepare.output_dir keeps its own config record", json_schema_extra=OPERATIONAL,
    )

    @model_validator(mode="after")
    def _checks(self) -> CurateAndTrainConfig:
        sel = self.train.selection
        if sel.policy not in ENGINE_POLICIES:
            raise ValueError(
                f"train.selection.policy {sel.policy!r} needs no reference scores; the Ray engine serves "
                f"{', '.join(ENGINE_POLICIES)} (use jobs/train.py for 'full' and 'random')"
            )
        if self.engine.lookahead < self.workers.range_steps:
            raise ValueError(
                f"engine.lookahead ({self.engine.lookahead}) must be >= workers.range_steps "
                f"({self.workers.range_steps}): a work unit could never start"
            )
        if self.engine.refresh == "overlapped":
            if sel.policy == "rho1":
                raise ValueError("engine.refresh=overlapped: rho1's reference is never refreshed")
            if self.engine.overlap_steps > sel.tau:
                raise ValueError(
                    f"engine.overlap_steps (δ = {self.engine.overlap_steps}) must be <= train.selection.tau "
                    f"({sel.tau})"
                )
        if self.engine.mode == "pipelined" and self.train.microbatch_size not in (None, self.train.batch_size):
            raise ValueError("engine.mode=pipelined selects over the whole batch: leave train.microbatch_size unset")
        if self.train.data.scored is not None:
            raise ValueError("train.data.scored is written by the engine here (output_dir/scored): leave it unset")
        if self.train.parallel.workers > 1 and self.engine.mode == "pipelined":
            raise ValueError("train.parallel.workers > 1 runs with engine.mode=exact only (in pipelined mode the "
                             "trainer only replays finished masks: one trainer process is enough)")
        if self.train.parallel.strategy == "fsdp":
            raise ValueError("train.parallel.strategy=fsdp is for jobs/train.py (in-process reference, sharded like "
                             "the proxy): the engine's scoring workers and refresh actor each hold a whole model; "
                             "use strategy=ddp with the engine")
        return self

    @classmethod
    def demo_default(cls, root: str = DEMO_ROOT) -> CurateAndTrainConfig:
        """The embedded default: the demo corpus (prepared if missing), tiny Llama, 2 CPU workers."""
        train = TrainConfig.demo_default(root)
        train.output_dir = os.path.join(root, "curate_and_train", train.selection.policy)
        # One torch thread for the trainer and for each worker: with more threads than cores, torch's
        # OpenMP spin-waits cost far more than they gain (a 2-core laptop runs trainer + workers).
        train.threads = 1
        return cls(train=train, prepare=PrepareConfig.demo_default(root))


class CurateConfig(StrictModel):
    """Config of ``jobs/curate.py``: score and select a corpus with given checkpoints (no training).

    Each block of ``batch_size`` sequences (of a permutation of the corpus drawn from ``seed``, or in file
    order) is one candidate batch: its top-γ tokens by ``Δ = ℓ(u) − ℓ(w̃)`` are kept. ``u`` is the proxy checkpoint; without
    one (``proxy_weights: null``) it is the base model of ``model`` (a static, RHO-1-style pass: the excess
    loss of the reference over the model it was trained from).
    """

    candidates: str = Field(description="candidate-shard directory (jobs/prepare.py output)", json_schema_extra=INPUT)
    tokenizer: str | None = Field(None, description="tokenizer.json; when set, checked against the shard manifest",
                                  json_schema_extra=INPUT)
    model: ModelConfig = Field(description="architecture (and base weights) of the proxy and the reference")
    reference_weights: str = Field(description="safetensors of the reference w̃", json_schema_extra=INPUT)
    proxy_weights: str | None = Field(None, description="safetensors of the proxy u; None = the base model",
                                      json_schema_extra=INPUT)
    gamma: Gamma = Field(0.6, description="γ: fraction of valid tokens kept per candidate batch, in (0, 1]")
    batch_size: int = Field(16, ge=1, description="sequences per candidate batch (selection block)")
    shuffle: bool = Field(
        True, description="form batches from a seeded permutation of the corpus (like the training stream); "
        "false = file order, where prepare.py's per-source parts make every batch single-source"
    )
    seed: int = Field(0, ge=0, description="seed of the permutation (shuffle: true)")
    precision: Precision = Field(
        "fp32", description="fp32 | amp_bf16: proxy and reference forwards under bf16 autocast on CUDA workers "
        "(fp32 on CPU workers); losses in float32"
    )
    output_dir: str = Field(description="selected/ (shards + manifest) and summary.json")
    workers: WorkersConfig = Field(default_factory=lambda: WorkersConfig(range_steps=10))
    ray: RayConfig = Field(default_factory=RayConfig, json_schema_extra=OPERATIONAL)
    progress: bool = Field(True, description="a progress bar on a terminal; else (a pipe, a log file) a progress "
                           "line per interval; false: neither", json_schema_extra=OPERATIONAL)

    @classmethod
    def demo_default(cls, root: str = DEMO_ROOT) -> CurateConfig:
        """Curate the demo pool with the final proxy and reference of the main job's demo run."""
        run = os.path.join(root, "curate_and_train", "blade", "final")
        data = os.path.join(root, "data")
        return cls(
            candidates=os.path.join(data, "candidates"),
            tokenizer=os.path.join(data, "tokenizer", "tokenizer.json"),
            model=demo_model_config(2048),
            reference_weights=os.path.join(run, "reference.safetensors"),
            proxy_weights=os.path.join(run, "model.safetensors"),
            output_dir=os.path.join(root, "curate", "blade"),
        )
