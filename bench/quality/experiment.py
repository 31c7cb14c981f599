"""The quality benchmark's training, in stages that each reuse what an earlier invocation finished:

1. ``data``: the pool (+ target validation; trains the tokenizer), the paper setting's pool (no GSM8K train)
   and the base text (+ base validation);
2. ``bases``: the proxy's base model, pretrained from scratch on the general base text for a set number of tokens
   per parameter (at most ``MAX_EPOCHS`` passes); the target's, likewise, trains in the ``main`` stage beside its
   runs (it is needed only from ``reuse`` on; alone it would leave one core idle);
3. ``sweep``: the choices, each at equal compute on the *dev* split (seed 0; the candidate with the lowest dev
   loss at the cheapest candidate's FLOPs): in the first setting BLADE's refresh setting and RHO-1's reference
   length (from the recorded report when its arms are used, ``bench.quality.recorded``); in the paper's pool,
   again, BLADE's λ and η_w, RHO-1's reference length and η_w, and full+val's share of target examples;
4. ``main``: every arm (``setting.POLICIES``) for ``steps`` proxy steps, every seed, in both settings (``full`` and
   ``full+val`` run on to the FLOPs of the costliest arm of their setting, with snapshots at each arm's
   equal-compute step); a chosen candidate that trained exactly as an arm's seed 0 is that run;
5. ``reuse``: for seeds < ``reuse_seeds`` in both settings, the target continued from its base on that seed's
   selected shards of each reused policy, the target's ``full`` of the same seed for as long as the smallest R's
   equal-total-compute point needs (``target_extra_steps``), and the target's ``full+val`` for ``steps``.

Arms of a recorded report (``Setting.recorded``) are used instead of trained while the checks of
``bench.quality.recorded`` pass; a check that fails trains them from that stage on. Every run saves snapshots
along the way (curves on the target evaluation set). :func:`train_all` runs the stages up to ``until`` and
returns the finished runs; ``bench.quality.analysis`` evaluates them.
"""

from __future__ import annotations

import math
import os
from typing import Any

import yaml

from bench.quality.clock import PAUSES, StageClock
from bench.quality.compute import base_flops, equal_compute_steps, run_flops, selection_flops
from bench.quality.pool import Job
from bench.quality.recorded import Recorded, blade_keys
from bench.quality.runs import REUSED, same_training
from bench.quality.setting import (
    MAX_EPOCHS,
    RECORDED_ARMS,
    SETTINGS,
    TARGET_SET,
    Setting,
    arm_policy,
    data_configs,
    forward_flops,
    model_config,
    recorded_path,
    run_shape,
)
from bench.quality.sweep import stage_sweep
from bench.quality.trainer import (
    FAMILIES,
    Runs,
    Trainer,
    arms_of,
    count_parameters,
    curve_steps,
    evaluator,
    pool_of,
    reuse_policies,
    run_prefix,
    score_means,
    start_model,
    sweep_choice,
    target_extra_steps,
)
from curation.ingest.prepare import prepare
from curation.io.atomic import atomic_write_text

__all__ = ["STAGES", "FAMILIES", "PAUSES", "Runs", "StageClock", "train_all", "count_parameters", "sweep_choice",
           "target_extra_steps", "run_prefix", "arms_of", "reuse_policies"]

STAGES = ("data", "bases", "sweep", "main", "reuse")


def _stage_data(r: Runs) -> None:
    for name, pcfg in data_configs(r.s, r.out).items():
        atomic_write_text(os.path.join(r.out, "configs", f"prepare_{name}.yaml"),
                          yaml.safe_dump(pcfg.model_dump(mode="json"), sort_keys=False))
        r.data[name] = prepare(pcfg)
        print(f"[data] {name}: " + ", ".join(f"{k} {m.totals().sequences} seq ({m.totals().tokens} tokens)"
                                             for k, m in r.data[name].manifests.items()), flush=True)
    r.tokenizer = r.data["pool"].tokenizer.path


def _base_job(r: Runs, t: Trainer, role: str) -> tuple[Job, dict[str, Any]]:
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


def _stage_bases(r: Runs, t: Trainer) -> None:
    """The proxy's base, which the sweep starts from (the target's base trains in the main stage, beside its runs)."""
    job, meta = _base_job(r, t, "proxy")
    r.bases["proxy"] = {**t.run_all([job])[0], **meta}  # alone: trained in this process


