"""``jobs/train.py`` and ``jobs/replay.py`` in one process: lock the output directory, wire, fit, finish.

* :func:`train`: online selection (exact BLADE or another policy) on the candidate stream
  (:func:`training.runs.wiring.build_training`, rank 0 of 1).
* :func:`replay` (BLADE-Tr): another model trained on selected-token shards by a plain masked-loss trainer.

Both hold ``output_dir``'s lock throughout and resume only with the config recorded in its ``config.yaml``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from curation.io import storage
from curation.io.atomic import atomic_write_text
from curation.io.hf_export import run_tokenizer
from curation.io.models import model_vocab_size
from curation.io.outputs import localize, open_output
from curation.io.shards import check_tokenizer, shard_dir_info
from curation.io.stop import check_stop, stop_requested
from schemas.train_config import ReplayConfig, TrainConfig
from training.blocks.callbacks import ValidationCurve
from training.blocks.data import TokenRows, rows_loader
from training.blocks.loggers import check_installed
from training.blocks.preemption import StopAtStepEnd
from training.blocks.throughput import throughput_callbacks
from training.blocks.trainer import build_model, make_trainer, resume_path, setup_device
from training.runs.wiring import TrainRun, build_training, finish_run

__all__ = ["train", "build_replay", "replay"]


def train(cfg: TrainConfig, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Run (or resume) a training run; returns the output paths (``final_weights``, ``final_reference``,
    ``summary``, ``plots``, ``selected``) and the wired ``run``.

    Within a :class:`curation.io.stop.GracefulStop` (``jobs/train.py``), a SIGTERM / SIGINT ends the fit after the step
    in progress with a checkpoint at that step (:mod:`training.blocks.preemption`); ``final/`` and the summary are
    then not written.

    Raises:
        OutputDirError: the directory is in use, was written with another config, or is not writable.
        StopRequested: a stop signal ended the run early; its message names the step and the checkpoint a rerun
            resumes from.
    """
    check_installed(cfg.loggers)
    cfg = localize(cfg)  # s3:// directories: their local caches (curation.io.storage)
    with open_output(cfg.output_dir, "train", {"config.yaml": cfg}) as lock:
        if "max_steps" in lock.extended:
            old, new = lock.extended["max_steps"]
            print(f"extending the run: max_steps {old} → {new} (continuing from its checkpoint)", flush=True)
        run = build_training(cfg, callbacks=callbacks)
        if stop_requested():  # a signal while the model and data were loading
            run.trainer.close()
            check_stop(f"before training (nothing trained in this run); rerun the same command to start from "
                       f"{run.resumed_from or 'the beginning'}")
        lock.write_records()
        run.fit()
        run.raise_if_stopped(cfg.max_steps)
        selected = os.path.join(cfg.output_dir, "selected") if cfg.write_selected else None
        out = finish_run(cfg.output_dir, run.outputs(extra={"selected_dir": selected}), plots=cfg.plots)
    return {**out, "selected": selected, "run": run}


def build_replay(cfg: ReplayConfig, *, callbacks: Sequence[Any] = ()) -> TrainRun:
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


def replay(cfg: ReplayConfig, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train ``cfg.model`` on the selected-token shards; returns output paths and the validation curve.

    Locks ``output_dir`` and resumes only with the config in its ``config.yaml`` (as :func:`train`)."""
    curve = ValidationCurve()
    check_installed(cfg.loggers)
    cfg = localize(cfg)
    with open_output(cfg.output_dir, "replay", {"config.yaml": cfg}) as lock:
        run = build_replay(cfg, callbacks=[curve, *callbacks])
        lock.write_records()
        total = int(run.trainer.state.max_duration.value)  # (a stop lowers max_duration to the step it ends at)
        run.fit()
        run.raise_if_stopped(total)
        out = finish_run(cfg.output_dir, run.outputs(reference=False), plots=False)
        atomic_write_text(os.path.join(cfg.output_dir, "validation.json"), json.dumps(curve.points, indent=1))
        storage.publish(os.path.join(cfg.output_dir, "validation.json"))
    return {**out, "validation": curve.points, "run": run}
