"""Wiring of a training run and of a replay run (what ``jobs/train.py`` and ``jobs/replay.py`` call).

``output_dir`` of a training run::

    config.yaml                 resolved config (a rerun resumes only with the same one: schemas.outdir)
    .lock                       held by the running job (pid, host, start time)
    checkpoints/                Composer checkpoints (BLADE state included); latest-rank0.pt → newest
    selected/                   selected-token shards (MDS) + manifest.json
    logs/metrics.jsonl          every logged metric, one JSON object per line
    summary.json, plots/*.png   run summary
    final/model.safetensors     the trained proxy (+ final/config.json)
    final/reference.safetensors the last reference w̃ (rho1: its static reference; blade: the last refresh)

A rerun with the same ``output_dir`` resumes from ``checkpoints/latest-rank0.pt`` (loaded with
``weights_only=True``) and ends with the same outputs as an uninterrupted run.

Every trainer of a :class:`~schemas.train_config.TrainConfig` is wired by one path:
:func:`training_inputs` (device, checked data, the model) → a loader and an algorithm of its own →
:func:`wire_training` (resume point, the Composer trainer of :func:`make_trainer`); the single-process
trainer is :func:`build_training`, the Ray engine's pipelined one
:func:`training.engine_hooks.build_pipelined_training`. :meth:`TrainRun.write_final` is the one writer of
``final/``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from curation.core.distributed import current_ranks
from curation.core.schedule import Schedule
from curation.engine.scorer import ScoredShards, resolve_device
from curation.io.models import (
    build_causal_lm,
    check_vocab,
    model_vocab_size,
    save_weights,
    weights_fingerprint,
)
from curation.io.shards import ShardDirInfo, check_tokenizer, shard_dir_info
from curation.io.stream_reader import StreamReader
from schemas.manifest import Manifest, atomic_write_text
from schemas.outdir import open_output_dir
from schemas.train_config import ModelConfig, OptimConfig, ReplayConfig, TrainConfig
from training.algorithm import BladeAlgorithm
from training.callbacks import JSONLinesLogger, SelectedShardWriter, SelectionStats, ValidationCurve
from training.checkpoint import checkpoint_write_errors, resume_checkpoint, weights_only_loading
from training.data import (
    StepBatches,
    StreamBatches,
    TokenRows,
    make_data_spec,
    rows_loader,
    stream_loader,
)
from training.model import MaskedCausalLM
from training.sharding import average_on_gloo, full_state_dict, install_wrap_policy, is_sharded
from training.summary import write_summary

__all__ = [
    "TrainRun", "TrainingInputs", "training_inputs", "wire_training", "build_model", "resume_path", "setup_device",
    "make_trainer", "build_training", "train", "build_replay", "replay",
]


@dataclass
class TrainRun:
    """A wired, not yet started training (or replay) run."""

    trainer: Any  # composer.Trainer
    model: MaskedCausalLM
    output_dir: str
    algorithm: BladeAlgorithm | None = None
    stats: SelectionStats | None = None
    writer: SelectedShardWriter | None = None
    resumed_from: str | None = None
    manifest_extra: dict[str, Any] | None = None

    def fit(self) -> None:
        """Train to ``max_duration`` (a rerun of a finished run only reports), then close the trainer.

        A checkpoint write that fails (full disk) becomes an OSError naming ``checkpoints/``."""
        try:
            if self.trainer.state.timestamp < self.trainer.state.max_duration:
                with checkpoint_write_errors(os.path.join(self.output_dir, "checkpoints")):
                    self.trainer.fit()
        finally:
            self.trainer.close()

    def final_state(self) -> tuple[nn.Module | dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The trained model's weights and the last reference w̃'s (None without one). A sharded run
        (``parallel.strategy: fsdp``) gathers both to full tensors on rank 0: every rank calls this."""
        hf = self.model.model
        reference = self.algorithm.reference_state_dict() if self.algorithm is not None else None
        return (full_state_dict(hf) if is_sharded(hf) else hf), reference

    def write_final(self, reference: Mapping[str, torch.Tensor] | str | None = None,
                    weights: nn.Module | Mapping[str, torch.Tensor] | None = None) -> str:
        """Write ``final/``: the trained model (``weights``, default the model's own, as ``model.safetensors``
        + the HF ``config.json``) and, when given, the last reference w̃ as ``reference.safetensors``
        (weights, or a safetensors file copied as is). Each file is written atomically. Returns ``final/``.
        """
        hf = self.model.model
        final = os.path.join(self.output_dir, "final")
        save_weights(hf if weights is None else weights, os.path.join(final, "model.safetensors"))
        hf.config.to_json_file(os.path.join(final, "config.json"))
        target = os.path.join(final, "reference.safetensors")
        if isinstance(reference, str):
            shutil.copyfile(reference, target + ".tmp")
            os.replace(target + ".tmp", target)
        elif reference is not None:
            save_weights(reference, target)
        return final


