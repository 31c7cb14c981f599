"""Settings of the quality benchmark: presets, data (bases, pool, validation, evaluation sets) and models.

Data, all from ``../shared/data`` (each source's SOURCE.md). Every off-domain (general) source is cut into
consecutive document slices ``[base | base validation | held-out evaluation | pool]``:

* **bases**: the proxy and the target model are each pretrained from scratch on the *base* slices of the
  general sources only (C4, WikiText-2, LAMBADA, BoolQ, PubMedQA, Tiny Shakespeare, and, feeding the bases only,
  the US presidential speeches, 85 English novels, 26k Wikipedia articles and 17 books of folk tales), for a
  set number of tokens per parameter and at most ``MAX_EPOCHS`` passes, with the base-validation slices as
  their validation set (the loss curve that shows the base flattening);
* **validation (target)**: the first 500 GSM8K *train* problems (in no pool); the references train on it;
* **dev**: the next ``DEV_DOCS`` GSM8K train problems after the pool's (in no pool, no reference's training
  data, no evaluation set): the only data any choice is made on (BLADE's refresh setting, RHO-1's reference
  length);
* **pool** (two settings): ``gsm8k-in-pool``: in-domain math in GSM8K's style and textbooks (GSM8K train after
  the validation slice, capped; OpenIntro Statistics; HoTT) mixed with the pool slices of the general sources;
  ``paper`` (the paper's regime, the target's validation data not in the pool): the same without GSM8K train,
  its share taken by the other math sources and the general text;
* **evaluation sets**, in no pool, base or validation set and never used for any choice: GSM8K test (the
  target's distribution), MATH test and AQuA (math in other styles), and the held-out slices of WikiText-2,
  LAMBADA and C4 (general text: forgetting).

Two model sizes: the **proxy** (the selector: every policy's continual pre-training) and the **target** (a
model whose training FLOPs per token are ≥ 5× the proxy's, which replays the proxy's selected shards).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from bench.quality.compute import RunShape
from curation.evaluation.flops import ModelShape, forward_flops_per_token
from curation.evaluation.heldout import read_set
from schemas.config import PrepareConfig, SourceConfig, TokenizerConfig
from schemas.train_config import ModelConfig

__all__ = ["SHARED", "POLICIES", "SELECTORS", "RECORDED_ARMS", "ARM_POLICY", "ARM_TEXT", "SOURCES", "EVAL_SETS",
           "GENERAL_SETS", "VAL_DOCS", "DEV_DOCS", "MAX_EPOCHS", "SETTINGS", "Setting", "PRESETS", "QUICK",
           "CPU_ESTIMATE_MIN", "BUDGET_MIN", "data_configs", "dev_source", "document_hashes", "eval_sources",
           "model_config", "run_shape", "forward_flops", "arm_policy", "recorded_path"]

#: the shared data, resolved: the configs every run records name the same files from any checkout on the machine, so
#: a run started in one checkout resumes from another
SHARED = os.path.realpath(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                       "..", "shared", "data"))
#: the arms: the five policies of SelectionConfig, BLADE with the paper's λ = 1 as an arm of its own, and ``full``
#: with the target examples (the validation slice the references train on) mixed into every batch
POLICIES = ("full", "random", "rho1", "blade", "blade-nosync", "blade-lam1", "full+val")
#: the arms that choose tokens with a reference (a selector's run emits shards a target can replay)
SELECTORS = ("rho1", "blade", "blade-nosync", "blade-lam1")
#: the SelectionConfig policy each arm trains with (``full+val``: ``full`` with ``data.validation_share``)
ARM_POLICY = {"blade-lam1": "blade", "full+val": "full"}
#: the arms a recorded report (``Setting.recorded``) may supply, when this machine reproduces its floats
RECORDED_ARMS = ("random", "rho1", "blade", "blade-nosync")
#: what each arm is, in one line (the report's setting section)
ARM_TEXT = {
    "full": "every token of the pool (Base-CT)",
    "random": "a uniform γ share of the tokens (no model)",
    "rho1": "RHO-1: excess loss against a static reference, trained once on the validation slice and never "
            "refreshed",
    "blade": "BLADE with the setting chosen on the dev split: excess loss against a reference re-synchronised to "
             "the proxy every τ steps, then trained K steps",
    "blade-nosync": "BLADE without the re-sync: the reference is forked from the proxy at step W, then every τ "
                    "steps trained K more steps from where it was (never re-synchronised; not a frozen copy)",
    "blade-lam1": "BLADE with the paper's λ = 1 (the masked candidate loss in the refresh objective), η_w and K as "
                  "given, whatever the dev split chose",
    "full+val": "`full` with the target examples (the 500 validation problems the references train on) mixed into "
                "every batch at the share chosen on the dev split",
}


def arm_policy(arm: str) -> str:
    """The SelectionConfig policy an arm trains with."""
    return ARM_POLICY.get(arm, arm)


MAX_EPOCHS = 2  # passes over the base text, at most
#: the two pools every policy is run on: GSM8K train in the pool (the first design), and the paper's regime
SETTINGS = ("gsm8k-in-pool", "paper")

# (name, file(s) under ../shared/data, how to read a record, domain, documents for the bases, base-validation
#  documents, held-out evaluation documents, pool cap (documents; None = all the rest; 0 = bases only))
SOURCES: list[tuple[str, list[str], dict[str, Any], str, int, int, int, int | None]] = [
    ("gsm8k", ["gsm8k/train.jsonl"], {"template": "{question}\n{answer}"}, "math", 0, 0, 0, 3000),
    ("openintro", ["textbook_openintro_stats/openintro_stats_tex.jsonl"], {}, "math", 0, 0, 0, 10),
    ("hott", ["textbook_hott/hott_tex.jsonl"], {}, "math", 0, 0, 0, 3),
    ("c4", ["c4_sample/c4_sample.jsonl"], {}, "general", 500, 20, 100, None),
    ("wikitext2", ["wikitext2/valid.txt", "wikitext2/test.txt"], {}, "general", 1200, 40, 200, None),
    ("lambada", ["lambada/lambada_openai.jsonl"], {"template": "{context} {continuation}"}, "general", 2600, 80,
     300, None),
    ("boolq", ["boolq/boolq.jsonl"], {"text_field": "query"}, "general", 1700, 50, 0, None),
    ("pubmedqa", ["pubmedqa/pubmed_qa_labeled.jsonl"], {"template": "{context} {continuation}"}, "general", 500, 20,
     0, None),
    ("shakespeare", ["tinyshakespeare/input.txt"], {}, "general", 3600, 100, 0, None),
    ("speeches", ["us_presidential_speeches/state_union.jsonl", "us_presidential_speeches/inaugural.jsonl"], {},
     "general", 118, 6, 0, 0),
    ("novels", ["eltec_english_novels/eltec_english_novels.jsonl.zst"], {}, "general", 83, 2, 0, 0),
    ("wikipedia", ["wikipedia_en_2018_articles/wikipedia_en_2018_articles.jsonl.zst"], {}, "general", 26000, 270, 0,
     0),
    ("folktales", ["gutenberg_folk_fairy_tales/gutenberg_folk_fairy_tales.jsonl.zst"], {}, "general", 16, 1, 0, 0),
]
# evaluation sets that are whole files (or a prefix): (name, files, how, documents (None = all), group)
EVAL_FILES: list[tuple[str, list[str], dict[str, Any], int | None, str]] = [
    ("gsm8k_test", ["gsm8k/test.jsonl"], {"template": "{question}\n{answer}"}, None, "target"),
    ("math_test", ["math_hendrycks/test.jsonl"], {"template": "{problem}\n{solution}"}, 500, "math, other styles"),
    ("aqua", ["aqua_rat/dev.json"], {"template": "{question}\n{rationale}"}, None, "math, other styles"),
]
#: every evaluation set and its group (the held-out general slices are named <source>_heldout)
EVAL_SETS: dict[str, str] = {**{n: g for n, _, _, _, g in EVAL_FILES},
                             **{f"{n}_heldout": "general (forgetting)" for n, *_, held, _ in SOURCES if held}}
TARGET_SET = "gsm8k_test"
#: the general held-out sets forgetting is measured on
GENERAL_SETS = ("c4_heldout", "wikitext2_heldout", "lambada_heldout")
VAL_DOCS = 500  # first GSM8K train problems: the validation (target) slice, skipped in the pool
DEV_DOCS = 500  # GSM8K train problems right after the pool's: the dev split every choice is made on
_GSM8K = ("gsm8k/train.jsonl", "{question}\n{answer}")


@dataclass(frozen=True)
class Setting:
    """Sizes of one benchmark setting (a preset)."""

    # data
    doc_scale: float = 1.0  # multiplies every document count (quick mode shrinks the corpus)
    pool_doc_cap: int | None = None  # cap on the documents of every pool source (quick mode)
    base_doc_cap: int | None = None  # cap on the documents of every base slice (quick mode)
    skip_sources: tuple[str, ...] = ()
    tokenizer: str | None = None  # a tokenizer.json under ../shared/data; None = train a BPE of `vocab` tokens
    vocab: int = 2048  # BPE size, or the model's (padded) vocabulary with a given tokenizer
    seq_len: int = 128
    # models: the proxy (selector) and the target (≥ 5× the proxy's FLOPs per token)
    hidden: int = 64
    layers: int = 4
    target_hidden: int = 160
    target_layers: int = 5
    # bases: pretrained from scratch on the general base slices for this many tokens per parameter (the run
    # stops with an error if that would take more than MAX_EPOCHS passes over the base text)
    base_tokens_per_parameter: float = 30.0
    target_base_tokens_per_parameter: float = 10.0
    base_batch: int = 16
    base_lr: float = 2e-3
    base_eval_interval: int = 250
    # continual pre-training of the proxy (every policy)
    batch: int = 8
    steps: int = 2000
    seeds: int = 3
    lr: float = 1e-3
    warmup: int = 100
    tau: int = 100
    gamma: float = 0.6
    rho1_steps: int = 200
    eval_interval: int = 100
    eval_batches: int | None = 8
    curve_interval: int = 500  # snapshots every this many steps, scored on the target evaluation set (curves)
    # refresh settings for blade (keys of SelectionConfig), compared at equal compute on the dev split: λ (with
    # 0), η_w, the refresh batch and K/τ above and below the paper's 0.3
    sweep: tuple[dict[str, Any], ...] = field(default_factory=lambda: (
        {"refresh_steps": 30, "ref_lr": 3e-3, "lam": 0.25, "refresh_batch_size": 8},  # K/τ = 0.3 (the paper's)
        {"refresh_steps": 10, "ref_lr": 3e-3, "lam": 0.25, "refresh_batch_size": 8},  # K/τ = 0.1
        {"refresh_steps": 50, "ref_lr": 3e-3, "lam": 0.25, "refresh_batch_size": 8},  # K/τ = 0.5
        {"refresh_steps": 30, "ref_lr": 3e-3, "lam": 0.0, "refresh_batch_size": 8},  # validation only
        {"refresh_steps": 30, "ref_lr": 3e-3, "lam": 1.0, "refresh_batch_size": 8},
        {"refresh_steps": 30, "ref_lr": 1e-3, "lam": 0.25, "refresh_batch_size": 8},
        {"refresh_steps": 30, "ref_lr": 1e-2, "lam": 0.25, "refresh_batch_size": 8},
        {"refresh_steps": 30, "ref_lr": 3e-3, "lam": 0.25, "refresh_batch_size": 4},
        {"refresh_steps": 30, "ref_lr": 3e-3, "lam": 0.25, "refresh_batch_size": 16},
    ))
    # RHO-1's static reference length (steps on the validation slice), chosen on the same dev split
    rho1_sweep: tuple[int, ...] = (100, 200, 400)
    # the choices made again in the paper's pool (seed 0, dev split, equal compute), each family's candidates
    # (SelectionConfig keys): BLADE's refresh (λ and η_w), RHO-1's reference (length and η_w; the first is the
    # first setting's choice), full+val's share of target examples per batch
    paper_sweep: tuple[dict[str, Any], ...] = field(default_factory=lambda: (
        {"refresh_steps": 30, "ref_lr": 3e-3, "lam": 0.0, "refresh_batch_size": 8},  # the first setting's choice
        {"refresh_steps": 30, "ref_lr": 1e-3, "lam": 0.0, "refresh_batch_size": 8},
        {"refresh_steps": 30, "ref_lr": 3e-3, "lam": 1.0, "refresh_batch_size": 8},  # the paper's λ
    ))
    paper_rho1_sweep: tuple[dict[str, Any], ...] = field(default_factory=lambda: (
        {"rho1_steps": 400, "ref_lr": 3e-3, "refresh_batch_size": 8},  # the first setting's choice
        {"rho1_steps": 800, "ref_lr": 3e-3, "refresh_batch_size": 8},
        {"rho1_steps": 1600, "ref_lr": 3e-3, "refresh_batch_size": 8},
        {"rho1_steps": 400, "ref_lr": 1e-3, "refresh_batch_size": 8},
    ))
    full_val_shares: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4)
    # the settings with a full+val arm (its share chosen in each on the dev split)
    full_val_settings: tuple[str, ...] = ("paper",)
    # blade-lam1's setting: the paper's λ = 1 with the first setting's chosen η_w, K and refresh batch
    lam1: dict[str, Any] = field(default_factory=lambda: {"refresh_steps": 30, "ref_lr": 3e-3, "lam": 1.0,
                                                          "refresh_batch_size": 8})
    # reuse: the target replays the selected shards of every seed < reuse_seeds of these policies, against the
    # target's own `full` of the same seed (the paper setting replays fewer policies: the budget)
    reuse_policies: tuple[str, ...] = ("rho1", "blade", "blade-nosync", "random")
    paper_reuse_policies: tuple[str, ...] = ("rho1", "blade", "blade-lam1")
    reuse_seeds: int = 3
    reuse_runs: tuple[int, ...] = (1, 4, 16)  # target runs one selection is amortized over
    smooth_window: int = 3  # snapshots averaged (centred) before reading "reaches" and break-even R
    target_lr: float = 1e-3
    target_curve_interval: int = 500
    # the target runs' in-run validation (printed only: their curves are the snapshots' scores on the evaluation
    # sets); None = eval_interval
    target_eval_interval: int | None = 500
    # target `full` beyond `steps` (None: to the equal total compute of the costliest reused selection, base
    # charged, at the smallest R, so that every R is decided)
    target_extra_steps: int | None = None
    eval_docs: int | None = None  # cap on the documents of every evaluation set (None = the sizes above)
    # torch threads of each training run; the sweep, main and reuse stages train `parallel_runs` runs at a time
    # (bench.quality.pool: on 2 cores two 1-thread runs do ≈ 1.4-1.6× the work of one 2-thread run); the proxy's
    # base trains alone first with `base_threads` (the sweep starts from it), the target's base in the main
    # stage as one of its runs (with `threads`); the evaluation uses all_threads
    threads: int = 1
    parallel_runs: int = 2
    base_threads: int = 2
    precision: str = "fp32"
    checkpoint_interval: int | None = 500  # None = only at the end of a run
    # a report of an earlier run of this preset (results.json; relative to the checkout) whose arms
    # (RECORDED_ARMS, with their replays) are used instead of training them again, when they were trained with the
    # same settings and this machine reproduces that run's floats exactly (bench.quality.recorded); None = train
    recorded: str | None = None

    @property
    def all_threads(self) -> int:
        """The threads the benchmark uses at once (the parallel runs' or a base's): the evaluation's."""
        return max(self.threads * self.parallel_runs, self.base_threads)


