"""The Composer trainer every run uses (train, replay, the engine-fed trainer, every data-parallel rank).

:func:`make_trainer` builds it from a :class:`~schemas.train_config.TrainConfig` or a
:class:`~schemas.train_config.ReplayConfig`: AdamW + gradient clipping, the JSON-lines metrics log, validation
every ``eval.interval`` steps (a data-parallel rank evaluates its share of the rows), checkpoints every
``checkpoint.interval`` steps and at a step where a stop request ended training (loaded weights-only), the
experiment loggers (:mod:`training.blocks.loggers`), ``model.activation_checkpointing`` and ``model.compile``
(:mod:`training.blocks.model`), and, with ``parallel.strategy: fsdp`` on more than one rank, the model sharded by
Composer's FSDP2 (one unit per decoder layer, activation checkpointing through its config;
:mod:`training.blocks.sharding`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch
from composer import Callback, Trainer
from composer.algorithms import GradientClipping
from composer.core import Evaluator, Event, State
from composer.loggers import Logger
from composer.trainer.trainer import TrainerMode
from composer.utils import dist as composer_dist
from composer.utils import ensure_tuple
from composer.utils.parallelism import FSDP2Config
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from curation.core.distributed import current_ranks
from curation.core.host_sync import queues, set_matmul_precision
from curation.io import storage
from curation.io.models import build_causal_lm, check_positions, check_vocab, model_vocab_size, resolve_device
from curation.io.shards import ShardDirInfo
from schemas.manifest import Manifest
from schemas.train_config import ModelConfig, OptimConfig, ReplayConfig, TrainConfig
from training.blocks import throughput
from training.blocks.callbacks import JSONLinesLogger
from training.blocks.checkpoint import checkpoint_files, resume_checkpoint, weights_only_loading
from training.blocks.data import TokenRows, make_data_spec, rows_loader
from training.blocks.loggers import experiment_loggers, mlflow_resumption
from training.blocks.model import MaskedCausalLM, checkpoint_activations
from training.blocks.sharding import (
    average_on_gloo,
    install_checkpoint_policy,
    install_wrap_policy,
    is_sharded,
)
from training.blocks.step_reads import StepReads

__all__ = ["make_trainer", "build_model", "setup_device", "resume_path", "rank_eval_loader"]


def _cpu_model() -> str:
    """The host processor's name as ``/proc/cpuinfo`` gives it (``CPU`` where it cannot say)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return "CPU"


def _cpu_model_without_a_process() -> None:
    """Every Composer ``Trainer`` asks ``get_composer_env_dict()`` for the processor's name (and then logs only the
    Composer version and commit from it), which py-cpuinfo finds by running a Python process of its own: ≈ 1.2 s of
    CPU and of wall time at the start of every process that trains (each job, each data-parallel rank). Composer's
    lookup is replaced by :func:`_cpu_model` (the same name where ``/proc/cpuinfo`` has one)."""
    from composer.utils import collect_env

    if callable(getattr(collect_env, "get_cpu_model", None)):
        collect_env.get_cpu_model = _cpu_model


_cpu_model_without_a_process()


def setup_device(threads: int | None, device: str, precision: str) -> torch.device:
    """Apply the CPU thread count and resolve the device (and its fp32 matmul precision: the same in every process of
    a run, :func:`curation.core.host_sync.set_matmul_precision`); a non-fp32 precision needs CUDA."""
    if threads is not None:
        torch.set_num_threads(threads)
    resolved = resolve_device(device)
    if precision != "fp32" and resolved.type != "cuda":
        raise ValueError(f"precision {precision!r} needs a CUDA device (device resolves to {resolved.type})")
    set_matmul_precision(resolved)
    return resolved


def build_model(model_cfg: ModelConfig, infos: Sequence[ShardDirInfo]) -> MaskedCausalLM:
    """The run's model, refused when it embeds fewer ids than the data's vocabulary (names the setting
    ``model`` and the manifest of ``infos[0]``)."""
    hf = build_causal_lm(model_cfg)
    check_vocab(hf, max(i.vocab_size for i in infos), what=Manifest.path_in(infos[0].path), setting="model")
    for info in infos:  # (checked before the run's config is recorded)
        if info.seq_len:
            check_positions(hf, info.seq_len, what=Manifest.path_in(info.path))
    return MaskedCausalLM(hf)


