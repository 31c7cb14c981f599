"""Exact online BLADE as a Composer ``Algorithm`` (docs/DESIGN.md §2, §3 "exact" mode).

One code path for every policy (``full``, ``random``, ``rho1``, ``blade``, ``blade-nosync``) and every world size
(a single process is rank 0 of 1):

* ``AFTER_DATALOADER`` (the batch of proxy step ``t``): when the schedule says so (``t = W, W+τ, ...``) the
  in-process reference is refreshed (:class:`~training.selection.reference.InProcessReference`); then ``ℓ(w̃)``
  of this batch's rows is attached as ``batch["ref_loss"]``, from that reference or from scored shards
  (:class:`~training.selection.shard_scores.ShardScores`), with the step's kept count ``kept_total`` and rows
  ``rows_total`` (the loss is normalised by the whole batch's, over all ranks).
* ``AFTER_FORWARD`` (each microbatch): ``ℓ(u)`` from the logits the forward pass already computed (no second
  proxy forward; the per-token losses are cached and reused by the loss), then the step's selection
  (:class:`curation.core.step.SelectionStep`: warm-up keeps every valid token; data-parallel ranks gather Δ and
  take the same global top-γ) and ``batch["loss_mask"] = α`` (this rank's rows) before the loss.
* ``BATCH_END``: the step's record (the whole batch, in single-process row order: mask, validity, scores, a
  finiteness flag, ``‖u − w̃‖`` every ``distance_interval`` steps, all on the device) is copied to the host without
  blocking and *delivered* a step later (:class:`~training.blocks.step_reads.StepReads`: the one host read of a
  steady step): it becomes :attr:`last`, goes to the subscribers (the shard writer, the statistics), and its mask
  joins the recent steps the next refresh's ``L_train`` uses (a refresh first delivers the step before it).

Under microbatching in a single process the selection is per microbatch (the mask must exist before each
microbatch's backward pass); the loss is still normalised by the whole batch's kept tokens.
Checkpoints (:meth:`state_dict`, loaded with ``torch.load(weights_only=True)``) hold the reference's state, the
schedule, the next step, the recent masks and the global RNG states (restored at ``FIT_START``: Composer skips its
own RNG restore when a dataset resumes itself mid-epoch).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from composer.core import Event, State
from composer.loggers import Logger
from torch import Tensor, nn

from curation.core.distributed import global_rows
from curation.core.host_sync import pinned
from curation.core.losses import target_valid
from curation.core.refresh_data import RecentMasks, recent_state, restore_recent
from curation.core.schedule import WARMUP_EPISODE, Schedule
from curation.core.stats import SelectionRecord, param_distance_tensor
from curation.core.step import SelectionStep
from schemas.train_config import TrainConfig
from training.blocks.checkpoint import rng_state, set_rng_state
from training.blocks.data import StreamBatches
from training.blocks.meters import Meters
from training.blocks.step_reads import StepReads
from training.selection.reference import InProcessReference
from training.selection.shard_scores import ShardScores

__all__ = ["BladeAlgorithm", "SelectionRecord"]


@dataclass
class _Pending:
    step: int
    episode: int
    ref_version: int
    selecting: bool
    kept: list[int]  # tokens kept per selection block of the whole batch
    full: dict[str, Any]  # the whole candidate batch of the step
    parts: list[dict[str, Any]] = field(default_factory=list)
    rows_done: int = 0


class BladeAlgorithm(StepReads[_Pending, SelectionRecord]):
    """Online token selection for one policy; see the module docstring.

    Args:
        cfg: the run's config: ``effective_microbatch_size`` (a single process's selection blocks),
            ``selection.refresh_candidate_batches`` (the steps whose masks the next refresh's ``L_train`` uses) and
            ``effective_distance_interval`` (measure ``‖u − w̃‖`` every this many steps).
        select: the run's selection step (policy, γ, seed, ranks, scope).
        schedule: the run's schedule.
        stream: the candidate stream's full batches.
        reference: the in-process reference (None: no reference, or scores from ``scored``).
        scored: ``ℓ(w̃)`` from scored shards or the engine.
        meters: the run's timers and counts (shared with the reference; benchmarks pass their own clock).
    """

    def __init__(self, cfg: TrainConfig, select: SelectionStep, schedule: Schedule, stream: StreamBatches, *,
                 reference: InProcessReference | None = None, scored: ShardScores | None = None,
                 meters: Meters | None = None) -> None:
        super().__init__()
        self.select = select
        self.policy = select.policy
        self.ranks = select.ranks
        self.schedule = schedule
        self.stream = stream
        self.reference = reference
        self.scored = scored
        self.microbatch_size = cfg.effective_microbatch_size
        self.distance_interval = cfg.effective_distance_interval
        #: ``(state, step, version) → {name: device tensor}`` read with the step's record (the engine-fed trainer's
        #: ``‖u − w‖``: :class:`training.runs.engine_feed.EngineSync`)
        self.extra_values: list[Any] = []
        self.meters = meters if meters is not None else Meters()
        self.timers, self.counts = self.meters.timers, self.meters.counts
        self.recent: deque[tuple[int, np.ndarray]] = deque(maxlen=cfg.selection.refresh_candidate_batches)
        self.last: SelectionRecord | None = None
        self.next_step = 0
        self.device = torch.device("cpu")
        self._pending_step: _Pending | None = None
        self._loaded_rng: dict[str, Any] | None = None

    @property
    def refresh_log(self) -> list[dict[str, Any]]:  # (rho1: the static reference's training)
        return self.reference.refresh_log if self.reference is not None else []

    def __repr__(self) -> str:
        return f"BladeAlgorithm(policy={self.policy.name!r})"

    # --- Composer hooks ----------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.AFTER_DATALOADER, Event.AFTER_FORWARD, Event.BATCH_END,
                         Event.FIT_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.FIT_START:
            self.start(state, logger)
            self._fit_start(state)
        elif event == Event.AFTER_DATALOADER:
            self._before_step(state)
        elif event == Event.AFTER_FORWARD:
            self._select(state)
        elif event == Event.BATCH_END:
            self.queue(state)
        elif event == Event.FIT_END:
            self.drain()

    @staticmethod
    def _proxy(state: State) -> nn.Module:
        return getattr(state.model, "module", state.model).model

    def _fit_start(self, state: State) -> None:
        proxy = self._proxy(state)
        self.device = next(proxy.parameters()).device
        step = int(state.timestamp.batch)
        if step != self.next_step:
            raise ValueError(
                f"BLADE state is at step {self.next_step} but the trainer is at step {step}: "
                "the checkpoint and the algorithm state disagree"
            )
        if self._loaded_rng is not None:
            set_rng_state(self._loaded_rng)
            self._loaded_rng = None
        if self.reference is not None:
            self.reference.start(proxy, step)

    # --- before each step: refresh, reference scores, kept count -----------------------------
    def _before_step(self, state: State) -> None:
        batch = state.batch
        step = int(batch["step"])
        if step != int(state.timestamp.batch):
            raise RuntimeError(f"data stream is at step {step} but the trainer at {int(state.timestamp.batch)}")
        warm = self.schedule.is_warmup(step)
        episode = self.schedule.episode(step)
        if self.reference is not None and self.policy.refreshes and self.schedule.refresh_due(step):
            self.drain()  # the refresh's L_train reads the masks of the steps before it
            self.reference.refresh(self._proxy(state), episode, RecentMasks.from_pairs(list(self.recent)))
        version = WARMUP_EPISODE
        if self.policy.needs_reference and not warm:
            version = self.schedule.reference_version(step, refreshed=self.policy.refreshes)
            ref = (self.scored.losses(step, batch["tokens"].numpy(), version) if self.scored is not None
                   else self.reference.losses(step))
            batch["ref_loss"] = pinned(torch.from_numpy(ref), self.device)  # (copied to the device without blocking)
        full = self.stream.batch(step) if self.ranks.world_size > 1 else batch  # (from memory: read once)
        v = full.get("valid")
        valid = target_valid(full["tokens"].cpu(), None if v is None else v.cpu().bool())
        kept = self.select.kept(valid, selecting=not warm, block_rows=self.microbatch_size)
        batch["kept_total"] = int(sum(kept))
        batch["rows_total"] = global_rows(int(batch["tokens"].shape[0]), self.ranks)
        self._pending_step = _Pending(step, episode, version, not warm, kept, full)

    # --- after the forward pass: select ------------------------------------------------------
    def _select(self, state: State) -> None:
        p = self._pending_step
        assert p is not None, "AFTER_FORWARD without AFTER_DATALOADER"
        batch = state.batch
        # ℓ(u) from the logits of this forward pass, computed once with the graph and reused by the loss
        # (not timed as selection: a plain step computes the same cross-entropy for its loss).
        losses, valid = getattr(state.model, "module", state.model).token_losses(state.outputs, batch)
        with self.meters.timed("select", self.device):
            proxy_losses = losses.detach()
            # A non-finite loss fails the step in finish(), once its record is read on the host; until then the
            # selection sees 0 there (on a GPU its own check is a device assertion that would end the process).
            finite = torch.isfinite(proxy_losses) | ~valid
            sel = self.select(p.step, torch.where(finite, proxy_losses, 0.0), valid, batch.get("ref_loss"),
                              selecting=p.selecting, offset=p.rows_done)
            batch["loss_mask"] = sel.local
            rows = slice(p.rows_done, p.rows_done + sel.mask.shape[0])  # the selection block's rows of the batch
            # Device tensors, read on the host a step later (StepReads): a read here would make the host wait for
            # the forward and the selection before queueing the backward.
            p.parts.append({
                "tokens": p.full["tokens"][rows], "mask": sel.mask, "valid": sel.valid, "scores": sel.scores,
                "sources": list(p.full["source"][rows]), "sample_ids": p.full["sample_id"][rows],
                "finite": finite.all(), "rows": int(sel.mask.shape[0]),
                "kept": p.kept if self.ranks.world_size > 1 else p.kept[len(p.parts) : len(p.parts) + 1],
            })
            p.rows_done += proxy_losses.shape[0]

    # --- after the step: the record, read a step later (StepReads) -------------------------------
    def step_values(self, state: State) -> dict[str, Tensor]:
        p = self._pending_step
        assert p is not None and p.parts, "BATCH_END without a selection"
        parts = p.parts
        one = len(parts) == 1
        finite = parts[0]["finite"] if one else torch.stack([part["finite"] for part in parts]).all()
        if self.ranks.world_size > 1:  # a NaN on one rank has reached every rank's weights: every rank stops
            flag = finite.to(torch.int32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = flag[0].bool()
        values = {"finite": finite}
        for key in ("mask", "valid", "scores"):
            values[key] = parts[0][key] if one else torch.cat([part[key] for part in parts])
        reference = self.reference.for_distance() if self.reference is not None else None
        if reference is not None and p.step % self.distance_interval == 0:
            with self.meters.timed("distance", self.device):
                values["distance"] = param_distance_tensor(self._proxy(state), reference)
        for extra in self.extra_values:
            values.update(extra(state, p.step, p.ref_version))
        return values

    def step_info(self, state: State) -> _Pending:
        p, self._pending_step = self._pending_step, None
        assert p is not None
        self.next_step = p.step + 1
        for part in p.parts:  # (the device tensors are in the step's copies)
            for key in ("mask", "valid", "scores", "finite"):
                part.pop(key, None)
        return p

    def finish(self, step: int, host: dict[str, Tensor], p: _Pending, loss: float | None) -> SelectionRecord:
        # Before anything of the step is recorded or saved (a diverged step is never written)
        if not bool(host["finite"]):
            raise ValueError(
                f"step {p.step}: the proxy's token loss is not finite (training diverged?); "
                "lower optim.lr or check the model weights"
            )
        mask = host["mask"].numpy().copy()  # (the host buffers are reused two steps later)
        first = 0
        for part in p.parts:
            rows = mask[first:first + part["rows"]] if self.ranks.world_size == 1 else mask
            assert int(rows.sum()) == sum(part["kept"]), (int(rows.sum()), part["kept"])
            first += part["rows"]
        rec = SelectionRecord(
            step=p.step, episode=p.episode, ref_version=p.ref_version,
            tokens=np.concatenate([part["tokens"].numpy() for part in p.parts]), mask=mask,
            valid=host["valid"].numpy().copy(), scores=host["scores"].numpy().copy(),
            sources=[s for part in p.parts for s in part["sources"]],
            sample_ids=np.concatenate([part["sample_ids"].numpy() for part in p.parts]), loss=loss,
        )
        if "distance" in host:
            rec.distance = float(host["distance"])
        self.recent.append((p.step, rec.mask.astype(np.uint8)))
        self.counts["selected_steps"] += int(p.selecting)
        self.last = rec
        return rec

    # --- checkpoint state --------------------------------------------------------------------
    def reference_state_dict(self, *, copy: bool = True) -> dict[str, Tensor] | None:
        """The current reference ``w̃``'s weights on the CPU (None before the first refresh, and for
        full / random, which have no reference; bfloat16 once compacted); ``copy=False``: without a copy, where they
        are (see :meth:`InProcessReference.weights`)."""
        return (self.reference.weights(copy=copy) or None) if self.reference is not None else None

    def state_dict(self) -> dict[str, Any]:
        self.drain()  # the step taken last is part of the checkpoint
        ref = self.reference.state_dict(self.next_step) if self.reference is not None else {
            "ref_version": WARMUP_EPISODE, "reference": None, "ref_optimizer": None, "scores": {}, "refresh_log": []}
        return {
            "repr": repr(self), "policy": self.policy.name, "schedule": self.schedule.to_dict(),
            "gamma": float(self.select.gamma), "next_step": int(self.next_step), **ref, **recent_state(self.recent),
            "timers": dict(self.timers), "counts": dict(self.counts), "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("policy") != self.policy.name:
            raise ValueError(
                f"checkpoint was written by policy {state.get('policy')!r}, this run uses {self.policy.name!r}"
            )
        same = self.schedule.same_episodes(state.get("schedule") or {})  # total_steps may differ: extended runs
        if not same or float(state.get("gamma", -1)) != float(self.select.gamma):
            raise ValueError(
                f"checkpoint schedule {state.get('schedule')} / gamma {state.get('gamma')} differ from this run's "
                f"{self.schedule.to_dict()} / {self.select.gamma}: resume with the same selection settings"
            )
        self.next_step = int(state["next_step"])
        if self.reference is not None:
            self.reference.load_state_dict(state)
        restore_recent(self.recent, state)
        self.timers.update(state.get("timers", {}))
        self.counts.update(state.get("counts", {}))
        self._loaded_rng = state.get("rng")
