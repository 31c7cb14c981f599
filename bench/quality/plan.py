"""The quality benchmark's plan: what a preset trains and scores per stage, in runs, steps and estimated minutes
(``CPU_ESTIMATE_MIN`` is the CPU preset's, kept equal by a test), stated before the run and written to
results.json beside the measured stage times."""

from __future__ import annotations

import math
from typing import Any

from bench.quality.compute import base_flops, equal_compute_steps, run_flops, selection_flops
from bench.quality.recorded import blade_keys, rho1_keys
from bench.quality.setting import (
    BUDGET_MIN,
    RECORDED_ARMS,
    SETTINGS,
    Setting,
    arm_policy,
    forward_flops,
    model_config,
    run_shape,
)
from bench.quality.trainer import arms_of, count_parameters, curve_steps, reuse_policies, target_extra_steps

__all__ = ["STEP_MS", "plan"]

#: The CPU preset's cost model (idle 2-core machine, two 1-thread runs at a time), from v7's records on this machine
#: kind: process CPU per proxy step at 1 thread, evaluation and checkpoints included (the recorded step times ×
#: 1.12, the main stage's measured overhead), ms; a reference step of RHO-1 (a refresh batch of 8) ≈ 60 ms; a
#: target step ≈ 205 ms (v7's reuse stage: 91.3 wall min for 51.5k target steps on 2 cores); the target's base
#: ≈ 395 ms per step of 16 sequences (3,584 s for 9,078 steps); the proxy's base 9.2 min alone at 2 threads; a
#: scoring of the proxy on the six evaluation sets ≈ 8 s of CPU (v7's evaluate stage: 62.5 CPU-min for ≈ 466 such
#: units), the target ×5.5, the target set alone ×0.4, the dev split ×0.15.
STEP_MS = {"full": 68, "random": 66, "rho1": 87, "blade": 104, "blade-nosync": 105, "blade-lam1": 121, "full+val": 68}
REF_STEP_MS, TARGET_STEP_MS, TARGET_BASE_STEP_MS, PROXY_BASE_MIN, EVAL_S = 60, 205, 395, 9.2, 8.0


def _proxy_s(arm: str, steps: int, rho1_steps: int = 0) -> float:
    return (STEP_MS[arm] * steps + REF_STEP_MS * rho1_steps) / 1e3


