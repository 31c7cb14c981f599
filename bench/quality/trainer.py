"""The quality benchmark's runs as configs: what every stage trains (``Runs``, the arms of each setting, the
choices) and the one place their configs are built (``Trainer``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from bench.quality.compute import loss_at
from bench.quality.pool import Job, run_jobs
from bench.quality.recorded import Checks, Recorded, same_choice
from bench.quality.runs import Evaluator, final_val
from bench.quality.setting import (
    POLICIES,
    RECORDED_ARMS,
    SETTINGS,
    Setting,
    arm_policy,
    eval_sources,
    model_config,
)
from curation.io.models import build_causal_lm
from schemas.train_config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    ReplayConfig,
    SelectionConfig,
    TrainConfig,
)

__all__ = ["FAMILIES", "Runs", "Trainer", "count_parameters", "sweep_choice", "arms_of", "reuse_policies",
           "run_prefix", "pool_of", "curve_steps", "start_model", "evaluator", "score_means", "target_extra_steps"]

#: the families of choices: (family, the arms that take its choice)
FAMILIES = {"blade": ("blade", "blade-nosync"), "rho1": ("rho1",), "full+val": ("full+val",)}


def count_parameters(mcfg: ModelConfig) -> int:
    """Parameters of a model config (tied weights counted once)."""
    return sum(p.numel() for p in build_causal_lm(mcfg).parameters())


def sweep_choice(curves: list[list[tuple[float, float]]]) -> tuple[int, float, list[float]]:
    """The refresh candidate chosen at equal compute: each candidate's (FLOPs, dev loss) curve read at
    the budget of the cheapest candidate's whole run; returns (chosen index, budget, loss of each)."""
    budget = min(c[-1][0] for c in curves)
    losses = [loss_at(c, budget) for c in curves]
    if any(v is None for v in losses):
        raise ValueError(f"a sweep curve does not reach back to the budget {budget:.3g}")
    return min(range(len(curves)), key=lambda i: losses[i]), budget, losses


@dataclass
class Runs:
    """Everything trained, as recorded results (``bench.quality.runs``), and the recorded report's arms used."""

    s: Setting
    out: str
    tokenizer: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # prepare results by name
    bases: dict[str, dict[str, Any]] = field(default_factory=dict)  # "proxy" / "target" → result (+ params)
    # every candidate of every choice: setting, family ("blade", "rho1", "full+val"), its selection setting, run
    # (None: from the recorded report), dev curve, chosen, ...
    sweep: list[dict[str, Any]] = field(default_factory=list)
    budgets: dict[str, dict[str, float]] = field(default_factory=dict)  # setting → family → equal-compute FLOPs
    # setting → family → the chosen selection setting ("full+val": {"validation_share": x})
    best: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    dev_base: float | None = None  # the proxy base's dev loss (every dev curve's first point)
    # setting → arm → result per seed (arms taken from the recorded report are absent)
    main: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    eq_steps: dict[str, dict[str, int]] = field(default_factory=dict)  # setting → full's steps at each arm's FLOPs
    # setting → {"full": [per seed], "full+val": [per seed] (its settings), "replays": {policy: [per seed]}}
    reuse: dict[str, dict[str, Any]] = field(default_factory=dict)
    target_steps: int = 0  # target full's length
    recorded: Recorded | None = None
    recorded_differences: list[str] = field(default_factory=list)  # preset settings unlike the recorded run's
    checks: Checks = field(default_factory=Checks)
    trained_recorded: bool = False  # the recorded arms were trained after all (a check failed)

    def recorded_ok(self) -> bool:
        """Whether the recorded report's arms may stand in (same settings, every float check so far equal)."""
        return self.recorded is not None and not self.recorded_differences and self.checks.passed \
            and not self.trained_recorded

    def uses_recorded(self, setting: str, arm: str, *, replay: bool = False) -> bool:
        """Whether an arm of a setting (or its replay) comes from the recorded report: it is one of the
        RECORDED_ARMS, recorded there, trains with the recorded choice in this setting, and the checks pass."""
        rec = self.recorded
        if arm not in RECORDED_ARMS or not self.recorded_ok() or not rec.has(setting, arm):
            return False
        if replay and not rec.has_replay(setting, arm):
            return False
        fam = "rho1" if arm == "rho1" else "blade"
        return arm == "random" or same_choice(fam, self.best[setting][fam], rec.best(setting)[fam])

    def selection(self, setting: str, arm: str) -> dict[str, Any]:
        """The SelectionConfig keys an arm trains with in a setting (besides the shared ones)."""
        best = self.best.get(setting, {})
        if arm in ("blade", "blade-nosync"):
            return dict(best["blade"])
        if arm == "rho1":
            return dict(best["rho1"])
        if arm == "blade-lam1":
            return dict(self.s.lam1)
        return {}

    def validation_share(self, setting: str, arm: str) -> float:
        return self.best[setting]["full+val"]["validation_share"] if arm == "full+val" else 0.0


