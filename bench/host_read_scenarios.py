"""The host-read counter's scenarios (issue 52; :mod:`bench.host_reads` counts): steady steps of the trainer and the
scoring workers, an episode start, a refresh and a weight load, each on a tiny Llama and a generated corpus, with the
targets they are held to.

* ``trainer_full``, ``trainer_random``, ``trainer_rho1``, ``trainer_blade``, ``trainer_blade_microbatched``: the
  single-process trainer's steady steps (after the warm-up and the episode's start; not the last step, which
  evaluates and checkpoints);
* ``trainer_engine`` (pipelined: the masks read from the engine's parts) and ``trainer_engine_exact`` (its scores):
  the trainer fed by the engine's scoring worker and refresh runner, run in this process (:class:`LocalEngine`:
  their reads are the engine's, not the trainer's); the steps that publish a proxy are left out;
* ``episode_start``: the in-process reference's scoring of an episode (per episode); ``refresh``: a refresh (for
  information: no target);
* ``worker_scored``, ``worker_selected``: a scoring worker's steady steps (a step launched and the one before it
  finished);
* ``weight_load``: one model's new version, loaded into a worker's scorer or taken from a model on the device.

:func:`measure` runs them, :func:`run` reports them (``jobs/bench_host_reads.py``, which only parses its arguments);
:func:`check_target` is what the tests assert.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from composer.core import Callback

from bench.host_reads import KINDS, OWNERS, HostReadCounter, labelled
from curation.core.distributed import Ranks
from curation.core.refresh_data import RecentMasks
from curation.core.schedule import Schedule
from curation.engine.coordinator import Coordinator
from curation.engine.plan import PROXY, REFERENCE, WorkUnit
from curation.engine.refresh_runner import RefreshRunner
from curation.engine.report import EngineProgress, PartInfo
from curation.engine.training_curation import TrainingCuration
from curation.engine.weights import Weights
from curation.engine.workers import BatchOrder, ScoringWorker, WorkerSpec
from curation.ingest.demo import write_demo_corpus
from curation.ingest.prepare import prepare
from curation.io.models import build_causal_lm
from curation.io.shards import shard_dir_info
from schemas.config import PrepareConfig
from schemas.engine_config import CurateAndTrainConfig
from schemas.train_config import TrainConfig, demo_model_config
from training.runs.rank import run_rank
from training.runs.wiring import TrainRun, build_training

__all__ = ["SCENARIOS", "TARGETS", "Figures", "Setting", "LocalEngine", "check_target", "figures", "measure", "run",
           "report_lines", "worker_setup", "trainer_scenario"]


#: Steady-step targets (issue 52): reads per steady step (or per episode, refresh, model and version).
TARGETS = {"trainer_full": 1, "trainer_random": 1, "trainer_rho1": 1, "trainer_blade": 1,
           "trainer_blade_microbatched": 1, "trainer_engine": 1, "trainer_engine_exact": 1, "episode_start": 2,
           "worker_scored": 1, "worker_selected": 1, "weight_load": 2}


@dataclass
class Figures:
    """The reads of one scenario: ``per_step`` (the most of any measured step), by owner, and where."""

    per_step: int
    steps: int
    owners: dict[str, int]
    kinds: dict[str, int]
    sites: list[str]
    pageable: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"per_step": self.per_step, "steps": self.steps, "owners": self.owners, "kinds": self.kinds,
                "sites": self.sites, "pageable": self.pageable}


def figures(counter: HostReadCounter, labels: list[Any]) -> Figures:
    """The worst of the steps ``labels``: its reads by owner and kind, and every site of those steps' reads."""
    groups = counter.by_label()
    worst = max(labels, key=lambda s: len(groups.get(s, [])))
    reads = groups.get(worst, [])
    every = [r for s in labels for r in groups.get(s, [])]
    owners = Counter(r.owner for r in reads)
    kinds = Counter(r.kind for r in reads)
    sites = sorted({f"{r.site} ({r.owner}, {r.kind})" for r in every})
    pageable = sorted({f"{r.site} ({r.owner})" for r in counter.pageable if r.label in labels})
    return Figures(len(reads), len(labels), {o: owners.get(o, 0) for o in OWNERS},
                   {k: kinds[k] for k in KINDS if kinds.get(k)}, sites, pageable)


def check_target(name: str, f: Figures) -> None:
    """Raise ``AssertionError`` naming every site of ``name``'s reads when it reads more than its target."""
    target = TARGETS[name]
    if f.per_step > target:
        raise AssertionError(f"{name}: {f.per_step} host reads in a steady step (target <= {target}), made at: "
                             + "; ".join(f.sites))


