"""How one trainer process of a :class:`~schemas.train_config.TrainConfig` is wired, and how every run finishes.

Every trainer (``jobs/train.py``, each rank of the data-parallel group, the engine-fed trainer) is wired by one
path: :func:`training_inputs` (device, checked data, the model) → its data and selection
(:func:`build_training`: the candidate stream, :class:`~curation.core.step.SelectionStep`, the in-process
reference or the scores read from shards, the BLADE algorithm; the engine's pipelined trainer:
:func:`training.runs.engine_feed.build_pipelined_training`) → :func:`wire` (resume point, the Composer trainer
of :func:`~training.blocks.trainer.make_trainer`). A single process is rank 0 of 1: the same objects as a rank of
the data-parallel group, with collectives that are no-ops. Every trainer process runs this wiring inside
:func:`training.runs.rank.run_rank`; :func:`training.runs.finish.finish` is the one writer of ``final/`` and
``summary.json``.

``output_dir`` of a training run::

    config.yaml                 resolved config (a rerun resumes only with the same one: curation.io.outdir)
    .lock                       held by the running job (pid, host, start time)
    checkpoints/                Composer checkpoints (BLADE state included); latest-rank0.pt → newest
    selected/                   selected-token shards (MDS) + manifest.json
    logs/metrics.jsonl          every logged metric, one JSON object per line
    summary.json, plots/*.png   run summary
    final/model.safetensors     the trained proxy (+ final/config.json)
    final/reference.safetensors the last reference w̃ (rho1: its static reference; blade: the last refresh)

A rerun with the same ``output_dir`` resumes from ``checkpoints/latest-rank0.pt`` (loaded with
``weights_only=True``), or from the newest intact checkpoint file when a stop came while Composer re-linked it,
and ends with the same outputs as an uninterrupted run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from composer import Trainer
from composer.core import Callback
from composer.loggers import LoggerDestination

from curation.core.distributed import Ranks
from curation.core.policies import RefreshMode
from curation.core.refresh import RefreshSettings
from curation.core.refresh_data import RefreshData
from curation.core.schedule import Schedule
from curation.core.step import SelectionStep
from curation.core.stream import CandidateStream
from curation.io import storage
from curation.io.hf_export import TokenizerFiles, run_tokenizer
from curation.io.models import model_vocab_size, weights_fingerprint
from curation.io.outputs import urls_in
from curation.io.scored_shards import ScoredShards
from curation.io.shards import ShardDirInfo, check_tokenizer, shard_dir_info
from curation.io.stream_reader import StreamReader
from schemas.train_config import TrainConfig
from training.blocks.callbacks import SelectedShardWriter, SelectionStats
from training.blocks.checkpoint import checkpoint_write_errors
from training.blocks.data import RankBatches, StepBatches, StreamBatches, TokenRows, stream_loader
from training.blocks.meters import Meters
from training.blocks.model import MaskedCausalLM
from training.blocks.preemption import StopAtStepEnd
from training.blocks.throughput import ReferenceWork, Throughput, throughput_callbacks
from training.blocks.trainer import build_model, make_trainer, resume_path, setup_device
from training.selection.algorithm import BladeAlgorithm
from training.selection.recorded import EngineSelection
from training.selection.reference import InProcessReference, ReferenceSettings
from training.selection.shard_scores import ScoreSource, ShardScores

__all__ = ["TrainRun", "TrainingInputs", "SelectionAlgorithm", "training_inputs", "build_training", "wire"]


#: What a trainer's selection is: a Composer algorithm that shows its callbacks what each step trained on
#: (:class:`~training.blocks.callbacks.StepSelections`): the BLADE algorithm, or the engine-fed pipelined trainer's
#: record of the engine's masks.
SelectionAlgorithm = BladeAlgorithm | EngineSelection


@dataclass
class TrainingInputs:
    """What every trainer of a :class:`TrainConfig` starts from: the device, the checked data, the model."""

    device: torch.device
    candidates: ShardDirInfo
    validation: ShardDirInfo
    tokenizer_fingerprint: str | None
    model: MaskedCausalLM
    vocab: int  # ids the model embeds (token ids read are checked against it)
    tokenizer: TokenizerFiles | None = None  # the shards' tokenizer (final/ gets a copy)


def training_inputs(cfg: TrainConfig) -> TrainingInputs:
    """Set up the device, check the data directories against each other and build the model.

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
    sequences = cand.manifest.totals().sequences
    if sequences and cfg.batch_size > sequences:  # (checked before the run's config is recorded)
        raise ValueError(f"batch_size {cfg.batch_size} is more than the {sequences} candidate sequences of "
                         f"{cand.path}: a step takes batch_size of them; lower batch_size")
    model = build_model(cfg.model, infos)
    return TrainingInputs(device, cand, val, fingerprint, model, model_vocab_size(model.model),
                          run_tokenizer(infos, cfg.data.tokenizer))