CPU = Setting(recorded=os.path.join("docs", "results", "v7", "results.json"))
#: The CPU preset's planned wall minutes per stage on an idle 2-core machine: ``bench.quality.plan.plan``
#: computes them from the preset and its cost model (v7's measured rates on this machine kind); a test keeps these
#: equal. They assume the recorded v7 arms stand in (``Setting.recorded``) and that the paper pool's choices come
#: out as the first setting's; its ``contingencies_minutes`` add what trains otherwise.
CPU_ESTIMATE_MIN = {"data": 1, "bases": 10, "sweep": 18, "main": 61, "reuse": 71, "evaluate": 21}
#: The wall-time budget of the CPU preset (issue 54: ≤ 3 hours on this 2-core machine)
BUDGET_MIN = 180
# One H100-class GPU (not run: no GPU was available): the same design with a longer context, a larger batch and
# a larger target (5.4× the proxy's FLOPs per token), sized so that 10 tokens per parameter stay within 2 passes
# over the base text.
GPU = Setting(
    vocab=4096, seq_len=512, hidden=128, layers=2, target_hidden=256, target_layers=5, base_batch=32, batch=32,
    steps=4000, warmup=200, tau=200, rho1_steps=400, eval_interval=200, eval_batches=20, curve_interval=1000,
    base_tokens_per_parameter=20.0, target_base_tokens_per_parameter=10.0,
    sweep=tuple({**c, "refresh_steps": c["refresh_steps"] * 2, "refresh_batch_size": c["refresh_batch_size"] * 4}
                for c in CPU.sweep),
    rho1_sweep=(200, 400, 800),
    paper_sweep=tuple({**c, "refresh_steps": c["refresh_steps"] * 2, "refresh_batch_size": c["refresh_batch_size"] * 4}
                      for c in CPU.paper_sweep),
    paper_rho1_sweep=tuple({**c, "rho1_steps": c["rho1_steps"] * 2, "refresh_batch_size": c["refresh_batch_size"] * 4}
                           for c in CPU.paper_rho1_sweep),
    lam1={**CPU.lam1, "refresh_steps": 60, "refresh_batch_size": 32},
    target_curve_interval=500, threads=16, parallel_runs=1, base_threads=16,
    precision="amp_bf16", checkpoint_interval=1000,
)
QUICK = Setting(
    doc_scale=0.02, pool_doc_cap=20, base_doc_cap=30, skip_sources=("openintro", "hott", "novels", "folktales"),
    vocab=512, seq_len=64, hidden=32, layers=1, target_hidden=96, target_layers=1, base_tokens_per_parameter=0.3,
    target_base_tokens_per_parameter=0.1,
    base_batch=8, base_eval_interval=10, batch=8, steps=12, seeds=2, warmup=2, tau=3, rho1_steps=3, eval_interval=4,
    eval_batches=1, curve_interval=6,
    sweep=({"refresh_steps": 3, "ref_lr": 3e-3, "lam": 0.25, "refresh_batch_size": 4},
           {"refresh_steps": 1, "ref_lr": 3e-3, "lam": 0.0, "refresh_batch_size": 4}),
    rho1_sweep=(2, 3),
    paper_sweep=({"refresh_steps": 1, "ref_lr": 3e-3, "lam": 0.0, "refresh_batch_size": 4},
                 {"refresh_steps": 1, "ref_lr": 3e-3, "lam": 1.0, "refresh_batch_size": 4}),
    paper_rho1_sweep=({"rho1_steps": 3, "ref_lr": 3e-3, "refresh_batch_size": 4},
                      {"rho1_steps": 6, "ref_lr": 3e-3, "refresh_batch_size": 4}),
    full_val_shares=(1 / 8, 1 / 4), lam1={"refresh_steps": 1, "ref_lr": 3e-3, "lam": 1.0, "refresh_batch_size": 4},
    reuse_policies=("rho1", "blade", "random"), paper_reuse_policies=("rho1", "blade-lam1"), reuse_seeds=2,
    target_curve_interval=4, target_eval_interval=8, eval_docs=16, checkpoint_interval=6,
)
PRESETS = {"cpu": CPU, "gpu": GPU}


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def recorded_path(s: Setting) -> str | None:
    """The preset's recorded report, resolved against this checkout (None: none)."""
    if s.recorded is None:
        return None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return s.recorded if os.path.isabs(s.recorded) else os.path.join(root, s.recorded)


