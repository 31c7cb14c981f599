"""Quality benchmark on real public text: the paper's comparison, ablations and transfer in miniature.

    python jobs/bench_quality.py --out runs/quality            # full setting (see RESULTS.md for wall time)
    python jobs/bench_quality.py --quick --out /tmp/q           # CI smoke version (≤ 3 minutes)

Setting (domain-shift continual pre-training scaled to 2 CPU cores; all data from ../shared/data):

* tokenizer: a byte-level BPE trained on the pool + validation slice (4,096 tokens in the full setting:
  with GPT-2's 50k vocabulary the embedding and LM head would dominate a 2M-parameter model and the
  CPU time);
* base model: a small Llama (hidden 128, 4 layers, tied embeddings) pretrained on off-domain text only
  (the first ~40% of the documents of each off-domain source, disjoint from the pool); every policy
  starts from it;
* candidate pool: in-domain math (GSM8K train minus the validation slice, OpenIntro Statistics and HoTT
  LaTeX, MATH test, AQuA dev) mixed with the rest of the off-domain text (C4, WikiText-2, LAMBADA,
  BoolQ, PubMedQA, Tiny Shakespeare); about 31% of the pool's sequences are math;
* validation (target) set: the first 500 GSM8K *train* problems (not in the pool);
* evaluation: token loss on GSM8K *test* (in-distribution; never in any pool or validation set). MATH
  test is in the pool, so it is not an evaluation set here.

Everything that is chosen (the BLADE refresh strength) is chosen by final validation-set loss only,
never by the evaluation set. Outputs under ``--out``: RESULTS.md, results.json, figures/*.png,
models/<run>/ (HF ``save_pretrained`` + tokenizer), runs/<run>/ (each training run's outputs).
A rerun with the same ``--out`` skips finished runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from curation.losses import token_losses  # noqa: E402
from curation.models import build_causal_lm  # noqa: E402
from curation.prepare import prepare  # noqa: E402
from curation.shards import open_shards  # noqa: E402
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig  # noqa: E402
from schemas.manifest import atomic_write_text, sha256_file  # noqa: E402
from schemas.outdir import ConfigMismatch, check_config_record, operational_keys  # noqa: E402
from schemas.train_config import (  # noqa: E402
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    ReplayConfig,
    SelectionConfig,
    TrainConfig,
)

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
POLICIES = ("full", "random", "rho1", "blade", "blade-nosync")
#: Settings a run may change and still resume (progress bars, checkpoint retention): train()/replay() ignore them too.
_OPERATIONAL = operational_keys(TrainConfig) | operational_keys(ReplayConfig)

# (name, file(s) under ../shared/data, how to read a record, domain, documents for the base model (off-domain),
#  pool cap (documents, None = all after the base slice))
SOURCES: list[tuple[str, list[str], dict[str, Any], str, int, int | None]] = [
    ("gsm8k", ["gsm8k/train.jsonl"], {"template": "{question}\n{answer}"}, "math", 0, 3000),
    ("openintro", ["textbook_openintro_stats/openintro_stats_tex.jsonl"], {}, "math", 0, 10),
    ("hott", ["textbook_hott/hott_tex.jsonl"], {}, "math", 0, 3),
    ("math", ["math_hendrycks/test.jsonl"], {"template": "{problem}\n{solution}"}, "math", 0, 1000),
    ("aqua", ["aqua_rat/dev.json"], {"template": "{question}\n{rationale}"}, "math", 0, None),
    ("c4", ["c4_sample/c4_sample.jsonl"], {}, "general", 400, None),
    ("wikitext2", ["wikitext2/valid.txt", "wikitext2/test.txt"], {}, "general", 992, None),
    ("lambada", ["lambada/lambada_openai.jsonl"], {"template": "{context} {continuation}"}, "general", 2061, None),
    ("boolq", ["boolq/boolq.jsonl"], {"text_field": "query"}, "general", 1308, None),
    ("pubmedqa", ["pubmedqa/pubmed_qa_labeled.jsonl"], {"template": "{context} {continuation}"}, "general", 400, None),
    ("shakespeare", ["tinyshakespeare/input.txt"], {}, "general", 2889, None),
]
VAL_DOCS = 500  # first GSM8K train problems: the validation (target) slice, skipped in the pool


@dataclass
class Setting:
    """Sizes of one benchmark setting."""

    doc_scale: float = 1.0  # multiplies every document cap (quick mode shrinks the corpus)
    pool_doc_cap: int | None = None  # cap on the documents of every pool source (quick mode)
    skip_sources: tuple[str, ...] = ()
    vocab: int = 4096
    hidden: int = 128
    layers: int = 4
    big_hidden: int = 192  # transfer target (BLADE-Tr)
    big_layers: int = 6
    seq_len: int = 128
    batch: int = 16
    base_steps: int = 400
    steps: int = 300
    seeds: int = 3
    lr: float = 1e-3
    warmup: int = 50
    tau: int = 50
    gamma: float = 0.6
    rho1_steps: int = 120
    eval_interval: int = 50
    eval_batches: int | None = 10
    eval_docs: int | None = None  # GSM8K test documents (None = all 1319)
    threads: int = 2
    # refresh strength candidates for blade (chosen by validation loss, seed 0); keys of SelectionConfig
    sweep: list[dict[str, Any]] = field(default_factory=lambda: [
        {"refresh_steps": 20, "ref_lr": 1e-3, "lam": 1.0},   # the calibration run's setting
        {"refresh_steps": 40, "ref_lr": 3e-3, "lam": 1.0},   # stronger: more steps, larger lr
        {"refresh_steps": 40, "ref_lr": 3e-3, "lam": 0.25},  # stronger, pulled harder to validation
        # the same with validation and candidate batches of b sequences instead of the default b/4
        {"refresh_steps": 40, "ref_lr": 3e-3, "lam": 0.25, "refresh_batch_size": 16},
    ])
    gammas: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
    taus: tuple[int, ...] = (25, 50, 100)
    long_steps: int = 600  # the long horizon (full, rho1, blade; seed 0): does the proxy pass the static reference?


FULL = Setting()
QUICK = Setting(
    doc_scale=0.02, pool_doc_cap=30, skip_sources=("openintro", "hott"), vocab=1024, hidden=32, layers=1, big_hidden=48, big_layers=1,
    seq_len=64, batch=8, base_steps=8, steps=8, seeds=1, warmup=2, tau=3, rho1_steps=3, eval_interval=4,
    eval_batches=2, eval_docs=40, threads=2,
    sweep=[{"refresh_steps": 2, "ref_lr": 1e-3, "lam": 1.0}, {"refresh_steps": 3, "ref_lr": 3e-3, "lam": 1.0}],
    gammas=(0.4, 0.6), taus=(3, 4), long_steps=12,
)


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def _cap(n: int | None, scale: float, limit: int | None = None) -> int | None:
    n = None if n is None else max(1, int(round(n * scale)))
    return limit if n is None else (n if limit is None else min(n, limit))


def data_configs(s: Setting, out: str) -> dict[str, PrepareConfig]:
    """The three preparations: pool (+ validation, trains the tokenizer), base (off-domain), eval."""
    def src(name, files, how, **kw):
        return SourceConfig(name=name, paths=[os.path.join(SHARED, f) for f in files], **how, **kw)

    pool, base = [], []
    for name, files, how, domain, base_docs, cap in SOURCES:
        if name in s.skip_sources:
            continue
        if domain == "math":
            skip = VAL_DOCS if name == "gsm8k" else 0
            pool.append(src(name, files, how, skip_documents=skip, max_documents=_cap(cap, s.doc_scale, s.pool_doc_cap)))
        else:
            b = _cap(base_docs, s.doc_scale)
            base.append(src(name, files, how, max_documents=b))
            pool.append(src(name, files, how, skip_documents=b, max_documents=_cap(cap, s.doc_scale, s.pool_doc_cap)))
    val = src("gsm8k_val", ["gsm8k/train.jsonl"], {"template": "{question}\n{answer}"},
              max_documents=_cap(VAL_DOCS, max(s.doc_scale, 0.1)))
    tok_path = os.path.join(out, "data", "pool", "tokenizer", "tokenizer.json")
    common = dict(seq_len=s.seq_len, progress=False)
    return {
        "pool": PrepareConfig(sources=pool, validation=[val], tokenizer=TokenizerConfig(vocab_size=s.vocab),
                              output_dir=os.path.join(out, "data", "pool"), **common),
        "base": PrepareConfig(sources=base, validation=[val], tokenizer=TokenizerConfig(path=tok_path),
                              output_dir=os.path.join(out, "data", "base"), **common),
        "eval": PrepareConfig(
            sources=[src("gsm8k_test", ["gsm8k/test.jsonl"], {"template": "{question}\n{answer}"},
                         max_documents=s.eval_docs)],
            tokenizer=TokenizerConfig(path=tok_path), output_dir=os.path.join(out, "data", "eval"), **common),
    }


# ------------------------------------------------------------------------------------------------
# runs
# ------------------------------------------------------------------------------------------------
def model_config(s: Setting, *, big: bool = False, weights: str | None = None) -> ModelConfig:
    h, n = (s.big_hidden, s.big_layers) if big else (s.hidden, s.layers)
    heads = max(1, h // 32)
    return ModelConfig(hf_config={
        "model_type": "llama", "vocab_size": s.vocab, "hidden_size": h, "intermediate_size": int(h * 8 / 3) // 8 * 8,
        "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": s.seq_len, "tie_word_embeddings": True, "attention_dropout": 0.0,
    }, weights=weights)


class StepTimer:
    """Composer callback: process CPU time of training steps only (data, selection, scoring, refresh,
    forward/backward, optimizer), excluding evaluation and checkpointing. CPU time, not wall time, so
    that other load on a shared machine does not distort the per-policy ratios."""

    def __new__(cls):
        from composer.core import Callback

        class _Timer(Callback):
            def __init__(self):
                self.seconds, self.steps, self._t0 = 0.0, 0, None

            def before_dataloader(self, state, logger):
                self._t0 = time.process_time()

            def batch_end(self, state, logger):
                if self._t0 is not None:
                    self.seconds += time.process_time() - self._t0
                    self.steps += 1
                    self._t0 = None

        return _Timer()


def run_training(cfg: TrainConfig, result_path: str) -> dict[str, Any]:
    """Train (or load the recorded result of a finished run)."""
    from training.run import train

    config = cfg.model_dump(mode="json")
    if _cached(result_path, config):
        with open(result_path) as f:
            return json.load(f)
    timer = StepTimer()
    out = train(cfg, callbacks=[timer])
    with open(out["summary"]) as f:
        summary = json.load(f)
    res = {"name": os.path.basename(cfg.output_dir), "final_weights": out["final_weights"],
           "step_seconds": timer.seconds / max(timer.steps, 1), "summary": summary,
           "final_reference": out.get("final_reference"), "config": config}
    atomic_write_text(result_path, json.dumps(res))
    return res


# selection keys a policy does not read (a finished full/random run stays valid when the refresh setting changes)
_UNUSED_BY = {p: ("refresh_steps", "ref_lr", "lam", "ref_weight_decay", "ref_grad_clip", "refresh_batch_size",
                  "refresh_candidate_batches", "rho1_steps", "reference_weights") for p in ("full", "random")}


REUSED: list[str] = []  # runs of this invocation taken from an earlier one


def _effective(config: dict[str, Any]) -> dict[str, Any]:
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


@torch.inference_mode()
def eval_loss(mcfg: ModelConfig, weights: str, shard_dir: str, *, batch: int = 32) -> float:
    """Mean token loss of a model over every sequence of a shard directory (position 0 excluded)."""
    model = build_causal_lm(mcfg.model_copy(update={"weights": weights})).eval()
    ds = open_shards(shard_dir, "candidate")
    total, count = 0.0, 0
    for i in range(0, len(ds), batch):
        toks = torch.as_tensor(np.stack([ds[j]["tokens"].astype(np.int64) for j in range(i, min(i + batch, len(ds)))]))
        losses, valid = token_losses(model(input_ids=toks).logits, toks)
        total += float(losses[valid].double().sum())
        count += int(valid.sum())
    return total / count


def save_hf(mcfg: ModelConfig, weights: str, tokenizer_json: str, directory: str) -> None:
    """The final model as an HF directory (save_pretrained + tokenizer) any evaluation harness can load."""
    from transformers import PreTrainedTokenizerFast

    model = build_causal_lm(mcfg.model_copy(update={"weights": weights}))
    model.save_pretrained(directory, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token="<|endoftext|>").save_pretrained(directory)


# ------------------------------------------------------------------------------------------------
def _mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(xs: list[float]) -> str:
    m, sd = _mean_std(xs)
    return f"{m:.3f} ± {sd:.3f}" if len(xs) > 1 else f"{m:.3f}"


def _final_val(res: dict[str, Any]) -> float:
    return res["summary"]["validation"][-1]["loss"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("runs", "quality"), help="output directory")
    ap.add_argument("--quick", action="store_true", help="CI smoke setting (tiny data and models, ≤ 3 minutes)")
    ap.add_argument("--seeds", type=int, default=None, help="override the number of seeds")
    ap.add_argument("--steps", type=int, default=None, help="override the proxy steps per run")
    args = ap.parse_args(argv)
    if not os.path.isdir(SHARED):
        print(f"error: the quality benchmark reads real text from {os.path.abspath(SHARED)}, which is absent",
              file=sys.stderr)
        return 2
    s = QUICK if args.quick else FULL
    if args.seeds:
        s = replace(s, seeds=args.seeds)
    if args.steps:
        s = replace(s, steps=args.steps)
    out = args.out
    t_start = time.perf_counter()
    REUSED.clear()  # counted per invocation
    torch.set_num_threads(s.threads)
    os.makedirs(os.path.join(out, "configs"), exist_ok=True)

    # 1. data --------------------------------------------------------------------------------------
    dirs: dict[str, Any] = {}
    for name, pcfg in data_configs(s, out).items():
        atomic_write_text(os.path.join(out, "configs", f"prepare_{name}.yaml"),
                          yaml.safe_dump(pcfg.model_dump(mode="json"), sort_keys=False))
        res = prepare(pcfg)
        dirs[name] = res
        print(f"[data] {name}: " + ", ".join(f"{k} {m.totals().sequences} seq" for k, m in res.manifests.items()),
              flush=True)
    tok = dirs["pool"].tokenizer.path
    pool_m = dirs["pool"].manifests["candidates"]
    domain = {name: dom for name, _, _, dom, _, _ in SOURCES}
    pool_share = {k: c.sequences / pool_m.totals().sequences for k, c in pool_m.sources.items()}
    math_share = sum(v for k, v in pool_share.items() if domain[k] == "math")

    def tcfg(name: str, *, policy: str, seed: int, data: str = "pool", mcfg: ModelConfig,
             steps: int | None = None, write_selected: bool = False, **sel: Any) -> TrainConfig:
        d = dirs[data].dirs
        sel_defaults = dict(policy=policy, gamma=s.gamma, warmup_steps=s.warmup, tau=s.tau, rho1_steps=s.rho1_steps,
                            seed=seed, refresh_steps=best.get("refresh_steps", 20) if best else 20,
                            ref_lr=best.get("ref_lr") if best else None, lam=best.get("lam", 1.0) if best else 1.0,
                            refresh_batch_size=best.get("refresh_batch_size") if best else None)
        sel_defaults.update(sel)
        n = steps or s.steps
        return TrainConfig(
            data=DataConfig(candidates=d["candidates"], validation=dirs["pool"].dirs["validation"], tokenizer=tok),
            model=mcfg, selection=SelectionConfig(**sel_defaults), optim=OptimConfig(lr=s.lr),
            eval=EvalConfig(interval=s.eval_interval, batch_size=32, max_batches=s.eval_batches),
            checkpoint=CheckpointConfig(interval=n, keep=1), output_dir=os.path.join(out, "runs", name),
            batch_size=s.batch, max_steps=n, seed=seed, threads=s.threads, progress_bar=False, plots=False,
            write_selected=write_selected, distance_interval=max(1, s.tau // 10),
        )

    def run(name: str, **kw: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        cfg = tcfg(name, **kw)
        res = run_training(cfg, os.path.join(out, "runs", name, "result.json"))
        print(f"[run] {name}: val {_final_val(res):.3f}, {res['step_seconds'] * 1e3:.0f} ms/step "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        return res

    # 2. base models (off-domain only) ---------------------------------------------------------------
    best: dict[str, Any] | None = None
    small, big = model_config(s), model_config(s, big=True)
    base = run("base", policy="full", seed=0, data="base", mcfg=small, steps=s.base_steps)
    base_w = base["final_weights"]
    start = model_config(s, weights=base_w)

    # 3. refresh-strength sweep for blade, chosen by final validation loss (seed 0) ------------------
    sweep, sweep_runs = [], []
    for i, cand in enumerate(s.sweep):
        res = run(f"sweep{i}-blade", policy="blade", seed=0, mcfg=start, write_selected=True, **cand)
        sweep_runs.append(res)
        sweep.append({"setting": cand, "val_loss": _final_val(res), "name": res["name"],
                      "param_distance_mean": _mean_dist(res)})
    chosen = min(range(len(sweep)), key=lambda i: sweep[i]["val_loss"])
    best = dict(sweep[chosen]["setting"])
    print(f"[sweep] chosen by validation loss: {best}", flush=True)

    # 4. the comparison: every policy, equal proxy steps, several seeds ------------------------------
    main_runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for seed in range(s.seeds):
        for p in POLICIES:
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

    # 6. the long horizon: does the proxy's validation loss pass the static reference's? -------------
    long_runs = {p: run(f"long-{p}", policy=p, seed=0, mcfg=start, steps=s.long_steps) for p in ("full", "rho1", "blade")}

    # 7. transfer (BLADE-Tr): a larger model trained on the selected tokens vs a random-γ selection ----
    big_base = run("base-big", policy="full", seed=0, data="base", mcfg=big, steps=s.base_steps)
    transfer = {}
    for src in ("blade", "random"):
        transfer[src] = run_replay(s, out, src, main_runs[src][0], big, big_base["final_weights"], dirs, tok)

    # 8. evaluation on GSM8K test, models saved as HF directories -------------------------------------
    eval_dir = dirs["eval"].dirs["candidates"]
    cache_path = os.path.join(out, "eval_cache.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}

    def evaluate(name: str, mcfg: ModelConfig, weights: str, shards: str = eval_dir) -> float:
        key = f"{name}@{sha256_file(weights)[:16]}"  # a retrained run is evaluated again
        if shards != eval_dir:
            key += f"@{os.path.basename(shards)}"
        if key not in cache:
            cache[key] = eval_loss(mcfg, weights, shards)
            atomic_write_text(cache_path, json.dumps(cache, indent=1))
        return cache[key]

    base_eval = evaluate("base", small, base_w)
    evals = {p: [evaluate(r["name"], small, r["final_weights"]) for r in rs] for p, rs in main_runs.items()}
    for p, rs in main_runs.items():
        for k, r in enumerate(rs):  # models/<policy>-seed<k>/ (blade seed 0 is the chosen sweep run)
            save_hf(small, r["final_weights"], tok, os.path.join(out, "models", f"{p}-seed{k}"))
    gamma_eval = {g: evaluate(r["name"], small, r["final_weights"]) for g, r in gamma_runs.items()}
    tau_eval = {t: evaluate(r["name"], small, r["final_weights"]) for t, r in tau_runs.items()}
    big_base_eval = evaluate("base-big", big, big_base["final_weights"])
    transfer_eval = {k: evaluate(f"replay-{k}", big, v["final_weights"]) for k, v in transfer.items()}
    for k, v in transfer.items():
        save_hf(big, v["final_weights"], tok, os.path.join(out, "models", f"replay-{k}-big"))

    # the static RHO-1 reference itself: on the validation slice it was trained on, and on GSM8K test
    ref_w = long_runs["rho1"].get("final_reference")
    static_ref = None if not ref_w else {
        "val": evaluate("static-reference", small, ref_w, dirs["pool"].dirs["validation"]),
        "gsm8k_test": evaluate("static-reference", small, ref_w),
    }

    results = {
        "setting": asdict(s), "quick": args.quick, "best_refresh": best, "sweep": sweep,
        "pool_share": pool_share, "math_share": math_share,
        "pool_counts": {k: c.model_dump() for k, c in pool_m.sources.items()},
        "base_eval_gsm8k_test": base_eval, "big_base_eval_gsm8k_test": big_base_eval,
        "eval_gsm8k_test": evals,
        "final_val": {p: [_final_val(r) for r in rs] for p, rs in main_runs.items()},
        "val_curves": {p: [r["summary"]["validation"] for r in rs] for p, rs in main_runs.items()},
        "long_val_curves": {p: r["summary"]["validation"] for p, r in long_runs.items()},
        "long_refreshes": {p: r["summary"].get("refreshes", []) for p, r in long_runs.items()},
        "long_eval_gsm8k_test": {p: evaluate(r["name"], small, r["final_weights"]) for p, r in long_runs.items()},
        "static_reference": static_ref,
        "step_seconds": {p: [r["step_seconds"] for r in rs] for p, rs in main_runs.items()},
        "kept_share": {p: _kept(rs[0]) for p, rs in main_runs.items()},
        "param_distance": {p: rs[0]["summary"].get("param_distance", []) for p, rs in main_runs.items()},
        "refreshes": {p: rs[0]["summary"].get("refreshes", []) for p, rs in main_runs.items()},
        "gamma_sweep": {str(g): {"val": _final_val(r), "gsm8k_test": gamma_eval[g]} for g, r in gamma_runs.items()},
        "tau_sweep": {str(t): {"val": _final_val(r), "gsm8k_test": tau_eval[t]} for t, r in tau_runs.items()},
        "transfer": {k: {"gsm8k_test": transfer_eval[k], "val": v["validation"][-1]["loss"] if v["validation"] else None}
                     for k, v in transfer.items()},
        "wall_seconds": time.perf_counter() - t_start,
        "reused_runs": sorted(set(REUSED)),
    }
    atomic_write_text(os.path.join(out, "results.json"), json.dumps(results, indent=1))
    figs = make_figures(results, main_runs, os.path.join(out, "figures"))
    atomic_write_text(os.path.join(out, "RESULTS.md"), results_md(results, figs, s, args))
    print(f"[done] {os.path.join(out, 'RESULTS.md')} in {results['wall_seconds'] / 60:.1f} min")
    return 0


def _mean_dist(res: dict[str, Any]) -> float | None:
    pts = res["summary"].get("param_distance") or []
    return statistics.fmean(p["value"] for p in pts) if pts else None


def _kept(res: dict[str, Any]) -> dict[str, float]:
    per = res["summary"]["tokens"]["per_source"]
    return {k: v["kept_fraction"] for k, v in sorted(per.items())}


def run_replay(s: Setting, out: str, src: str, res: dict[str, Any], big: ModelConfig, big_base_w: str,
               dirs: dict[str, Any], tok: str) -> dict[str, Any]:
    """Train the larger model on the selected-token shards of one run (one pass, training order)."""
    from training.run import replay

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


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def make_figures(results: dict[str, Any], main_runs: dict[str, list[dict[str, Any]]], fig_dir: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(fig_dir, exist_ok=True)
    figs: dict[str, str] = {}

    def save(fig, name):
        path = os.path.join(fig_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        figs[name] = path

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p, rs in main_runs.items():
        for i, r in enumerate(rs):
            v = r["summary"]["validation"]
            ax.plot([x["step"] for x in v], [x["loss"] for x in v], color=f"C{POLICIES.index(p)}",
                    alpha=1.0 if i == 0 else 0.35, label=p if i == 0 else None)
    ax.set(xlabel="proxy step", ylabel="validation loss (GSM8K train slice)", title="Validation loss per policy")
    ax.legend()
    save(fig, "val_loss.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p, curve in results["long_val_curves"].items():
        ax.plot([x["step"] for x in curve], [x["loss"] for x in curve], color=f"C{POLICIES.index(p)}", label=p)
    if results.get("static_reference"):
        ax.axhline(results["static_reference"]["val"], color="gray", ls="--",
                   label="static reference (trained on this slice)")
    ax.set(xlabel="proxy step", ylabel="validation loss", title="Long horizon")
    ax.legend()
    save(fig, "long_horizon.png")

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    for col, p in enumerate(("blade", "rho1")):
        hists = main_runs[p][0]["summary"].get("delta_histograms") or {}
        keys = sorted(hists, key=int)
        picks = [keys[0], keys[len(keys) // 2], keys[-1]] if len(keys) >= 3 else keys
        for ax, k in zip(axes, picks, strict=False):
            h = hists[k]
            edges = np.asarray(h["edges"])
            counts = np.asarray(h["counts"][1:-1] if len(h["counts"]) == len(edges) + 1 else h["counts"], float)
            centers = (edges[:-1] + edges[1:]) / 2
            ax.plot(centers, counts / max(counts.sum(), 1), color=f"C{col}", label=f"{p} (episode {k})")
            ax.set(xlabel="Δ = ℓ(u) − ℓ(w)", title=f"point {picks.index(k) + 1}")
            ax.legend(fontsize=7)
    axes[0].set_ylabel("share of tokens")
    save(fig, "delta_hist.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p in ("blade", "blade-nosync", "rho1"):
        pts = results["param_distance"].get(p) or []
        ax.plot([x["step"] for x in pts], [x["value"] for x in pts], label=p)
    ax.set(xlabel="proxy step", ylabel="‖u − w‖₂", title="Proxy–reference distance (with vs without sync)")
    ax.legend()
    save(fig, "param_distance.png")

    for key, xlabel, name in (("gamma_sweep", "γ", "gamma_sweep.png"), ("tau_sweep", "τ", "tau_sweep.png")):
        sw = results[key]
        xs = sorted(sw, key=float)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([float(x) for x in xs], [sw[x]["val"] for x in xs], "o-", label="validation")
        ax.plot([float(x) for x in xs], [sw[x]["gsm8k_test"] for x in xs], "s-", label="GSM8K test")
        ax.set(xlabel=xlabel, ylabel="token loss", title=f"BLADE, {xlabel} sweep")
        ax.legend()
        save(fig, name)
    return figs


def results_md(r: dict[str, Any], figs: dict[str, str], s: Setting, args: argparse.Namespace) -> str:
    full_t = statistics.fmean(r["step_seconds"]["full"])
    lines = [
        "# BLADE quality benchmark (miniature, real public text)",
        "",
        f"Produced by `python jobs/bench_quality.py{' --quick' if args.quick else ''} --out {args.out}` "
        f"in {r['wall_seconds'] / 60:.1f} minutes on this machine (2 CPU cores)"
        + (f"; {len(r['reused_runs'])} runs finished by an earlier invocation with the same settings were reused, "
           "so this is not the from-scratch time." if r.get("reused_runs") else "."),
        "",
        "## Setting",
        "",
        f"- Llama {s.hidden}×{s.layers} (tied embeddings), BPE vocabulary {s.vocab}, context {s.seq_len}; "
        f"base pretrained {s.base_steps} steps on off-domain text only.",
        f"- Candidate pool: {sum(c['sequences'] for c in r['pool_counts'].values())} sequences, "
        f"{r['math_share'] * 100:.0f}% math (per source below).",
        f"- {s.steps} proxy steps × {s.batch} × {s.seq_len} tokens per policy, γ = {s.gamma}, W = {s.warmup}, "
        f"τ = {s.tau}, {s.seeds} seed(s); lr {s.lr} (AdamW, wd 0.01, clip 1.0, constant).",
        f"- RHO-1: static reference trained {s.rho1_steps} steps on the validation slice from the base model.",
        "- Validation (target) = first 500 GSM8K train problems (not in the pool); evaluation = GSM8K test "
        "token loss (never used for any choice).",
        "",
        "## Held-out loss per policy (lower is better)",
        "",
        "| policy | GSM8K test (mean ± std) | validation (final) | time/step vs full |",
        "|---|---|---|---|",
        f"| base (no CPT) | {r['base_eval_gsm8k_test']:.3f} | | |",
    ]
    for p in POLICIES:
        lines.append(f"| {p} | {_fmt(r['eval_gsm8k_test'][p])} | {_fmt(r['final_val'][p])} | "
                     f"{statistics.fmean(r['step_seconds'][p]) / full_t:.2f}× |")
    lines += ["", "## Refresh-strength sweep (blade, seed 0; chosen by validation loss)", "",
              "| setting | final validation loss | mean ‖u − w‖ |", "|---|---|---|"]
    for row in r["sweep"]:
        d = row["param_distance_mean"]
        lines.append(f"| `{json.dumps(row['setting'])}` | {row['val_loss']:.3f} | {d:.2f} |" if d is not None
                     else f"| `{json.dumps(row['setting'])}` | {row['val_loss']:.3f} | |")
    lines += ["", f"Chosen: `{json.dumps(r['best_refresh'])}`.", "",
              "## Kept share per source (seed 0)", "",
              "| source | pool share | " + " | ".join(POLICIES) + " |", "|---|---|" + "---|" * len(POLICIES)]
    for src in sorted(r["pool_share"]):
        lines.append(f"| {src} | {r['pool_share'][src] * 100:.1f}% | "
                     + " | ".join(_pct(r["kept_share"][p].get(src)) for p in POLICIES) + " |")
    lines += ["", "## γ and τ sweeps (blade, seed 0)", "", "| γ | validation | GSM8K test |", "|---|---|---|"]
    lines += [f"| {g} | {v['val']:.3f} | {v['gsm8k_test']:.3f} |" for g, v in r["gamma_sweep"].items()]
    lines += ["", "| τ | validation | GSM8K test |", "|---|---|---|"]
    lines += [f"| {t} | {v['val']:.3f} | {v['gsm8k_test']:.3f} |" for t, v in r["tau_sweep"].items()]
    lines += ["", f"## Long horizon ({s.long_steps} steps, seed 0)", "",
              "| policy | final validation | GSM8K test |", "|---|---|---|"]
    lines += [f"| {p} | {r['long_val_curves'][p][-1]['loss']:.3f} | {r['long_eval_gsm8k_test'][p]:.3f} |"
              for p in r["long_val_curves"]]
    lines += ["", f"## Transfer (BLADE-Tr): Llama {s.big_hidden}×{s.big_layers} replaying selected tokens", "",
              "| selected tokens from | GSM8K test | validation |", "|---|---|---|",
              f"| (big base, no CPT) | {r['big_base_eval_gsm8k_test']:.3f} | |"]
    for k, v in r["transfer"].items():
        val = f"{v['val']:.3f}" if v["val"] is not None else ""
        lines.append(f"| {k} (seed 0, γ = {s.gamma}) | {v['gsm8k_test']:.3f} | {val} |")
    lines += ["", "## Figures", ""]
    lines += [f"![{name}](figures/{name})" for name in figs]
    lines += ["", "## What the numbers say (generated)", ""]
    f_mean, f_sd = _mean_std(r["eval_gsm8k_test"]["full"])
    for p in POLICIES[1:]:
        m, sd = _mean_std(r["eval_gsm8k_test"][p])
        noise = 2 * max(f_sd, sd)
        if len(r["eval_gsm8k_test"][p]) < 2:
            verdict = "one seed: no noise estimate"
        else:
            verdict = "within seed noise" if abs(m - f_mean) <= noise else ("better" if m < f_mean else "worse")
            verdict += f"; 2×std = {noise:.3f}"
        lines.append(f"- {p} vs full on GSM8K test: {m - f_mean:+.3f} nats ({verdict}).")
    crossing = _crossing(r)
    lines.append(f"- Static reference (rho1) validation loss vs the blade proxy's: {crossing}")
    lines.append("")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"


def _crossing(r: dict[str, Any]) -> str:
    """When the proxies' validation loss falls below the static RHO-1 reference's own, and how they
    compare on GSM8K test."""
    ref = r.get("static_reference")
    if not ref:
        return "static reference not saved."
    ref_val = ref["val"]
    test = ", ".join(f"{p} {v:.3f}" for p, v in r["long_eval_gsm8k_test"].items())
    head = (f"the static reference's loss is {ref_val:.3f} on the validation slice (which it was trained on) and "
            f"{ref['gsm8k_test']:.3f} on GSM8K test (proxies after {r['setting']['long_steps']} steps: {test}); ")
    out = []
    for p in ("blade", "rho1", "full"):
        step = next((pt["step"] for pt in r["long_val_curves"][p] if pt["loss"] < ref_val), None)
        out.append(f"the {p} proxy passes it at step {step}" if step is not None
                   else f"the {p} proxy does not pass it within {r['setting']['long_steps']} steps")
    return head + "; ".join(out) + "."


if __name__ == "__main__":
    sys.exit(main())