@dataclass
class Setting:
    """The scenarios' shared inputs: a generated corpus (prepared once under ``root``) and the tiny model."""

    root: str
    steps: int = 12
    batch_size: int = 4

    def data(self) -> str:
        out = os.path.join(self.root, "data")
        if not os.path.exists(os.path.join(out, "candidates", "index.json")):
            write_demo_corpus(os.path.join(self.root, "raw"),
                              sizes={"target": 60, "general": 60, "noise": 30, "target_val": 30})
            cfg = PrepareConfig.demo_default(self.root)
            prepare(cfg.model_copy(update={"progress": False,
                                           "tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": 512})}))
        return out

    def train_config(self, name: str, policy: str, **updates: Any) -> Any:

        self.data()
        base = TrainConfig.demo_default(self.root).model_dump(mode="json")
        cfg = {
            **base,
            "model": demo_model_config(512, hidden=32, layers=1).model_dump(mode="json"),
            "output_dir": os.path.join(self.root, "runs", name), "batch_size": self.batch_size,
            "max_steps": self.steps, "progress_bar": False, "plots": False, "threads": 1, "device": "auto",
            "selection": {**base["selection"], "policy": policy, "warmup_steps": 2, "tau": 100, "refresh_steps": 2,
                          "refresh_batch_size": 2, "rho1_steps": 2, "refresh_candidate_batches": 2},
            "eval": {**base["eval"], "interval": 1000, "batch_size": 4, "max_batches": 1},
            "checkpoint": {**base["checkpoint"], "interval": 1000, "keep": 1},
        }
        for k, v in updates.items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
        return TrainConfig.model_validate(cfg)


class _StepLabels:
    """A Composer callback that labels the counter's reads with the step being taken (from its dataloader event)."""

    def __new__(cls, counter: HostReadCounter) -> Any:

        class _Labels(Callback):
            def before_dataloader(self, state: Any, logger: Any) -> None:
                counter.label = int(state.timestamp.batch)

            def fit_end(self, state: Any, logger: Any) -> None:
                counter.label = "fit_end"

        return _Labels()


def _steady(total: int, *, first: int, exclude: set[int] = frozenset()) -> list[int]:
    """The steps measured: from ``first`` to the one before the last (which evaluates and checkpoints)."""
    return [s for s in range(first, total - 1) if s not in exclude]


def trainer_scenario(setting: Setting, name: str, policy: str, *, counter_hook: Callable[[Any], None] | None = None,
                     **updates: Any) -> tuple[Figures, HostReadCounter]:
    """A single-process trainer of ``policy``: its steady steps after the warm-up (and the episode's start)."""

    cfg = setting.train_config(name, policy, **updates)
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a new run, not a resumed one
    with HostReadCounter() as counter:
        run = build_training(cfg)
        run.trainer.state.callbacks.insert(0, _StepLabels(counter))
        counter.adopt(run.trainer)
        if counter_hook is not None:
            counter_hook(run)
        counter.label = "fit_start"
        run.fit()
    w = cfg.selection.warmup_steps
    return figures(counter, _steady(cfg.max_steps, first=w + 2)), counter


class LocalEngine:
    """The engine in this process, for the counter (an :class:`~curation.engine.handle.EngineHandle`): the real
    scoring worker and refresh runner of the job's work, run when the trainer asks for a part or publishes a proxy
    (no Ray). Their reads are labelled ``("engine", ...)``: they are not the trainer's."""

    def __init__(self, curation: Any, counter: HostReadCounter) -> None:

        work = curation.work
        self.counter, self.plan = counter, curation.plan
        self.coordinator = Coordinator(work.units)
        self.wait_seconds = 0.0
        self.waits: list[tuple[int, float]] = []
        self.parts: dict[str, PartInfo] = {}
        self.weights: dict[tuple[str, int], Any] = {}
        with labelled(counter, ("engine", "start")):
            self.worker = ScoringWorker(work.worker_spec, 0)
            self.runner = RefreshRunner(work.refresh_spec) if work.refresh_spec is not None else None
            if self.runner is not None and work.refresh_mode.name == "STATIC":
                self.weights[(REFERENCE, 0)] = self.runner.static()[0]

    def wait_part(self, step: int, *, timeout_s: float = 0.0) -> PartInfo:
        unit = self.coordinator.unit_for(step)
        if unit.name not in self.parts:
            with labelled(self.counter, ("engine", step)):
                res = self.worker.run(unit, lambda kind, version: self.weights[(kind, version)])
            self.parts[unit.name] = PartInfo(res.name, unit.first, unit.stop, unit.ref_version)
        return self.parts[unit.name]

    def publish_proxy(self, step: int, model: Any, recent: Any = None) -> None:

        weights = Weights.from_state_dict(model)  # (the trainer's reads: RayEngine does the same)
        self.weights[(PROXY, step)] = weights
        version = self.plan.refresh_sources().get(step)
        if version is not None and self.runner is not None:
            with labelled(self.counter, ("engine", "refresh")):
                self.weights[(REFERENCE, version)] = self.runner.refresh(
                    version, weights, recent or RecentMasks.from_pairs([]), source_step=step,
                    previous=self.weights.get((REFERENCE, version - 1)))[0]

    def reference(self, version: int, *, timeout_s: float = 0.0) -> Any:

        return self.weights[(REFERENCE, version)]

    def trainer_at(self, step: int) -> None:
        pass

    def progress(self) -> EngineProgress:
        return EngineProgress(units_done=len(self.parts), units_total=len(self.coordinator.units), trainer_step=0,
                              redone=0, failed=None, tokens=0, kept_tokens=0)


