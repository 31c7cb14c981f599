"""The quality benchmark's report: statistics over seeds, figures and the generated RESULTS.md.

Pure functions of the results dict written by :func:`bench.quality.analysis.analyse` (no training). The
first lines of RESULTS.md answer the three questions for both settings side by side, whichever way they go:
BLADE vs RHO-1 at the long horizon; native selection at equal compute; reused selection at equal total compute
(base charged, every R). The verdict rules (``bench.quality.verdicts``) come right after, before any table;
a hand-written reading, when ``--out`` holds a ``READING.md``, after them.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from bench.quality.verdicts import rules_md
from curation.evaluation.heldout import Interval

__all__ = ["seed_interval", "make_figures", "results_md", "answers"]

SETTING_TITLES = {"gsm8k-in-pool": "GSM8K train in the pool", "paper": "the paper's regime (no GSM8K train in the pool)"}

POLICIES = ("full", "random", "rho1", "blade", "blade-nosync")
# two-sided 95% quantiles of Student's t by degrees of freedom (1..10); larger: 1.96 would be optimistic, so 2.2
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def seed_interval(diffs: list[float]) -> Interval:
    """Mean of paired per-seed differences with a 95% t interval (n − 1 degrees of freedom)."""
    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return Interval(m, m, m)
    half = _T975.get(len(diffs) - 1, 2.2) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return Interval(m, m - half, m + half)


def _fmt(xs: list[float]) -> str:
    m, sd = statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)
    return f"{m:.3f} ± {sd:.3f}" if len(xs) > 1 else f"{m:.3f}"


def _iv(d: dict[str, Any]) -> str:
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def _verdict(d: dict[str, Any], better: str = "better", worse: str = "worse") -> str:
    return better if d["hi"] < 0 else worse if d["lo"] > 0 else "no significant difference"


def _mean_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    return [(pts[0][0], statistics.fmean(p[1] for p in pts)) for pts in zip(*curves, strict=False)]


# ------------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------------
def make_figures(r: dict[str, Any], fig_dir: str) -> dict[str, str]:
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

    s, target = r["setting"], r["target_set"]
    color = {p: f"C{i}" for i, p in enumerate(POLICIES)}

    fig, ax = plt.subplots(figsize=(6.5, 4))  # the bases flatten
    for role, b in r["bases"].items():
        tok = s["base_batch"] * s["seq_len"]
        ax.plot([p["step"] * tok / b["parameters"] for p in b["curve"]], [p["loss"] for p in b["curve"]], "o-", ms=3,
                label=f"{role} ({b['parameters'] / 1e6:.2f}M parameters, {b['epochs']:.2f} epochs)")
    ax.set(xlabel="tokens per parameter", ylabel="loss on held-out general text", title="Base pretraining")
    ax.legend(fontsize=8)
    save(fig, "bases.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))  # the choices on the dev split: frontiers
    for ax, policy in zip(axes, ("blade", "rho1"), strict=True):
        for row in (x for x in r["sweep"] if x["policy"] == policy):
            ax.plot(*zip(*row["curve"], strict=True), "o-", ms=3, label=_sweep_label(row) + (" (chosen)" if row["chosen"] else ""))
        ax.axvline(r["sweep_budget" if policy == "blade" else "rho1_budget"], color="gray", ls="--",
                   label="equal-compute budget")
        ax.set(xlabel="FLOPs (analytic)", ylabel="dev loss (GSM8K train dev split)",
               title=f"{policy}: {'refresh settings' if policy == 'blade' else 'reference length'} (seed 0)")
        ax.legend(fontsize=6)
    save(fig, "sweep_frontier.png")

    for name, st in r["settings"].items():
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))  # curves over steps: validation and the target set
        for p in POLICIES:
            val = _mean_curve([[(x["step"], x["loss"]) for x in c] for c in st["val_curves"][p]])
            axes[0].plot(*zip(*val, strict=True), color=color[p], label=p)
            axes[1].plot(*zip(*_mean_curve(st["test_curves"][p]), strict=True), "o-", ms=3, color=color[p], label=p)
        axes[1].axhline(st["static_reference"][target], color="gray", ls="--", label="static RHO-1 reference")
        axes[0].set(xlabel="proxy step", ylabel="validation loss (mean over seeds)", title=f"Validation ({name})")
        axes[1].set(xlabel="proxy step", ylabel=f"{target} loss (mean over seeds)", title=f"{target} ({name})")
        for ax in axes:
            ax.legend(fontsize=8)
        save(fig, f"curves-{name}.png")
        reuse = st.get("reuse") or {}
        if reuse:
            runs = list(r["reuse_runs"])
            fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), sharey=True)
            for ax, n in zip(axes if len(runs) > 1 else [axes], runs, strict=True):
                ax.plot(*zip(*smooth_pts(reuse["full_curve"]), strict=True), "o-", ms=3, color=color["full"],
                        label="full (target, mean of seeds)")
                for p, e in reuse["policies"].items():
                    ax.plot(*zip(*e["accountings"]["charged"]["runs"][str(n)]["curve"], strict=True), "o-", ms=3,
                            color=color[p], label=f"replay {p}")
                ax.axhline(reuse["full_level_smoothed"], color="gray", ls="--", label="full's final loss")
                ax.set(xlabel="total FLOPs (target + (selection + proxy base) / R)", ylabel=f"{target} loss",
                       title=f"{name}: R = {n}, base charged")
                ax.legend(fontsize=7)
            save(fig, f"reuse-{name}.png")
    return figs


def smooth_pts(curve: list) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in curve]


def _sweep_label(row: dict[str, Any]) -> str:
    st = row["setting"]
    if row["policy"] == "rho1":
        return f"reference {st['rho1_steps']} steps"
    return f"K {st['refresh_steps']}, η_w {st['ref_lr']}, λ {st['lam']}, batch {st['refresh_batch_size']}"


# ------------------------------------------------------------------------------------------------
# RESULTS.md
# ------------------------------------------------------------------------------------------------
def _answer_cells(r: dict[str, Any], st: dict[str, Any]) -> list[str]:
    """The three answers of one setting, one cell each."""
    t, v = r["target_set"], st["verdicts"]
    one = f"`blade` − `rho1` = {_iv(st['blade_vs_rho1'][t])}: **{v['blade_vs_rho1']}**"
    two = "; ".join(f"`{p}` {_iv(st['vs_full_equal_compute'][p][t])} ({r['flops'][p]['total'] / r['flops']['full']['total']:.2f}×"
                    f" FLOPs): **{v['native'][p]}**" for p in POLICIES[2:])
    reuse = st.get("reuse") or {}
    if not reuse:
        return [one, two, "not run"]
    three = []
    for p, e in reuse["policies"].items():
        be = r["break_even"].get(_name_of(r, st), {}).get(p, {})
        three.append(f"`{p}`: {e['accountings']['charged']['summary']}; break-even R {be.get('charged', {}).get('label')}"
                     f" (base charged), {be.get('free', {}).get('label')} (free)")
    return [one, two, "; ".join(three)]


def _name_of(r: dict[str, Any], st: dict[str, Any]) -> str:
    return next(n for n, x in r["settings"].items() if x is st)


def answers(r: dict[str, Any]) -> list[str]:
    """The three answers for both settings side by side, generated from the numbers (whichever way they go)."""
    t, s = r["target_set"], r["setting"]
    names = list(r["settings"])
    cells = {n: _answer_cells(r, r["settings"][n]) for n in names}
    questions = (f"1. BLADE vs RHO-1 at the long horizon ({s['steps']} proxy steps, {s['seeds']} seeds, equal tokens)",
                 "2. Native selection at equal compute (policy − `full` with the same analytic FLOPs)",
                 f"3. Reused selection at equal total compute ({len(r['reuse_seeds'])} seeds; selection + the proxy's "
                 f"base charged, amortized over R ∈ {{{', '.join(map(str, r['reuse_runs']))}}} target runs)")
    out = [f"On {t} (nats per token; paired 95% intervals; negative = the first is better).", "",
           "| question | " + " | ".join(SETTING_TITLES.get(n, n) for n in names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {q} | " + " | ".join(cells[n][i] for n in names) + " |" for i, q in enumerate(questions)]
    return out


def _stage_table(r: dict[str, Any]) -> list[str]:
    st, est = r.get("stage_times") or {}, r.get("estimate_minutes") or {}
    rows = ["| stage | wall (min) | process CPU (min) | pieces | planned, CPU preset (min) | stopped, not counted (min) |",
            "|---|---|---|---|---|---|"]
    rows += [f"| {k} | {v['wall'] / 60:.1f} | {v['cpu'] / 60:.1f} | {v['pieces']} | {est.get(k, '')} | "
             f"{v.get('stopped', 0) / 60:.1f} |" for k, v in st.items()]
    if st:
        rows.append(f"| **total** | {sum(v['wall'] for v in st.values()) / 60:.1f} | "
                    f"{sum(v['cpu'] for v in st.values()) / 60:.1f} | | {sum(est.values())} | "
                    f"{sum(v.get('stopped', 0) for v in st.values()) / 60:.1f} |")
    return rows


def _sweep_md(r: dict[str, Any]) -> list[str]:
    lines = [f"## The choices, on the dev split at equal compute (seed 0; {r['dev_split']['documents']} GSM8K train "
             "problems in no pool, no reference's training data and no evaluation set: overlaps by document hash "
             + ", ".join(f"{k} {v}" for k, v in r["dev_split"]["overlap"].items()) + ")", "",
             f"BLADE's refresh settings at {r['sweep_budget']:.3g} FLOPs and RHO-1's reference lengths at "
             f"{r['rho1_budget']:.3g} FLOPs (each family's cheapest whole run); figure `sweep_frontier.png`.", "",
             "| policy | setting | FLOPs vs full | dev loss at the budget | final dev loss | final validation | chosen |",
             "|---|---|---|---|---|---|---|"]
    for row in r["sweep"]:
        lines.append(f"| {row['policy']} | {_sweep_label(row)}" + (f" (K/τ = {row['kt']:.2g})" if "kt" in row else "")
                     + f" | {row['flops_vs_full']:.2f}× | {row['dev_at_budget']:.3f} | {row['curve'][-1][1]:.3f} | "
                     f"{row['val_loss']:.3f} | {'**yes**' if row['chosen'] else ''} |")
    return lines


def results_md(r: dict[str, Any], figs: dict[str, str], command: str, *, hardware: str, reading: str = "") -> str:
    s = r["setting"]
    sets = list(r["eval_sets"])
    b, tb = r["bases"]["proxy"], r["bases"]["target"]
    lines = ["# BLADE quality benchmark (real public text)", "",
             f"Produced by `{command}` ({hardware}). Stage times below (added up over the resumed pieces).", "",
             "## Three answers, both settings (generated from the numbers)", "", *answers(r), "",
             "## Verdict rules (fixed in `bench/quality/verdicts.py` before the runs)", "", *rules_md(), ""]
    if reading:
        lines += [reading.strip(), ""]
    lines += [
        "## Setting", "",
        f"- **Proxy** (the selector): Llama {s['hidden']}×{s['layers']}, {b['parameters'] / 1e6:.2f}M parameters; "
        f"**target**: Llama {s['target_hidden']}×{s['target_layers']}, {tb['parameters'] / 1e6:.2f}M parameters, "
        f"{r['flops_ratio']:.2f}× the proxy's training FLOPs per token. Tied embeddings, vocabulary {s['vocab']} "
        f"({'tokenizer ' + s['tokenizer'] if s['tokenizer'] else 'BPE trained on the pool'}), context {s['seq_len']}.",
        f"- **Bases**, pretrained from scratch on general text only ({b['unique_tokens'] / 1e6:.2f}M tokens: C4, "
        "WikiText-2, LAMBADA, BoolQ, PubMedQA, Tiny Shakespeare, US presidential speeches, English novels, Wikipedia "
        f"articles, folk tales; held-out slices excluded): proxy **{b['tokens_per_parameter']:.1f} tokens per "
        f"parameter** ({b['epochs']:.2f} epochs, final held-out general loss {b['final_val']:.3f}, {b['flops']:.3g} "
        f"FLOPs); target **{tb['tokens_per_parameter']:.1f} tokens per parameter** ({tb['epochs']:.2f} epochs, "
        f"{tb['final_val']:.3f}); constant lr {s['base_lr']}, {s['base_batch']} sequences per step (figure `bases.png`).",
        "- **Two settings**, every policy in each: " + "; ".join(
            f"**{SETTING_TITLES.get(n, n)}**: pool of {sum(c['sequences'] for c in st['pool_counts'].values())} "
            f"sequences, {st['math_share'] * 100:.0f}% math" for n, st in r["settings"].items()) + ".",
        f"- **Continual pre-training**: {s['steps']} proxy steps × {s['batch']} × {s['seq_len']} tokens per policy, "
        f"γ = {s['gamma']}, W = {s['warmup']}, τ = {s['tau']}, {s['seeds']} seeds; lr {s['lr']} (AdamW, wd 0.01, "
        f"clip 1.0, constant). Chosen on the dev split: {r['best_refresh']}.",
        "- Validation (target; the references train on it) = first 500 GSM8K train problems. Evaluation sets (never "
        "used for any choice): " + ", ".join(f"{k} ({r['eval_documents'].get(k)} docs; {g})"
                                              for k, g in r["eval_sets"].items()) + ".",
        "- Metric: whole-document token loss (nats per token). Paired by seed: mean over seeds, 95% t interval.", "",
        "## Stage times", "", *_stage_table(r), "", *_sweep_md(r)]
    for name, st in r["settings"].items():
        lines += _setting_md(r, name, st, sets)
    ff = r["flops"]["full"]["total"]
    lines += ["", "## Compute per policy (analytic FLOPs)", "",
              "| policy | proxy fwd+bwd | reference scoring | reference training | total vs full |", "|---|---|---|---|---|"]
    for p in POLICIES:
        f = r["flops"][p]
        lines.append(f"| {p} | {f['proxy']:.3g} | {f['scoring']:.3g} | {f['refresh']:.3g} | {f['total'] / ff:.2f}× |")
    lines += ["", "## Figures", ""] + [f"![{name}](figures/{name})" for name in figs] + [""]
    return "\n".join(lines)


def _setting_md(r: dict[str, Any], name: str, st: dict[str, Any], sets: list[str]) -> list[str]:
    s, t = r["setting"], r["target_set"]
    full_t = statistics.fmean(st["step_seconds"]["full"])
    lines = ["", f"## Setting `{name}`: {SETTING_TITLES.get(name, name)}", "",
             f"### Held-out loss per policy after {s['steps']} proxy steps (mean ± std over seeds)", "",
             "| policy | " + " | ".join(sets) + " | validation | time/step vs full |", "|---|" + "---|" * (len(sets) + 2),
             "| base (no CPT) | " + " | ".join(f"{r['base_eval'][k]:.3f}" for k in sets) + " | | |"]
    for p in POLICIES:
        lines.append(f"| {p} | " + " | ".join(_fmt([e[k] for e in st["eval"][p]]) for k in sets)
                     + f" | {_fmt(st['final_val'][p])} | {statistics.fmean(st['step_seconds'][p]) / full_t:.2f}× |")
    ref = st["static_reference"]
    lines.append("| static RHO-1 reference | " + " | ".join(f"{ref[k]:.3f}" for k in sets) + " | | |")
    lines += ["", "### Paired differences vs `full` (policy − full; negative = the policy is better)", "",
              "Equal compute: `full` after the steps with the same FLOPs ("
              + ", ".join(f"{p}: {r['equal_compute_steps'][p]}" for p in POLICIES[2:]) + ").", "",
              "| policy | compared at | " + " | ".join(sets) + " |", "|---|---|" + "---|" * len(sets)]
    for p in POLICIES[1:]:
        for how, key in (("equal tokens", "vs_full_equal_tokens"), ("equal compute", "vs_full_equal_compute")):
            lines.append(f"| {p} | {how} | " + " | ".join(_iv(st[key][p][k]) for k in sets) + " |")
    for label, key in (("blade − rho1", "blade_vs_rho1"), ("blade − blade-nosync", "blade_vs_nosync")):
        lines.append(f"| {label} | equal tokens | " + " | ".join(_iv(st[key][k]) for k in sets) + " |")
    wins = {p: sum(v == "worse" for v in st["verdicts"]["native_all_sets"][p].values()) for p in POLICIES[2:]}
    lines += ["", "Sets on which `full` is significantly better at equal compute: "
              + ", ".join(f"{p} {n} of {len(sets)}" for p, n in wins.items()) + "."]
    steps = [n for n, _ in st["test_curves"]["full"][0]]
    lines += ["", f"### {t} over steps (mean over seeds)", "",
              "| policy | " + " | ".join(str(n) for n in steps) + f" | passed the static reference by {st['pass_margin']}"
              " nats at (per seed) |", "|---|" + "---|" * (len(steps) + 1)]
    for p in POLICIES:
        lines.append(f"| {p} | " + " | ".join(f"{v:.3f}" for _, v in _mean_curve(st["test_curves"][p])) + " | "
                     + ", ".join("never" if x is None else str(x) for x in st["passed_static_reference"][p]) + " |")
    lines += ["", "### Kept share per source (seed 0)", "", "| source | pool share | " + " | ".join(POLICIES) + " |",
              "|---|---|" + "---|" * len(POLICIES)]
    for src in sorted(st["pool_share"]):
        lines.append(f"| {src} | {st['pool_share'][src] * 100:.1f}% | " + " | ".join(
            "–" if st["kept_share"][p].get(src) is None else f"{st['kept_share'][p][src] * 100:.0f}%" for p in POLICIES)
            + " |")
    return lines + _reuse_md(r, name, st, sets)


def _reuse_md(r: dict[str, Any], name: str, st: dict[str, Any], sets: list[str]) -> list[str]:
    reuse, s, t = st.get("reuse") or {}, r["setting"], r["target_set"]
    if not reuse:
        return []
    lines = ["", f"### Reuse: the target ({r['flops_ratio']:.2f}× the proxy's FLOPs per token) replaying each seed's "
             f"selected shards, {reuse['seeds']} seeds", "",
             f"Each replay continues the target's base for {s['steps']} steps on that seed's shards; the target's "
             f"`full` of the same seed trains on every token (and runs on to {reuse['full_steps']} steps for the "
             "equal-compute points). Selection = the proxy's whole run; **base charged** adds the proxy's base "
             f"pretraining ({reuse['proxy_base_flops']:.3g} FLOPs = {reuse['base_vs_target_run']:.2f} target runs; "
             "`random` needs no model: 0 either way). `full`'s final "
             f"{t} loss (smoothed mean): {reuse['full_level_smoothed']:.3f} (base {reuse['base'][t]:.3f}).", "",
             f"| replayed | accounting | compared at | {t} | verdict | FLOPs to reach full's final loss (× full's) | "
             + " | ".join(k for k in sets if k != t) + " |", "|---|---|---|---|---|---|" + "---|" * (len(sets) - 1)]
    for p, e in reuse["policies"].items():
        lines.append(f"| {p} | | equal target steps | {_iv(e['equal_steps'][t])} | {e['equal_steps_verdict']} | | "
                     + " | ".join(_iv(e["equal_steps"][k]) for k in sets if k != t) + " |")
        for acct, a in e["accountings"].items():
            for n, x in a["runs"].items():
                reach = x["vs_full_flops"]
                lines.append(f"| {p} | {acct} ({a['selection'] / reuse['full_flops']:.2f} runs) | R = {n}"
                             + (" (full's last snapshot: a bound)" if x["bound"] else "") + f" | "
                             f"{_iv(x['equal_compute'][t])} | {x['verdict']} | {'never' if reach is None else f'{reach:.2f}×'} | "
                             + " | ".join(_iv(x["equal_compute"][k]) for k in sets if k != t) + " |")
    lines += ["", "| policy | break-even R, base charged | break-even R, free |", "|---|---|---|"]
    for p, be in r["break_even"].get(name, {}).items():
        lines.append(f"| {p} | {be['charged']['label']} | {be['free']['label']} |")
    lines += ["", f"Target {t} curves (mean over seeds, at target step): full "
              + ", ".join(f"{x / reuse['target_step_flops']:.0f} {v:.3f}" for x, v in reuse["full_curve"]) + "; "
              + "; ".join(f"{p}: " + ", ".join(f"{n:.0f} {v:.3f}" for n, v in e["curve_steps"])
                          for p, e in reuse["policies"].items()) + "."]
    return lines
