"""The quality benchmark's ``sweep`` stage: the choices, each at equal compute on the dev split (seed 0): the first
setting's (from the recorded report when its arms stand in, else trained as that report's run did) and the paper
pool's own (BLADE's λ and η_w, RHO-1's reference length and η_w, full+val's share), and the checks of the
recorded report's floats that this stage can make (the proxy's base; the paper pool's seed-0 candidates that are
the recorded arms' seed 0)."""

from __future__ import annotations

from typing import Any

from bench.quality.compute import run_flops
from bench.quality.pool import Job
from bench.quality.recorded import blade_keys, same_choice
from bench.quality.runs import Evaluator, final_val
from bench.quality.setting import SETTINGS, TARGET_SET, arm_policy, dev_source, model_config, run_shape
from bench.quality.trainer import (
    Runs,
    Trainer,
    curve_steps,
    evaluator,
    pool_of,
    reuse_policies,
    run_prefix,
    score_means,
    start_model,
    sweep_choice,
)

__all__ = ["stage_sweep"]


def _dev_curve(r: Runs, ev: Evaluator, res: dict[str, Any], policy: str, sel: dict[str, Any]) -> list[tuple[float, float]]:
    """(FLOPs, dev loss) of a sweep run: the base at 0, then each snapshot."""
    shape, small = run_shape(r.s), model_config(r.s)
    dev = dev_source(r.s)
    pts = [(0.0, r.dev_base)]
    for n in sorted(int(k) for k in res["snapshots"]):
        loss = ev(f"{res['name']}@{n}", small, res["snapshots"][str(n)], sets=(), extra=(dev,))[dev.name].mean
        pts.append((run_flops(shape, policy, n, sel).total, loss))
    return pts


def _train_family(r: Runs, t: Trainer, setting: str, family: str, cands: list[dict[str, Any]],
                  names: list[str]) -> list[Job]:
    """Seed-0 candidates of one family in one setting (``steps`` steps, snapshots on the curve steps), as jobs."""
    s = r.s
    snaps = curve_steps(s.curve_interval, s.steps)
    reused = reuse_policies(s, setting)
    jobs = []
    for cand, name in zip(cands, names, strict=True):
        vshare = cand.get("validation_share", 0.0)
        sel = {k: v for k, v in cand.items() if k != "validation_share"}
        # shards written as the arm it may become writes them (a chosen candidate is that arm's seed 0)
        arms = {family} | ({"blade-lam1"} if family == "blade" and blade_keys(sel) == blade_keys(s.lam1) else set())
        jobs.append(t.job(name, policy=arm_policy(family), seed=0, mcfg=start_model(r), data=pool_of(setting),
                          write_selected=bool(arms & set(reused)), snapshots=snaps, validation_share=vshare, **sel))
    return jobs


def _rows(r: Runs, ev: Evaluator, setting: str, family: str, cands: list[dict[str, Any]],
          done: list[dict[str, Any]]) -> None:
    """The candidates' rows (dev curves at equal compute) and the family's choice."""
    s, shape = r.s, run_shape(r.s)
    policy = arm_policy(family)
    sels = [{k: v for k, v in c.items() if k != "validation_share"} for c in cands]
    curves = lambda: [_dev_curve(r, ev, res, policy, sel) for sel, res in zip(sels, done, strict=True)]  # noqa: E731
    ev.prefetch(curves)
    rows = [{"in_setting": setting, "policy": family, "setting": dict(c), "run": res, "curve": curve,
             "val_loss": final_val(res), "flops": run_flops(shape, policy, s.steps, sel).as_dict()}
            for c, sel, res, curve in zip(cands, sels, done, curves(), strict=True)]
    _choose(r, setting, family, rows)
    r.sweep.extend(rows)


def _choose(r: Runs, setting: str, family: str, rows: list[dict[str, Any]]) -> None:
    """Mark the candidate of one family with the lowest dev loss at the cheapest candidate's FLOPs as chosen."""
    chosen, budget, losses = sweep_choice([c["curve"] for c in rows])
    r.budgets.setdefault(setting, {})[family] = budget
    for c, v in zip(rows, losses, strict=True):
        c["dev_at_budget"] = v
        c["chosen"] = c is rows[chosen]
    r.best.setdefault(setting, {})[family] = dict(rows[chosen]["setting"])


def _check_base(r: Runs, ev: Evaluator) -> None:
    """The proxy's base against the recorded one: validation curve, dev loss, the evaluation sets."""
    rec = r.recorded.r
    r.checks.compare("proxy base: validation curve", [p["loss"] for p in r.bases["proxy"]["validation"]],
                     [p["loss"] for p in rec["bases"]["proxy"]["curve"]])
    r.checks.compare("proxy base: dev loss", r.dev_base, rec["dev_split"]["base_loss"])
    r.checks.compare("proxy base: evaluation sets",
                     score_means(ev("base-proxy", model_config(r.s), r.bases["proxy"]["final_weights"])), rec["base_eval"])


