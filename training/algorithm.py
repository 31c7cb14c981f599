"""Exact online BLADE as a Composer ``Algorithm`` (docs/DESIGN.md §2, §3 "exact" mode).

One code path for every policy (``full``, ``random``, ``rho1``, ``blade``, ``blade-nosync``):

* ``AFTER_DATALOADER`` (full batch of proxy step ``t``): when the schedule says so
  (``t = W, W+τ, ...``) refresh the reference synchronously with the core
  :func:`~curation.core.refresh.refresh_reference` (through the policy: ``blade`` restarts from ``u``,
  ``blade-nosync`` continues); then attach ``ℓ(w̃)`` of this batch as ``batch["ref_loss"]``. The
  scores come from scored shards when ``data.scored`` is set (written by the Ray engine), else
  from the in-process reference, which pre-computes the scores of the coming steps of the episode
  right after a refresh and is then moved off the training device (the paper's offloading).
  Also writes ``kept_total`` (the number of tokens that will be kept) for the loss normaliser.
* ``AFTER_FORWARD`` (each microbatch): ``ℓ(u)`` from the logits the forward pass already computed
  (no second proxy forward; the per-token losses are cached and reused by the loss), scores and
  ``select_top_fraction`` through the policy, and ``batch["loss_mask"] = α`` before the loss.
  Warm-up steps keep every valid token.
* ``BATCH_END``: the batch's selection becomes :attr:`BladeAlgorithm.last` (read by the shard
  writer and stats callbacks), and joins the recent batches the next refresh uses for
  ``L_train(α, w)``.

Selection is over the whole candidate batch, except under microbatching
(``microbatch_size < batch_size``), where it is per microbatch (like per-rank selection in
data-parallel training: the mask must exist before each microbatch's backward pass). The loss is
still normalised by the whole batch's kept tokens.

The refresh's inputs (validation batches, the recent batches' rows and masks, its settings) come from
:class:`curation.core.refresh_data.RefreshData`, as those of the engine's refresh actor do; the step
arithmetic (warm-up, episodes, refresh steps, episode ends) from the run's
:class:`curation.core.schedule.Schedule`.

Checkpoints: :meth:`BladeAlgorithm.state_dict` holds the reference weights and (``blade-nosync``)
its optimizer state, the schedule, the reference version, the next step, the recent batches'
masks, the refresh log and the global RNG states (restored at ``FIT_START``: Composer skips its
own RNG restore when a dataset resumes itself mid-epoch). Only tensors and plain Python values,
so the checkpoint loads with ``torch.load(weights_only=True)``. The pre-computed scores of the rest of the
episode are saved with it (single process; float16, a few MB), so a resumed run takes the same scores as an
uninterrupted one without re-scoring; without them (data-parallel ranks, whose rows differ) they are
recomputed from the restored reference, step by step as in an uninterrupted run: the same masks bit for
bit on CPU.

Off the training device (CUDA), a ``blade`` reference that has scored its whole episode is kept as a
:class:`training.reference_store.CompactReference` (bfloat16, one reused host buffer) instead of its float32
module: it is only read for ``‖u − w̃‖``, checkpoints and ``final/reference.safetensors`` after that.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from torch import Tensor, nn

from curation.core.losses import target_valid
from curation.core.policies import RefreshMode, get_policy
from curation.core.refresh_data import RecentMasks, RefreshData, recent_state, restore_recent
from curation.core.schedule import WARMUP_EPISODE, Schedule
from curation.core.selection import num_selected
from curation.core.stats import SelectionRecord, param_distance
from curation.engine.scorer import ReferenceScorer, ScoredShards
from curation.io.models import read_weights
from schemas.train_config import ModelConfig, SelectionConfig
from training.checkpoint import rng_state, set_rng_state
from training.data import StreamBatches, TokenRows
from training.reference_store import InProcessReference

__all__ = ["BladeAlgorithm", "SelectionRecord"]


@dataclass
class _Pending:
    step: int
    episode: int
    ref_version: int
    selecting: bool
    expected_kept: list[int]
    parts: list[dict[str, Any]] = field(default_factory=list)
    rows_done: int = 0
    full: dict[str, Any] | None = None  # data-parallel: the whole candidate batch of the step


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


class BladeAlgorithm(Algorithm):
    """Online token selection for one policy; see the module docstring.

    Args:
        selection: the selection section of the config.
        stream_data: the training stream (the reference reads the coming batches from it).
        validation: validation rows (the refresh's ``L_val`` and the RHO-1 reference).
        model_config: the proxy's model config (recorded with the reference scorer).
        schedule: the run's schedule (``total_steps`` = the run's proxy steps).
        batch_size: ``b``.
        microbatch_size: sequences per forward/backward (``None`` = ``b``).
        ref_lr: ``η_w`` (the proxy's LR unless the selection config sets one).
        refresh_batch_size: sequences per validation and per candidate batch of a refresh step.
        scored: scored shards to take ``ℓ(w̃)`` from (no in-process reference then).
        distance_interval: measure ``‖u − w‖`` every this many steps.
        precision: the trainer's ``fp32`` / ``amp_bf16``: the reference's scoring and refresh run at the
            precision of the proxy's forward (bf16 autocast on CUDA), so Δ compares like with like.
        parallel: on a data-parallel worker, its :class:`training.parallel.ParallelSelection` (this rank's
            rows are scored; the selection is taken over the whole batch; the loss normalised globally).
        timing: synchronise CUDA around timed phases (benchmarks).
        clock: the clock of :attr:`timers` (``time.perf_counter``; benchmarks on a shared CPU use
            ``time.process_time``).
    """

    def __init__(
        self,
        *,
        selection: SelectionConfig,
        stream_data: StreamBatches,
        validation: TokenRows,
        model_config: ModelConfig,
        schedule: Schedule,
        batch_size: int,
        microbatch_size: int | None = None,
        ref_lr: float,
        refresh_batch_size: int,
        scored: ScoredShards | None = None,
        distance_interval: int = 1,
        precision: str = "fp32",
        parallel: Any = None,
        timing: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = selection
        self.parallel = parallel
        self.policy = get_policy(selection.policy)
        self.stream_data = stream_data
        self.microbatch_size = microbatch_size or batch_size
        self.scored = scored
        self.distance_interval = distance_interval
        self.precision = precision
        self.timing = timing
        self.clock = clock
        self.schedule = schedule
        self.uses_reference = self.policy.needs_reference
        self.in_process = self.uses_reference and scored is None

        # w̃, its scorer and the refresh workspace (module and AdamW reused refresh after refresh)
        self.reference = InProcessReference(
            model_config=model_config, precision=precision, batch_size=selection.score_batch_size or batch_size,
            offload=selection.offload_reference, keep_optimizer_state=self.policy.refresh_mode is RefreshMode.CONTINUE)
        self.ref_version = WARMUP_EPISODE
        self.score_cache: dict[int, np.ndarray] = {}
        self._loaded_scores: dict[int, np.ndarray] = {}
        self.recent: deque[tuple[int, np.ndarray]] = deque(maxlen=selection.refresh_candidate_batches)
        self.refresh_log: list[dict[str, Any]] = []
        self.timers: dict[str, float] = {"select": 0.0, "score": 0.0, "refresh": 0.0, "distance": 0.0}
        self.counts: dict[str, int] = {"score_steps": 0, "refreshes": 0, "selected_steps": 0}
        self.last: SelectionRecord | None = None
        self.next_step = 0
        self._pending: _Pending | None = None
        self._loaded_reference: dict[str, Tensor] | None = None
        self._loaded_rng: dict[str, Any] | None = None
        self.refresh_data = RefreshData(
            selection=selection, schedule=schedule, refresh_batch_size=refresh_batch_size, lr=ref_lr,
            precision=precision, num_validation=len(validation), validation_path=validation.path,
            validation_tokens=lambda ids: torch.stack([validation[int(i)]["tokens"] for i in ids]),
            step_tokens=lambda step: stream_data.batch(step)["tokens"],
        )

    @property
    def scorer(self) -> ReferenceScorer | None:
        return self.reference.scorer

    @property
    def _train_device(self) -> torch.device:
        return self.reference.train_device

    def __repr__(self) -> str:
        return f"BladeAlgorithm(policy={self.policy.name!r})"

    # --- Composer hooks ----------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.AFTER_DATALOADER, Event.AFTER_FORWARD, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.FIT_START:
            self._fit_start(state)
        elif event == Event.AFTER_DATALOADER:
            self._before_step(state)
        elif event == Event.AFTER_FORWARD:
            self._select(state)
        elif event == Event.BATCH_END:
            self._after_step(state)

    # --- fit start: reference set-up, resume checks ------------------------------------------
    def _proxy(self, state: State) -> nn.Module:
        return _unwrap(state.model).model

    def _fit_start(self, state: State) -> None:
        proxy = self._proxy(state)
        self.reference.place(proxy)
        step = int(state.timestamp.batch)
        if step != self.next_step:
            raise ValueError(
                f"BLADE state is at step {self.next_step} but the trainer is at step {step}: "
                "the checkpoint and the algorithm state disagree"
            )
        if self._loaded_rng is not None:
            set_rng_state(self._loaded_rng)
            self._loaded_rng = None
        if not self.in_process:
            return
        if self._loaded_reference is not None:
            module = self.reference.build(proxy, self._loaded_reference)
            self._loaded_reference = None
            self.score_cache, self._loaded_scores = self._loaded_scores, {}
            self._set_reference(module, self.ref_version, keep_scores=True)
        elif self.policy.refresh_mode is RefreshMode.STATIC:
            self._train_static(proxy)

    def _set_reference(self, module: nn.Module, version: int, *, offload: bool = True, keep_scores: bool = False,
                       ) -> None:
        """Make ``module`` the scoring reference (:meth:`InProcessReference.set`)."""
        self.ref_version = version
        if not keep_scores:
            self.score_cache.clear()
        self.reference.set(module, version, offload=offload, compact=self._scored_episode())

    def _scored_episode(self) -> bool:
        """A ``blade`` reference (single process) whose scores of the rest of its episode are all cached: it will
        not score again, so off the training device it is kept compact."""
        if self.policy.refresh_mode is not RefreshMode.SYNC or self.parallel is not None:
            return False
        step = self.next_step
        return all(t in self.score_cache for t in range(step, max(self.schedule.episode_end(step), step + 1)))

    def _train_static(self, proxy: nn.Module) -> None:
        with self._timed("refresh"):
            if self.cfg.reference_weights is not None:
                path = self.cfg.reference_weights
                self._set_reference(self.reference.build(proxy, read_weights(path), what=path), 0)
                return
            result = self.refresh_data.train_static(proxy, clone=self.reference.clone)
        self.refresh_log.append(self._refresh_entry(0, 0, result))
        self._set_reference(result.model, 0)

    # --- before each step: refresh, reference scores, kept count -----------------------------
    def _before_step(self, state: State) -> None:
        batch = state.batch
        step = int(batch["step"])
        if step != int(state.timestamp.batch):
            raise RuntimeError(f"data stream is at step {step} but the trainer at {int(state.timestamp.batch)}")
        warm = self.schedule.is_warmup(step)
        episode = self.schedule.episode(step)
        if self.in_process and self.policy.refreshes and self.schedule.refresh_due(step):
            self._refresh(state, episode)
        version = WARMUP_EPISODE
        if self.uses_reference and not warm:
            version = self.schedule.reference_version(step, refreshed=self.policy.refreshes)
            batch["ref_loss"] = torch.from_numpy(self._ref_losses(step, batch, version))
        selecting = not warm
        gamma = self.policy.effective_gamma(self.cfg.gamma) if selecting else 1.0
        if self.parallel is not None:  # global kept count and rows, the full batch for the record
            expected, full = self.parallel.before_step(batch, gamma, self._valid)
            self._pending = _Pending(step, episode, version, selecting, expected, full=full)
            return
        valid = self._valid(batch)
        expected = [
            num_selected(gamma, int(valid[i : i + self.microbatch_size].sum()))
            for i in range(0, valid.shape[0], self.microbatch_size)
        ]
        batch["kept_total"] = int(sum(expected))
        self._pending = _Pending(step, episode, version, selecting, expected)

    @staticmethod
    def _valid(batch: dict[str, Any]) -> Tensor:
        v = batch.get("valid")
        return target_valid(batch["tokens"].cpu(), None if v is None else v.cpu().bool())

    def _ref_losses(self, step: int, batch: dict[str, Any], version: int) -> np.ndarray:
        if self.scored is not None:
            tokens, ref, episodes = self.scored.read(step)
            if self.parallel is not None:  # this rank's rows
                rows = self.parallel.rows(tokens.shape[0])
                tokens, ref, episodes = tokens[rows], ref[rows], episodes[rows]
            if not np.array_equal(tokens.astype(np.int64), batch["tokens"].numpy()):
                raise ValueError(
                    f"{self.scored.path}: the scored sequences of step {step} are not the candidate stream's"
                )
            if (episodes != version).any():
                raise ValueError(
                    f"{self.scored.path}: step {step} was scored by reference version {int(episodes[0])}, "
                    f"the schedule needs version {version} (stale scores)"
                )
            return ref
        if step not in self.score_cache:
            self._precompute(step)
        for old in [s for s in self.score_cache if s < step]:
            del self.score_cache[old]
        return self.score_cache.pop(step)

    def _precompute(self, step: int) -> None:
        """Score the coming steps of the episode with the reference, then offload it."""
        end = self.schedule.episode_end(step)
        if self.cfg.score_lookahead is not None:
            end = min(end, step + self.cfg.score_lookahead)
        with self._timed("score"):
            scorer = self.reference.scorer_on_device()
            for t in range(step, max(end, step + 1)):
                # One step per forward call, so a resumed run scores exactly the same batches.
                tokens = self.stream_data.batch(t)["tokens"]
                if self.parallel is not None:  # each rank scores its own rows
                    tokens = tokens[self.parallel.rows(tokens.shape[0])]
                self.score_cache[t] = scorer(tokens)
                self.counts["score_steps"] += 1
            if self.cfg.offload_reference:
                self.reference.offload(compact=self._scored_episode())

    def _refresh(self, state: State, episode: int) -> None:
        proxy = self._proxy(state)
        for p in proxy.parameters():  # Composer zeroes them (set_to_none) before the step anyway
            p.grad = None
        continue_mode = self.policy.refresh_mode is RefreshMode.CONTINUE
        previous = None
        if continue_mode and self.reference.module is not None and self.ref_version >= 0:
            previous = self.reference.module  # the workspace moves it back to the device (no copy in between)
        else:
            self.reference.drop()  # blade: the old reference is not needed any more
        self.score_cache.clear()
        with self._timed("refresh"):
            result = self.refresh_data.refresh(
                self.policy, proxy, episode, RecentMasks.from_pairs(list(self.recent)), previous=previous,
                optimizer_state=self.reference.optimizer_state_for_refresh() if continue_mode else None,
                workspace=self.reference.workspace, clone=self.reference.clone,
            )
        self.reference.optimizer_state = result.optimizer_state if continue_mode else None
        self.counts["refreshes"] += 1
        self.refresh_log.append(self._refresh_entry(self.schedule.refresh_step(episode), episode, result))
        self._set_reference(result.model, episode, offload=False)

    def _refresh_entry(self, step: int, version: int, result: Any) -> dict[str, Any]:
        return result.log_entry(step=step, version=version)

    # --- after the forward pass: select ------------------------------------------------------
    def _select(self, state: State) -> None:
        pending = self._pending
        assert pending is not None, "AFTER_FORWARD without AFTER_DATALOADER"
        batch = state.batch
        # ℓ(u) from the logits of this forward pass, computed once with the graph and reused by the loss
        # (not timed as selection: a plain step computes the same cross-entropy for its loss).
        losses, valid = _unwrap(state.model).token_losses(state.outputs, batch)
        with self._timed("select"):
            proxy_losses = losses.detach()
            if not bool(torch.isfinite(proxy_losses[valid]).all()):
                raise ValueError(
                    f"step {pending.step}: the proxy's token loss is not finite (training diverged?); "
                    "lower optim.lr or check the model weights"
                )
            rows = proxy_losses.shape[0]
            offset = pending.rows_done
            if self.parallel is not None:
                self._select_across_ranks(pending, batch, proxy_losses, valid)
                return
            if not pending.selecting:
                mask = valid
                scores = torch.full(valid.shape, math.nan, dtype=torch.float32, device=valid.device)
            else:
                gen = None
                if self.policy.needs_generator:
                    seed = int(np.random.SeedSequence([self.cfg.seed, pending.step, offset]).generate_state(1)[0])
                    gen = torch.Generator().manual_seed(seed)
                mask, scores = self.policy.select(
                    proxy_losses, valid, self.cfg.gamma, ref_losses=batch.get("ref_loss"), generator=gen
                )
            k_expected = pending.expected_kept[len(pending.parts)]
            assert int(mask.sum()) == k_expected, (int(mask.sum()), k_expected)
            batch["loss_mask"] = mask
            pending.parts.append({
                "tokens": batch["tokens"].detach().cpu().numpy(),
                "mask": mask.cpu().numpy(),
                "valid": valid.cpu().numpy(),
                "scores": scores.float().cpu().numpy(),
                "sources": list(batch["source"]),
                "sample_ids": batch["sample_id"].cpu().numpy(),
            })
            pending.rows_done += rows

    def _select_across_ranks(self, pending: _Pending, batch: dict[str, Any], proxy_losses: Tensor,
                             valid: Tensor) -> None:
        """Data-parallel: Δ of this rank's rows, the selection of the whole batch, this rank's slice as α."""
        assert pending.full is not None
        sel, part = self.parallel.step(
            self.policy, self.policy.effective_gamma(self.cfg.gamma), seed=self.cfg.seed, step=pending.step,
            selecting=pending.selecting, full=pending.full, proxy_losses=proxy_losses,
            ref_losses=batch.get("ref_loss"), valid=valid)
        assert sel.kept == sum(pending.expected_kept), (sel.kept, pending.expected_kept)
        batch["loss_mask"] = sel.local
        pending.parts.append(part)
        pending.rows_done += proxy_losses.shape[0]

    # --- after the step ----------------------------------------------------------------------
    def _after_step(self, state: State) -> None:
        pending = self._pending
        assert pending is not None and pending.parts, "BATCH_END without a selection"
        parts = pending.parts
        rec = SelectionRecord(
            step=pending.step, episode=pending.episode, ref_version=pending.ref_version,
            tokens=np.concatenate([p["tokens"] for p in parts]), mask=np.concatenate([p["mask"] for p in parts]),
            valid=np.concatenate([p["valid"] for p in parts]), scores=np.concatenate([p["scores"] for p in parts]),
            sources=[s for p in parts for s in p["sources"]],
            sample_ids=np.concatenate([p["sample_ids"] for p in parts]),
        )
        reference = self.reference.for_distance()
        if reference is not None and pending.step % self.distance_interval == 0:
            with self._timed("distance"):
                rec.distance = param_distance(self._proxy(state), reference)
        self.recent.append((pending.step, rec.mask.astype(np.uint8)))
        self.counts["selected_steps"] += int(pending.selecting)
        self.last = rec
        self.next_step = pending.step + 1
        self._pending = None

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if self.timing and self._train_device.type == "cuda":
            torch.cuda.synchronize()
        start = self.clock()
        try:
            yield
        finally:
            if self.timing and self._train_device.type == "cuda":
                torch.cuda.synchronize()
            self.timers[name] += self.clock() - start

    # --- checkpoint state --------------------------------------------------------------------
    def reference_state_dict(self) -> dict[str, Tensor] | None:
        """The current reference ``w̃``'s weights on the CPU (None before the first refresh, and for
        full / random, which have no reference; bfloat16 once compacted, see the module docstring)."""
        return self.reference.state_dict() or self._loaded_reference

    def state_dict(self) -> dict[str, Any]:
        reference = self.reference_state_dict()
        return {
            "repr": repr(self),
            "policy": self.policy.name,
            "schedule": self.schedule.to_dict(),
            "gamma": float(self.cfg.gamma),
            "next_step": int(self.next_step),
            "ref_version": int(self.ref_version),
            "reference": reference,
            "ref_optimizer": self.reference.saved_optimizer_state(),
            # the scores of the rest of the episode (a data-parallel checkpoint is rank 0's: its rows only)
            "scores": {} if self.parallel is not None else {
                int(t): torch.from_numpy(v) for t, v in self.score_cache.items() if t >= self.next_step},
            **recent_state(self.recent),
            "refresh_log": list(self.refresh_log),
            "timers": dict(self.timers),
            "counts": dict(self.counts),
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("policy") != self.policy.name:
            raise ValueError(
                f"checkpoint was written by policy {state.get('policy')!r}, this run uses {self.policy.name!r}"
            )
        same = self.schedule.same_episodes(state.get("schedule") or {})  # total_steps may differ: extended runs
        if not same or float(state.get("gamma", -1)) != float(self.cfg.gamma):
            raise ValueError(
                f"checkpoint schedule {state.get('schedule')} / gamma {state.get('gamma')} differ from this run's "
                f"{self.schedule.to_dict()} / {self.cfg.gamma}: resume with the same selection settings"
            )
        self.next_step = int(state["next_step"])
        self.ref_version = int(state["ref_version"])
        self._loaded_reference = state.get("reference")
        self._loaded_scores = {int(t): v.numpy() for t, v in (state.get("scores") or {}).items()}
        self.reference.optimizer_state = state.get("ref_optimizer")
        restore_recent(self.recent, state)
        self.refresh_log = list(state.get("refresh_log", []))
        self.timers.update(state.get("timers", {}))
        self.counts.update(state.get("counts", {}))
        self._loaded_rng = state.get("rng")
        self.score_cache.clear()
