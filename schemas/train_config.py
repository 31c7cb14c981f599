"""Validated configs of the training jobs (``jobs/train.py``, ``jobs/replay.py``) and of the scorer.

No torch here: models are described by a Hugging Face config dict (built locally, nothing from a
hub) or a local directory.

Defaults, scaled down from the paper (docs/DESIGN.md §2) for the embedded demo (tiny Llama trained from
scratch on ≈2250 sequences of 128 tokens on a CPU):

=================== ========================== ======================================================
setting             paper (1.1B–7B CPT)        demo default (why)
=================== ========================== ======================================================
γ                   0.6                        0.6 (a fraction: independent of scale)
τ                   1000 steps                 30 (≈ 1/5 of the 150-step run, like 1000 of 5000)
K                   300                        30 (K/τ = 1, not the paper's 0.3: with a model this small,
                                               9 refresh steps of 4 sequences barely move w̃ away from
                                               u, Δ is mostly noise and BLADE does no better than
                                               `random`; 30 steps give a clearly lower validation loss
                                               than `full` on the demo. jobs/bench_training.py measures
                                               the paper's K/τ = 0.3)
λ                   1                          1
η_u = η_w           8e-5 (2e-5 for 7B)         1e-3 (a 0.23M-parameter model from random init needs a
                                               larger step than continual pre-training of 1B+)
AdamW wd / clip     0.01 / 1.0, constant LR    0.01 / 1.0, constant LR
batch               512 × 2048 tokens          16 × 128 tokens
proxy steps         5000                       150 (≈ 1 pass over the demo pool)
warm-up W           (not given)                30 steps (= τ: the proxy must know the pool first)
refresh batch       (not given)                4 validation + 4 candidate sequences per refresh step
                                               (b/4 each: a refresh step costs ≈ ½ a proxy step,
                                               so K/τ = 0.3 adds ≈ 0.15 of a step; see
                                               jobs/bench_training.py)
=================== ========================== ======================================================
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from schemas.config import DEMO_ROOT, Gamma, StrictModel
from schemas.records import EXTENDABLE, INPUT, OPERATIONAL
from schemas.train_options import LoggersConfig, ThroughputConfig

__all__ = [
    "POLICY_CHOICES",
    "DataConfig",
    "ModelConfig",
    "TrainModelConfig",
    "SelectionConfig",
    "OptimConfig",
    "EvalConfig",
    "CheckpointConfig",
    "ParallelConfig",
    "TrainConfig",
    "ReplayConfig",
    "ScorerConfig",
    "demo_model_config",
]

#: Selection policies (curation.core.policies.POLICY_NAMES; repeated here because schemas/ has no torch).
POLICY_CHOICES = ("full", "random", "rho1", "blade", "blade-nosync")
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "amp_bf16"]


class ModelConfig(StrictModel):
    """A causal LM: built from a HF config dict (random init) or loaded from a local directory."""

    #: ``path`` (your model) given in a file or ``--set`` replaces the default's ``hf_config``, and the other way
    #: round (:mod:`schemas.merging`)
    exclusive_keys: ClassVar[tuple[tuple[str, ...], ...]] = (("hf_config", "path"),)

    hf_config: dict[str, Any] | None = Field(
        None, description="HF config as a dict with 'model_type' (e.g. llama); the model is built with random init"
    )
    path: str | None = Field(None, description="local HF model directory (config.json + weights); no hub access",
                             json_schema_extra=INPUT)
    trust_remote_code: bool = Field(False, description="allow custom modelling code from `path` (off unless asked)")
    init_seed: int = Field(0, ge=0, description="seed of the random initialisation (hf_config)")
    weights: str | None = Field(None, description="safetensors file loaded over the built model (e.g. a final proxy)",
                                json_schema_extra=INPUT)

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.hf_config is None) == (self.path is None):
            raise ValueError("set exactly one of model.hf_config (build from a config) or model.path (local directory)")
        if self.hf_config is not None and "model_type" not in self.hf_config:
            raise ValueError("model.hf_config needs a 'model_type' key (e.g. llama)")
        return self


class TrainModelConfig(ModelConfig):
    """The trained model: what it is (:class:`ModelConfig`) and how it runs. Both off by default (the behaviour
    runs recorded before these keys existed were trained with)."""

    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward pass (less activation "
        "memory for ≈ one more forward of compute); FSDP: through Composer's FSDP config")
    compile: bool = Field(False, description="torch.compile the model's forward (slower first steps; on a CPU it "
                          "needs a C compiler)")

    @property
    def architecture(self) -> ModelConfig:
        """What the model is, without how it runs (the engine's scoring workers and refresh actor build it)."""
        return ModelConfig.model_validate(self.model_dump(exclude={"activation_checkpointing", "compile"}))


def _train_model(value: Any) -> Any:
    # a plain ModelConfig (e.g. demo_model_config()) is taken as a TrainModelConfig with both options off
    if isinstance(value, ModelConfig) and not isinstance(value, TrainModelConfig):
        return value.model_dump()
    return value


def demo_model_config(vocab_size: int = 2048, *, hidden: int = 64, layers: int = 2, seq_len: int = 128) -> ModelConfig:
    """The tiny Llama of the demo (0.23M parameters at vocab 2048 with the defaults, tied embeddings)."""
    return ModelConfig(
        hf_config={
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": hidden * 8 // 3 // 8 * 8 + 8,
            "num_hidden_layers": layers,
            "num_attention_heads": max(1, hidden // 16),
            "num_key_value_heads": max(1, hidden // 16),
            "max_position_embeddings": seq_len,
            "tie_word_embeddings": True,
            "attention_dropout": 0.0,
        }
    )


class DataConfig(StrictModel):
    """Where the shards are (written by ``jobs/prepare.py``)."""

    candidates: str = Field(description="candidate-shard directory (MDS + manifest.json)", json_schema_extra=INPUT)
    validation: str = Field(description="validation-shard directory (the target set)", json_schema_extra=INPUT)
    tokenizer: str | None = Field(
        None, description="tokenizer.json (or directory); when set, its fingerprint must match the shard manifests",
        json_schema_extra=INPUT,
    )
    scored: str | None = Field(
        None, description="scored-shard directory with ref_loss for the stream; None = in-process reference",
        json_schema_extra=INPUT,
    )
    validation_share: float = Field(
        0.0, ge=0, lt=1, description="share of every step's rows taken from the validation shards instead of the "
        "stream's (target examples mixed into every batch, in a seeded order that goes through all of them once "
        "per pass: the `full+val` baseline; the batch keeps batch_size rows); policy full only; 0 = none"
    )


class SelectionConfig(StrictModel):
    """Token selection (docs/DESIGN.md §2). See the module docstring for paper vs demo defaults."""

    policy: Literal["full", "random", "rho1", "blade", "blade-nosync"] = Field("blade", description="selection policy")
    gamma: Gamma = Field(0.6, description="γ: fraction of valid tokens kept per candidate batch, in (0, 1]")
    warmup_steps: int = Field(30, ge=0, description="W: proxy steps on all tokens before the first refresh")
    tau: int = Field(30, ge=1, description="τ: proxy steps per episode (between refreshes)")
    refresh_steps: int = Field(30, ge=0, description="K: reference steps per refresh (paper 300 for τ = 1000)")
    lam: float = Field(1.0, ge=0, description="λ: weight of the masked candidate loss in the refresh objective")
    ref_lr: float | None = Field(None, gt=0, description="η_w; None = the proxy's optim.lr")
    ref_weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay of the reference's refresh steps")
    ref_grad_clip: float | None = Field(1.0, ge=0, description="max total gradient norm of a refresh step; None = off")
    refresh_batch_size: int | None = Field(
        None, ge=1, description="sequences per validation and per candidate batch of a refresh step; None = b/4"
    )
    refresh_candidate_batches: int = Field(
        8, ge=1, description="recent trained batches (with their masks) the refresh cycles through for L_train"
    )
    rho1_steps: int = Field(30, ge=0, description="rho1: steps of the static reference on validation data")
    reference_weights: str | None = Field(
        None, description="rho1: safetensors of an already trained static reference (skips its training)",
        json_schema_extra=INPUT,
    )
    seed: int = Field(0, ge=0, description="seed of the random policy's scores")
    score_batch_size: int | None = Field(None, ge=1, description="sequences per reference scoring forward; None = b")
    score_lookahead: int | None = Field(
        None, ge=1, description="steps scored at once by the in-process reference; None = the rest of the episode"
    )
    offload_reference: bool = Field(
        True, description="keep the reference on CPU between refreshes (it only scores right after a refresh)"
    )
    refresh_joint_forward: bool | None = Field(
        None, description="a refresh step's validation and candidate rows in one forward, stacked (the same losses, "
        "one forward fewer per step: a GPU runs small refresh batches at the host's pace; the stacked rows' "
        "activations are held at once); None = on a GPU only"
    )
    scope: Literal["global", "rank"] = Field(
        "global", description="with parallel.workers > 1: top-γ over the global candidate batch (Δ gathered from "
        "every rank; equals the single-process selection) or over each rank's b/N rows (no collective needed "
        "for the choice; each rank's block keeps its own γ share, like microbatch selection)"
    )


class OptimConfig(StrictModel):
    """Proxy optimizer: AdamW, constant LR, gradient clipping (the paper's)."""

    lr: float = Field(1e-3, gt=0, description="η_u (paper 8e-5 for 1.1B continual pre-training)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), strict=False,  # a YAML list is a pair (items stay strict)
                                       description="AdamW (β1, β2)")
    eps: float = Field(1e-8, gt=0, description="AdamW ε")
    grad_clip: float | None = Field(1.0, ge=0, description="max total gradient norm; None = off")


class EvalConfig(StrictModel):
    """Validation loss / perplexity on the validation shards."""

    interval: int = Field(25, ge=1, description="evaluate every this many proxy steps (and at the end)")
    batch_size: int = Field(16, ge=1, description="validation sequences per forward")
    max_batches: int | None = Field(None, ge=1, description="cap on validation batches per evaluation; None = all")


class CheckpointConfig(StrictModel):
    """Composer checkpoints (BLADE state included) and automatic resume."""

    interval: int = Field(25, ge=1, description="save every this many proxy steps (and at the end)")
    keep: int = Field(2, ge=-1, description="checkpoints to keep (-1 = all)", json_schema_extra=OPERATIONAL)
    resume: bool = Field(True, description="resume from output_dir/checkpoints/latest-rank0.pt when present (or, "
                         "without that link, from the newest intact checkpoint file there)",
                         json_schema_extra=OPERATIONAL)


class ParallelConfig(StrictModel):
    """Data-parallel training (Ray Train's TorchTrainer hosting Composer; DESIGN.md §2, §3).

    ``workers = 1`` is the single-process trainer (no Ray Train, no process group): today's outputs, bit
    for bit. With ``workers = N > 1`` every trainer worker holds ``b/N`` rows of each candidate batch.
    """

    workers: int = Field(1, ge=1, description="trainer processes (Ray Train workers); 1 = the in-process trainer")
    cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs reserved per trainer worker",
                                   json_schema_extra=OPERATIONAL)
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs per trainer worker; 0 = CPU training (gloo)",
                                   json_schema_extra=OPERATIONAL)
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: a full model copy per worker; fsdp: the proxy and the in-process reference "
        "sharded over the workers (Composer's FSDP2, one unit per decoder layer), for models that do not fit "
        "one device")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process-group backend; auto = nccl with GPUs, gloo without", json_schema_extra=OPERATIONAL)
    max_failures: int = Field(2, ge=-1, description="restarts of the worker group from the last checkpoint after "
                              "a worker failure (-1 = unlimited)", json_schema_extra=OPERATIONAL)
    timeout_s: int = Field(1800, ge=1, description="timeout of the trainer's collectives (seconds)",
                           json_schema_extra=OPERATIONAL)
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each trainer worker asks for besides its CPUs and "
        "GPUs, to keep the ranks on the nodes started with them (e.g. {rank: 1} with ray start --resources "
        "'{\"rank\": 1}' on each node: one rank per node)", json_schema_extra=OPERATIONAL)

    @model_validator(mode="after")
    def _checks(self) -> ParallelConfig:
        if self.backend == "nccl" and self.gpus_per_worker == 0:
            raise ValueError("parallel.backend=nccl needs GPUs: set parallel.gpus_per_worker > 0 (or backend=auto)")
        if self.backend == "gloo" and self.gpus_per_worker > 0:
            raise ValueError("parallel.backend=gloo with parallel.gpus_per_worker > 0: Composer needs nccl for GPU "
                             "training; use backend=auto")
        if self.strategy == "fsdp" and self.workers < 2:
            raise ValueError("parallel.strategy=fsdp shards the model over the trainer workers: set "
                             "parallel.workers >= 2 (or strategy=ddp)")
        return self

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.gpus_per_worker > 0 else "gloo"