def stage_sweep(r: Runs, t: Trainer) -> None:
    """The choices at equal compute on the dev split: the first setting's (recorded, or trained as the recorded
    run did), then the paper pool's three families at once."""
    s = r.s
    first, paper = SETTINGS
    ev = evaluator(r)
    dev = dev_source(s)
    r.dev_base = ev("base-proxy", model_config(s), r.bases["proxy"]["final_weights"], sets=(), extra=(dev,))[dev.name].mean
    if r.recorded is not None and not r.recorded_differences:
        _check_base(r, ev)
    if r.recorded_ok():  # the first setting's choices as recorded (its candidates' runs are not trained again)
        for row in r.recorded.sweep_rows(first):
            r.sweep.append({**row, "in_setting": first, "run": None, "recorded": True})
        r.budgets[first] = r.recorded.budgets(first)
        r.best[first] = r.recorded.best(first)
        print(f"[sweep] {first}: the recorded choices {r.best[first]} (candidates not trained again)", flush=True)
    else:
        _first_setting_sweep(r, t, ev)
    fams = {"blade": list(s.paper_sweep), "rho1": list(s.paper_rho1_sweep),
            "full+val": [{"validation_share": x} for x in s.full_val_shares]}
    if paper not in s.full_val_settings:
        del fams["full+val"]
    pre = run_prefix(paper)
    names = {f: [f"{pre}sweep{i}-{f}" for i in range(len(c))] for f, c in fams.items()}
    jobs = [j for f, c in fams.items() for j in _train_family(r, t, paper, f, c, names[f])]
    done = iter(t.run_all(jobs))
    results = {f: [next(done) for _ in c] for f, c in fams.items()}
    for f, c in fams.items():
        _rows(r, ev, paper, f, c, results[f])
    if first in s.full_val_settings:  # full+val's share in the first setting too
        c = [{"validation_share": x} for x in s.full_val_shares]
        done = t.run_all(_train_family(r, t, first, "full+val", c, [f"sweep{i}-full+val" for i in range(len(c))]))
        _rows(r, ev, first, "full+val", c, done)
    if r.recorded_ok():
        _check_paper_candidates(r, ev, results, fams)
    for setting in SETTINGS:
        print(f"[sweep] {setting}: chosen at equal compute on the dev split: {r.best[setting]}", flush=True)


def _first_setting_sweep(r: Runs, t: Trainer, ev: Evaluator) -> None:
    """The first setting's choices trained (no usable record): BLADE's refresh settings, then RHO-1's reference
    lengths with BLADE's chosen η_w and batch (so that the two families differ only in what they are)."""
    s, first = r.s, SETTINGS[0]
    cands = [dict(c) for c in s.sweep]
    done = t.run_all(_train_family(r, t, first, "blade", cands, [f"sweep{i}-blade" for i in range(len(cands))]))
    _rows(r, ev, first, "blade", cands, done)
    chosen = r.best[first]["blade"]
    rho = [{"rho1_steps": n, "ref_lr": chosen["ref_lr"], "refresh_batch_size": chosen["refresh_batch_size"]}
           for n in s.rho1_sweep]
    done = t.run_all(_train_family(r, t, first, "rho1", rho, [f"sweep-rho1-{n}" for n in s.rho1_sweep]))
    _rows(r, ev, first, "rho1", rho, done)


def _check_paper_candidates(r: Runs, ev: Evaluator, results: dict[str, list[dict[str, Any]]],
                            fams: dict[str, list[dict[str, Any]]]) -> None:
    """The paper pool's seed-0 candidates that train as the recorded paper arms' seed 0 against those: the six
    evaluation sets after ``steps`` and the target set's curve."""
    rec, paper, small = r.recorded, SETTINGS[1], model_config(r.s)
    st = rec.r["settings"][paper]
    for family in ("blade", "rho1"):
        for cand, res in zip(fams[family], results[family], strict=True):
            if not same_choice(family, cand, rec.best(paper)[family]):
                continue
            r.checks.compare(f"{paper} {family} seed 0 (candidate {res['name']}): evaluation sets",
                             score_means(ev(f"{res['name']}@final", small, res["final_weights"])), st["eval"][family][0])
            curve = [[0, st["test_curves"][family][0][0][1]]] + [
                [int(n), ev(f"{res['name']}@{n}", small, w, sets=(TARGET_SET,))[TARGET_SET].mean]
                for n, w in sorted(res["snapshots"].items(), key=lambda x: int(x[0])) if int(n) <= r.s.steps]
            r.checks.compare(f"{paper} {family} seed 0 (candidate {res['name']}): {TARGET_SET} curve", curve,
                             st["test_curves"][family][0])