def _every(interval: int, last: int, event_name: str):
    from composer.core import Event

    event = Event(event_name)

    def due(state: Any, ev: Any) -> bool:
        b = int(state.timestamp.batch)
        return ev == event and b > 0 and (b % interval == 0 or b >= last)

    return due


def _optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def _common_algorithms(cfg: OptimConfig) -> list[Any]:
    if not cfg.grad_clip:
        return []
    from composer.algorithms import GradientClipping

    return [GradientClipping(clipping_type="norm", clipping_threshold=cfg.grad_clip)]


def build_model(model_cfg: ModelConfig, infos: Sequence[ShardDirInfo]) -> MaskedCausalLM:
    """The run's model, refused when it embeds fewer ids than the data's vocabulary (names the setting
    ``model`` and the manifest of ``infos[0]``)."""
    hf = build_causal_lm(model_cfg)
    check_vocab(hf, max(i.vocab_size for i in infos), what=Manifest.path_in(infos[0].path), setting="model")
    return MaskedCausalLM(hf)


def _evaluator(path: str | None, eval_cfg: Any, model_vocab: int):
    if path is None:
        return None
    from composer.core import Evaluator

    rows = TokenRows(path, "candidate", model_vocab=model_vocab)
    loader = rows_loader(rows, batch_size=eval_cfg.batch_size, max_batches=eval_cfg.max_batches)
    if current_ranks().world_size > 1:  # a data-parallel worker evaluates its share of the rows
        from training.parallel import rank_eval_loader

        loader = rank_eval_loader(loader)
    return Evaluator(label="eval", dataloader=make_data_spec(loader), metric_names=["TokenLoss", "TokenPerplexity"])


def resume_path(output_dir: str, resume: bool) -> str | None:
    """The checkpoint a run in ``output_dir`` resumes from (None: a new run).

    Raises:
        ValueError: checkpoints exist but ``resume`` is off.
    """
    folder = os.path.join(output_dir, "checkpoints")
    if not os.path.lexists(os.path.join(folder, "latest-rank0.pt")):  # (a dangling link: damaged, see below)
        return None
    if not resume:
        raise ValueError(
            f"{folder} holds checkpoints of an earlier run; set checkpoint.resume=true to continue it, "
            "or use a new output_dir"
        )
    return resume_checkpoint(folder)  # the newest intact one (a damaged latest one falls back, with a warning)


def setup_device(threads: int | None, device: str, precision: str) -> torch.device:
    """Apply the CPU thread count and resolve the device; a non-fp32 precision needs CUDA."""
    if threads is not None:
        torch.set_num_threads(threads)
    resolved = resolve_device(device)
    if precision != "fp32" and resolved.type != "cuda":
        raise ValueError(f"precision {precision!r} needs a CUDA device (device resolves to {resolved.type})")
    return resolved