def _eq_steps(r: Runs, setting: str) -> dict[str, int]:
    s, shape = r.s, run_shape(r.s)
    return {a: equal_compute_steps(shape, arm_policy(a), s.steps, r.selection(setting, a)) for a in arms_of(s, setting)}


def _candidate_runs(r: Runs) -> dict[tuple[str, str], dict[str, Any]]:
    """(setting, arm) → a trained seed-0 candidate that may be that arm's seed 0 (the chosen one of its family;
    blade-lam1's setting when a BLADE candidate had it)."""
    out = {}
    for row in r.sweep:
        if row.get("run") is None or row["policy"] == "full+val":
            continue
        setting = row["in_setting"]
        if row["chosen"]:
            out[(setting, row["policy"])] = row["run"]
        if row["policy"] == "blade" and blade_keys(row["setting"]) == blade_keys(r.s.lam1):
            out[(setting, "blade-lam1")] = row["run"]
    return out


def _proxy_jobs(r: Runs, t: Trainer, arms: set[tuple[str, str]]) -> tuple[list[tuple[str, str, Any]], list[Job]]:
    """The main stage's proxy runs of the (setting, arm) pairs given: slots (setting, arm, a result or an index into
    the jobs) in seed order, and the jobs to run."""
    s = r.s
    snaps = curve_steps(s.curve_interval, s.steps)
    cands = _candidate_runs(r)
    slots: list[tuple[str, str, Any]] = []
    jobs: list[Job] = []
    for setting in SETTINGS:
        long = snaps | set(r.eq_steps[setting].values())
        reused = reuse_policies(s, setting)
        for seed in range(s.seeds):
            for arm in arms_of(s, setting):
                if (setting, arm) not in arms:
                    continue
                if arm in ("full", "full+val"):  # on to the costliest arm's FLOPs, snapshots at each one's
                    kw = dict(steps=max(long), snapshots=long)
                else:
                    kw = dict(snapshots=snaps, write_selected=seed < s.reuse_seeds and arm in reused)
                job = t.arm_job(setting, arm, seed, **kw)
                cand = cands.get((setting, arm)) if seed == 0 else None
                if cand is not None and same_training(cand["config"], job.cfg.model_dump(mode="json")) and \
                        set(job.snapshots) <= {int(n) for n in cand["snapshots"]}:
                    slots.append((setting, arm, cand))
                    continue
                if cand is not None:
                    print(f"[main] {job.name}: the chosen candidate trained otherwise; training it", flush=True)
                slots.append((setting, arm, len(jobs)))
                jobs.append(job)
    return slots, jobs


def _fill(r: Runs, slots: list[tuple[str, str, Any]], done: list[dict[str, Any]]) -> None:
    for setting, arm, _ in slots:
        r.main.setdefault(setting, {})[arm] = []
    for setting, arm, res in slots:  # seeds in order within each (setting, arm)
        r.main[setting][arm].append(done[res] if isinstance(res, int) else res)


def _recorded_pairs(r: Runs) -> set[tuple[str, str]]:
    return {(st, a) for st in SETTINGS for a in RECORDED_ARMS if r.uses_recorded(st, a)}


def _stage_main(r: Runs, t: Trainer) -> None:
    s = r.s
    for setting in SETTINGS:
        r.eq_steps[setting] = _eq_steps(r, setting)
    recorded = _recorded_pairs(r)
    pairs = {(st, a) for st in SETTINGS for a in arms_of(s, st)} - recorded
    if recorded:
        print("[main] from the recorded report: " + ", ".join(f"{st}/{a}" for st, a in sorted(recorded)), flush=True)
    slots, jobs = _proxy_jobs(r, t, pairs)
    # the target's base, needed only from the reuse stage on, trains beside these runs: started first (the longest
    # run), it fills one slot while the main runs take turns in the other, then both
    tjob, tmeta = _base_job(r, t, "target")
    tres, *done = t.run_all([tjob, *jobs])
    r.bases["target"] = {**tres, **tmeta}
    _fill(r, slots, done)
    if recorded:
        _check_main(r)
        if not r.recorded_ok():
            _train_recorded(r, t)


