"""The reference refresh of the engine (no ray): BLADE's refresh from a proxy snapshot and the recent
masks, or RHO-1's static reference. Runs in-process in tests and inside the Ray refresh actor.

Its inputs (validation and candidate batches, the refresh call) come from
:class:`curation.core.refresh_data.RefreshData`, as the single-process trainer's do; this module adds the
engine's side: reading the shard directories, saving each version (and ``blade-nosync``'s optimizer state)
to disk.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curation.core.flat_weights import FlatStaging
from curation.core.host_sync import set_matmul_precision
from curation.core.policies import RefreshMode, get_policy
from curation.core.refresh import CONTINUE, RefreshResult, RefreshSettings, RefreshStart, RefreshWorkspace
from curation.core.refresh_data import RecentMasks, RefreshData
from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream
from curation.engine.weights import Weights
from curation.io import objects, storage
from curation.io.atomic import atomic_write_text
from curation.io.bad_shards import blame
from curation.io.models import (
    build_causal_lm,
    check_token_range,
    load_weights,
    model_vocab_size,
    resolve_device,
)
from curation.io.paths import UnsafeNameError
from curation.io.shards import ShardReader, open_shards
from schemas.train_config import ModelConfig, SelectionConfig


# ------------------------------------------------------------------------------------------------
# reference refresh
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RefreshSpec:
    """Settings of the refresh (the training config's selection section, resolved; handed to the actor as it is).

    Attributes:
        model: proxy/reference architecture.
        validation: validation-shard directory (``L_val``).
        candidates: candidate-shard directory (tokens of the recent steps).
        stream: the training candidate stream.
        selection: the run's selection settings.
        ref_lr: ``η_w``.
        refresh_batch_size: sequences per validation / candidate batch of a refresh step.
        engine_dir: where reference versions are saved (``reference-0003.safetensors``).
        schedule: the run's schedule (the one the trainer and the engine's plan follow).
        device: ``auto`` / ``cpu`` / ``cuda``.
        threads: torch CPU threads (``None``: leave as is).
        precision: ``fp32`` / ``amp_bf16`` (the refresh's forward passes under bf16 autocast on CUDA).
    """

    model: ModelConfig
    validation: str
    candidates: str
    stream: CandidateStream
    selection: SelectionConfig
    ref_lr: float
    refresh_batch_size: int
    engine_dir: str
    schedule: Schedule
    device: str = "auto"
    threads: int | None = None
    precision: str = "fp32"


def reference_path(engine_dir: str, version: int) -> str:
    return os.path.join(engine_dir, f"reference-{version:04d}.safetensors")


def reference_log_path(engine_dir: str, version: int) -> str:
    """Reference ``version``'s log, written after its weights: the mark that the version is complete."""
    return os.path.join(engine_dir, f"reference-{version:04d}.json")


def proxy_path(engine_dir: str, step: int) -> str:
    return os.path.join(engine_dir, f"proxy-{step:09d}.safetensors")


class RefreshRunner:
    """Computes reference versions (see the module docstring).

    Args:
        spec: the refresh settings.
    """

    def __init__(self, spec: RefreshSpec) -> None:
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.cfg = spec.selection
        self.policy = get_policy(self.cfg.policy)
        self.device = resolve_device(spec.device)
        self.matmul = set_matmul_precision(self.device)  # the trainer's and the workers' setting
        self.staging = FlatStaging()  # a proxy snapshot's way to the device (one copy per dtype, reused)
        self.model_cfg = spec.model
        self.proxy = build_causal_lm(self.model_cfg).to(self.device)
        self.validation = open_shards(spec.validation, "candidate")
        self.stream = spec.stream
        self.candidates = open_shards(spec.candidates, "candidate")
        self.schedule = spec.schedule
        # The same batches and settings as the single-process trainer's refreshes.
        settings = RefreshSettings.of(self.cfg, lr=spec.ref_lr, batch_size=spec.refresh_batch_size,
                                      precision=spec.precision)
        self.data = RefreshData(
            settings, self.schedule, num_validation=len(self.validation),
            validation_path=spec.validation,
            validation_tokens=lambda ids: self._tokens(self.validation, ids),
            step_tokens=lambda step: self._tokens(self.candidates, self.stream.batch_ids(step)),
        )
        self.opt_version: int | None = None
        # The reference module and AdamW of a refresh, reused refresh after refresh (curation.core.refresh).
        self.workspace = RefreshWorkspace(keep_optimizer_state=self.policy.refresh_mode is RefreshMode.CONTINUE)

    def _tokens(self, dataset: ShardReader, ids: np.ndarray) -> Tensor:
        """The rows ``ids`` of ``dataset``; an id outside the model's vocabulary names the sample and blames its shard
        (:mod:`curation.io.bad_shards`), as the trainer's loaders do, instead of an embedding's index error."""
        rows = np.stack([np.asarray(dataset[int(i)]["tokens"]) for i in ids])
        vocab = model_vocab_size(self.proxy)
        if rows.size and int(rows.max()) >= vocab:  # one reduction; the first bad row named
            bad = int(np.argmax((rows >= vocab).any(axis=1)))
            try:
                check_token_range(rows[bad], vocab, f"{dataset.path} (sample {int(ids[bad])})")
            except ValueError as e:
                blame(e, dataset.shard_path(int(ids[bad])))
                raise
        return torch.from_numpy(rows.astype(np.int64))

    def _entry(self, step: int, version: int, result: RefreshResult, seconds: float, **more: object) -> dict[str, Any]:
        return {**result.log_entry(step=step, version=version), "seconds": seconds, **more}

    def static(self) -> tuple[Weights, dict[str, Any]]:
        """RHO-1's reference (version 0): given weights, or trained on validation data from the base model."""
        start = time.perf_counter()
        base = build_causal_lm(self.model_cfg).to(self.device)
        if self.cfg.reference_weights is not None:
            load_weights(base, self.cfg.reference_weights)
            weights = Weights.from_state_dict(base)
            log = {"step": 0, "version": 0, "steps": 0, "weights": self.cfg.reference_weights}
        else:
            result = self.data.train_static(base)
            weights = Weights.from_state_dict(result.model)
            log = self._entry(0, 0, result, time.perf_counter() - start)
        self._save(0, weights, log)
        return weights, log

    def _save(self, version: int, weights: Weights, log: Mapping[str, object]) -> None:
        """The reference and its log go to disk before the result is returned (a resumed job reuses both)."""
        engine_dir = self.spec.engine_dir
        path, log_path = reference_path(engine_dir, version), reference_log_path(engine_dir, version)
        weights.save(path)
        atomic_write_text(log_path, json.dumps(log, indent=1))  # last: a kill before it leaves the version to redo
        for name in (path, self._opt_path(version), log_path):  # the log last
            if os.path.exists(name):
                storage.publish(name)  # an object-store output directory: in the bucket before it is used

    def refresh(
        self,
        version: int,
        proxy: Weights,
        recent: RecentMasks,
        *,
        source_step: int,
        previous: Weights | None = None,
    ) -> tuple[Weights, dict[str, Any]]:
        """Reference ``version`` from the proxy snapshot ``u^(source_step)`` (policy's refresh mode).

        ``blade-nosync`` continues from ``previous`` (reference ``version − 1``) and its optimizer state,
        kept in memory and saved next to the reference (so a restarted actor or a resumed job continues it).
        """
        start = time.perf_counter()
        proxy.load_into(self.proxy, staging=self.staging)
        continue_mode = self.policy.refresh_mode is RefreshMode.CONTINUE
        prev_sd = None
        opt_state = None
        if continue_mode and version > 0:
            if previous is None:
                raise ValueError(f"blade-nosync refresh {version} needs reference {version - 1}")
            prev_sd = {k: v.to(self.device) for k, v in previous.state_dict().items()}
            opt_state = self._optimizer_state(version - 1)
        step = self.schedule.refresh_step(version)
        result = self.data.refresh(self.policy, self.proxy, version, recent,
                                   RefreshStart(previous=prev_sd, optimizer_state=opt_state, workspace=self.workspace))
        weights = Weights.from_state_dict(result.model)
        if continue_mode:
            self.opt_version = version  # its AdamW state stays in the workspace's optimizer
            tmp = self._opt_path(version) + ".tmp"
            torch.save(result.optimizer_state, tmp)
            os.replace(tmp, self._opt_path(version))
        log = self._entry(step, version, result, time.perf_counter() - start, source_step=source_step,
                          staleness=step - source_step, recent_steps=list(recent.steps))
        self._save(version, weights, log)
        return weights, log

    def _opt_path(self, version: int) -> str:
        return reference_path(self.spec.engine_dir, version).replace(".safetensors", ".optim.pt")

    def _optimizer_state(self, version: int) -> dict[str, Any] | str:
        """The AdamW state reference ``version`` left: still in the workspace's AdamW (continued in place), or
        read from the file saved next to it (a restarted actor, a resumed job)."""
        if self.opt_version == version:
            return CONTINUE
        path = self._opt_path(version)
        if not storage.fetch(path):
            raise ValueError(f"{path}: optimizer state of reference {version} is missing (blade-nosync resume)")
        return torch.load(path, map_location="cpu", weights_only=True)


_LOG = re.compile(r"reference-\d+\.json")


def refresh_logs(engine_dir: str) -> list[dict[str, Any]]:
    """The logs of every reference version computed so far (this run and the runs it resumed), wherever they were
    written (an object-store ``engine_dir``: the bucket's).

    Raises:
        UnsafeNameError: a ``reference-*.json`` in ``engine_dir`` is a symbolic link (this module writes none: it
            could have the report read a file outside the run); one line naming it, nothing read through it.
    """
    import glob

    url = storage.url_of(engine_dir)
    if url is not None:  # an object-store run: a refresh actor on another node wrote its logs into its own cache
        for key in objects.list_objects(url):
            if _LOG.fullmatch(key):
                storage.fetch(os.path.join(engine_dir, key))  # (a version's log is published last, never rewritten)
    logs = []
    for path in sorted(glob.glob(os.path.join(engine_dir, "reference-*.json"))):
        if os.path.islink(path):
            raise UnsafeNameError(f"{path}: a symbolic link (to {os.readlink(path)!r:.120}), not a reference log "
                                  "written by the run; refused (nothing was read through it): delete it")
        with open(path, encoding="utf-8") as f:
            logs.append(json.load(f))
    return sorted(logs, key=lambda r: r["version"])
