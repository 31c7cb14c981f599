"""The quality benchmark's training, in stages that each reuse what an earlier invocation finished:

1. ``data``: the pool (+ target validation; trains the tokenizer), the paper setting's pool (no GSM8K train)
   and the base text (+ base validation);
2. ``bases``: the proxy's base model, pretrained from scratch on the general base text for a set number of tokens
   per parameter (at most ``MAX_EPOCHS`` passes); the target's, likewise, trains in the ``main`` stage beside its
   runs (it is needed only from ``reuse`` on; alone it would leave one core idle, and beside the sweep's few runs
   it outlasted them);
3. ``sweep``: blade (seed 0) with each refresh setting and rho1 (seed 0) with each reference length; in each
   family the one with the lowest *dev* loss at equal compute (the cheapest candidate's FLOPs) is chosen;
4. ``main``: ``full``, ``random``, ``rho1``, ``blade`` and ``blade-nosync`` for ``steps`` proxy steps, every seed,
   in both settings (``full`` runs on to the FLOPs of the costliest policy, with snapshots at each policy's
   equal-compute step);
5. ``reuse``: for seeds < ``reuse_seeds`` in both settings, the target continued from its base on that seed's
   selected shards of each reused policy, and the target's ``full`` of the same seed for as long as the
   equal-total-compute points need (``target_extra_steps``).

Every run saves snapshots along the way (curves on the target evaluation set). :func:`train_all` runs the
stages up to ``until`` and returns the finished runs; ``bench.quality.analysis`` evaluates them.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from bench.quality.compute import base_flops, equal_compute_steps, loss_at, run_flops, selection_flops
from bench.quality.pool import Job, run_jobs
from bench.quality.runs import REUSED, Evaluator, final_val, same_training
from bench.quality.setting import (
    MAX_EPOCHS,
    POLICIES,
    SETTINGS,
    Setting,
    data_configs,
    dev_source,
    eval_sources,
    forward_flops,
    model_config,
    run_shape,
)
from curation.ingest.prepare import prepare
from curation.io.atomic import atomic_write_text
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

__all__ = ["STAGES", "Runs", "StageClock", "train_all", "count_parameters", "sweep_choice", "target_extra_steps",
           "run_prefix"]

STAGES = ("data", "bases", "sweep", "main", "reuse")


def _cpu() -> float:
    """CPU seconds of this process and of its ended child processes (a stage's parallel runs: their CPU counts
    once their pool has closed, at the stage's end)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


class StageClock:
    """Wall and process-CPU seconds per stage, added up over the invocations that ran it
    (``out/stage_times.json``, flushed every :attr:`PERIOD` s so a killed piece keeps most of its time).

    Time the process spent stopped (``SIGSTOP``, e.g. paused while a shared machine runs something else) is not
    the stage's: the monotonic clock counts it, so a flush that comes more than :attr:`STOPPED_AFTER` seconds after
    the previous one counts its interval beyond one period as ``stopped`` (kept beside ``wall``, not in it)."""

    PERIOD = 30.0
    STOPPED_AFTER = 90.0  # three periods late: only a stopped (or suspended) process is that late

    def __init__(self, out: str):
        self.path = os.path.join(out, "stage_times.json")
        self.times: dict[str, dict[str, float]] = json.load(open(self.path)) if os.path.exists(self.path) else {}
        self._lock = threading.Lock()
        self._open: tuple[str, float, float] | None = None

    def _flush(self, final: bool = False, now: float | None = None) -> None:
        with self._lock:
            if self._open is None:
                return
            name, t0, c0 = self._open
            now, cpu = time.perf_counter() if now is None else now, _cpu()
            entry = self.times.setdefault(name, {"wall": 0.0, "cpu": 0.0, "pieces": 0})
            gap = now - t0
            stopped = gap - self.PERIOD if gap > self.STOPPED_AFTER else 0.0
            entry["wall"] += gap - stopped
            entry["cpu"] += cpu - c0
            if stopped:
                entry["stopped"] = entry.get("stopped", 0.0) + stopped
            if final:
                entry["pieces"] += 1
                self._open = None
            else:
                self._open = (name, now, cpu)
            atomic_write_text(self.path, json.dumps(self.times, indent=1))

    def stage(self, name: str):
        clock = self

        class _Stage:
            def __enter__(self):
                clock._open = (name, time.perf_counter(), _cpu())
                stop = threading.Event()
                self._stop = stop

                def tick():
                    while not stop.wait(clock.PERIOD):
                        clock._flush()

                self._thread = threading.Thread(target=tick, daemon=True)
                self._thread.start()

            def __exit__(self, *exc):
                self._stop.set()
                self._thread.join()
                clock._flush(final=True)
                return False

        return _Stage()


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
    """Everything trained, as recorded results (``bench.quality.runs``)."""

    s: Setting
    out: str
    tokenizer: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # prepare results by name
    bases: dict[str, dict[str, Any]] = field(default_factory=dict)  # "proxy" / "target" → result (+ params)
    sweep: list[dict[str, Any]] = field(default_factory=list)  # per blade candidate: setting, run, dev curve, …
    rho1_sweep: list[dict[str, Any]] = field(default_factory=list)  # per reference length: the same
    best: dict[str, Any] = field(default_factory=dict)  # the chosen refresh setting (+ the chosen rho1_steps)
    sweep_budget: float | None = None
    rho1_budget: float | None = None
    dev_base: float | None = None  # the proxy base's dev loss (every dev curve's first point)
    # setting → policy → result per seed
    main: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    eq_steps: dict[str, int] = field(default_factory=dict)  # full's steps at each policy's FLOPs
    # setting → {"full": [result per seed], "replays": {policy: [result per seed]}}
    reuse: dict[str, dict[str, Any]] = field(default_factory=dict)
    target_steps: int = 0  # target full's length


def _curve_steps(interval: int, last: int) -> set[int]:
    return set(range(interval, last + 1, interval)) | {last}


# relative time per step, to start a stage's longest runs first: a target step ≈ 3 proxy steps at 1 thread (322
# against 110 ms), a refresh adds ≈ 0.6 of a step at K/τ = 0.3, RHO-1's reference trains once
_COST = {"full": 1.0, "random": 0.9, "rho1": 1.2, "blade": 1.6, "blade-nosync": 1.6}
_TARGET_COST = 3.0


class _Trainer:
    """Builds the configs of the benchmark's runs and runs them (one place for the shared settings)."""

    def __init__(self, runs: Runs):
        self.r, self.s = runs, runs.s

    def config(self, name: str, *, policy: str, seed: int, mcfg: ModelConfig, data: str = "pool",
               steps: int | None = None, batch: int | None = None, lr: float | None = None,
               eval_interval: int | None = None, write_selected: bool = False, threads: int | None = None,
               **sel: Any) -> TrainConfig:
        s, dirs = self.s, self.r.data
        sel = {**dict(policy=policy, gamma=s.gamma, warmup_steps=s.warmup, tau=s.tau, rho1_steps=s.rho1_steps,
                      seed=seed), **self.r.best, **sel}
        n = steps or s.steps
        return TrainConfig(
            data=DataConfig(candidates=dirs[data].dirs["candidates"], validation=dirs[data].dirs["validation"],
                            tokenizer=self.r.tokenizer),
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
        cost = cfg.max_steps * (_TARGET_COST if target else 1.0) * _COST[cfg.selection.policy]
        return Job(name, cfg, os.path.join(self.r.out, "runs", name, "result.json"), tuple(sorted(snapshots)), cost)

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


def _stage_data(r: Runs) -> None:
    for name, pcfg in data_configs(r.s, r.out).items():
        atomic_write_text(os.path.join(r.out, "configs", f"prepare_{name}.yaml"),
                          yaml.safe_dump(pcfg.model_dump(mode="json"), sort_keys=False))
        r.data[name] = prepare(pcfg)
        print(f"[data] {name}: " + ", ".join(f"{k} {m.totals().sequences} seq ({m.totals().tokens} tokens)"
                                             for k, m in r.data[name].manifests.items()), flush=True)
    r.tokenizer = r.data["pool"].tokenizer.path


def _base_job(r: Runs, t: _Trainer, role: str) -> tuple[Job, dict[str, Any]]:
    """The proxy's or the target's base pretraining run on the general text, and what its record adds."""
    s = r.s
    sequences = r.data["base"].manifests["candidates"].totals().sequences
    tpp = s.base_tokens_per_parameter if role == "proxy" else s.target_base_tokens_per_parameter
    mcfg = model_config(s, target=role == "target")
    params = count_parameters(mcfg)
    steps = math.ceil(tpp * params / (s.base_batch * s.seq_len))
    epochs = steps * s.base_batch / sequences
    if epochs > MAX_EPOCHS:
        raise ValueError(f"the {role} base at {tpp} tokens per parameter needs {epochs:.2f} passes over the base "
                         f"text ({sequences} sequences), more than MAX_EPOCHS = {MAX_EPOCHS}")
    # the proxy's base trains alone, with base_threads; the target's beside the main runs, with theirs (whatever
    # parallel_runs is, so that the result does not depend on it)
    threads = s.base_threads if role == "proxy" else s.threads
    job = t.job(f"base-{role}", policy="full", seed=0, data="base", mcfg=mcfg, steps=steps, batch=s.base_batch,
                lr=s.base_lr, eval_interval=s.base_eval_interval, threads=threads)
    tokens = steps * s.base_batch * s.seq_len
    return job, {"parameters": params, "tokens": tokens, "tokens_per_parameter": tokens / params, "epochs": epochs,
                 "unique_tokens": sequences * s.seq_len,
                 "flops": base_flops(forward_flops(s, target=role == "target"), tokens)}


def _stage_bases(r: Runs, t: _Trainer) -> None:
    """The proxy's base, which the sweep starts from (the target's base trains in the main stage, beside its runs)."""
    job, meta = _base_job(r, t, "proxy")
    r.bases["proxy"] = {**t.run_all([job])[0], **meta}  # alone: trained in this process


def _start(r: Runs, role: str = "proxy") -> ModelConfig:
    return model_config(r.s, target=role == "target", weights=r.bases[role]["final_weights"])


def _dev_curve(r: Runs, ev: Evaluator, res: dict[str, Any], policy: str, sel: dict[str, Any]) -> list[tuple[float, float]]:
    """(FLOPs, dev loss) of a sweep run: the base at 0, then each snapshot."""
    shape, small = run_shape(r.s), model_config(r.s)
    dev = dev_source(r.s)
    pts = [(0.0, r.dev_base)]
    for n in sorted(int(k) for k in res["snapshots"]):
        loss = ev(f"{res['name']}@{n}", small, res["snapshots"][str(n)], sets=(), extra=(dev,))[dev.name].mean
        pts.append((run_flops(shape, policy, n, sel).total, loss))
    return pts


def _stage_sweep(r: Runs, t: _Trainer) -> None:
    """BLADE's refresh settings and RHO-1's reference lengths, each chosen at equal compute on the dev split."""
    s, shape = r.s, run_shape(r.s)
    snaps = _curve_steps(s.curve_interval, s.steps)
    ev = Evaluator(r.out, r.tokenizer, eval_sources(s), max_len=s.seq_len, threads=s.threads, parallel=s.parallel_runs)
    dev = dev_source(s)
    r.dev_base = ev("base-proxy", model_config(s), r.bases["proxy"]["final_weights"], sets=(), extra=(dev,))[dev.name].mean
    done = t.run_all([t.job(f"sweep{i}-blade", policy="blade", seed=0, mcfg=_start(r), write_selected=True,
                            snapshots=snaps, **cand) for i, cand in enumerate(s.sweep)])
    curves = lambda: [_dev_curve(r, ev, res, "blade", cand) for cand, res in zip(s.sweep, done, strict=True)]  # noqa: E731
    ev.prefetch(curves)
    for cand, res, curve in zip(s.sweep, done, curves(), strict=True):
        r.sweep.append({"policy": "blade", "setting": dict(cand), "run": res, "curve": curve,
                        "val_loss": final_val(res), "flops": run_flops(shape, "blade", s.steps, cand).as_dict()})
    _choose(r, r.sweep, "sweep_budget")
    r.best = dict(next(c["setting"] for c in r.sweep if c["chosen"]))
    # RHO-1's reference trains with the refresh's η_w and batch (ref_lr, refresh_batch_size): the length sweep runs
    # with BLADE's chosen setting, as the main stage's rho1 runs do, so that its chosen run is their seed 0
    done = t.run_all([t.job(f"sweep-rho1-{n}", policy="rho1", seed=0, mcfg=_start(r), write_selected=True,
                            snapshots=snaps, rho1_steps=n) for n in s.rho1_sweep])
    sels = [{**r.best, "rho1_steps": n} for n in s.rho1_sweep]
    curves = lambda: [_dev_curve(r, ev, res, "rho1", sel) for sel, res in zip(sels, done, strict=True)]  # noqa: E731
    ev.prefetch(curves)
    for n, res, sel, curve in zip(s.rho1_sweep, done, sels, curves(), strict=True):
        cand = {"rho1_steps": n}
        r.rho1_sweep.append({"policy": "rho1", "setting": cand, "run": res, "curve": curve,
                             "val_loss": final_val(res), "flops": run_flops(shape, "rho1", s.steps, sel).as_dict()})
    _choose(r, r.rho1_sweep, "rho1_budget")
    r.best["rho1_steps"] = next(c["setting"]["rho1_steps"] for c in r.rho1_sweep if c["chosen"])
    print(f"[sweep] chosen at equal compute on the dev split: {r.best}", flush=True)


def _choose(r: Runs, rows: list[dict[str, Any]], budget_attr: str) -> None:
    """Mark the candidate of one family with the lowest dev loss at the cheapest candidate's FLOPs as chosen."""
    chosen, budget, losses = sweep_choice([c["curve"] for c in rows])
    setattr(r, budget_attr, budget)
    for c, v in zip(rows, losses, strict=True):
        c["dev_at_budget"] = v
        c["chosen"] = c is rows[chosen]


def _reuse_policies(s: Setting, setting: str) -> tuple[str, ...]:
    return s.reuse_policies if setting == SETTINGS[0] else s.paper_reuse_policies


def run_prefix(setting: str) -> str:
    """The run names' prefix of a setting: none for the first (its runs keep the single-setting names)."""
    return "" if setting == SETTINGS[0] else f"{setting}-"


def _stage_main(r: Runs, t: _Trainer) -> None:
    s, shape = r.s, run_shape(r.s)
    r.eq_steps = {p: equal_compute_steps(shape, p, s.steps, r.best) for p in POLICIES}
    snaps = _curve_steps(s.curve_interval, s.steps)
    # a chosen sweep run is the first setting's seed-0 run of its policy when it trained exactly as that run would
    # (same data, model, schedule, selection and seed; its name, snapshots and progress output aside)
    chosen = {"blade": next(c["run"] for c in r.sweep if c["chosen"]),
              "rho1": next(c["run"] for c in r.rho1_sweep if c["chosen"])}
    slots: list[tuple[str, str, dict[str, Any] | int]] = []  # (setting, policy, a result or an index into jobs)
    jobs: list[Job] = []
    for setting in SETTINGS:
        data, pre, reused = ("pool" if setting == SETTINGS[0] else "pool-paper"), run_prefix(setting), _reuse_policies(s, setting)
        for seed in range(s.seeds):
            full_snaps = snaps | set(r.eq_steps.values())
            slots.append((setting, "full", len(jobs)))
            jobs.append(t.job(f"{pre}full-seed{seed}", policy="full", seed=seed, mcfg=_start(r), data=data,
                              steps=max(full_snaps), snapshots=full_snaps))
            for p in POLICIES[1:]:
                kw = dict(policy=p, seed=seed, mcfg=_start(r), data=data, snapshots=snaps,
                          write_selected=seed < s.reuse_seeds and p in reused)
                if p in chosen and seed == 0 and setting == SETTINGS[0]:
                    own = t.config(f"{pre}{p}-seed{seed}", **{k: v for k, v in kw.items() if k != "snapshots"})
                    if same_training(chosen[p]["config"], own.model_dump(mode="json")):
                        slots.append((setting, p, chosen[p]))
                        continue
                    print(f"[main] {p}-seed0: the chosen sweep run trained otherwise; training it", flush=True)
                slots.append((setting, p, len(jobs)))
                jobs.append(t.job(f"{pre}{p}-seed{seed}", **kw))
    # the target's base, needed only from the reuse stage on, trains beside these runs: started first (the longest
    # run), it fills one slot while the main runs take turns in the other, then both
    tjob, tmeta = _base_job(r, t, "target")
    tres, *done = t.run_all([tjob, *jobs])
    r.bases["target"] = {**tres, **tmeta}
    for setting in SETTINGS:
        r.main[setting] = {p: [] for p in POLICIES}
    for setting, p, res in slots:  # seeds in order within each (setting, policy)
        r.main[setting][p].append(done[res] if isinstance(res, int) else res)


def target_extra_steps(s: Setting, selections: list[float], base: float, per_step: float) -> int:
    """Target ``full``'s steps beyond ``steps``: to the equal total compute of the costliest selection with the
    proxy's base charged, amortized over the second-smallest R (the smallest R's point, further out, is compared
    with ``full``'s last snapshot: a bound)."""
    if s.target_extra_steps is not None:
        return s.target_extra_steps
    runs = sorted(s.reuse_runs)
    r2 = runs[1] if len(runs) > 1 else runs[0]
    return math.ceil((max([0.0, *selections]) + base) / r2 / per_step)


def _stage_reuse(r: Runs, t: _Trainer) -> None:
    s = r.s
    shape, tshape = run_shape(s), run_shape(s, target=True)
    per_step = run_flops(tshape, "full", 1).total
    sels = [selection_flops(shape, p, s.steps, r.best) for p in {*s.reuse_policies, *s.paper_reuse_policies}]
    extra = target_extra_steps(s, sels, r.bases["proxy"]["flops"], per_step)
    r.target_steps = s.steps + extra  # snapshots every target_curve_interval steps and at the end
    start = _start(r, "target")
    jobs: list[Job] = []
    for setting in SETTINGS:
        data, pre = ("pool" if setting == SETTINGS[0] else "pool-paper"), run_prefix(setting)
        for seed in range(s.reuse_seeds):
            jobs.append(t.job(
                f"{pre}target-full-seed{seed}", policy="full", seed=seed, mcfg=start, data=data, steps=r.target_steps,
                lr=s.target_lr, eval_interval=s.target_eval_interval, snapshots=_curve_steps(s.target_curve_interval, r.target_steps) | {s.steps}))
            for p in _reuse_policies(s, setting):
                selected = r.main[setting][p][seed]["summary"]["selected_dir"]
                jobs.append(t.replay_job(f"{pre}target-replay-{p}-seed{seed}", selected, start,
                                         _curve_steps(s.target_curve_interval, s.steps)))
    done = iter(t.run_all(jobs))
    for setting in SETTINGS:  # the jobs' order
        entry = r.reuse[setting] = {"full": [], "replays": {p: [] for p in _reuse_policies(s, setting)}}
        for _seed in range(s.reuse_seeds):
            entry["full"].append(next(done))
            for p in entry["replays"]:
                entry["replays"][p].append(next(done))


def train_all(s: Setting, out: str, *, until: str | None = None) -> Runs:
    """Run (or reuse) every stage up to and including ``until`` (default: all)."""
    if until is not None and until not in STAGES:
        raise ValueError(f"until must be one of {', '.join(STAGES)}, got {until!r}")
    REUSED.clear()  # counted per invocation
    import torch

    torch.set_num_threads(s.all_threads)
    os.makedirs(os.path.join(out, "configs"), exist_ok=True)
    runs, clock = Runs(s=s, out=out), StageClock(out)
    trainer = _Trainer(runs)
    steps = {"data": lambda: _stage_data(runs), "bases": lambda: _stage_bases(runs, trainer),
             "sweep": lambda: _stage_sweep(runs, trainer), "main": lambda: _stage_main(runs, trainer),
             "reuse": lambda: _stage_reuse(runs, trainer)}
    for name in STAGES:
        with clock.stage(name):
            steps[name]()
        if name == until:
            break
    return runs