def _check_main(r: Runs) -> None:
    """Each seed's ``full`` (after ``steps`` and at the recorded arms' equal-compute steps) and the target's base
    against the recorded ones."""
    rec, small, ev = r.recorded.r, model_config(r.s), evaluator(r)
    big = model_config(r.s, target=True)

    def uses():
        out = {}
        for setting in SETTINGS:
            pre = run_prefix(setting)
            for k, full in enumerate(r.main[setting]["full"]):
                rec_eq = r.recorded.equal_compute_steps(setting)
                steps = {r.s.steps} | {r.eq_steps[setting][p] for p in RECORDED_ARMS
                                       if r.eq_steps[setting][p] == rec_eq[p]}
                for n in sorted(steps):
                    out[(setting, k, n)] = score_means(ev(f"{pre}full-seed{k}@{n}", small, full["snapshots"][str(n)]))
        out["target"] = score_means(ev("base-target", big, r.bases["target"]["final_weights"]))
        return out

    ev.prefetch(uses)
    got = uses()
    for setting in SETTINGS:
        st = rec["settings"][setting]
        for k in range(len(r.main[setting]["full"])):
            r.checks.compare(f"{setting} full seed {k} after {r.s.steps} steps: evaluation sets",
                             got[(setting, k, r.s.steps)], st["eval"]["full"][k])
            for p in RECORDED_ARMS:
                n = r.eq_steps[setting][p]
                if n != r.s.steps and n == r.recorded.equal_compute_steps(setting)[p]:
                    r.checks.compare(f"{setting} full seed {k} at {p}'s equal-compute step {n}",
                                     got[(setting, k, n)], st["eval_equal_compute_full"][p][k])
    r.checks.compare("target base: validation curve", [p["loss"] for p in r.bases["target"]["validation"]],
                     [p["loss"] for p in rec["bases"]["target"]["curve"]])
    r.checks.compare("target base: evaluation sets", got["target"], rec["target_base_eval"])


def _train_recorded(r: Runs, t: Trainer) -> None:
    """A float check failed: the recorded arms are trained after all (their seed-0 candidates reused where they
    trained alike)."""
    print(f"[recorded] not used: {', '.join(r.checks.failed())} differ; training its arms", flush=True)
    r.trained_recorded = True
    pairs = {(st, a) for st in SETTINGS for a in RECORDED_ARMS} - {(st, a) for st, d in r.main.items() for a in d}
    slots, jobs = _proxy_jobs(r, t, pairs)
    _fill(r, slots, t.run_all(jobs))


def _stage_reuse(r: Runs, t: Trainer) -> None:
    s = r.s
    shape, tshape = run_shape(s), run_shape(s, target=True)
    per_step = run_flops(tshape, "full", 1).total
    sels = [selection_flops(shape, arm_policy(p), s.steps, r.selection(st, p))
            for st in SETTINGS for p in reuse_policies(s, st)]
    extra = target_extra_steps(s, sels, r.bases["proxy"]["flops"], per_step)
    r.target_steps = s.steps + extra  # snapshots every target_curve_interval steps and at the end
    jobs, slots = _reuse_jobs(r, t, replays_of_recorded=False)
    _reuse_fill(r, slots, t.run_all(jobs))
    if r.recorded_ok() and any(r.uses_recorded(st, p, replay=True) for st in SETTINGS for p in reuse_policies(s, st)):
        _check_reuse(r)
        if not r.recorded_ok():
            if not r.trained_recorded:
                _train_recorded(r, t)
            jobs, slots = _reuse_jobs(r, t, replays_of_recorded=True)
            _reuse_fill(r, slots, t.run_all(jobs))


def _reuse_jobs(r: Runs, t: Trainer, *, replays_of_recorded: bool) -> tuple[list[Job], list[tuple]]:
    """The reuse stage's runs: the target's full (and full+val) of each seed and the replays not taken from the
    recorded report (``replays_of_recorded``: only the replays of the recorded arms, trained after all)."""
    s = r.s
    start = start_model(r, "target")
    jobs: list[Job] = []
    slots: list[tuple] = []
    for setting in SETTINGS:
        pre = run_prefix(setting)
        for seed in range(s.reuse_seeds):
            if not replays_of_recorded:
                slots.append((setting, "full", seed))
                jobs.append(t.job(
                    f"{pre}target-full-seed{seed}", policy="full", seed=seed, mcfg=start, data=pool_of(setting),
                    steps=r.target_steps, lr=s.target_lr, eval_interval=s.target_eval_interval,
                    snapshots=curve_steps(s.target_curve_interval, r.target_steps) | {s.steps}))
                if setting in s.full_val_settings:
                    slots.append((setting, "full+val", seed))
                    jobs.append(t.job(
                        f"{pre}target-full+val-seed{seed}", policy="full", seed=seed, mcfg=start, data=pool_of(setting),
                        steps=s.steps, lr=s.target_lr, eval_interval=s.target_eval_interval,
                        validation_share=r.validation_share(setting, "full+val"),
                        snapshots=curve_steps(s.target_curve_interval, s.steps)))
            for p in reuse_policies(s, setting):
                if (p not in RECORDED_ARMS) if replays_of_recorded else r.uses_recorded(setting, p, replay=True):
                    continue
                selected = r.main[setting][p][seed]["summary"]["selected_dir"]
                slots.append((setting, ("replay", p), seed))
                jobs.append(t.replay_job(f"{pre}target-replay-{p}-seed{seed}", selected, start,
                                         curve_steps(s.target_curve_interval, s.steps)))
    return jobs, slots