def engine_scenario(setting: Setting, name: str, mode: str) -> Figures:
    """The trainer fed by the engine's workers (``mode``: pipelined, the engine's masks; exact, its scores), blade."""

    t = setting.train_config(name, "blade")
    shutil.rmtree(t.output_dir, ignore_errors=True)
    cfg = CurateAndTrainConfig.model_validate({
        "train": t.model_dump(mode="json"), "prepare": None,
        "engine": {"mode": mode, "snapshot_period": 4, "lookahead": 100},
        "workers": {"count": 1, "threads": 1, "range_steps": 2}})
    curation = TrainingCuration.of(cfg)
    with HostReadCounter() as counter:
        engine = LocalEngine(curation, counter)

        def ready(run: TrainRun) -> None:  # wired (the engine's sync first among the callbacks), not yet fitted
            run.trainer.state.callbacks.insert(0, _StepLabels(counter))
            counter.adopt(run.trainer)
            counter.label = "fit_start"

        run_rank(t, Ranks(), curation.feed(engine, timeout_s=60.0), ready=ready)  # the engine-fed trainer's one path
    published = {s - 1 for s in curation.plan.publish_steps()}
    return figures(counter, _steady(t.max_steps, first=t.selection.warmup_steps + 2, exclude=published))


def reference_scenario(setting: Setting, phase: str) -> Figures:
    """The in-process reference of a blade run (τ = 4): each episode's scoring (``score``) or each refresh."""

    cfg = setting.train_config(f"reference_{phase}", "blade", selection={"tau": 4}, max_steps=14)  # 3 whole episodes
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    with HostReadCounter() as counter:
        run = build_training(cfg)
        reference = run.algorithm.reference
        method = {"score": "_score_from", "refresh": "refresh"}[phase]
        real = getattr(reference, method)
        episodes = []

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            episodes.append((phase, len(episodes)))
            with labelled(counter, episodes[-1]):
                return real(*args, **kwargs)

        setattr(reference, method, wrapped)
        run.trainer.state.callbacks.insert(0, _StepLabels(counter))
        counter.adopt(run.trainer)
        run.fit()
    return figures(counter, episodes[1:] or episodes)  # (the first refresh also allocates what later ones reuse)


def worker_setup(setting: Setting, output: str) -> tuple[Any, Any, Any]:

    cfg = setting.train_config("worker", "blade")
    cand = shard_dir_info(cfg.data.candidates, "candidate")
    num = cand.manifest.totals().sequences
    spec = WorkerSpec(candidates=cfg.data.candidates, out_dir=os.path.join(setting.root, "runs", f"worker-{output}"),
                      model=cfg.model.architecture, order=BatchOrder("stream", num, cfg.batch_size, 0),
                      vocab_size=cand.vocab_size, policy="blade", gamma=0.5, schedule=Schedule.of(cfg),
                      device="auto", threads=1, needs_proxy=output == "selected")
    shutil.rmtree(spec.out_dir, ignore_errors=True)
    return cfg, spec, num