class TrainConfig(StrictModel):
    """Config of ``jobs/train.py``: one policy, candidate shards → trained proxy + selected-token shards."""

    data: DataConfig
    model: TrainModelConfig
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    output_dir: str = Field(description="checkpoints/, selected/, logs/, summary.json, plots/, final/")
    batch_size: int = Field(16, ge=1, description="b: sequences per proxy step (the candidate batch)")
    microbatch_size: int | None = Field(
        None, ge=1, description="sequences per forward/backward; None = b (selection is then per microbatch)"
    )
    max_steps: int = Field(150, ge=1, description="proxy steps; a rerun may raise it to extend a finished or "
                           "stopped run (docs/FAILURES.md, 'Extending a run')", json_schema_extra=EXTENDABLE)
    seed: int = Field(0, ge=0, description="candidate-stream seed")
    device: Device = Field("auto", description="auto = cuda when a GPU is visible, else cpu")
    precision: Precision = Field(
        "fp32", description="fp32 | amp_bf16 (CUDA only); governs the proxy step, ℓ(u), the reference scores "
        "ℓ(w̃) (in-process and on the Ray workers) and the refresh alike, so exact-mode masks agree"
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads; None = torch's default")
    write_selected: bool = Field(True, description="write selected-token shards to output_dir/selected")
    distance_interval: int | None = Field(
        None, ge=1, description="log ‖u − w‖ every this many steps; None = throughput.log_interval (it is computed "
        "on the device and read with the step's record: no host read of its own)")
    progress_bar: bool = Field(True, description="a progress bar on a terminal; else (a pipe, a log file) a progress line "
                               "every throughput.log_interval steps; false: neither", json_schema_extra=OPERATIONAL)
    plots: bool = Field(True, description="write plots/*.png with the summary", json_schema_extra=OPERATIONAL)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    loggers: LoggersConfig = Field(default_factory=LoggersConfig, json_schema_extra=OPERATIONAL,
                                   description="TensorBoard, MLflow, W&B next to logs/metrics.jsonl (rank 0)")
    throughput: ThroughputConfig = Field(default_factory=ThroughputConfig, json_schema_extra=OPERATIONAL)

    _model = field_validator("model", mode="before")(staticmethod(_train_model))

    @model_validator(mode="after")
    def _checks(self) -> TrainConfig:
        if self.microbatch_size is not None and self.microbatch_size > self.batch_size:
            raise ValueError(f"microbatch_size ({self.microbatch_size}) must be <= batch_size ({self.batch_size})")
        n = self.parallel.workers
        if n > 1:
            if self.batch_size % n:
                raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of parallel.workers ({n}): "
                                 "every trainer worker holds batch_size / workers rows of each candidate batch")
            per_rank = self.batch_size // n
            if self.microbatch_size is not None and self.microbatch_size != per_rank:
                raise ValueError(
                    f"microbatch_size ({self.microbatch_size}) with parallel.workers={n}: each worker trains its "
                    f"{per_rank} rows in one forward/backward (the mask must exist before the backward pass); "
                    f"set microbatch_size to null or {per_rank}, or use more workers")
            if self.parallel.gpus_per_worker == 0 and self.device == "cuda":
                raise ValueError("device=cuda with parallel.workers > 1 needs parallel.gpus_per_worker > 0")
        if self.data.validation_share:
            if self.selection.policy != "full" or n > 1 or self.data.scored is not None:
                raise ValueError(
                    f"data.validation_share ({self.data.validation_share}) mixes validation rows into the batches of "
                    "a plain run: it needs selection.policy=full, parallel.workers=1 and no data.scored (got "
                    f"policy {self.selection.policy}, {n} worker(s), scored {self.data.scored})")
        if self.model.compile and self.parallel.strategy == "fsdp":
            raise ValueError("model.compile is not wired for parallel.strategy=fsdp (each FSDP unit would have to be "
                             "compiled); use strategy=ddp or model.compile=false")
        return self

    # --- settings whose default is another setting, resolved here once -----------------------------
    @property
    def refresh_batch_size(self) -> int:
        """Sequences per validation and per candidate batch of a refresh step (default ``b / 4``)."""
        return self.selection.refresh_batch_size or max(1, self.batch_size // 4)

    @property
    def ref_lr(self) -> float:
        """``η_w``, the reference's learning rate (default: the proxy's ``optim.lr``)."""
        return self.selection.ref_lr or self.optim.lr

    @property
    def effective_microbatch_size(self) -> int:
        """Sequences per forward/backward: ``microbatch_size``, else a worker's whole share ``b / workers``."""
        return self.microbatch_size or self.batch_size // self.parallel.workers

    @property
    def effective_distance_interval(self) -> int:
        """Steps between two measures of ``‖u − w‖``: ``distance_interval``, else ``throughput.log_interval``."""
        return self.distance_interval or self.throughput.log_interval

    @property
    def score_batch_size(self) -> int:
        """Sequences per forward of the in-process reference's scoring (default ``b``)."""
        return self.selection.score_batch_size or self.batch_size

    @classmethod
    def demo_default(cls, root: str = DEMO_ROOT, *, policy: str = "blade") -> TrainConfig:
        """The embedded default: demo shards from ``python jobs/prepare.py`` under ``root/data``."""
        data = os.path.join(root, "data")
        return cls(
            data=DataConfig(
                candidates=os.path.join(data, "candidates"),
                validation=os.path.join(data, "validation"),
                tokenizer=os.path.join(data, "tokenizer", "tokenizer.json"),
            ),
            model=demo_model_config(2048),
            selection=SelectionConfig(policy=policy),
            output_dir=os.path.join(root, "train", policy),
        )


class ReplayConfig(StrictModel):
    """Config of ``jobs/replay.py``: train another model (size) on selected-token shards (BLADE-Tr)."""

    selected: str = Field(description="selected-token shard directory written by jobs/train.py",
                          json_schema_extra=INPUT)
    validation: str | None = Field(None, description="validation shards for the loss curve; None = no evaluation",
                                   json_schema_extra=INPUT)
    tokenizer: str | None = Field(None, description="tokenizer.json; when set, checked against the shard manifest",
                                  json_schema_extra=INPUT)
    model: TrainModelConfig
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    output_dir: str = Field(description="checkpoints/, logs/, summary.json, final/")
    batch_size: int = Field(16, ge=1, description="sequences per step")
    microbatch_size: int | None = Field(None, ge=1, description="sequences per forward/backward; None = batch_size")
    epochs: int = Field(1, ge=1, description="passes over the selected-token shards")
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps (None = epochs)")
    shuffle: bool = Field(False, description="False replays in training order (the order BLADE trained in)")
    seed: int = Field(0, ge=0, description="seed of the shuffle")
    device: Device = Field("auto", description="auto = cuda when a GPU is visible, else cpu")
    precision: Precision = Field("fp32", description="fp32 | amp_bf16 (CUDA only)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads; None = torch's default")
    progress_bar: bool = Field(True, description="a progress bar on a terminal; else (a pipe, a log file) a progress line "
                               "every throughput.log_interval steps; false: neither", json_schema_extra=OPERATIONAL)
    loggers: LoggersConfig = Field(default_factory=LoggersConfig, json_schema_extra=OPERATIONAL,
                                   description="TensorBoard, MLflow, W&B next to logs/metrics.jsonl")
    throughput: ThroughputConfig = Field(default_factory=ThroughputConfig, json_schema_extra=OPERATIONAL)

    _model = field_validator("model", mode="before")(staticmethod(_train_model))

    @property
    def effective_microbatch_size(self) -> int:
        """Sequences per forward/backward (default ``b``)."""
        return self.microbatch_size or self.batch_size

    @classmethod
    def demo_default(cls, root: str = DEMO_ROOT) -> ReplayConfig:
        """Replay the demo BLADE run's selected tokens into a wider and deeper Llama."""
        data = os.path.join(root, "data")
        return cls(
            selected=os.path.join(root, "train", "blade", "selected"),
            validation=os.path.join(data, "validation"),
            tokenizer=os.path.join(data, "tokenizer", "tokenizer.json"),
            model=demo_model_config(2048, hidden=96, layers=3),
            output_dir=os.path.join(root, "replay", "blade-wide"),
        )


class ScorerConfig(StrictModel):
    """A token-loss scorer (curation.core.scorer.TokenLossScorer, built by curation.io.models.build_scorer): one model, loaded once."""

    model: ModelConfig
    weights: str | None = Field(None, description="safetensors of the reference (overrides model.weights)")
    device: Device = Field("auto", description="auto = cuda when a GPU is visible, else cpu")
    batch_size: int = Field(16, ge=1, description="sequences per scoring forward")
    precision: Precision = Field(
        "fp32", description="amp_bf16: forward under bf16 autocast on CUDA (fp32 on a CPU), losses in float32; "
        "the trainer passes its own `precision`, so ℓ(u) and ℓ(w̃) are computed alike"
    )
