"""The trainer's own reference ``w̃`` (exact mode without the engine): one owner of its weights, its AdamW state,
where each lives, and the scores of its episode (DESIGN.md §3 "Single process").

After each refresh the new ``w̃`` scores the coming steps of its episode on the training device and is then moved
off it (the paper's offloading). Where its weights are, :attr:`InProcessReference.where`:

* ``DEVICE``: the float32 module on the training device (it scores there; on a CPU it never leaves);
* ``HOST``: the float32 module on the host (it will score again: ``blade-nosync``, which continues from it, a
  ``score_lookahead`` shorter than the episode); ``rho1``'s static reference, which scores every episode, stays on the
  device (it is never moved per episode);
* ``COMPACT``: a bfloat16 copy in one host buffer reused by every refresh
  (:class:`~training.selection.host_buffers.CompactReference`): a ``blade`` reference that has scored its whole
  episode is read only by ``‖u − w̃‖``, checkpoints and ``final/reference.safetensors`` until the next refresh;
* ``NONE``: no reference yet (or ``blade``'s, dropped when a refresh restarts from ``u``).

``blade-nosync`` carries the reference AdamW state from refresh to refresh; where it is,
:attr:`InProcessReference.optimizer_at`: in the refresh workspace's AdamW (``OPTIMIZER``: continued in place), in
one reused host buffer while the reference is off the device (``HOST``:
:class:`~training.selection.host_buffers.HostOptimizerState`), or a checkpoint's, loaded by the next refresh
(``SAVED``). The refresh workspace (:class:`~curation.core.refresh.RefreshWorkspace`: the module and AdamW a
refresh reuses) is parked, not rebuilt, while the reference is off the device.

With a sharded proxy (``parallel.strategy: fsdp``, :mod:`training.blocks.sharding`) the reference is sharded the
same way and stays on the devices: each rank holds its shards of ``w̃`` (and of its AdamW state), never a whole
model; its state dicts are gathered (collectives every rank calls).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from curation.core.distributed import Ranks
from curation.core.host_sync import queues
from curation.core.policies import RefreshMode, SelectionPolicy, get_policy
from curation.core.refresh import CONTINUE, Clone, RefreshStart, RefreshWorkspace
from curation.core.refresh_data import RecentMasks, RefreshData
from curation.core.schedule import WARMUP_EPISODE, Schedule
from curation.core.scorer import TokenLossScorer
from curation.io.models import load_state, read_weights
from schemas.train_config import ModelConfig, TrainConfig
from training.blocks.data import StreamBatches
from training.blocks.meters import Meters
from training.blocks.sharding import (
    full_state_dict,
    gather_optimizer_state,
    is_sharded,
    load_full_state_dict,
    reshard,
    shard_optimizer_state,
    sharded_clone,
)
from training.selection.host_buffers import CompactReference, HostOptimizerState

__all__ = ["ReferenceSettings", "InProcessReference", "Where", "OptimizerAt"]


class Where(StrEnum):
    """Where the reference's weights are (module docstring)."""

    NONE = "none"
    DEVICE = "device"
    HOST = "host"
    COMPACT = "compact"


class OptimizerAt(StrEnum):
    """Where ``blade-nosync``'s carried AdamW state is (module docstring)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    HOST = "host"
    SAVED = "saved"


@dataclass(frozen=True)
class ReferenceSettings:
    """What the in-process reference needs of a run's config (its defaults resolved)."""

    policy: SelectionPolicy
    model: ModelConfig
    precision: str
    score_batch_size: int
    offload: bool
    score_lookahead: int | None = None
    reference_weights: str | None = None

    @classmethod
    def of(cls, cfg: TrainConfig) -> ReferenceSettings:
        s = cfg.selection
        return cls(policy=get_policy(s.policy), model=cfg.model, precision=cfg.precision,
                   score_batch_size=cfg.score_batch_size, offload=s.offload_reference,
                   score_lookahead=s.score_lookahead, reference_weights=s.reference_weights)