@dataclass
class TrainRun:
    """A wired, not yet started training (or replay) run."""

    trainer: Trainer
    model: MaskedCausalLM
    output_dir: str
    algorithm: SelectionAlgorithm | None = None  # BladeAlgorithm, EngineSelection, or None (replay)
    stats: SelectionStats | None = None
    resumed_from: str | None = None
    stream: CandidateStream | None = None  # the candidate stream it trains on (None: replay)
    stopper: StopAtStepEnd | None = None  # ends the fit at a step end on a stop request (SIGTERM, SIGINT)
    throughput: Throughput | None = None  # tokens/s, MFU, time left (the summary's `throughput`)
    tokenizer: TokenizerFiles | None = None  # the shards' tokenizer (copied into final/)

    @property
    def stopped_at(self) -> int | None:
        """The steps trained when a stop request ended the fit early (None: it was not stopped)."""
        return self.stopper.stopped_at if self.stopper is not None else None

    def fit(self) -> None:
        """Train to ``max_duration`` (a rerun of a finished run only reports), then close the trainer.

        A checkpoint write that fails (full disk) becomes an OSError naming ``checkpoints/``."""
        try:
            if self.trainer.state.timestamp < self.trainer.state.max_duration:
                with checkpoint_write_errors(os.path.join(self.output_dir, "checkpoints")):
                    self.trainer.fit()
        finally:
            self.trainer.close()


def wire(cfg: TrainConfig, inputs: TrainingInputs, data: StepBatches, algorithm: SelectionAlgorithm, *,
         callbacks: Sequence[Callback], loggers: Sequence[LoggerDestination] = (), stopper: StopAtStepEnd | None = None,
         reference: ReferenceWork | None = None, schedule: Schedule | None = None) -> TrainRun:
    """The Composer trainer of ``cfg`` on ``data`` with ``algorithm`` (its statistics and throughput logged),
    resuming from ``output_dir``'s checkpoints. ``stopper`` ends the fit at a step end on a stop request (default: on
    a signal caught by the active :class:`curation.io.stop.GracefulStop`; a data-parallel rank passes its group's);
    ``reference`` is the in-process reference's work and ``schedule`` the run's (the time left counts both).

    Raises:
        ValueError: ``output_dir`` holds checkpoints and ``checkpoint.resume`` is off.
    """
    resume = resume_path(cfg.output_dir, cfg.checkpoint.resume)
    os.makedirs(cfg.output_dir, exist_ok=True)
    stats = SelectionStats(algorithm, vocab_size=inputs.vocab, lr=cfg.optim.lr,  # (a diverging proxy stops the run)
                           log_interval=cfg.throughput.log_interval, max_steps=cfg.max_steps)
    stopper = stopper or StopAtStepEnd()
    speed, meter = throughput_callbacks(cfg, inputs.model, total_steps=cfg.max_steps, selections=algorithm,
                                        reference=reference, schedule=schedule or Schedule.of(cfg))
    trainer = make_trainer(cfg, model=inputs.model, loader=stream_loader(data, inputs.device), total_steps=cfg.max_steps,
                           device=inputs.device, resume=resume, algorithms=[algorithm],
                           callbacks=[stats, *callbacks, stopper, speed, meter], loggers=loggers)
    return TrainRun(trainer=trainer, model=inputs.model, output_dir=cfg.output_dir, algorithm=algorithm, stats=stats,
                    resumed_from=resume, stream=data.stream, stopper=stopper, throughput=meter,
                    tokenizer=inputs.tokenizer)