def make_trainer(
    *, model: MaskedCausalLM, train_loader: Any, total_steps: int, optim: OptimConfig, algorithms: Sequence[Any],
    callbacks: Sequence[Any], loggers: Sequence[Any], eval_path: str | None, eval_cfg: Any, vocab: int,
    output_dir: str, checkpoint: Any, resume: str | None, run_name: str, device: torch.device, precision: str,
    microbatch_size: int, progress_bar: bool, seed: int, fsdp: bool = False,
) -> Any:
    """The Composer trainer every run uses (train, replay, pipelined engine): AdamW + clipping, the JSON
    metrics logger, validation every ``eval_cfg.interval`` steps, checkpoints loaded weights-only.
    ``fsdp``: shard the model over the process group (Composer's FSDP2, one unit per decoder layer;
    checkpoints hold the full weights, gathered on rank 0: :mod:`training.sharding`)."""
    from composer import Trainer

    parallelism = None
    if fsdp:
        from composer.utils.parallelism import FSDP2Config

        install_wrap_policy(model.model)
        parallelism = {"fsdp": FSDP2Config(state_dict_type="full")}

    with weights_only_loading():
        return Trainer(
            model=model,
            train_dataloader=make_data_spec(train_loader),
            max_duration=f"{total_steps}ba",
            optimizers=_optimizer(model, optim),
            algorithms=[*algorithms, *_common_algorithms(optim)],
            callbacks=list(callbacks),
            loggers=[JSONLinesLogger(os.path.join(output_dir, "logs", "metrics.jsonl")), *loggers],
            eval_dataloader=_evaluator(eval_path, eval_cfg, vocab),
            eval_interval=_every(eval_cfg.interval, total_steps, "batch_end"),
            save_folder=os.path.join(output_dir, "checkpoints"),
            save_interval=_every(checkpoint.interval, total_steps, "batch_checkpoint"),
            save_num_checkpoints_to_keep=checkpoint.keep,
            save_overwrite=True,
            load_path=resume,
            run_name=run_name,
            device=device.type if device.type != "cuda" else "gpu",
            precision=precision,
            device_train_microbatch_size=microbatch_size,
            accumulate_train_batch_on_tokens=False,
            progress_bar=progress_bar,
            log_to_console=False,
            seed=seed,
            parallelism_config=parallelism,
        )


@dataclass
class TrainingInputs:
    """What every trainer of a :class:`TrainConfig` starts from: the device, the checked data, the model."""

    device: torch.device
    candidates: ShardDirInfo
    validation: ShardDirInfo
    tokenizer_fingerprint: str | None
    model: MaskedCausalLM
    vocab: int  # ids the model embeds (token ids read are checked against it)


def training_inputs(cfg: TrainConfig) -> TrainingInputs:
    """Set up the device, check the data directories against each other and build the model.

    ``ranks`` (a :class:`curation.core.distributed.Ranks` with ``world_size > 1``): wire one worker of the
    data-parallel trainer instead (:mod:`training.parallel`).

    Raises:
        ShardSchemaError: a shard directory has the wrong columns (names directory, shard and column).
        ValueError: tokenizer, ``seq_len`` or vocabulary mismatch (names the files/settings), or bad settings.
    """
    device = setup_device(cfg.threads, cfg.device, cfg.precision)
    cand = shard_dir_info(cfg.data.candidates, "candidate")
    val = shard_dir_info(cfg.data.validation, "candidate")
    infos = [cand, val]
    if cfg.data.scored is not None:
        infos.append(shard_dir_info(cfg.data.scored, "scored"))
    fingerprint = check_tokenizer(infos, cfg.data.tokenizer)
    if cand.seq_len is not None and val.seq_len is not None and cand.seq_len != val.seq_len:
        raise ValueError(f"seq_len differs: {cand.path} has {cand.seq_len}, {val.path} has {val.seq_len}")
    model = build_model(cfg.model, infos)
    return TrainingInputs(device, cand, val, fingerprint, model, model_vocab_size(model.model))


def wire_training(
    cfg: TrainConfig, inputs: TrainingInputs, *, data: StepBatches, algorithm: Any, stats: SelectionStats,
    callbacks: Sequence[Any], loggers: Sequence[Any] = (), microbatch_size: int,
    writer: SelectedShardWriter | None = None, manifest_extra: dict[str, Any] | None = None,
) -> TrainRun:
    """The Composer trainer of ``cfg`` on ``data`` with ``algorithm``, resuming from ``output_dir``'s checkpoints.

    Raises:
        ValueError: ``output_dir`` holds checkpoints and ``checkpoint.resume`` is off.
    """
    resume = resume_path(cfg.output_dir, cfg.checkpoint.resume)
    os.makedirs(cfg.output_dir, exist_ok=True)
    trainer = make_trainer(
        model=inputs.model, train_loader=stream_loader(data), total_steps=cfg.max_steps, optim=cfg.optim,
        algorithms=[algorithm], callbacks=callbacks, loggers=loggers, eval_path=cfg.data.validation,
        eval_cfg=cfg.eval, vocab=inputs.vocab, output_dir=cfg.output_dir, checkpoint=cfg.checkpoint, resume=resume,
        run_name="train", device=inputs.device, precision=cfg.precision, microbatch_size=microbatch_size,
        progress_bar=cfg.progress_bar, seed=cfg.seed,
        fsdp=cfg.parallel.strategy == "fsdp" and current_ranks().world_size > 1,
    )
    if is_sharded(inputs.model.model):
        average_on_gloo(inputs.model.model)
    return TrainRun(trainer=trainer, model=inputs.model, output_dir=cfg.output_dir, algorithm=algorithm, stats=stats,
                    writer=writer, resumed_from=resume, manifest_extra=manifest_extra)


