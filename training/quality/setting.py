"""Settings of the quality benchmark: presets, data (pool, base, validation, evaluation sets) and the compute
model (FLOPs per policy).

Data, all from ``../shared/data`` (each source's SOURCE.md):

* validation (target) slice: the first 500 GSM8K *train* problems (not in the pool);
* pool: in-domain math in GSM8K's style and textbooks (GSM8K train minus the validation slice, OpenIntro
  Statistics and HoTT LaTeX) mixed with off-domain text (C4, WikiText-2, LAMBADA, BoolQ, PubMedQA, Tiny
  Shakespeare);
* base model data: the first ~40% of the documents of each off-domain source (disjoint from the pool);
* evaluation sets, in no pool and no validation set: GSM8K test (the target's distribution), MATH test and
  AQuA (math in other styles), and held-out slices of WikiText-2, LAMBADA and C4 (general text: forgetting),
  taken right after each source's base slice and skipped by the pool.

Nothing is chosen on an evaluation set: the refresh strength is chosen by validation loss only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from curation.core.schedule import Schedule
from curation.evaluation import flops
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
from schemas.train_config import ModelConfig

__all__ = ["SHARED", "POLICIES", "SOURCES", "EVAL_SETS", "VAL_DOCS", "Setting", "PRESETS", "QUICK",
           "data_configs", "eval_sources", "model_config", "Compute", "compute", "equal_compute_steps",
           "forward_flops_per_token"]

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "..", "shared",
                      "data")
POLICIES = ("full", "random", "rho1", "blade", "blade-nosync")

# (name, file(s) under ../shared/data, how to read a record, domain, documents for the base model (off-domain),
#  held-out evaluation documents right after the base slice, pool cap (documents, None = all the rest))
SOURCES: list[tuple[str, list[str], dict[str, Any], str, int, int, int | None]] = [
    ("gsm8k", ["gsm8k/train.jsonl"], {"template": "{question}\n{answer}"}, "math", 0, 0, 3000),
    ("openintro", ["textbook_openintro_stats/openintro_stats_tex.jsonl"], {}, "math", 0, 0, 10),
    ("hott", ["textbook_hott/hott_tex.jsonl"], {}, "math", 0, 0, 3),
    ("c4", ["c4_sample/c4_sample.jsonl"], {}, "general", 400, 100, None),
    ("wikitext2", ["wikitext2/valid.txt", "wikitext2/test.txt"], {}, "general", 992, 200, None),
    ("lambada", ["lambada/lambada_openai.jsonl"], {"template": "{context} {continuation}"}, "general", 2061, 300, None),
    ("boolq", ["boolq/boolq.jsonl"], {"text_field": "query"}, "general", 1308, 0, None),
    ("pubmedqa", ["pubmedqa/pubmed_qa_labeled.jsonl"], {"template": "{context} {continuation}"}, "general", 400, 0,
     None),
    ("shakespeare", ["tinyshakespeare/input.txt"], {}, "general", 2889, 0, None),
]
# evaluation sets that are whole files (or a prefix): (name, files, how, documents (None = all), group)
EVAL_FILES: list[tuple[str, list[str], dict[str, Any], int | None, str]] = [
    ("gsm8k_test", ["gsm8k/test.jsonl"], {"template": "{question}\n{answer}"}, None, "target"),
    ("math_test", ["math_hendrycks/test.jsonl"], {"template": "{problem}\n{solution}"}, 500, "math, other styles"),
    ("aqua", ["aqua_rat/dev.json"], {"template": "{question}\n{rationale}"}, None, "math, other styles"),
]
#: every evaluation set and its group (the held-out general slices are named <source>_heldout)
EVAL_SETS: dict[str, str] = {**{n: g for n, _, _, _, g in EVAL_FILES},
                             **{f"{n}_heldout": "general (forgetting)" for n, _, _, _, _, held, _ in SOURCES if held}}
VAL_DOCS = 500  # first GSM8K train problems: the validation (target) slice, skipped in the pool


@dataclass
class Setting:
    """Sizes of one benchmark setting (a preset)."""

    doc_scale: float = 1.0  # multiplies every document count (quick mode shrinks the corpus)
    pool_doc_cap: int | None = None  # cap on the documents of every pool source (quick mode)
    skip_sources: tuple[str, ...] = ()
    tokenizer: str | None = None  # a tokenizer.json under ../shared/data; None = train a BPE of `vocab` tokens
    vocab: int = 4096  # BPE size, or the model's (padded) vocabulary with a given tokenizer
    hidden: int = 128
    layers: int = 4
    big_hidden: int = 192  # transfer target (BLADE-Tr)
    big_layers: int = 6
    transfer: bool = True
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
    eval_docs: int | None = None  # cap on the documents of every evaluation set (None = the sizes above)
    threads: int = 2
    precision: str = "fp32"
    checkpoint_interval: int | None = None  # None = only at the end of a run
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
    long_steps: int = 600  # the long horizon (full, rho1, blade; seed 0; = steps: the main runs' seed 0)


CPU = Setting()
# One H100-class GPU, about 30-40 minutes (an estimate: not run yet, see README): a 51M-parameter Llama with the
# GPT-2 tokenizer, context 512, 2,000 proxy steps, 3 seeds; the main runs are the long horizon (long_steps =
# steps: 2,000 steps, 9 refreshes); one refresh setting (K/τ = 0.2 with batches of b sequences, the CPU
# sweep's winning shape at a cheaper K), no γ/τ sweeps and no transfer run, to fit the time; checkpoints every
# 500 steps, so it can be run in pieces.
GPU = Setting(
    tokenizer="tokenizer_gpt2/gpt2_tokenizer.json", vocab=50304, hidden=512, layers=8, transfer=False, seq_len=512,
    batch=16, base_steps=1000, steps=2000, seeds=3, lr=3e-4, warmup=200, tau=200, rho1_steps=400, eval_interval=200,
    eval_batches=20, threads=16, precision="amp_bf16", checkpoint_interval=500,
    sweep=[{"refresh_steps": 40, "ref_lr": 3e-4, "lam": 0.25, "refresh_batch_size": 16}],
    gammas=(0.6,), taus=(200,), long_steps=2000,
)
QUICK = Setting(
    doc_scale=0.02, pool_doc_cap=30, skip_sources=("openintro", "hott"), vocab=1024, hidden=32, layers=1, big_hidden=48,
    big_layers=1, seq_len=64, batch=8, base_steps=8, steps=8, seeds=1, warmup=2, tau=3, rho1_steps=3, eval_interval=4,
    eval_batches=2, eval_docs=40, threads=2,
    sweep=[{"refresh_steps": 2, "ref_lr": 1e-3, "lam": 1.0}, {"refresh_steps": 3, "ref_lr": 3e-3, "lam": 1.0}],
    gammas=(0.4, 0.6), taus=(3, 4), long_steps=12,
)
PRESETS = {"cpu": CPU, "gpu": GPU}


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def _cap(n: int | None, scale: float, limit: int | None = None) -> int | None:
    n = None if n is None else max(1, int(round(n * scale)))
    return limit if n is None else (n if limit is None else min(n, limit))


def _src(name: str, files: list[str], how: dict[str, Any], **kw: Any) -> SourceConfig:
    return SourceConfig(name=name, paths=[os.path.join(SHARED, f) for f in files], **how, **kw)


def eval_sources(s: Setting) -> list[SourceConfig]:
    """The evaluation sets (read by curation.evaluation.heldout, whole documents)."""
    out = [_src(name, files, how, max_documents=_cap(n, s.doc_scale, s.eval_docs))
           for name, files, how, n, _ in EVAL_FILES]
    for name, files, how, _, base_docs, held, _ in SOURCES:
        if held and name not in s.skip_sources:
            out.append(_src(f"{name}_heldout", files, how, skip_documents=_cap(base_docs, s.doc_scale),
                            max_documents=_cap(held, s.doc_scale, s.eval_docs)))
    return out


def data_configs(s: Setting, out: str) -> dict[str, PrepareConfig]:
    """The two preparations: pool (+ validation; trains the tokenizer unless one is given) and base."""
    pool, base = [], []
    for name, files, how, domain, base_docs, held, cap in SOURCES:
        if name in s.skip_sources:
            continue
        if domain == "math":
            skip = VAL_DOCS if name == "gsm8k" else 0
            pool.append(_src(name, files, how, skip_documents=skip, max_documents=_cap(cap, s.doc_scale, s.pool_doc_cap)))
        else:
            b = _cap(base_docs, s.doc_scale)
            h = _cap(held, s.doc_scale) if held else 0
            base.append(_src(name, files, how, max_documents=b))
            pool.append(_src(name, files, how, skip_documents=b + h,
                             max_documents=_cap(cap, s.doc_scale, s.pool_doc_cap)))
    val = _src("gsm8k_val", ["gsm8k/train.jsonl"], {"template": "{question}\n{answer}"},
               max_documents=_cap(VAL_DOCS, max(s.doc_scale, 0.1)))
    if s.tokenizer:
        pool_tok = base_tok = TokenizerConfig(path=os.path.join(SHARED, s.tokenizer))
    else:
        pool_tok = TokenizerConfig(vocab_size=s.vocab)
        base_tok = TokenizerConfig(path=os.path.join(out, "data", "pool", "tokenizer", "tokenizer.json"))
    common = dict(seq_len=s.seq_len, progress=False)
    return {
        "pool": PrepareConfig(sources=pool, validation=[val], tokenizer=pool_tok,
                              output_dir=os.path.join(out, "data", "pool"), **common),
        "base": PrepareConfig(sources=base, validation=[val], tokenizer=base_tok,
                              output_dir=os.path.join(out, "data", "base"), **common),
    }


def model_config(s: Setting, *, big: bool = False, weights: str | None = None) -> ModelConfig:
    h, n = (s.big_hidden, s.big_layers) if big else (s.hidden, s.layers)
    heads = max(1, h // 64) if h >= 512 else max(1, h // 32)
    return ModelConfig(hf_config={
        "model_type": "llama", "vocab_size": s.vocab, "hidden_size": h, "intermediate_size": _inter(h),
        "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": s.seq_len, "tie_word_embeddings": True, "attention_dropout": 0.0,
    }, weights=weights)


def _inter(h: int) -> int:
    return int(h * 8 / 3) // 8 * 8


# ------------------------------------------------------------------------------------------------
# compute
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compute:
    """FLOPs of one run, by part (forward = 2 FLOPs per weight per token + attention; backward = 2 forwards)."""

    proxy: float  # forward + backward of the proxy on every candidate token
    scoring: float  # reference forward on the candidate batches after the warm-up
    refresh: float  # reference training: the refreshes (blade) or the static reference (rho1)

    @property
    def total(self) -> float:
        return self.proxy + self.scoring + self.refresh


def forward_flops_per_token(s: Setting) -> float:
    """2·(weights used in matmuls, LM head included) + 2·layers·context·hidden (attention scores and values): the
    formula of :mod:`curation.evaluation.flops` (the trainer's MFU uses it too) for the setting's model."""
    shape = flops.ModelShape(hidden=s.hidden, layers=s.layers, intermediate=_inter(s.hidden), vocab=s.vocab,
                             context=s.seq_len)
    return flops.forward_flops_per_token(shape)


def compute(s: Setting, policy: str, steps: int, *, sel: dict[str, Any] | None = None) -> Compute:
    """Analytic FLOPs of ``steps`` proxy steps of ``policy`` with the selection settings ``sel`` (the
    refresh setting; keys of SelectionConfig), following the schedule of training/selection/algorithm.py: every
    step trains the proxy on b·L tokens (the masked ones too: a masked token still costs its share of the
    forward and backward pass); after the W warm-up steps the reference scores each candidate batch; a
    refresh runs K steps on a validation batch and (λ ≠ 0) a candidate batch of ``refresh_batch_size``
    sequences each, before steps W, W + τ, …; rho1 trains its static reference rho1_steps steps on
    validation batches once."""
    sel = sel or {}
    f = forward_flops_per_token(s)
    tokens = s.batch * s.seq_len
    warm, tau = sel.get("warmup_steps", s.warmup), sel.get("tau", s.tau)
    proxy = 3.0 * f * tokens * steps
    if policy in ("full", "random"):
        return Compute(proxy, 0.0, 0.0)
    rb = sel.get("refresh_batch_size") or max(1, s.batch // 4)
    scoring = f * tokens * max(0, steps - warm)
    if policy == "rho1":
        return Compute(proxy, scoring, 3.0 * f * rb * s.seq_len * sel.get("rho1_steps", s.rho1_steps))
    refreshes = Schedule(warm, tau, steps).num_refreshes()
    per_step = rb * s.seq_len * (2 if sel.get("lam", 1.0) != 0 else 1)
    return Compute(proxy, scoring, 3.0 * f * per_step * sel.get("refresh_steps", 20) * refreshes)


def equal_compute_steps(s: Setting, policy: str, sel: dict[str, Any] | None = None) -> int:
    """Steps of ``full`` with the FLOPs of ``s.steps`` steps of ``policy``."""
    return max(1, round(compute(s, policy, s.steps, sel=sel).total / compute(s, "full", 1).total))