def _reuse_fill(r: Runs, slots: list[tuple], done: list[dict[str, Any]]) -> None:
    for (setting, what, _seed), res in zip(slots, done, strict=True):  # seeds in order
        entry = r.reuse.setdefault(setting, {"full": [], "replays": {}})
        if isinstance(what, tuple):
            entry["replays"].setdefault(what[1], []).append(res)
        else:
            entry.setdefault(what, []).append(res)


def _check_reuse(r: Runs) -> None:
    """Each seed's target ``full`` after ``steps`` (the evaluation sets) and the mean target-set curve up to there
    against the recorded ones."""
    rec, big, ev, s = r.recorded.r, model_config(r.s, target=True), evaluator(r), r.s

    def uses():
        out = {}
        for setting in SETTINGS:
            pre = run_prefix(setting)
            for k, full in enumerate(r.reuse[setting]["full"]):
                for n in sorted(int(x) for x in full["snapshots"]):
                    if n <= s.steps:
                        out[(setting, k, n)] = score_means(ev(f"{pre}target-full-seed{k}@{n}", big, full["snapshots"][str(n)],
                                                         sets=None if n >= s.steps else (TARGET_SET,)))
        return out

    ev.prefetch(uses)
    got = uses()
    for setting in SETTINGS:
        ru = rec["settings"][setting].get("reuse") or {}
        if not ru:
            continue
        seeds = len(r.reuse[setting]["full"])
        for k in range(seeds):
            r.checks.compare(f"{setting} target full seed {k} after {s.steps} steps: evaluation sets",
                             got[(setting, k, s.steps)], ru["full_final"][k])
        steps = sorted(n for (st, k, n) in got if st == setting and k == 0)
        ours = [[n * ru["target_step_flops"], sum(got[(setting, k, n)][TARGET_SET] for k in range(seeds)) / seeds]
                for n in steps]
        theirs = [pt for pt in ru["full_curve"] if 0 < pt[0] <= s.steps * ru["target_step_flops"]]
        r.checks.compare(f"{setting} target full: mean {TARGET_SET} curve up to {s.steps} steps", ours, theirs)


def train_all(s: Setting, out: str, *, until: str | None = None) -> Runs:
    """Run (or reuse) every stage up to and including ``until`` (default: all)."""
    if until is not None and until not in STAGES:
        raise ValueError(f"until must be one of {', '.join(STAGES)}, got {until!r}")
    REUSED.clear()  # counted per invocation
    import torch

    torch.set_num_threads(s.all_threads)
    os.makedirs(os.path.join(out, "configs"), exist_ok=True)
    runs, clock = Runs(s=s, out=out), StageClock(out)
    path = recorded_path(s)
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"the preset's recorded report {path} (Setting.recorded) is absent")
        runs.recorded = Recorded(path)
        runs.recorded_differences = runs.recorded.setting_differences(s)
        print(f"[recorded] {path} (sha256 {runs.recorded.sha256[:12]}): " + (
            "its arms stand in while this machine reproduces its floats" if not runs.recorded_differences else
            "not used: the preset differs in " + "; ".join(runs.recorded_differences)), flush=True)
    trainer = Trainer(runs)
    steps = {"data": lambda: _stage_data(runs), "bases": lambda: _stage_bases(runs, trainer),
             "sweep": lambda: stage_sweep(runs, trainer), "main": lambda: _stage_main(runs, trainer),
             "reuse": lambda: _stage_reuse(runs, trainer)}
    for name in STAGES:
        with clock.stage(name):
            steps[name]()
        if name == until:
            break
    return runs