def build_training(
    cfg: TrainConfig, *, callbacks: Sequence[Any] = (), loggers: Sequence[Any] = (), timing: bool = False,
    scored: Any | None = None, clock: Callable[[], float] = time.perf_counter, schedule: Schedule | None = None,
    ranks: Any | None = None,
) -> TrainRun:
    """Check the data against the model and wire the Composer trainer for ``cfg``.

    ``scored`` is a live source of reference scores (``read(step)``, ``path``) used instead of
    ``cfg.data.scored``: the Ray engine's :class:`training.engine_hooks.EngineScores`.
    ``schedule`` is the run's schedule when the caller already built it (the Ray engine's job), else it is
    built here from ``cfg.selection`` and ``cfg.max_steps``.
    ``ranks`` (a :class:`curation.core.distributed.Ranks` with ``world_size > 1``): wire one worker of the
    data-parallel trainer instead (:mod:`training.parallel`).

    Raises:
        ShardSchemaError: a shard directory has the wrong columns (names directory, shard and column).
        ValueError: tokenizer or vocabulary mismatch (names the files/settings), or bad settings.
    """
    inputs = training_inputs(cfg)
    cand, vocab, hf = inputs.candidates, inputs.vocab, inputs.model.model
    reader = StreamReader.open(cfg.data.candidates, batch_size=cfg.batch_size, seed=cfg.seed)
    stream_data = StreamBatches(reader, cfg.max_steps, model_vocab=vocab)
    validation = TokenRows(cfg.data.validation, "candidate", model_vocab=vocab)
    if scored is None and cfg.data.scored is not None:
        scored = ScoredShards(cfg.data.scored, reader.stream)

    dp = None
    if ranks is not None and ranks.world_size > 1:
        from training.parallel import data_parallel_parts

        dp = data_parallel_parts(cfg, ranks, stream_data)
    algorithm = BladeAlgorithm(
        selection=cfg.selection, stream_data=stream_data, validation=validation, model_config=cfg.model,
        schedule=schedule or Schedule(cfg.selection.warmup_steps, cfg.selection.tau, cfg.max_steps),
        batch_size=cfg.batch_size, microbatch_size=cfg.microbatch_size,
        ref_lr=cfg.selection.ref_lr or cfg.optim.lr, refresh_batch_size=cfg.refresh_batch_size,
        scored=scored, distance_interval=cfg.distance_interval, precision=cfg.precision, timing=timing, clock=clock,
        parallel=dp.selection if dp else None,
    )
    stats = SelectionStats(algorithm)
    extra = {
        "stream": reader.stream.to_dict(),
        "policy": cfg.selection.policy,
        "schedule": algorithm.schedule.to_dict(),
        "gamma": cfg.selection.gamma,
        "candidates": os.path.abspath(cfg.data.candidates),
        "world_size": cfg.parallel.workers,
    }
    writer = None
    cbs: list[Any] = [stats]
    if cfg.write_selected:
        writer = (dp.writer if dp else SelectedShardWriter)(
            os.path.join(cfg.output_dir, "selected"), algorithm=algorithm, vocab_size=cand.vocab_size,
            seq_len=cand.seq_len or reader.dataset[0]["tokens"].shape[0], max_steps=cfg.max_steps,
            flush_every=cfg.checkpoint.interval,
            manifest_fields={
                "config": cfg.model_dump(mode="json"), "tokenizer_fingerprint": inputs.tokenizer_fingerprint,
                "model_fingerprints": {"initial_proxy": weights_fingerprint(hf)}, "extra": extra,
            },
        )
        cbs.append(writer)
    cbs.extend(callbacks)
    return wire_training(cfg, inputs, data=dp.batches if dp else stream_data, algorithm=algorithm, stats=stats,
                         callbacks=cbs, loggers=loggers,
                         microbatch_size=dp.microbatch_size if dp else cfg.microbatch_size or cfg.batch_size,
                         writer=writer, manifest_extra=extra)