def resume_path(output_dir: str, resume: bool) -> str | None:
    """The checkpoint a run in ``output_dir`` resumes from (None: a new run).

    Raises:
        ValueError: checkpoints exist but ``resume`` is off.
    """
    folder = os.path.join(output_dir, "checkpoints")
    # (a dangling link is a damaged checkpoint; files without the link: a kill while Composer re-linked it)
    if not os.path.lexists(os.path.join(folder, "latest-rank0.pt")) and not checkpoint_files(folder):
        return None
    if not resume:
        raise ValueError(
            f"{folder} holds checkpoints of an earlier run; set checkpoint.resume=true to continue it, "
            "or use a new output_dir"
        )
    return resume_checkpoint(folder)  # the newest intact one (a damaged latest one falls back, with a warning)


def rank_eval_loader(loader: DataLoader) -> DataLoader:
    """``loader``'s rows split over the ranks (``DistributedSampler``, no shuffling, no rows dropped).

    Composer drops the sampler's padding duplicates at the end and sums the metric states over the ranks,
    so the validation loss is the single-process one up to float summation order."""
    sampler = DistributedSampler(loader.dataset, shuffle=False, drop_last=False)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn,
                      num_workers=0)


def _every(interval: int, last: int, event_name: str, *, at_stop: bool = False):
    """Due every ``interval`` steps and at step ``last``; ``at_stop``: also at a step where training was stopped
    early (``state.stop_training()`` lowered ``max_duration`` to it: :mod:`training.blocks.preemption`)."""
    event = Event(event_name)

    def due(state: Any, ev: Any) -> bool:
        b = int(state.timestamp.batch)
        stopped = at_stop and state.max_duration is not None and b >= int(state.max_duration.value)
        return ev == event and b > 0 and (b % interval == 0 or b >= last or stopped)

    return due


def _optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; fused (one kernel for every parameter, no host work per tensor) where the parameters are on a GPU. A
    CPU run keeps torch's default AdamW (the bit-exact oracle tests)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=True if queues(device) else None)


def _evaluator(path: str | None, cfg: TrainConfig | ReplayConfig, model_vocab: int) -> Evaluator | None:
    if path is None:
        return None
    rows = TokenRows(path, "candidate", model_vocab=model_vocab)
    loader = rows_loader(rows, batch_size=cfg.eval.batch_size, max_batches=cfg.eval.max_batches)
    if current_ranks().world_size > 1:  # a data-parallel worker evaluates its share of the rows
        loader = rank_eval_loader(loader)
    return Evaluator(label="eval", dataloader=make_data_spec(loader), metric_names=["TokenLoss", "TokenPerplexity"])