def build_training(cfg: TrainConfig, *, ranks: Ranks | None = None, scored: ScoreSource | None = None,
                   schedule: Schedule | None = None, callbacks: Sequence[Callback] = (),
                   loggers: Sequence[LoggerDestination] = (), meters: Meters | None = None,
                   stopper: StopAtStepEnd | None = None) -> TrainRun:
    """Check the data against the model and wire the trainer of rank ``ranks`` (default: a single process) for
    ``cfg``: exact BLADE (or another policy) on the candidate stream.

    ``scored`` is a live source of reference scores used instead of ``cfg.data.scored`` (the Ray engine's
    :class:`~training.selection.shard_scores.EngineScores`); ``schedule`` the run's schedule when the caller
    built it already (the engine's job: its plan's :meth:`~curation.core.schedule.Schedule.of`); ``meters`` the timers and counts (benchmarks);
    ``stopper`` as in :func:`wire`.

    Raises:
        ShardSchemaError: a shard directory has the wrong columns (names directory, shard and column).
        ValueError: tokenizer or vocabulary mismatch (names the files/settings), or bad settings.
    """
    ranks = ranks or Ranks()
    if ranks.world_size != cfg.parallel.workers:
        raise ValueError(f"the worker group has {ranks.world_size} workers, parallel.workers is {cfg.parallel.workers}"
                         + (" (jobs/train.py runs the group on Ray)" if ranks.world_size == 1 else ""))
    inputs = training_inputs(cfg)
    reader = StreamReader.open(cfg.data.candidates, batch_size=cfg.batch_size, seed=cfg.seed)
    select = SelectionStep(cfg.selection.policy, cfg.selection.gamma, cfg.selection.seed, ranks, cfg.selection.scope)
    if scored is None and cfg.data.scored is not None:
        scored = ScoredShards(cfg.data.scored, reader.stream)
    in_process = select.policy.needs_reference and scored is None
    stream = StreamBatches(reader, cfg.max_steps, model_vocab=inputs.vocab,
                           keep_behind=cfg.selection.refresh_candidate_batches if in_process else 0)
    schedule = schedule or Schedule.of(cfg)
    meters = meters if meters is not None else Meters()
    seq_len = inputs.candidates.seq_len or reader.dataset[0]["tokens"].shape[0]
    reference = work = None
    if in_process:
        work = ReferenceWork.of(cfg, rows=cfg.batch_size // ranks.world_size, seq_len=seq_len,
                                static=select.policy.refresh_mode is RefreshMode.STATIC)
        validation = TokenRows(cfg.data.validation, "candidate", model_vocab=inputs.vocab)
        refresh = RefreshData(
            RefreshSettings.of(cfg.selection, lr=cfg.ref_lr, batch_size=cfg.refresh_batch_size,
                               precision=cfg.precision),
            schedule, num_validation=len(validation), validation_path=validation.path,
            validation_tokens=lambda ids: torch.stack([validation[int(i)]["tokens"] for i in ids]),
            step_tokens=lambda step: stream.batch(step)["tokens"])
        reference = InProcessReference(ReferenceSettings.of(cfg), refresh, stream, schedule=schedule, ranks=ranks,
                                       meters=meters)
    algorithm = BladeAlgorithm(cfg, select, schedule, stream, reference=reference,
                               scored=ShardScores(scored, ranks) if scored else None, meters=meters)
    extra = {"stream": reader.stream.to_dict(), "policy": cfg.selection.policy, "schedule": schedule.to_dict(),
             "gamma": cfg.selection.gamma, "candidates": storage.canonical(cfg.data.candidates),
             "world_size": cfg.parallel.workers}
    cbs: list[Callback] = []
    if cfg.write_selected:
        cand = inputs.candidates
        cbs.append(SelectedShardWriter(
            os.path.join(cfg.output_dir, "selected"), algorithm=algorithm, vocab_size=cand.vocab_size,
            seq_len=seq_len, max_steps=cfg.max_steps,
            flush_every=cfg.checkpoint.interval, rank=ranks.rank,
            manifest_fields={
                "config": urls_in(cfg.model_dump(mode="json")), "tokenizer_fingerprint": inputs.tokenizer_fingerprint,
                "model_fingerprints": {"initial_proxy": weights_fingerprint(inputs.model.model)}, "extra": extra,
            },
        ))
    return wire(cfg, inputs, RankBatches(stream, ranks), algorithm, callbacks=[*cbs, *callbacks], loggers=loggers,
                stopper=stopper, reference=work, schedule=schedule)
