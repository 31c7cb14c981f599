"""The quality benchmark's experiment: data, every training run (reused when finished with the same
settings), evaluation on the held-out sets, and the comparisons at equal tokens and at equal compute.

A run's outputs live in ``out/runs/<name>/`` with a ``result.json`` recording its settings; a rerun into the
same ``out`` reuses every run whose recorded settings match, resumes an unfinished one from its checkpoints,
and retrains a run whose settings changed. ``full`` is one long run per seed whose weights are saved at the
step counts with the compute of each selection policy (and at the comparison's step count): with a constant
learning rate and a data stream that depends only on (seed, step), its weights at step n are those of an
n-step run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch
import yaml

from curation.evaluation.heldout import DocScores, export_hf, paired_difference, read_set, score_documents
from curation.ingest.prepare import prepare
from curation.ingest.tokenizer import load_tokenizer
from curation.io.models import build_causal_lm, save_weights
from schemas.config import SourceConfig
from schemas.manifest import atomic_write_text, sha256_file
from schemas.outdir import ConfigMismatch, check_config_record, operational_keys
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
from training.quality.report import seed_interval
from training.quality.setting import (
    EVAL_SETS,
    POLICIES,
    SOURCES,
    Setting,
    compute,
    data_configs,
    equal_compute_steps,
    eval_sources,
    model_config,
)
from training.runs.single import replay, train

__all__ = ["REUSED", "run_experiment", "run_training", "StepTimer", "SaveAtSteps"]

REUSED: list[str] = []  # runs of this invocation taken from an earlier one
SELECTIVE = tuple(p for p in POLICIES if p not in ("full", "random"))  # policies that cost more than full


def _callback_base():
    from composer.core import Callback

    return Callback


class StepTimer:
    """Composer callback: time of training steps only (data, selection, scoring, refresh, forward/backward,
    optimizer), excluding evaluation and checkpointing. On a CPU, process CPU time (other load on a shared
    machine does not distort the per-policy ratios); on a GPU, wall time after synchronising the device."""

    def __new__(cls):
        cuda = torch.cuda.is_available()

        def now() -> float:
            if cuda:
                torch.cuda.synchronize()
                return time.perf_counter()
            return time.process_time()

        class _Timer(_callback_base()):
            def __init__(self):
                self.seconds, self.steps, self._t0 = 0.0, 0, None

            def before_dataloader(self, state, logger):
                self._t0 = now()

            def batch_end(self, state, logger):
                if self._t0 is not None:
                    self.seconds += now() - self._t0
                    self.steps += 1
                    self._t0 = None

        return _Timer()


class SaveAtSteps:
    """Composer callback: save the proxy's weights after the given step counts (``<dir>/step<n>.safetensors``)."""

    def __new__(cls, steps: list[int], directory: str):
        class _Save(_callback_base()):
            def batch_end(self, state, logger):
                n = int(state.timestamp.batch)  # steps finished
                if n in steps:
                    save_weights(state.model.model, os.path.join(directory, f"step{n}.safetensors"))

        return _Save()


# selection keys a policy does not read (a finished full/random run stays valid when the refresh setting changes)
_UNUSED_BY = {p: ("refresh_steps", "ref_lr", "lam", "ref_weight_decay", "ref_grad_clip", "refresh_batch_size",
                  "refresh_candidate_batches", "rho1_steps", "reference_weights") for p in ("full", "random")}


#: Settings a run may change and still resume (progress bars, checkpoint retention): train()/replay() ignore them too.
_OPERATIONAL = operational_keys(TrainConfig) | operational_keys(ReplayConfig)


