"""``jobs/train.py`` and ``jobs/replay.py`` as library functions: lock the output directory, train, finish.

* :func:`train`: online selection (exact BLADE or another policy) on the candidate stream: one process, or a
  data-parallel Ray Train worker group (``parallel.workers > 1``), through the one launcher
  (:func:`training.runs.launch.launch`).
* :func:`replay` (BLADE-Tr): another model trained on selected-token shards by a plain masked-loss trainer.

Both hold ``output_dir``'s lock throughout, resume only with the config recorded in its ``config.yaml``, and end in
:func:`training.runs.finish.finish`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

from composer.core import Callback

from curation.core.distributed import Ranks
from curation.engine.ray_backend import ray_session
from curation.io import storage
from curation.io.atomic import atomic_write_text
from curation.io.hf_export import run_tokenizer
from curation.io.models import model_vocab_size
from curation.io.outputs import localize, open_output
from curation.io.shards import check_tokenizer, shard_dir_info
from curation.io.stop import GracefulStop, check_stop, stop_requested
from schemas.train_config import ReplayConfig, TrainConfig
from training.blocks.callbacks import ValidationCurve
from training.blocks.data import TokenRows, rows_loader
from training.blocks.loggers import check_installed
from training.blocks.preemption import StopAtStepEnd
from training.blocks.throughput import throughput_callbacks
from training.blocks.trainer import build_model, make_trainer, resume_path, setup_device
from training.runs.finish import Finished, finish
from training.runs.group import trainer_cpus
from training.runs.launch import launch
from training.runs.rank import rank_result
from training.runs.wiring import TrainRun

__all__ = ["train", "build_replay", "replay"]


def train(cfg: TrainConfig, *, callbacks: Sequence[Callback] = (), step_times: bool = False) -> Finished:
    """Run (or resume) a training run; returns what it wrote (and, trained in this process, the wired ``run``).

    ``parallel.workers > 1``: the worker group runs on Ray (a local instance unless a ``ray job submit`` names a
    cluster). Within a :class:`curation.io.stop.GracefulStop` (``jobs/train.py``), a SIGTERM / SIGINT ends the fit
    after the step in progress with a checkpoint at that step (:mod:`training.blocks.preemption`); ``final/`` and the
    summary are then not written. ``callbacks``: more Composer callbacks (one process only); ``step_times``: every
    rank records its step times.

    Raises:
        OutputDirError: the directory is in use, was written with another config, or is not writable.
        StopRequested: a stop signal ended the run early; its message names the step and the checkpoint a rerun
            resumes from.
        ValueError: bad settings or data (a worker group's: the failing worker's message).
    """
    check_installed(cfg.loggers)  # here, not in a worker after Ray started
    cfg = localize(cfg)  # s3:// directories: their local caches (curation.io.storage), shared by the ranks
    with open_output(cfg.output_dir, "train", {"config.yaml": cfg}) as lock:
        if "max_steps" in lock.extended:
            old, new = lock.extended["max_steps"]
            print(f"extending the run: max_steps {old} → {new} (continuing from its checkpoint)", flush=True)
        wired: list[TrainRun] = []

        def ready(run: TrainRun) -> None:  # one process: the model and data are loaded, checked and wired
            wired.append(run)
            if stop_requested():  # a signal while they were loading
                run.trainer.close()
                check_stop(f"before training (nothing trained in this run); rerun the same command to start from "
                           f"{run.resumed_from or 'the beginning'}")
            lock.write_records()

        if cfg.parallel.workers > 1:  # the ranks check their data themselves: the records go first
            lock.write_records()
            # entered after ray.init, which sets its own SIGTERM handler (a second signal stops at once)
            with ray_session(None, need_cpus=trainer_cpus(cfg)), GracefulStop(
                    what="the training step in progress and its checkpoint"):
                result = launch(cfg, step_times=step_times)
        else:
            result = launch(cfg, callbacks=callbacks, step_times=step_times, ready=ready)
        finished = finish(cfg.output_dir, result, plots=cfg.plots)
    return dataclasses.replace(finished, run=wired[0] if wired else None)


def build_replay(cfg: ReplayConfig, *, callbacks: Sequence[Callback] = ()) -> TrainRun:
    """Wire a plain masked-loss Composer trainer on selected-token shards (the mask is honoured)."""
    device = setup_device(cfg.threads, cfg.device, cfg.precision)
    sel = shard_dir_info(cfg.selected, "selected")
    infos = [sel] + ([shard_dir_info(cfg.validation, "candidate")] if cfg.validation else [])
    check_tokenizer(infos, cfg.tokenizer)
    model = build_model(cfg.model, infos)
    rows = TokenRows(cfg.selected, "selected", use_mask=True, model_vocab=model_vocab_size(model.model))
    loader = rows_loader(rows, batch_size=cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed)
    resume = resume_path(cfg.output_dir, cfg.checkpoint.resume)
    total = cfg.max_steps or len(loader) * cfg.epochs
    speed, meter = throughput_callbacks(cfg, model, total_steps=total, validation=cfg.validation is not None)
    stopper = StopAtStepEnd()  # a SIGTERM / SIGINT (jobs/replay.py) ends the fit after the step, with a checkpoint
    trainer = make_trainer(cfg, model=model, loader=loader, total_steps=total, device=device, resume=resume,
                           callbacks=[*callbacks, stopper, speed, meter])
    return TrainRun(trainer=trainer, model=model, output_dir=cfg.output_dir, resumed_from=resume, throughput=meter,
                    stopper=stopper, tokenizer=run_tokenizer(infos, cfg.tokenizer))


def replay(cfg: ReplayConfig, *, callbacks: Sequence[Callback] = ()) -> Finished:
    """Train ``cfg.model`` on the selected-token shards; returns what it wrote (``validation``: the curve, also in
    ``validation.json``) and the wired ``run``.

    Locks ``output_dir`` and resumes only with the config in its ``config.yaml`` (as :func:`train`)."""
    curve = ValidationCurve()
    check_installed(cfg.loggers)
    cfg = localize(cfg)
    with open_output(cfg.output_dir, "replay", {"config.yaml": cfg}) as lock:
        run = build_replay(cfg, callbacks=[curve, *callbacks])
        lock.write_records()
        total = int(run.trainer.state.max_duration.value)  # (a stop lowers max_duration to the step it ends at)
        run.fit()
        result = dataclasses.replace(rank_result(run, Ranks(), reference=False), validation=tuple(curve.points))
        result.raise_if_stopped(cfg.output_dir, total)
        out = finish(cfg.output_dir, result, plots=False)
        atomic_write_text(os.path.join(cfg.output_dir, "validation.json"), json.dumps(curve.points, indent=1))
        storage.publish(os.path.join(cfg.output_dir, "validation.json"))
    return dataclasses.replace(out, run=run)