def make_trainer(
    cfg: TrainConfig | ReplayConfig, *, model: MaskedCausalLM, loader: Any, total_steps: int, device: torch.device,
    resume: str | None, algorithms: Sequence[Any] = (), callbacks: Sequence[Any] = (), loggers: Sequence[Any] = (),
) -> Trainer:
    """The Composer trainer of ``cfg`` (module docstring) training ``model`` on ``loader`` for ``total_steps``,
    resuming from the checkpoint ``resume``. Rank 0 of a data-parallel group writes the logs (``loggers:`` beside
    the JSON lines: :mod:`training.blocks.loggers`)."""
    train = isinstance(cfg, TrainConfig)
    fsdp = train and cfg.parallel.strategy == "fsdp" and current_ranks().world_size > 1
    rank = current_ranks().rank
    dests = [JSONLinesLogger(os.path.join(cfg.output_dir, "logs", "metrics.jsonl"))] if rank == 0 else []
    dests += experiment_loggers(cfg.loggers, cfg.output_dir, rank=rank, flush_interval=cfg.checkpoint.interval)
    parallelism = None
    if fsdp:
        install_wrap_policy(model.model)
        if cfg.model.activation_checkpointing:
            install_checkpoint_policy(model.model)
        parallelism = {"fsdp": FSDP2Config(state_dict_type="full",
                                           activation_checkpointing=cfg.model.activation_checkpointing)}
    elif cfg.model.activation_checkpointing:
        checkpoint_activations(model.model)
    if cfg.model.compile:
        compiler = os.environ.get("CXX") or "g++"
        if device.type == "cpu" and shutil.which(compiler) is None:
            raise ValueError(f"model.compile on a CPU needs a C++ compiler ({compiler} not found; torch.compile's "
                             "inductor builds C++ kernels): install one or set model.compile=false")
        model.compile_forward()
    clipping = [GradientClipping(clipping_type="norm", clipping_threshold=cfg.optim.grad_clip)] \
        if cfg.optim.grad_clip else []
    # The step's deferred reads (its loss, and the selection's record: training.blocks.step_reads): the selection
    # algorithm's own, else a plain one (replay)
    step_reads = next((a for a in algorithms if isinstance(a, StepReads)), None)
    reads = [] if step_reads is not None else [StepReads()]
    step_reads = step_reads or reads[0]
    with weights_only_loading(), mlflow_resumption(cfg.loggers, cfg.output_dir, resuming=resume is not None,
                                                   rank=rank):
        trainer = LeanTrainer(
            model=model,
            train_dataloader=make_data_spec(loader),
            max_duration=f"{total_steps}ba",
            optimizers=_optimizer(model, cfg.optim, device),
            algorithms=[*algorithms, *clipping, *reads],
            callbacks=list(callbacks),
            loggers=[*dests, *loggers],
            eval_dataloader=_evaluator(cfg.data.validation if train else cfg.validation, cfg,
                                       model_vocab_size(model.model)),
            eval_interval=_every(cfg.eval.interval, total_steps, "batch_end"),
            save_folder=os.path.join(cfg.output_dir, "checkpoints"),
            save_interval=_every(cfg.checkpoint.interval, total_steps, "batch_checkpoint", at_stop=True),
            save_num_checkpoints_to_keep=cfg.checkpoint.keep,
            save_overwrite=True,
            load_path=resume,
            run_name="train" if train else "replay",
            device=device.type if device.type != "cuda" else "gpu",
            precision=cfg.precision,
            device_train_microbatch_size=cfg.effective_microbatch_size,
            accumulate_train_batch_on_tokens=False,
            progress_bar=cfg.progress_bar and throughput.interactive(),  # (else progress lines: training.blocks.throughput)
            log_to_console=False,
            seed=cfg.seed,
            parallelism_config=parallelism,
        )
    trainer.step_reads = step_reads
    if is_sharded(model.model):
        average_on_gloo(model.model)
    if storage.url_of(cfg.output_dir) is not None and current_ranks().rank == 0:
        trainer.state.callbacks.append(CheckpointUpload(cfg.output_dir))  # after Composer's checkpoint saver
    return trainer