def arms_of(s: Setting, setting: str) -> tuple[str, ...]:
    """The arms run in a setting (``full+val`` only in ``full_val_settings``)."""
    return tuple(p for p in POLICIES if p != "full+val" or setting in s.full_val_settings)


def reuse_policies(s: Setting, setting: str) -> tuple[str, ...]:
    """The policies whose shards the target replays in a setting."""
    return s.reuse_policies if setting == SETTINGS[0] else s.paper_reuse_policies


def run_prefix(setting: str) -> str:
    """The run names' prefix of a setting: none for the first (its runs keep the single-setting names)."""
    return "" if setting == SETTINGS[0] else f"{setting}-"


def pool_of(setting: str) -> str:
    return "pool" if setting == SETTINGS[0] else "pool-paper"


def curve_steps(interval: int, last: int) -> set[int]:
    return set(range(interval, last + 1, interval)) | {last}


# relative time per step, to start a stage's longest runs first: a target step ≈ 3 proxy steps at 1 thread (322
# against 110 ms), a refresh adds ≈ 0.6 of a step at K/τ = 0.3 (more with λ ≠ 0), RHO-1's reference trains once
_COST = {"full": 1.0, "random": 0.9, "rho1": 1.2, "blade": 1.6, "blade-nosync": 1.6}
_TARGET_COST = 3.0