def _current_schema(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded run config as the current TrainConfig would write it: settings added since the run was
    recorded get their defaults (which reproduce the old behaviour), so a package upgrade does not retrain
    (or delete) finished runs; a config the current schema rejects is returned as it is (and differs)."""
    body = {k: v for k, v in config.items() if k != "snapshots"}
    try:
        body = TrainConfig.model_validate(body).model_dump(mode="json")
    except ValueError:
        return config
    return {**body, **({"snapshots": config["snapshots"]} if "snapshots" in config else {})}


def _effective(config: dict[str, Any]) -> dict[str, Any]:
    config = _current_schema(config)
    sel = config.get("selection")
    if not isinstance(sel, dict):
        return config
    unused = _UNUSED_BY.get(sel.get("policy"), ())
    return {**config, "selection": {k: v for k, v in sel.items() if k not in unused}}


def _cached(result_path: str, config: dict[str, Any]) -> bool:
    """Whether a finished run's result can be reused: it exists and was made with the same settings.

    A run directory left by a different setting (e.g. after the refresh sweep chose differently) is
    removed so that the run starts afresh instead of resuming someone else's checkpoints."""
    run_dir = os.path.dirname(result_path)
    if os.path.exists(result_path):
        with open(result_path) as f:
            if _effective(json.load(f).get("config", {})) == _effective(config):
                REUSED.append(os.path.basename(run_dir))
                return True
        print(f"[run] {os.path.basename(run_dir)}: settings changed since the recorded run; training it again",
              flush=True)
    if os.path.isdir(run_dir):
        saved = os.path.join(run_dir, "config.yaml")
        stale = os.path.exists(result_path)
        if not stale and os.path.exists(saved):  # an unfinished run resumes only with the same config
            try:
                check_config_record(saved, config, ignore=_OPERATIONAL)
            except ConfigMismatch:
                stale = True
        if stale:
            shutil.rmtree(run_dir)
    return False


def run_training(cfg: TrainConfig, result_path: str, *, snapshots: tuple[int, ...] = ()) -> dict[str, Any]:
    """Train (or load the recorded result of a finished run with the same settings and snapshots)."""
    config = cfg.model_dump(mode="json")
    if snapshots:
        config["snapshots"] = sorted(snapshots)
    if _cached(result_path, config):
        with open(result_path) as f:
            return json.load(f)
    timer = StepTimer()
    snap_dir = os.path.join(cfg.output_dir, "snapshots")
    callbacks = [timer] + ([SaveAtSteps(sorted(snapshots), snap_dir)] if snapshots else [])
    out = train(cfg, callbacks=callbacks)
    with open(out["summary"]) as f:
        summary = json.load(f)
    res = {"name": os.path.basename(cfg.output_dir), "final_weights": out["final_weights"],
           "step_seconds": timer.seconds / max(timer.steps, 1), "summary": summary,
           "final_reference": out.get("final_reference"), "config": config,
           "snapshots": {str(n): os.path.join(snap_dir, f"step{n}.safetensors") for n in sorted(snapshots)}}
    missing = [p for p in res["snapshots"].values() if not os.path.isfile(p)]
    if missing:  # a resumed run whose snapshot step was before the checkpoint it resumed from
        raise RuntimeError(f"snapshots missing after training {cfg.output_dir}: {missing}; delete the run directory")
    atomic_write_text(result_path, json.dumps(res))
    return res


def _final_val(res: dict[str, Any], at: int | None = None) -> float:
    curve = res["summary"]["validation"]
    if at is not None:
        curve = [p for p in curve if p["step"] <= at]
    return curve[-1]["loss"]


class Evaluator:
    """Whole-document token loss of each model on every evaluation set, cached in ``out/eval_cache.json``
    by run name, weights hash and set (a retrained run or a changed set is evaluated again)."""

    def __init__(self, s: Setting, out: str, tokenizer: str, sources: list[SourceConfig]):
        self.s, self.sources = s, sources
        self.tok = load_tokenizer(tokenizer)
        self.texts: dict[str, list[str]] = {}
        self.documents: dict[str, int] = {}  # documents per set
        self.path = os.path.join(out, "eval_cache.json")
        self.cache = json.load(open(self.path)) if os.path.exists(self.path) else {}
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    def __call__(self, name: str, mcfg: ModelConfig, weights: str,
                 extra: tuple[SourceConfig, ...] = ()) -> dict[str, DocScores]:
        key = f"{name}@{sha256_file(weights)[:16]}"
        entry = self.cache.setdefault(key, {})
        model = None
        out = {}
        for src in [*self.sources, *extra]:
            skey = f"{src.name}@{sha256_file(src.paths[0])[:8]}:{src.skip_documents}:{src.max_documents}:{self.s.seq_len}"
            if skey not in entry:
                if model is None:
                    model = build_causal_lm(mcfg.model_copy(update={"weights": weights})).to(self.device).eval()
                if src.name not in self.texts:
                    self.texts[src.name] = read_set(src)
                entry[skey] = score_documents(model, self.tok, self.texts[src.name], max_len=self.s.seq_len,
                                              batch_size=32).to_json()
                atomic_write_text(self.path, json.dumps(self.cache))
            out[src.name] = DocScores.from_json(entry[skey])
            self.documents[src.name] = len(out[src.name].sums)
        return out


def _means(scores: dict[str, DocScores]) -> dict[str, float]:
    return {k: v.mean for k, v in scores.items()}


def _compare(a: list[dict[str, DocScores]], b: list[dict[str, DocScores]]) -> dict[str, dict[str, Any]]:
    """Per set: mean of a − b over seeds with a 95% interval (t over seeds; one seed: document bootstrap)."""
    out = {}
    for name in a[0]:
        diffs = [x[name].mean - y[name].mean for x, y in zip(a, b, strict=True)]
        if len(diffs) > 1:
            iv, method = seed_interval(diffs), f"t over {len(diffs)} seeds"
        else:
            iv, method = paired_difference(a[0][name], b[0][name], rounds=1000, seed=0), "document bootstrap, 1 seed"
        out[name] = {"mean": iv.value, "lo": iv.lo, "hi": iv.hi, "per_seed": diffs, "method": method}
    return out


def run_experiment(s: Setting, out: str) -> dict[str, Any]:
    """Every run of the benchmark, evaluated; returns the JSON-ready results (see training.quality.report)."""
    REUSED.clear()  # counted per invocation
    t_start = time.perf_counter()
    torch.set_num_threads(s.threads)
    os.makedirs(os.path.join(out, "configs"), exist_ok=True)

    # 1. data --------------------------------------------------------------------------------------
    dirs: dict[str, Any] = {}
    for name, pcfg in data_configs(s, out).items():
        atomic_write_text(os.path.join(out, "configs", f"prepare_{name}.yaml"),
                          yaml.safe_dump(pcfg.model_dump(mode="json"), sort_keys=False))
        dirs[name] = prepare(pcfg)
        print(f"[data] {name}: " + ", ".join(f"{k} {m.totals().sequences} seq" for k, m in dirs[name].manifests.items()),
              flush=True)
    tok = dirs["pool"].tokenizer.path
    pool_m = dirs["pool"].manifests["candidates"]
    domain = {src[0]: src[3] for src in SOURCES}
    pool_share = {k: c.sequences / pool_m.totals().sequences for k, c in pool_m.sources.items()}
    best: dict[str, Any] = {}

    def tcfg(name: str, *, policy: str, seed: int, data: str = "pool", mcfg: ModelConfig,
             steps: int | None = None, write_selected: bool = False, **sel: Any) -> TrainConfig:
        sel_defaults = dict(policy=policy, gamma=s.gamma, warmup_steps=s.warmup, tau=s.tau, rho1_steps=s.rho1_steps,
                            seed=seed, refresh_steps=best.get("refresh_steps", 20), ref_lr=best.get("ref_lr"),
                            lam=best.get("lam", 1.0), refresh_batch_size=best.get("refresh_batch_size"))
        sel_defaults.update(sel)
        n = steps or s.steps
        return TrainConfig(
            data=DataConfig(candidates=dirs[data].dirs["candidates"], validation=dirs["pool"].dirs["validation"],
                            tokenizer=tok),
            model=mcfg, selection=SelectionConfig(**sel_defaults), optim=OptimConfig(lr=s.lr),
            eval=EvalConfig(interval=s.eval_interval, batch_size=32, max_batches=s.eval_batches),
            checkpoint=CheckpointConfig(interval=min(n, s.checkpoint_interval or n), keep=1),
            output_dir=os.path.join(out, "runs", name), batch_size=s.batch, max_steps=n, seed=seed,
            threads=s.threads, precision=s.precision, progress_bar=False, plots=False,
            write_selected=write_selected, distance_interval=max(1, s.tau // 10),
        )

    def run(name: str, snapshots: tuple[int, ...] = (), **kw: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        res = run_training(tcfg(name, **kw), os.path.join(out, "runs", name, "result.json"), snapshots=snapshots)
        print(f"[run] {name}: val {_final_val(res):.3f}, {res['step_seconds'] * 1e3:.0f} ms/step "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        return res

    # 2. base model (off-domain only) ----------------------------------------------------------------
    small, big = model_config(s), model_config(s, big=True)
    base = run("base", policy="full", seed=0, data="base", mcfg=small, steps=s.base_steps)
    start = model_config(s, weights=base["final_weights"])

    # 3. refresh-strength sweep for blade, chosen by final validation loss (seed 0) ------------------
    sweep, sweep_runs = [], []
    for i, cand in enumerate(s.sweep):
        res = run(f"sweep{i}-blade", policy="blade", seed=0, mcfg=start, write_selected=True, **cand)
        sweep_runs.append(res)
        pts = res["summary"].get("param_distance") or []
        sweep.append({"setting": cand, "val_loss": _final_val(res), "name": res["name"],
                      "param_distance_mean": statistics.fmean(p["value"] for p in pts) if pts else None})
    chosen = min(range(len(sweep)), key=lambda i: sweep[i]["val_loss"])
    best.update(sweep[chosen]["setting"])
    print(f"[sweep] chosen by validation loss: {best}", flush=True)

    # 4. the comparison at equal proxy steps; full is one long run per seed (snapshots at equal compute) ----
    eq_steps = {p: equal_compute_steps(s, p, best) for p in POLICIES}
    main_runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for seed in range(s.seeds):
        snaps = {s.steps, *eq_steps.values()} | ({s.long_steps} if seed == 0 else set())
        main_runs["full"].append(run(f"full-seed{seed}", policy="full", seed=seed, mcfg=start, steps=max(snaps),
                                     snapshots=tuple(sorted(snaps))))
        for p in POLICIES[1:]:
            if p == "blade" and seed == 0:  # the chosen sweep run is exactly this run (same config and seed)
                main_runs[p].append(sweep_runs[chosen])
                continue
            main_runs[p].append(run(f"{p}-seed{seed}", policy=p, seed=seed, mcfg=start,
                                    write_selected=(seed == 0 and p in ("blade", "random"))))

    # 5. ablations: γ and τ sweeps (blade, seed 0) --------------------------------------------------
    gamma_runs = {g: (main_runs["blade"][0] if g == s.gamma else run(f"gamma{g}-blade", policy="blade", seed=0,
                                                                       mcfg=start, gamma=g)) for g in s.gammas}
    tau_runs = {t: (main_runs["blade"][0] if t == s.tau else run(f"tau{t}-blade", policy="blade", seed=0, mcfg=start,
                                                                   tau=t, warmup_steps=min(s.warmup, t)))
                for t in s.taus}

    # 6. the long horizon (seed 0): does the proxy pass the static reference? full = the long full run ---
    long_runs = {p: main_runs[p][0] if s.long_steps == s.steps else
                 run(f"long-{p}", policy=p, seed=0, mcfg=start, steps=s.long_steps) for p in ("rho1", "blade")}

    # 7. transfer (BLADE-Tr): a larger model trained on the selected tokens vs a random-γ selection ----
    transfer: dict[str, Any] = {}
    big_base = None
    if s.transfer:
        big_base = run("base-big", policy="full", seed=0, data="base", mcfg=big, steps=s.base_steps)
        for src in ("blade", "random"):
            transfer[src] = run_replay(s, out, src, main_runs[src][0], big, big_base["final_weights"], dirs, tok)

    # 8. evaluation on the held-out sets; models saved as HF directories -----------------------------
    evaluate = Evaluator(s, out, tok, eval_sources(s))

    def snap(seed: int, step: int) -> str:
        return main_runs["full"][seed]["snapshots"][str(step)]

    ev = {p: [evaluate(f"full-seed{k}@{s.steps}" if p == "full" else r["name"], small,
                       snap(k, s.steps) if p == "full" else r["final_weights"]) for k, r in enumerate(rs)]
          for p, rs in main_runs.items()}
    ev_eq = {p: [evaluate(f"full-seed{k}@{eq_steps[p]}", small, snap(k, eq_steps[p])) for k in range(s.seeds)]
             for p in POLICIES[1:]}
    for p, rs in main_runs.items():
        for k, r in enumerate(rs):  # models/<policy>-seed<k>/ (blade seed 0 is the chosen sweep run)
            w = snap(k, s.steps) if p == "full" else r["final_weights"]
            export_hf(build_causal_lm(small.model_copy(update={"weights": w})), tok,
                      os.path.join(out, "models", f"{p}-seed{k}"))
    base_ev = evaluate("base", small, base["final_weights"])
    gamma_ev = {g: evaluate(r["name"], small, r["final_weights"]) for g, r in gamma_runs.items()}
    tau_ev = {t: evaluate(r["name"], small, r["final_weights"]) for t, r in tau_runs.items()}
    long_ev = {"full": evaluate(f"full-seed0@{s.long_steps}", small, snap(0, s.long_steps)),
               **{p: evaluate(r["name"], small, r["final_weights"]) for p, r in long_runs.items()}}
    transfer_ev = {k: evaluate(f"replay-{k}", big, v["final_weights"]) for k, v in transfer.items()}
    big_base_ev = evaluate("base-big", big, big_base["final_weights"]) if big_base else None
    # the static RHO-1 reference itself: on the validation slice it was trained on, and on the held-out sets
    ref_w = long_runs["rho1"].get("final_reference")
    val_src = data_configs(s, out)["pool"].validation[0]
    static_ref = _means(evaluate("static-reference", small, ref_w, (val_src,))) if ref_w else None

    full_curve = lambda k, n: [p for p in main_runs["full"][k]["summary"]["validation"] if p["step"] <= n]  # noqa: E731
    flops = {p: {**compute(s, p, s.steps, sel=best).__dict__, "total": compute(s, p, s.steps, sel=best).total}
             for p in POLICIES}
    curves0 = {p: main_runs["full"][0]["summary"]["validation"] if p == "full" else rs[0]["summary"]["validation"]
               for p, rs in main_runs.items()}
    flops_at_step = {p: {str(pt["step"]): compute(s, p, pt["step"], sel=best).total for pt in c}
                     for p, c in curves0.items()}
    return {
        "setting": asdict(s), "best_refresh": best, "sweep": sweep, "eval_sets": EVAL_SETS,
        "pool_share": pool_share, "math_share": sum(v for k, v in pool_share.items() if domain[k] == "math"),
        "pool_counts": {k: c.model_dump() for k, c in pool_m.sources.items()},
        "eval_documents": dict(evaluate.documents),
        "eval": {p: [_means(e) for e in es] for p, es in ev.items()},
        "eval_equal_compute_full": {p: [_means(e) for e in es] for p, es in ev_eq.items()},
        "vs_full_equal_tokens": {p: _compare(ev[p], ev["full"]) for p in POLICIES[1:]},
        "vs_full_equal_compute": {p: _compare(ev[p], ev_eq[p]) for p in POLICIES[1:]},
        "blade_vs_rho1": _compare(ev["blade"], ev["rho1"]),
        "blade_vs_nosync": _compare(ev["blade"], ev["blade-nosync"]),
        "equal_compute_steps": eq_steps, "flops": flops, "flops_at_step": flops_at_step,
        "step_seconds": {p: [r["step_seconds"] for r in rs] for p, rs in main_runs.items()},
        # the algorithm's own timers (wall clock, seconds per proxy step): refresh (incl. rho1's static
        # reference), reference scoring, selection
        "part_seconds": {p: {k: statistics.fmean(r["summary"]["seconds"].get(k, 0.0) / r["summary"]["steps"] for r in rs)
                             for k in ("refresh", "score", "select")} for p, rs in main_runs.items()},
        "base_eval": _means(base_ev), "big_base_eval": _means(big_base_ev) if big_base_ev else None,
        "final_val": {p: [_final_val(r, s.steps) for r in rs] for p, rs in main_runs.items()},
        "val_curves": {p: [full_curve(k, s.steps) if p == "full" else r["summary"]["validation"]
                           for k, r in enumerate(rs)] for p, rs in main_runs.items()},
        "full_long_curves": [r["summary"]["validation"] for r in main_runs["full"]],
        "long_val_curves": {"full": full_curve(0, s.long_steps),
                            **{p: r["summary"]["validation"] for p, r in long_runs.items()}},
        "long_eval": {p: _means(e) for p, e in long_ev.items()},
        "static_reference": static_ref,
        "kept_share": {p: {k: v["kept_fraction"] for k, v in sorted(rs[0]["summary"]["tokens"]["per_source"].items())}
                       for p, rs in main_runs.items()},
        "param_distance": {p: rs[0]["summary"].get("param_distance", []) for p, rs in main_runs.items()},
        "delta_histograms": {p: main_runs[p][0]["summary"].get("delta_histograms") or {} for p in ("blade", "rho1")},
        "gamma_sweep": {str(g): {"val": _final_val(r), **_means(gamma_ev[g])} for g, r in gamma_runs.items()},
        "tau_sweep": {str(t): {"val": _final_val(r), **_means(tau_ev[t])} for t, r in tau_runs.items()},
        "transfer": {k: {**_means(transfer_ev[k]), "val": v["validation"][-1]["loss"] if v["validation"] else None}
                     for k, v in transfer.items()},
        "wall_seconds": time.perf_counter() - t_start,
        "reused_runs": sorted(set(REUSED)),
    }


def run_replay(s: Setting, out: str, src: str, res: dict[str, Any], big: ModelConfig, big_base_w: str,
               dirs: dict[str, Any], tok: str) -> dict[str, Any]:
    """Train the larger model on the selected-token shards of one run (one pass, training order)."""
    path = os.path.join(out, "runs", f"replay-{src}", "result.json")
    cfg = ReplayConfig(
        selected=res["summary"]["selected_dir"], validation=dirs["pool"].dirs["validation"], tokenizer=tok,
        model=big.model_copy(update={"weights": big_base_w}), optim=OptimConfig(lr=s.lr),
        eval=EvalConfig(interval=s.eval_interval, batch_size=32, max_batches=s.eval_batches),
        checkpoint=CheckpointConfig(interval=s.steps, keep=1), output_dir=os.path.join(out, "runs", f"replay-{src}"),
        batch_size=s.batch, epochs=1, threads=s.threads, progress_bar=False,
    )
    config = cfg.model_dump(mode="json")
    if _cached(path, config):
        with open(path) as f:
            return json.load(f)
    r = replay(cfg)
    with open(os.path.join(cfg.output_dir, "validation.json")) as f:
        curve = json.load(f)
    result = {"final_weights": r["final_weights"], "validation": curve, "config": config}
    atomic_write_text(path, json.dumps(result))
    print(f"[run] replay-{src} (big model): val {curve[-1]['loss'] if curve else float('nan'):.3f}", flush=True)
    return result