def plan(s: Setting) -> dict[str, Any]:
    """What the preset trains and scores per stage, in runs, steps and estimated minutes on an idle 2-core machine
    (``STEP_MS``...; the CPU preset's cost model), assuming the recorded arms stand in and the paper pool's
    choices come out as the first setting's (the first candidate of each family); ``contingencies`` add what
    otherwise trains."""
    shape, tshape = run_shape(s), run_shape(s, target=True)
    first, paper = SETTINGS
    inpool_best = {"blade": blade_keys(s.paper_sweep[0]), "rho1": rho1_keys(s.paper_rho1_sweep[0])}
    best = {first: dict(inpool_best), paper: dict(inpool_best)}
    for st in s.full_val_settings:
        best[st]["full+val"] = {"validation_share": s.full_val_shares[0]}
    sel = {"blade": lambda st: best[st]["blade"], "blade-nosync": lambda st: best[st]["blade"],
           "rho1": lambda st: best[st]["rho1"], "blade-lam1": lambda st: s.lam1}
    selection = lambda st, a: sel[a](st) if a in sel else {}  # noqa: E731
    eq = {st: {a: equal_compute_steps(shape, arm_policy(a), s.steps, selection(st, a)) for a in arms_of(s, st)}
          for st in SETTINGS}
    full_len = {st: max({*eq[st].values(), s.steps}) for st in SETTINGS}
    rec = set(RECORDED_ARMS) if s.recorded else set()
    # sweep: the paper pool's candidates (seed 0, steps), their dev curves, the two recorded arms' checks
    sweep_s = sum(_proxy_s("blade-lam1" if c.get("lam") else "blade", s.steps) for c in s.paper_sweep) + \
        sum(_proxy_s("rho1", s.steps, c["rho1_steps"]) for c in s.paper_rho1_sweep) + \
        len(s.full_val_shares) * _proxy_s("full+val", s.steps)
    candidates = len(s.paper_sweep) + len(s.paper_rho1_sweep) + len(s.full_val_shares)
    sweep_s += EVAL_S * (candidates * (s.steps // s.curve_interval + 1) * 0.15 + 2 * 2.6)
    # main: full and full+val to the costliest arm's FLOPs; every other arm not recorded (seed 0 of a chosen
    # candidate reused); the target's base beside them
    main_runs = []
    for st in SETTINGS:
        for seed in range(s.seeds):
            for a in arms_of(s, st):
                if a in rec or (seed == 0 and st == paper and a in ("blade-lam1",)):
                    continue
                steps = full_len[st] if a in ("full", "full+val") else s.steps
                main_runs.append((a, steps, selection(st, a).get("rho1_steps", 0) if a == "rho1" else 0))
    target_base_steps = math.ceil(s.target_base_tokens_per_parameter * _target_params(s) / (s.base_batch * s.seq_len))
    main_s = sum(_proxy_s(a, n, k) for a, n, k in main_runs) + TARGET_BASE_STEP_MS * target_base_steps / 1e3
    main_s += EVAL_S * (2 * s.seeds * 3 + 5.5)  # the checks: full at steps and two equal-compute steps, the base
    # reuse: the target's full to the smallest R's point of the costliest reused selection (base charged), full+val
    # for steps, every replay not recorded
    per_step = run_flops(tshape, "full", 1).total
    base = base_flops(forward_flops(s), math.ceil(s.base_tokens_per_parameter * _proxy_params(s) /
                                                   (s.base_batch * s.seq_len)) * s.base_batch * s.seq_len)
    sels = [selection_flops(shape, arm_policy(p), s.steps, selection(st, p)) for st in SETTINGS
            for p in reuse_policies(s, st)]
    target_steps = s.steps + target_extra_steps(s, sels, base, per_step)
    replays = [(st, p) for st in SETTINGS for p in reuse_policies(s, st) if p not in rec]
    target_runs = 2 * s.reuse_seeds * target_steps + len(s.full_val_settings) * s.reuse_seeds * s.steps + \
        len(replays) * s.reuse_seeds * s.steps
    reuse_s = TARGET_STEP_MS * target_runs / 1e3 + EVAL_S * 5.5 * 2 * s.reuse_seeds * (1 + 0.4 * 3)
    # evaluate: what the checks did not score (target-set curves ×0.4, the target ×5.5)
    snaps = s.steps // s.curve_interval
    proxy_units = 2 * s.seeds * (1 + 0.4 * snaps) + len(s.full_val_settings) * s.seeds * (4 + 0.4 * snaps) + \
        2 * s.seeds * (1 + 0.4 * snaps)
    t_snaps_after = len([n for n in curve_steps(s.target_curve_interval, target_steps) if n > s.steps])
    target_units = 5.5 * (2 * s.reuse_seeds * t_snaps_after + (len(s.full_val_settings) * s.reuse_seeds +
                                                                len(replays) * s.reuse_seeds) * (1 + 0.4 * snaps))
    eval_s = EVAL_S * (proxy_units + target_units)
    minutes = {"data": 1, "bases": math.ceil(PROXY_BASE_MIN), "sweep": math.ceil(sweep_s / 2 / 60),
               "main": math.ceil(main_s / 2 / 60), "reuse": math.ceil(reuse_s / 2 / 60),
               "evaluate": math.ceil(eval_s / 2 / 60) + 1}
    # contingencies: the paper pool choosing otherwise (3 seeds less the candidate, and their replays), the record
    # unusable (its arms, their replays, the first setting's choices trained; v7's own measured stages)
    extra = {
        "paper rho1 chosen otherwise": math.ceil(((s.seeds - 1) * _proxy_s("rho1", s.steps, 800) +
                                                  s.reuse_seeds * s.steps * TARGET_STEP_MS / 1e3) / 2 / 60),
        "paper blade chosen otherwise": math.ceil(((s.seeds - 1) * _proxy_s("blade", s.steps) +
                                                   s.seeds * _proxy_s("blade-nosync", s.steps) +
                                                   s.reuse_seeds * s.steps * TARGET_STEP_MS / 1e3) / 2 / 60),
        "record not usable (its arms trained)": 22 + 36 + 62 + 25,
    }
    return {"estimate_minutes": minutes, "total_minutes": sum(minutes.values()), "budget_minutes": BUDGET_MIN,
            "over_budget_minutes": max(0, sum(minutes.values()) - BUDGET_MIN), "contingencies_minutes": extra,
            "equal_compute_steps": eq, "full_steps": full_len, "target_steps": target_steps,
            "paper_candidates": candidates, "main_runs": len(main_runs), "target_base_steps": target_base_steps,
            "target_runs": {"full": 2 * s.reuse_seeds, "full+val": len(s.full_val_settings) * s.reuse_seeds,
                            "replays": len(replays) * s.reuse_seeds, "target_steps": target_runs},
            "recorded_arms": sorted(rec)}


def _proxy_params(s: Setting) -> int:
    return count_parameters(model_config(s))


def _target_params(s: Setting) -> int:
    return count_parameters(model_config(s, target=True))