def worker_scenario(setting: Setting, output: str) -> Figures:
    """A scoring worker's steady steps (a unit of 6 steps after a first unit loaded the weights)."""

    cfg, spec, _ = worker_setup(setting, output)
    weights = {(REFERENCE, 0): Weights.from_state_dict(build_causal_lm(cfg.model.architecture)),
               (PROXY, 2): Weights.from_state_dict(build_causal_lm(cfg.model.architecture))}
    proxy = 2 if output == "selected" else None
    with HostReadCounter() as counter:
        worker = ScoringWorker(spec, 0)
        real = worker._launch

        def launch(unit: Any, step: int, loaded: Any) -> Any:
            counter.label = step  # the step launched (and the one before it, finished after it)
            return real(unit, step, loaded)

        worker._launch = launch
        counter.label = "warm-up"
        worker.run(WorkUnit(2, 4, output, 0, proxy), lambda k, v: weights[(k, v)])
        worker.run(WorkUnit(4, 10, output, 0, proxy), lambda k, v: weights[(k, v)])
    return figures(counter, list(range(5, 9)))  # (step 9's label also holds its own finish, after the last launch)


def weight_load_scenario(setting: Setting) -> Figures:
    """One model's weights of a new version, both ways: loaded into a worker's scorer (after a first version) and
    taken from a model on the device (a proxy publication, a refresh's result)."""

    cfg, spec, _ = worker_setup(setting, "scored")
    versions = [Weights.from_state_dict(build_causal_lm(cfg.model.architecture.model_copy(update={"init_seed": i})))
                for i in range(2)]
    with HostReadCounter() as counter:
        worker = ScoringWorker(spec, 0)
        with labelled(counter, "first"):
            worker.set_weights(REFERENCE, 0, versions[0])
        with labelled(counter, "load"):
            worker.set_weights(REFERENCE, 1, versions[1])
        with labelled(counter, "take"):
            Weights.from_state_dict(worker.scorers[REFERENCE].model)
    return figures(counter, ["load", "take"])


def measure(root: str | None = None, *, only: list[str] | None = None) -> dict[str, Any]:
    """Every scenario's figures (``only``: these), the targets, and whether each is met."""
    with contextlib.ExitStack() as stack:
        if root is None:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="host-reads-"))
        setting = Setting(root)
        out: dict[str, Any] = {"torch": torch.__version__}
        start = time.perf_counter()
        for name, run in SCENARIOS.items():
            if only is not None and name not in only:
                continue
            out[name] = run(setting).to_dict()
        out["seconds"] = round(time.perf_counter() - start, 1)
        out["targets"] = {k: v for k, v in TARGETS.items() if k in out}
        out["met"] = {k: out[k]["per_step"] <= v for k, v in out["targets"].items()}
        out["sites"] = sorted({s for k in SCENARIOS if k in out for s in out[k]["sites"]})
        return out


SCENARIOS: dict[str, Callable[[Setting], Figures]] = {
    "trainer_full": lambda s: trainer_scenario(s, "full", "full")[0],
    "trainer_random": lambda s: trainer_scenario(s, "random", "random")[0],
    "trainer_rho1": lambda s: trainer_scenario(s, "rho1", "rho1")[0],
    "trainer_blade": lambda s: trainer_scenario(s, "blade", "blade")[0],
    "trainer_blade_microbatched": lambda s: trainer_scenario(s, "blade_mb", "blade", microbatch_size=2)[0],
    "trainer_engine": lambda s: engine_scenario(s, "engine_pipelined", "pipelined"),
    "trainer_engine_exact": lambda s: engine_scenario(s, "engine_exact", "exact"),
    "episode_start": lambda s: reference_scenario(s, "score"),
    "refresh": lambda s: reference_scenario(s, "refresh"),
    "worker_scored": lambda s: worker_scenario(s, "scored"),
    "worker_selected": lambda s: worker_scenario(s, "selected"),
    "weight_load": weight_load_scenario,
}


def report_lines(r: dict[str, Any]) -> list[str]:
    """:func:`measure`'s figures as text: each target's scenario (reads per step, met or not, by owner, its sites),
    then the refresh's (no target)."""
    lines = []
    for name, target in r["targets"].items():
        f = r[name]
        lines.append(f"{name}: {f['per_step']} per step (target <= {target}, "
                     f"{'met' if r['met'][name] else 'NOT met'}); by owner {f['owners']}")
        lines += [f"    {site}" for site in f["sites"]]
    if "refresh" in r:
        lines.append(f"refresh: {r['refresh']['per_step']} per refresh; sites {r['refresh']['sites']}")
    return lines


def run(root: str | None = None, *, only: list[str] | None = None, as_json: bool = False) -> int:
    """``jobs/bench_host_reads.py``: :func:`measure`, printed as one JSON line (``as_json``) or as text
    (:func:`report_lines`); 0 when every target is met, else 1."""
    r = measure(root, only=only)
    print(json.dumps(r) if as_json else "\n".join(report_lines(r)), flush=True)
    return 0 if all(r["met"].values()) else 1