class LeanTrainer(Trainer):
    """Composer's trainer without host reads in a steady step of one process (docs/DESIGN.md §6; on a GPU each
    read drains the device's queue: issue 31 measured the plain step at 1.10-1.30× a bare PyTorch loop of the same
    model on an H200, issue 52 counted the reads left):

    * no optimizer closure: AdamW steps after the backward, as in a plain loop, instead of from a closure whose
      ``.item()`` waits for the whole backward before the AdamW kernels are queued (the same arithmetic; Composer
      itself uses no closure with ``amp_fp16``);
    * one process: a step's samples, tokens and time are this process's, without the round trip through the
      device that sums them over the ranks (three ``.item()`` calls), and neither the batch size nor the end of the
      data goes through the device to be summed over ranks (two ``.item()`` calls);
    * the step's loss stays on the device: Composer's loop would read it at once (``loss.cpu().item()``, a drain of
      the whole step). It goes to the run's :class:`~training.blocks.step_reads.StepReads` (``step_reads``), which
      reads it with the step's other figures a step later, logs ``loss/train/total`` and sets
      ``state.total_loss_dict``.

    With data-parallel ranks every one of these is Composer's own code."""

    step_reads: StepReads | None = None

    def _use_closures(self) -> bool:
        return False

    def _one_process(self) -> bool:
        return composer_dist.get_world_size() == 1

    def _accumulate_time_across_ranks(self, num_samples, num_tokens, batch_time):  # noqa: ANN001, ANN202
        if not self._one_process():
            return super()._accumulate_time_across_ranks(num_samples, num_tokens, batch_time)
        return int(round(num_samples)), int(num_tokens), batch_time

    def _train_batch(self, use_grad_scaling: bool):  # noqa: ANN202
        losses = super()._train_batch(use_grad_scaling)
        if losses is None or self.step_reads is None or not self._one_process():
            return losses
        self.step_reads.loss = losses.get("loss/train/total")
        return None  # (Composer's loop reads and logs a returned loss at once; None: nothing to read)

    def _iter_dataloader(self, trainer_mode):  # noqa: ANN001, ANN202
        if not self._one_process():
            yield from super()._iter_dataloader(trainer_mode)
            return
        # Composer's loop, less the all-reduce of "this rank's data ended" (one process: its own end)
        assert self.state.dataloader is not None, "the dataloader should be set before calling this method"
        if self.state.dataloader_len is None:
            dataloader_iter = iter(self.state.dataloader)
        else:
            dataloader_iter = itertools.islice(self.state.dataloader, int(self.state.dataloader_len))
        while True:
            try:
                if trainer_mode == TrainerMode.TRAIN:
                    self.engine.run_event(Event.BEFORE_DATALOADER)
                batch = next(dataloader_iter)
            except StopIteration:
                if trainer_mode == TrainerMode.TRAIN:
                    self.engine.run_marker_only_event(Event.AFTER_DATALOADER)
                break
            yield batch

    def _train_microbatches(self, microbatches, total_loss_dict, ddp_sync=True):  # noqa: ANN001, ANN202
        if not self._one_process():
            return super()._train_microbatches(microbatches, total_loss_dict, ddp_sync)
        # Composer 0.32's method, less the round trip of the batch size through the device (`.item()` of an
        # all-reduce): one process's batch size is its own.
        assert self._train_data_spec is not None
        with contextlib.nullcontext():
            self.engine.run_event(Event.BEFORE_TRAIN_BATCH)
            assert self.state.optimizers is not None
            assert self.state.scaler is not None
            use_grad_scaling = self._use_grad_scaling(self.state.precision, self.state.scaler)
            for optimizer in self.state.optimizers:
                try:
                    optimizer.zero_grad(set_to_none=True)
                except TypeError:
                    optimizer.zero_grad()
            if self.accumulate_train_batch_on_tokens:
                current_batch_size = sum(self._train_data_spec.get_num_tokens_in_batch(b, token_type="loss_generating")
                                         for b in microbatches)
            else:
                current_batch_size = sum(self._train_data_spec.get_num_samples_in_batch(b) for b in microbatches)
            current_batch_size = float(current_batch_size)  # (Composer: tensor.item() / world size, a float)
            current_batch = self.state.batch
            for microbatch_idx, self.state.batch in enumerate(microbatches):
                self.state.batch = self.state.device.batch_to_device(self.state.batch)
                self.state.batch = self._train_data_spec.microbatch_transforms(self.state.batch)
                is_final_microbatch = microbatch_idx + 1 == len(microbatches)
                microbatch_loss_dict = self._train_microbatch(use_grad_scaling, current_batch_size, is_final_microbatch)
                for k, microbatch_loss in microbatch_loss_dict.items():
                    loss_key = f"loss/train/{k}"
                    if loss_key not in total_loss_dict:
                        total_loss_dict[loss_key] = self.state.device.tensor_to_device(torch.zeros(size=(1,)))
                    total_loss_dict[loss_key] += microbatch_loss
            self.state.batch = current_batch
            if use_grad_scaling:
                for optimizer in ensure_tuple(self.state.optimizers):
                    self.state.scaler.unscale_(optimizer)
            self.engine.run_event(Event.AFTER_TRAIN_BATCH)
            return total_loss_dict["loss/train/total"]


class CheckpointUpload(Callback):
    """An object-store output directory: after each checkpoint Composer saves (this callback is added after its
    saver), ``checkpoints/`` is mirrored to the bucket (new files uploaded, pruned ones deleted, the
    ``latest-rank0.pt`` link kept) and ``logs/`` uploaded, so a rerun anywhere resumes from that step."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def _push(self) -> None:
        storage.push(self.output_dir, "checkpoints", delete=True)
        storage.push(self.output_dir, "logs")

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._push()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._push()
