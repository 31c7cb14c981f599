"""The reference refresh of the engine (no ray): BLADE's refresh from a proxy snapshot and the recent
masks, or RHO-1's static reference. Runs in-process in tests and inside the Ray refresh actor.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curation.core.losses import target_valid
from curation.core.policies import RefreshMode, get_policy, train_static_reference
from curation.core.refresh import RefreshWorkspace
from curation.core.stream import CandidateStream
from curation.engine.weights import Weights
from curation.io.models import build_causal_lm
from curation.io.shards import open_shards
from schemas.manifest import atomic_write_text
from schemas.train_config import ModelConfig


# ------------------------------------------------------------------------------------------------
# reference refresh
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RefreshSpec:
    """Settings of the refresh (the training config's selection section, resolved).

    Attributes:
        model: proxy/reference architecture (``ModelConfig`` dict).
        validation: validation-shard directory (``L_val``).
        candidates: candidate-shard directory (tokens of the recent steps).
        stream: the training :class:`~curation.core.stream.CandidateStream` as a dict.
        selection: the ``SelectionConfig`` as a dict.
        ref_lr: ``η_w``.
        refresh_batch_size: sequences per validation / candidate batch of a refresh step.
        engine_dir: where reference versions are saved (``reference-0003.safetensors``).
        device: ``auto`` / ``cpu`` / ``cuda``.
        threads: torch CPU threads (``None``: leave as is).
        precision: ``fp32`` / ``amp_bf16`` (the refresh's forward passes under bf16 autocast on CUDA).
    """

    model: dict[str, Any]
    validation: str
    candidates: str
    stream: dict[str, Any]
    selection: dict[str, Any]
    ref_lr: float
    refresh_batch_size: int
    engine_dir: str
    device: str = "auto"
    threads: int | None = None
    precision: str = "fp32"


def reference_path(engine_dir: str, version: int) -> str:
    return os.path.join(engine_dir, f"reference-{version:04d}.safetensors")


def proxy_path(engine_dir: str, step: int) -> str:
    return os.path.join(engine_dir, f"proxy-{step:09d}.safetensors")


@dataclass
class RecentMasks:
    """The recent trained steps and their masks (what ``L_train(α, w)`` of a refresh uses)."""

    steps: list[int] = field(default_factory=list)
    masks: np.ndarray | None = None  # (n, b, L) uint8

    def save(self, path: str) -> None:
        from safetensors.numpy import save_file

        data = {"steps": np.asarray(self.steps, dtype=np.int64)}
        if self.masks is not None:
            data["masks"] = np.ascontiguousarray(self.masks, dtype=np.uint8)
        tmp = path + ".tmp"
        save_file(data, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> RecentMasks:
        from safetensors.numpy import load_file

        data = load_file(path)
        return cls([int(s) for s in data["steps"]], data.get("masks"))

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[int, np.ndarray]]) -> RecentMasks:
        if not pairs:
            return cls()
        return cls([int(s) for s, _ in pairs], np.stack([np.asarray(m, dtype=np.uint8) for _, m in pairs]))


class RefreshRunner:
    """Computes reference versions (see the module docstring).

    Args:
        spec: the refresh settings.
    """

    def __init__(self, spec: RefreshSpec) -> None:
        from schemas.train_config import SelectionConfig

        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.cfg = SelectionConfig.model_validate(spec.selection)
        self.policy = get_policy(self.cfg.policy)
        from curation.engine.scorer import resolve_device

        self.device = resolve_device(spec.device)
        self.model_cfg = ModelConfig.model_validate(spec.model)
        self.proxy = build_causal_lm(self.model_cfg).to(self.device)
        self.validation = open_shards(spec.validation, "candidate")
        if len(self.validation) == 0:
            raise ValueError(f"{spec.validation}: the validation set is empty")
        self.stream = CandidateStream.from_dict(spec.stream)
        self.candidates = open_shards(spec.candidates, "candidate")
        rb = spec.refresh_batch_size
        n = len(self.validation)
        # The same deterministic validation batches as the single-process trainer.
        self._val_stream = CandidateStream(n, rb, seed=self.cfg.seed + 1)
        self._static_stream = CandidateStream(n, rb, seed=self.cfg.seed + 2)
        self.opt_state: dict[str, Any] | None = None
        self.opt_version: int | None = None
        # The reference module and AdamW of a refresh, reused refresh after refresh (curation.core.refresh).
        self.workspace = RefreshWorkspace(keep_optimizer_state=self.policy.refresh_mode is RefreshMode.CONTINUE)

    def _tokens(self, dataset: Any, ids: np.ndarray) -> Tensor:
        return torch.stack([torch.from_numpy(np.asarray(dataset[int(i)]["tokens"]).astype(np.int64)) for i in ids])

    def _val_batches(self, stream: CandidateStream, version: int, steps: int) -> Iterator[dict[str, Tensor]]:
        for k in range(steps):
            yield {"tokens": self._tokens(self.validation, stream.batch_ids(version * steps + k))}

    def _cand_batches(self, recent: RecentMasks, steps: int, current_step: int) -> Iterator[dict[str, Tensor]]:
        """Rows of the recent trained steps with their masks, cycled; before anything was trained (``W = 0``)
        the batch of the refresh step with every valid token stands in (as in the single-process trainer)."""
        if steps == 0 or self.cfg.lam == 0:
            return iter(())
        if recent.steps:
            tokens = torch.cat([self._tokens(self.candidates, self.stream.batch_ids(s)) for s in recent.steps])
            masks = torch.from_numpy(np.asarray(recent.masks).astype(bool)).reshape(tokens.shape)
        else:
            tokens = self._tokens(self.candidates, self.stream.batch_ids(current_step))
            masks = target_valid(tokens)
        n, rb = tokens.shape[0], self.spec.refresh_batch_size

        def gen() -> Iterator[dict[str, Tensor]]:
            for k in range(steps):
                idx = torch.arange(k * rb, (k + 1) * rb) % n
                yield {"tokens": tokens[idx], "mask": masks[idx]}

        return gen()

    def _entry(self, step: int, version: int, result: Any, seconds: float, **more: Any) -> dict[str, Any]:
        return {**result.log_entry(step=step, version=version), "seconds": seconds, **more}

    def static(self) -> tuple[Weights, dict[str, Any]]:
        """RHO-1's reference (version 0): given weights, or trained on validation data from the base model."""
        start = time.perf_counter()
        base = build_causal_lm(self.model_cfg).to(self.device)
        if self.cfg.reference_weights is not None:
            from curation.io.models import load_weights

            load_weights(base, self.cfg.reference_weights)
            weights = Weights.from_state_dict(base)
            log = {"step": 0, "version": 0, "steps": 0, "weights": self.cfg.reference_weights}
        else:
            steps = self.cfg.rho1_steps
            result = train_static_reference(
                base, self._val_batches(self._static_stream, 0, steps), steps=steps, lr=self.spec.ref_lr,
                weight_decay=self.cfg.ref_weight_decay, grad_clip=self.cfg.ref_grad_clip,
                precision=self.spec.precision,
            )
            weights = Weights.from_state_dict(result.model)
            log = self._entry(0, 0, result, time.perf_counter() - start)
        self._save(0, weights, log)
        return weights, log

    def _save(self, version: int, weights: Weights, log: dict[str, Any]) -> None:
        """The reference and its log go to disk before the result is returned (a resumed job reuses both)."""
        path = reference_path(self.spec.engine_dir, version)
        weights.save(path)
        atomic_write_text(path.replace(".safetensors", ".json"), json.dumps(log, indent=1))

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
        proxy.load_into(self.proxy)
        continue_mode = self.policy.refresh_mode is RefreshMode.CONTINUE
        prev_sd = None
        opt_state = None
        if continue_mode and version > 0:
            if previous is None:
                raise ValueError(f"blade-nosync refresh {version} needs reference {version - 1}")
            prev_sd = {k: v.to(self.device) for k, v in previous.state_dict().items()}
            opt_state = self._optimizer_state(version - 1)
        step = self.stream_step(version)
        result = self.policy.refresh(
            self.proxy,
            self._val_batches(self._val_stream, version, self.cfg.refresh_steps),
            self._cand_batches(recent, self.cfg.refresh_steps, self.stream_step(version)),
            previous=prev_sd, optimizer_state=opt_state, steps=self.cfg.refresh_steps, lam=self.cfg.lam,
            lr=self.spec.ref_lr, weight_decay=self.cfg.ref_weight_decay, grad_clip=self.cfg.ref_grad_clip,
            precision=self.spec.precision, workspace=self.workspace,
        )
        weights = Weights.from_state_dict(result.model)
        if continue_mode:
            self.opt_state, self.opt_version = result.optimizer_state, version
            tmp = self._opt_path(version) + ".tmp"
            torch.save(result.optimizer_state, tmp)
            os.replace(tmp, self._opt_path(version))
        log = self._entry(step, version, result, time.perf_counter() - start, source_step=source_step,
                          staleness=step - source_step, recent_steps=list(recent.steps))
        self._save(version, weights, log)
        return weights, log

    def stream_step(self, version: int) -> int:
        """The step before which reference ``version`` is due (``W + eτ``)."""
        return self.cfg.warmup_steps + version * self.cfg.tau

    def _opt_path(self, version: int) -> str:
        return os.path.join(self.spec.engine_dir, f"reference-{version:04d}.optim.pt")

    def _optimizer_state(self, version: int) -> dict[str, Any] | None:
        if self.opt_version == version and self.opt_state is not None:
            return self.opt_state
        path = self._opt_path(version)
        if not os.path.exists(path):
            raise ValueError(f"{path}: optimizer state of reference {version} is missing (blade-nosync resume)")
        return torch.load(path, map_location="cpu", weights_only=True)


def refresh_logs(engine_dir: str) -> list[dict[str, Any]]:
    """The logs of every reference version computed so far (this run and the runs it resumed)."""
    import glob

    logs = []
    for path in sorted(glob.glob(os.path.join(engine_dir, "reference-*.json"))):
        with open(path, encoding="utf-8") as f:
            logs.append(json.load(f))
    return sorted(logs, key=lambda r: r["version"])