def _cap(n: int | None, scale: float, limit: int | None = None) -> int | None:
    n = None if n is None else max(1, int(round(n * scale)))
    return limit if n is None else (n if limit is None else min(n, limit))


def _src(name: str, files: list[str], how: dict[str, Any], **kw: Any) -> SourceConfig:
    return SourceConfig(name=name, paths=[os.path.join(SHARED, f) for f in files], **how, **kw)


def _slices(s: Setting, base: int, val: int, held: int) -> tuple[int, int, int]:
    """Scaled document counts of a general source's base, base-validation and held-out slices."""
    return (_cap(base, s.doc_scale, s.base_doc_cap), _cap(val, s.doc_scale) if val else 0,
            _cap(held, s.doc_scale) if held else 0)


def eval_sources(s: Setting) -> list[SourceConfig]:
    """The evaluation sets (read by curation.evaluation.heldout, whole documents)."""
    out = [_src(name, files, how, max_documents=_cap(n, s.doc_scale, s.eval_docs))
           for name, files, how, n, _ in EVAL_FILES]
    for name, files, how, _, base, val, held, _ in SOURCES:
        if held and name not in s.skip_sources:
            b, v, h = _slices(s, base, val, held)
            out.append(_src(f"{name}_heldout", files, how, skip_documents=b + v,
                            max_documents=_cap(held, s.doc_scale, s.eval_docs)))
    return out