def finish_training(run: TrainRun, plots: bool, extra: dict[str, Any],
                    state: tuple[Any, dict[str, torch.Tensor] | None] | None = None) -> dict[str, Any]:
    """After the fit: ``final/`` (proxy + last reference) and the summary (+ plots); returns their paths.
    ``state``: :meth:`TrainRun.final_state`, when the caller gathered it already (sharded runs)."""
    # the last reference w̃ (rho1: the static one), e.g. for reference_weights
    weights, reference = state or run.final_state()
    final = run.write_final(reference, weights)
    out = {"final_weights": os.path.join(final, "model.safetensors")}
    if reference is not None:
        out["final_reference"] = os.path.join(final, "reference.safetensors")
    if run.stats is not None:
        summary, pngs = write_summary(run.output_dir, run.stats.summary_data(), extra=extra, plots=plots)
        out.update(summary=summary, plots=pngs)
    return out


def train(cfg: TrainConfig, *, callbacks: Sequence[Any] = (), timing: bool = False) -> dict[str, Any]:
    """Run (or resume) a training run; returns the output paths.

    Holds ``output_dir``'s lock throughout; a rerun resumes only with the config in ``config.yaml``.

    Raises:
        OutputDirError: the directory is in use, was written with another config, or is not writable.
    """
    with open_output_dir(cfg.output_dir, "train", {"config.yaml": cfg}) as lock:
        run = build_training(cfg, callbacks=callbacks, timing=timing)
        lock.write_records()
        run.fit()
        extra = {"resumed_from": run.resumed_from,
                 "stream": run.manifest_extra["stream"] if run.manifest_extra else None,
                 "selected_dir": os.path.join(cfg.output_dir, "selected") if cfg.write_selected else None}
        out = finish_training(run, cfg.plots, extra)
    out["selected"] = extra["selected_dir"]
    out["run"] = run
    return out


# ------------------------------------------------------------------------------------------------
# replay (BLADE-Tr): another model trained on selected-token shards
# ------------------------------------------------------------------------------------------------
def build_replay(cfg: ReplayConfig, *, callbacks: Sequence[Any] = ()) -> TrainRun:
    """Wire a plain masked-loss Composer trainer on selected-token shards (the mask is honoured)."""

    device = setup_device(cfg.threads, cfg.device, cfg.precision)
    sel = shard_dir_info(cfg.selected, "selected")
    infos = [sel] + ([shard_dir_info(cfg.validation, "candidate")] if cfg.validation else [])
    check_tokenizer(infos, cfg.tokenizer)
    model = build_model(cfg.model, infos)
    vocab = model_vocab_size(model.model)
    rows = TokenRows(cfg.selected, "selected", use_mask=True, model_vocab=vocab)
    loader = rows_loader(rows, batch_size=cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed)
    steps_per_epoch = len(loader)
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    resume = resume_path(cfg.output_dir, cfg.checkpoint.resume)
    trainer = make_trainer(
        model=model, train_loader=loader, total_steps=total, optim=cfg.optim, algorithms=[],
        callbacks=callbacks, loggers=[], eval_path=cfg.validation, eval_cfg=cfg.eval, vocab=vocab,
        output_dir=cfg.output_dir, checkpoint=cfg.checkpoint, resume=resume, run_name="replay", device=device,
        precision=cfg.precision, microbatch_size=cfg.microbatch_size or cfg.batch_size,
        progress_bar=cfg.progress_bar, seed=cfg.seed,
    )
    return TrainRun(trainer=trainer, model=model, output_dir=cfg.output_dir, resumed_from=resume)


def replay(cfg: ReplayConfig) -> dict[str, Any]:
    """Train ``cfg.model`` on the selected-token shards; returns output paths and the validation curve.

    Locks ``output_dir`` and resumes only with the config in its ``config.yaml`` (as :func:`train`)."""
    curve = ValidationCurve()
    with open_output_dir(cfg.output_dir, "replay", {"config.yaml": cfg}) as lock:
        run = build_replay(cfg, callbacks=[curve])
        lock.write_records()
        run.fit()
        out = finish_training(run, False, {})
        atomic_write_text(os.path.join(cfg.output_dir, "validation.json"), json.dumps(curve.points, indent=1))
    out["validation"] = curve.points
    out["run"] = run
    return out