class InProcessReference:
    """The in-process reference of one run (module docstring).

    Args:
        settings: the reference's settings.
        refresh: the run's refresh inputs (validation batches, recent masks, refresh settings).
        stream: the candidate stream's full batches (the reference scores the coming steps' rows).
        schedule: the run's schedule (episodes, refresh steps).
        ranks: this process's place in the data-parallel group (each rank scores its own rows).
        meters: the run's timers and counts (``score``, ``refresh``; ``score_steps``, ``refreshes``).
    """

    def __init__(self, settings: ReferenceSettings, refresh: RefreshData, stream: StreamBatches, *,
                 schedule: Schedule, ranks: Ranks, meters: Meters) -> None:
        self.settings = settings
        self.policy = settings.policy
        self.refresh_data = refresh
        self.stream = stream
        self.schedule = schedule
        self.ranks = ranks
        self.meters = meters
        self.version = WARMUP_EPISODE
        self.refresh_log: list[dict[str, Any]] = []
        self.scores: dict[int, np.ndarray] = {}  # ℓ(w̃) of the coming steps of the episode (this rank's rows)
        self.scorer: TokenLossScorer | None = None  # holds the float32 module while there is one
        self.compact = CompactReference()
        self.optimizer_host = HostOptimizerState()
        self.workspace = RefreshWorkspace(keep_optimizer_state=self.continues)
        self.train_device = torch.device("cpu")
        self.sharded = False
        self._saved_optimizer: dict[str, Any] | None = None  # a checkpoint's AdamW state (full tensors)
        self._loaded: dict[str, Any] | None = None  # a checkpoint's weights and scores, until fit start

    @property
    def continues(self) -> bool:
        """``blade-nosync``: each refresh continues the previous reference and its AdamW."""
        return self.policy.refresh_mode is RefreshMode.CONTINUE

    @property
    def module(self) -> nn.Module | None:
        """The float32 module (None before the first reference, and once compacted or dropped)."""
        return None if self.scorer is None else self.scorer.model

    @property
    def where(self) -> Where:
        if self.compact.holds:
            return Where.COMPACT
        if self.module is None:
            return Where.NONE
        on = next(self.module.parameters()).device
        return Where.DEVICE if on.type == self.train_device.type else Where.HOST

    @property
    def optimizer_at(self) -> OptimizerAt:
        if self.optimizer_host.holds:
            return OptimizerAt.HOST
        if self._saved_optimizer is not None:
            return OptimizerAt.SAVED
        opt = self.workspace.optimizer
        return OptimizerAt.OPTIMIZER if self.continues and opt is not None and opt.state else OptimizerAt.NONE

    @property
    def clone(self) -> Clone:
        """How a reference module is built from the proxy (a deep copy; shard by shard when sharded)."""
        return sharded_clone if self.sharded else copy.deepcopy

    # --- the run's operations ----------------------------------------------------------------
    def start(self, proxy: nn.Module, step: int) -> None:
        """At fit start (step ``step``): follow the proxy (its device; sharded or not), then take a checkpoint's
        reference and the scores of the rest of its episode, or train RHO-1's static one."""
        self.train_device = next(proxy.parameters()).device
        self.sharded = is_sharded(proxy)
        loaded, self._loaded = self._loaded, None
        if loaded is not None and loaded["reference"] is not None:
            self.scores = loaded["scores"]
            self.use(self.build(proxy, loaded["reference"]), self.version, step=step)
        elif self.policy.refresh_mode is RefreshMode.STATIC:
            path = self.settings.reference_weights
            with self.meters.timed("refresh", self.train_device):
                if path is not None:
                    self.use(self.build(proxy, read_weights(path), what=path), 0, step=step)
                    return
                result = self.refresh_data.train_static(proxy, clone=self.clone)
            self.refresh_log.append(result.log_entry(step=0, version=0))
            self.use(result.model, 0, step=step)

    def refresh(self, proxy: nn.Module, episode: int, recent: RecentMasks) -> None:
        """Reference ``episode`` from the proxy ``u`` (``blade``: restarting from ``u``; ``blade-nosync``: continuing
        the previous reference and its AdamW); it stays on the device to score the coming steps."""
        for p in proxy.parameters():  # Composer zeroes them (set_to_none) before the step anyway
            p.grad = None
        previous = None
        if self.continues and self.module is not None and self.version >= 0:
            previous = self.module  # the workspace moves it back to the device (no copy in between)
        else:
            self.drop()  # blade: the old reference is not needed any more
        self.scores.clear()
        with self.meters.timed("refresh", self.train_device):
            result = self.refresh_data.refresh(self.policy, proxy, episode, recent, RefreshStart(
                previous=previous, optimizer_state=self._optimizer_for_refresh(), workspace=self.workspace,
                clone=self.clone))
        self.meters.counts["refreshes"] += 1
        self.refresh_log.append(result.log_entry(step=self.schedule.refresh_step(episode), version=episode))
        self.use(result.model, episode, step=None)

    def losses(self, step: int) -> np.ndarray:
        """``ℓ(w̃)`` of this rank's rows of ``step`` (float16): scored with the coming steps of the episode the
        first time one of them is asked for, after which the reference is offloaded."""
        if step not in self.scores:
            self._score_from(step)
        for old in [s for s in self.scores if s < step]:
            del self.scores[old]
        return self.scores.pop(step)

    def _score_from(self, step: int) -> None:
        end = self.schedule.episode_end(step)
        if self.settings.score_lookahead is not None:
            end = min(end, step + self.settings.score_lookahead)
        with self.meters.timed("score", self.train_device):
            if self.module is None:
                raise RuntimeError("no reference module to score with (it was compacted after scoring its episode)")
            scorer = self.scorer.to(self.train_device)
            steps = range(step, max(end, step + 1))
            # One step per forward call, so a resumed run scores exactly the same batches; every forward queued,
            # then one check and one copy back of all of them (TokenLossScorer.score_many: one wait)
            batches = []
            for t in steps:
                tokens = self.stream.batch(t)["tokens"]
                batches.append(tokens[self.ranks.rows(tokens.shape[0])])
            for t, losses in zip(steps, scorer.score_many(batches), strict=True):
                self.scores[t] = losses
                self.meters.counts["score_steps"] += 1
            if self.settings.offload:
                self.offload(compact=self._scored_episode(step))

    def _scored_episode(self, step: int) -> bool:
        """A ``blade`` reference (single process) whose scores of the rest of its episode are all here: it will not
        score again, so off the training device it is kept compact. An episode cut short by ``max_steps`` counts
        whole: its reference stays float32, so a run extended from its checkpoint scores the episode's remaining
        steps with the weights a longer run scored them with."""
        if self.policy.refresh_mode is not RefreshMode.SYNC or self.ranks.world_size > 1:
            return False
        whole = self.schedule.refresh_step(self.schedule.episode(step)) + self.schedule.tau
        return all(t in self.scores for t in range(step, max(whole, step + 1)))

    # --- where the weights and the AdamW state live ------------------------------------------
    def build(self, proxy: nn.Module, weights: Mapping[str, Tensor], *, what: str = "reference weights") -> nn.Module:
        """A reference module with the proxy's architecture and ``weights`` (full tensors, e.g. a checkpoint's):
        on the host, or, sharded, in this rank's shards on the training device (with a checkpoint's gathered
        AdamW state, ``blade-nosync``, loaded into the shards of the workspace's optimizer)."""
        module = self.clone(proxy)
        if not self.sharded:
            module.to("cpu")
            load_state(module, weights, what=what)
            return module
        load_full_state_dict(module, weights, what=what)
        if self._saved_optimizer is not None:  # the next refresh continues it in the workspace's AdamW
            self.workspace.model = module
            params = list(module.parameters())
            self.workspace.adamw(params, shard_optimizer_state(self._saved_optimizer, params))
            self._saved_optimizer = None
        return module

    def use(self, module: nn.Module, version: int, *, step: int | None = None) -> None:
        """Make ``module`` the reference. A freshly refreshed one (``step=None``) stays where it was computed: it
        scores the coming steps there right away and is offloaded after that, so its weights cross to the host once
        per refresh, not there and back. Otherwise (at fit start, step ``step``) it is offloaded now."""
        self.version = version
        if self.scorer is None:  # built where the module is (the scorer moves its model to its device)
            on = next(module.parameters()).device  # (a GPU, or the host-read counter's stand-in for one: queues)
            where = torch.device("cuda") if on.type == "cuda" else on if queues(on) else torch.device("cpu")
            self.scorer = TokenLossScorer(module, device=where, precision=self.settings.precision,
                                          batch_size=self.settings.score_batch_size)
        else:
            self.scorer.model = module.eval()
            for p in module.parameters():
                p.requires_grad_(False)
        self.scorer.version = version
        self.compact.clear()
        if step is None:
            self.scorer.device = next(module.parameters()).device
        elif self.settings.offload:
            self.offload(compact=self._scored_episode(step))
        else:
            self.scorer.to(self.train_device)

    def offload(self, *, compact: bool = False) -> None:
        """Move the module off the training device (a no-op on a CPU and when sharded), or keep it compact
        (``compact``: it will not score again). The refresh workspace keeps its module and AdamW without their
        device memory (parked); a carried AdamW state goes to the host buffer."""
        assert self.module is not None
        if not queues(self.train_device) or self.sharded:
            return
        if self.policy.refresh_mode is RefreshMode.STATIC:
            return  # rho1's static reference scores every episode: it stays on the device, never moved per episode
        if compact:
            self.compact.store(self.module, int(self.scorer.version or 0))
            self.scorer.model = None
        else:
            self.scorer.to("cpu")
        at = self.optimizer_at
        if at in (OptimizerAt.OPTIMIZER, OptimizerAt.SAVED):  # the AdamW moments follow the weights
            self.optimizer_host.store(self.workspace.optimizer.state_dict() if at is OptimizerAt.OPTIMIZER
                                      else self._saved_optimizer)
            self._saved_optimizer = None
        self.workspace.park(weights=compact)

    def drop(self) -> None:
        """Forget the weights (``blade``: a refresh restarts from ``u``)."""
        if self.scorer is not None:
            self.scorer.model = None
        self.compact.clear()

    def _optimizer_for_refresh(self) -> Mapping[str, Any] | str | None:
        """The AdamW state the next refresh starts from (None: a fresh one); a host copy comes back to the device."""
        at = self.optimizer_at
        if not self.continues or at is OptimizerAt.NONE:
            return None
        if at is OptimizerAt.OPTIMIZER:
            return CONTINUE
        if at is OptimizerAt.HOST:
            state = self.optimizer_host.restore()  # new device tensors: the AdamW takes them as they are
            self.optimizer_host.clear()
            return state
        state, self._saved_optimizer = self._saved_optimizer, None
        return state

    # --- what reads w̃ between refreshes ------------------------------------------------------
    def for_distance(self) -> nn.Module | dict[str, Tensor] | None:
        """What ``param_distance`` reads as ``w̃`` (None without a reference; sharded: in its shards)."""
        if self.compact.holds:
            return self.compact.parameters()
        return reshard(self.module) if self.sharded and self.module is not None else self.module

    def weights(self, *, copy: bool = True) -> dict[str, Tensor] | None:
        """``w̃``'s weights on the CPU (bfloat16 once compacted), or None (a checkpoint's until fit start). Sharded:
        gathered to full tensors on rank 0 (``{}`` on the other ranks); a collective every rank calls.

        ``copy=False`` (what is written right away, once the fit is over): no copy, the tensors where they are (views
        into the compact buffer, or the module's own, on its device), so the final save does not hold a second
        reference on the host while the trained weights are copied out (issue 31: +165 MB of a GPU run's peak RSS)."""
        if self.compact.holds:
            return self.compact.state_dict(copy=copy)
        if self.module is not None and self.sharded:
            return full_state_dict(self.module)
        if self.module is not None and not copy:
            return {k: v.detach() for k, v in self.module.state_dict().items()}
        if self.module is not None:
            return {k: v.detach().to("cpu").clone() for k, v in self.module.state_dict().items()}
        return self._loaded["reference"] if self._loaded is not None else None

    def optimizer_state(self) -> dict[str, Any] | None:
        """The carried AdamW state as a checkpoint holds it (sharded: gathered on rank 0, a collective)."""
        at = self.optimizer_at
        if at is OptimizerAt.HOST:
            return self.optimizer_host.state_dict()
        if at is OptimizerAt.SAVED:
            return self._saved_optimizer
        if at is OptimizerAt.OPTIMIZER:
            state = self.workspace.optimizer.state_dict()
            return gather_optimizer_state(state) if self.sharded else state
        return None

    # --- checkpoint state --------------------------------------------------------------------
    def state_dict(self, next_step: int) -> dict[str, Any]:
        """The reference's part of a checkpoint taken before step ``next_step``: its version and weights, the carried
        AdamW state, the refresh log and the scores of the rest of the episode (a single process: a data-parallel
        checkpoint is rank 0's, whose rows are its own; a resumed group re-scores them)."""
        return {
            "ref_version": int(self.version),
            "reference": self.weights(),
            "ref_optimizer": self.optimizer_state(),
            "scores": {} if self.ranks.world_size > 1 else {
                int(t): torch.from_numpy(v) for t, v in self.scores.items() if t >= next_step},
            "refresh_log": list(self.refresh_log),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.version = int(state["ref_version"])
        self.refresh_log = list(state.get("refresh_log", []))
        self._saved_optimizer = state.get("ref_optimizer")
        self.optimizer_host.clear()
        self.scores = {}
        self._loaded = {"reference": state.get("reference"),
                        "scores": {int(t): v.numpy() for t, v in (state.get("scores") or {}).items()}}