class Trainer:
    """Builds the configs of the benchmark's runs and runs them (one place for the shared settings)."""

    def __init__(self, runs: Runs):
        self.r, self.s = runs, runs.s

    def config(self, name: str, *, policy: str, seed: int, mcfg: ModelConfig, data: str = "pool",
               steps: int | None = None, batch: int | None = None, lr: float | None = None,
               eval_interval: int | None = None, write_selected: bool = False, threads: int | None = None,
               validation_share: float = 0.0, **sel: Any) -> TrainConfig:
        s, dirs = self.s, self.r.data
        sel = {"policy": policy, "gamma": s.gamma, "warmup_steps": s.warmup, "tau": s.tau, "rho1_steps": s.rho1_steps,
               "seed": seed, **sel}
        n = steps or s.steps
        return TrainConfig(
            data=DataConfig(candidates=dirs[data].dirs["candidates"], validation=dirs[data].dirs["validation"],
                            tokenizer=self.r.tokenizer, validation_share=validation_share),
            model=mcfg, selection=SelectionConfig(**sel), optim=OptimConfig(lr=lr or s.lr),
            eval=EvalConfig(interval=eval_interval or s.eval_interval, batch_size=32, max_batches=s.eval_batches),
            checkpoint=CheckpointConfig(interval=min(n, s.checkpoint_interval or n), keep=1),
            output_dir=os.path.join(self.r.out, "runs", name), batch_size=batch or s.batch, max_steps=n, seed=seed,
            threads=threads or s.threads, precision=s.precision, progress_bar=False, plots=False,
            write_selected=write_selected,
            distance_interval=max(1, s.tau // 10),
        )

    def job(self, name: str, snapshots: set[int] | tuple[int, ...] = (), **kw: Any) -> Job:
        cfg = self.config(name, **kw)
        target = cfg.model.hf_config["hidden_size"] == self.s.target_hidden and self.s.target_hidden != self.s.hidden
        sel = cfg.selection
        cost = _COST[sel.policy] + (0.3 if sel.policy.startswith("blade") and sel.lam else 0.0)
        return Job(name, cfg, os.path.join(self.r.out, "runs", name, "result.json"), tuple(sorted(snapshots)),
                   cfg.max_steps * (_TARGET_COST if target else 1.0) * cost)

    def arm_job(self, setting: str, arm: str, seed: int, name: str | None = None, **kw: Any) -> Job:
        """A proxy run of an arm in a setting (``kw``: steps, snapshots, write_selected, ...)."""
        return self.job(name or f"{run_prefix(setting)}{arm}-seed{seed}", policy=arm_policy(arm), seed=seed,
                        mcfg=start_model(self.r), data=pool_of(setting),
                        validation_share=self.r.validation_share(setting, arm), **self.r.selection(setting, arm), **kw)

    def run_all(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """Independent runs, ``parallel_runs`` at a time; their results in the order of ``jobs``."""
        return run_jobs(jobs, self.s.parallel_runs, self.report)

    @staticmethod
    def report(job: Job, res: dict[str, Any], seconds: float) -> None:
        speed = "" if isinstance(job.cfg, ReplayConfig) else \
            f", {res['step_seconds'] * 1e3:.0f} ms/step ({res.get('step_clock', 'process CPU')})"
        print(f"[run] {job.name}: val {final_val(res):.3f}{speed} ({f'{seconds:.0f}s' if seconds else 'recorded'})",
              flush=True)

    def replay_job(self, name: str, selected: str, mcfg: ModelConfig, snapshots: set[int]) -> Job:
        s = self.s
        cfg = ReplayConfig(
            selected=selected, validation=self.r.data["pool"].dirs["validation"], tokenizer=self.r.tokenizer,
            model=mcfg, optim=OptimConfig(lr=s.target_lr),
            eval=EvalConfig(interval=s.target_eval_interval or s.eval_interval, batch_size=32, max_batches=s.eval_batches),
            checkpoint=CheckpointConfig(interval=min(s.steps, s.checkpoint_interval or s.steps), keep=1),
            output_dir=os.path.join(self.r.out, "runs", name), batch_size=s.batch, epochs=1, threads=s.threads,
            precision=s.precision, progress_bar=False,
        )
        return Job(name, cfg, os.path.join(self.r.out, "runs", name, "result.json"), tuple(sorted(snapshots)),
                   s.steps * _TARGET_COST)


def start_model(r: Runs, role: str = "proxy") -> ModelConfig:
    return model_config(r.s, target=role == "target", weights=r.bases[role]["final_weights"])


def score_means(scores: dict[str, Any]) -> dict[str, float]:
    return {k: v.mean for k, v in scores.items()}


def evaluator(r: Runs) -> Evaluator:
    s = r.s
    return Evaluator(r.out, r.tokenizer, eval_sources(s), max_len=s.seq_len, threads=s.threads, parallel=s.parallel_runs)


def target_extra_steps(s: Setting, selections: list[float], base: float, per_step: float) -> int:
    """Target ``full``'s steps beyond ``steps``: to the equal total compute of the costliest reused selection with
    the proxy's base charged, amortized over the smallest R, so that every R is decided."""
    if s.target_extra_steps is not None:
        return s.target_extra_steps
    return math.ceil((max([0.0, *selections]) + base) / min(s.reuse_runs) / per_step)