def _gsm8k_pool_docs(s: Setting) -> int:
    cap = next(c for n, *_, c in SOURCES if n == "gsm8k")
    return _cap(cap, s.doc_scale, s.pool_doc_cap)


def dev_source(s: Setting) -> SourceConfig:
    """The dev split: GSM8K train problems after the validation slice and the pool's (in no pool, no reference's
    training data, no evaluation set); scored whole, like an evaluation set, but only ever used for choices."""
    return _src("gsm8k_dev", [_GSM8K[0]], {"template": _GSM8K[1]}, skip_documents=VAL_DOCS + _gsm8k_pool_docs(s),
                max_documents=_cap(DEV_DOCS, max(s.doc_scale, 0.1), s.eval_docs))


def data_configs(s: Setting, out: str) -> dict[str, PrepareConfig]:
    """The three preparations: pool (+ the target validation slice; trains the tokenizer unless one is given),
    the paper setting's pool (the same without GSM8K train) and base (+ the base-validation slices), tokenized
    alike."""
    pool, base, base_val = [], [], []
    for name, files, how, domain, base_docs, val_docs, held_docs, cap in SOURCES:
        if name in s.skip_sources:
            continue
        if domain == "math":
            skip = VAL_DOCS if name == "gsm8k" else 0
            pool.append(_src(name, files, how, skip_documents=skip, max_documents=_cap(cap, s.doc_scale, s.pool_doc_cap)))
            continue
        b, v, h = _slices(s, base_docs, val_docs, held_docs)
        base.append(_src(name, files, how, max_documents=b))
        if v:
            base_val.append(_src(f"{name}_val", files, how, skip_documents=b, max_documents=v))
        if cap != 0:
            pool.append(_src(name, files, how, skip_documents=b + v + h,
                             max_documents=_cap(cap, s.doc_scale, s.pool_doc_cap)))
    val = _src("gsm8k_val", [_GSM8K[0]], {"template": _GSM8K[1]}, max_documents=_cap(VAL_DOCS, max(s.doc_scale, 0.1)))
    if s.tokenizer:
        pool_tok = base_tok = TokenizerConfig(path=os.path.join(SHARED, s.tokenizer))
    else:
        pool_tok = TokenizerConfig(vocab_size=s.vocab)
        base_tok = TokenizerConfig(path=os.path.join(out, "data", "pool", "tokenizer", "tokenizer.json"))
    common = dict(seq_len=s.seq_len, progress=False)
    return {
        "pool": PrepareConfig(sources=pool, validation=[val], tokenizer=pool_tok,
                              output_dir=os.path.join(out, "data", "pool"), **common),
        "pool-paper": PrepareConfig(sources=[p for p in pool if p.name != "gsm8k"], validation=[val], tokenizer=base_tok,
                                    output_dir=os.path.join(out, "data", "pool-paper"), **common),
        "base": PrepareConfig(sources=base, validation=base_val, tokenizer=base_tok,
                              output_dir=os.path.join(out, "data", "base"), **common),
    }


def document_hashes(source: SourceConfig) -> set[str]:
    """SHA-256 of every document's text of a source (with its skip/max), as read for training or evaluation:
    what the dev split's disjointness from the pool, the validation slice and the evaluation sets is checked on."""
    return {hashlib.sha256(t.encode()).hexdigest() for t in read_set(source)}


# ------------------------------------------------------------------------------------------------
# models and their compute
# ------------------------------------------------------------------------------------------------
def model_config(s: Setting, *, target: bool = False, weights: str | None = None) -> ModelConfig:
    """The proxy's (or the target's) Llama: tied embeddings, heads of 32 (64 from hidden 512)."""
    h, n = (s.target_hidden, s.target_layers) if target else (s.hidden, s.layers)
    heads = max(1, h // 64) if h >= 512 else max(1, h // 32)
    return ModelConfig(hf_config={
        "model_type": "llama", "vocab_size": s.vocab, "hidden_size": h, "intermediate_size": _inter(h),
        "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": s.seq_len, "tie_word_embeddings": True, "attention_dropout": 0.0,
    }, weights=weights)


def _inter(h: int) -> int:
    return int(h * 8 / 3) // 8 * 8


def forward_flops(s: Setting, *, target: bool = False) -> float:
    """Forward FLOPs per token of the proxy (or the target) at the setting's context."""
    return forward_flops_per_token(ModelShape.of_hf_config(model_config(s, target=target).hf_config, s.seq_len))


def run_shape(s: Setting, *, target: bool = False) -> RunShape:
    """What a continual pre-training run's FLOPs depend on (batch, schedule, the model's FLOPs per token)."""
    return RunShape(forward_flops=forward_flops(s, target=target), batch=s.batch, seq_len=s.seq_len,
                    warmup=s.warmup, tau=s.tau, rho1_steps=s.rho1_steps)
