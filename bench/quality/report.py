"""The quality benchmark's report: statistics over seeds, figures and the generated RESULTS.md.

Pure functions of the results dict written by :func:`bench.quality.analysis.analyse` (no training). The
first lines of RESULTS.md answer the three questions, whichever way they go: BLADE vs RHO-1 at the long
horizon; native selection at equal compute; reused selection at equal total compute. A hand-written reading,
when ``--out`` holds a ``READING.md``, is placed right after them.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from curation.evaluation.heldout import Interval

__all__ = ["seed_interval", "make_figures", "results_md", "answers"]

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
                label=f"{role} ({b['parameters'] / 1e6:.2f}M parameters, {b['epochs']:.1f} epochs)")
    ax.set(xlabel="tokens per parameter", ylabel="loss on held-out general text", title="Base pretraining")
    ax.legend(fontsize=8)
    save(fig, "bases.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))  # curves over steps: validation and the target set
    for p in POLICIES:
        val = _mean_curve([[(x["step"], x["loss"]) for x in c] for c in r["val_curves"][p]])
        axes[0].plot(*zip(*val, strict=True), color=color[p], label=p)
        axes[1].plot(*zip(*_mean_curve(r["test_curves"][p]), strict=True), "o-", ms=3, color=color[p], label=p)
    axes[1].axhline(r["static_reference"][target], color="gray", ls="--", label="static RHO-1 reference")
    axes[0].set(xlabel="proxy step", ylabel="validation loss (mean over seeds)", title="Validation (GSM8K train slice)")
    axes[1].set(xlabel="proxy step", ylabel=f"{target} loss (mean over seeds)", title=f"{target} over the horizon")
    for ax in axes:
        ax.legend(fontsize=8)
    save(fig, "curves.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))  # native loss vs compute; the refresh frontier
    for p in POLICIES:
        axes[0].plot(*zip(*r["compute_curves"][p][0], strict=True), color=color[p], label=p)
    axes[0].plot(*zip(*r["full_val_compute_curve"], strict=True), color=color["full"], ls=":", label="full (run on)")
    axes[0].set(xlabel="FLOPs (analytic)", ylabel="validation loss", title="Validation loss vs compute (seed 0)")
    for row in r["sweep"]:
        axes[1].plot(*zip(*row["curve"], strict=True), label=f"K/τ = {row['kt']:.2g}" + (" (chosen)" if row["chosen"] else ""))
    axes[1].plot(*zip(*r["full_val_compute_curve"], strict=True), color="k", ls=":", label="full")
    axes[1].axvline(r["sweep_budget"], color="gray", ls="--", label="equal-compute budget")
    axes[1].set(xlabel="FLOPs (analytic)", ylabel="validation loss", title="Refresh strength: frontier (blade, seed 0)")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.set_ylim(top=min(ax.get_ylim()[1], r["final_val"]["full"][0] + 0.6))
    save(fig, "loss_vs_compute.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))  # Δ over time (the paper's Fig. 3)
    for p, ls in (("rho1", "--"), ("blade", "-"), ("blade-nosync", ":")):
        rows = r["delta_over_time"][p]
        for q, c in (("q0.5", "C0"), ("q0.9", "C1"), ("q0.99", "C3")):
            axes[0].plot([x["episode"] for x in rows], [x[q] for x in rows], ls=ls, color=c, label=f"{p} {q[1:]}")
        axes[1].plot([x["episode"] for x in rows], [x["positive"] for x in rows], ls=ls, label=p)
    axes[0].set(xlabel="episode (τ steps)", ylabel="Δ = ℓ(u) − ℓ(w̃) quantile", title="Δ distribution over time")
    axes[1].set(xlabel="episode (τ steps)", ylabel="share of tokens with Δ > 0", title="Right tail over time")
    for ax in axes:
        ax.legend(fontsize=7)
    save(fig, "delta_over_time.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p in ("blade", "blade-nosync", "rho1"):
        pts = r["param_distance"].get(p) or []
        ax.plot([x["step"] for x in pts], [x["value"] for x in pts], label=p)
    ax.set(xlabel="proxy step", ylabel="‖u − w‖₂", title="Proxy–reference distance (with vs without sync)")
    ax.legend()
    save(fig, "param_distance.png")

    reuse = r.get("reuse") or {}
    if reuse:
        runs = list(s["reuse_runs"])
        fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True)
        for ax, n in zip(axes if len(runs) > 1 else [axes], runs, strict=True):
            ax.plot(*zip(*reuse["full_curve"], strict=True), "o-", ms=3, color=color["full"], label="full (target)")
            for p, e in reuse["policies"].items():
                ax.plot(*zip(*e["amortized"][str(n)]["curve"], strict=True), "o-", ms=3, color=color[p],
                        label=f"replay {p}")
            ax.axhline(reuse["full_final"][target], color="gray", ls="--", label="full's final loss")
            ax.set(xlabel="total FLOPs (target training + selection / R)", ylabel=f"{target} loss",
                   title=f"Target replaying the proxy's shards, selection amortized over R = {n}")
            ax.legend(fontsize=8)
        save(fig, "reuse.png")
    return figs


# ------------------------------------------------------------------------------------------------
# RESULTS.md
# ------------------------------------------------------------------------------------------------
def answers(r: dict[str, Any]) -> list[str]:
    """The three answers, generated from the numbers (whichever way they go)."""
    t = r["target_set"]
    s = r["setting"]
    br = r["blade_vs_rho1"][t]
    out = [f"1. **BLADE vs RHO-1 at the long horizon** ({s['steps']} proxy steps, {s['seeds']} seeds, {t}): "
           f"`blade` − `rho1` = {_iv(br)} nats: "
           + {"better": "**BLADE is better**.", "worse": "**RHO-1 is better**.",
              "no significant difference": "**no significant difference**."}[_verdict(br)]]
    eq = r["vs_full_equal_compute"]
    parts = [f"`{p}` {_iv(eq[p][t])} ({_verdict(eq[p][t], 'beats full', 'full wins')}; "
             f"{r['flops'][p]['total'] / r['flops']['full']['total']:.2f}× full's FLOPs)" for p in POLICIES[2:]]
    winners = [p for p in POLICIES[2:] if eq[p][t]["hi"] < 0]
    out.append(f"2. **Native selection at equal compute** (policy − `full` with the same analytic FLOPs, {t}): "
               + "; ".join(parts) + ". " + (f"**Selection pays for its compute: {', '.join(winners)}.**" if winners
                                             else "**No selection policy beats `full` at equal compute.**"))
    reuse = r.get("reuse") or {}
    if reuse:
        lines = []
        for p, e in reuse["policies"].items():
            per = []
            for n, a in e["amortized"].items():
                d = a["equal_compute"].get(t)
                reach = a["vs_full_flops"]
                per.append(f"R = {n}: {_iv(d) if d else 'n/a'}, reaches full's final loss "
                           + (f"with {reach:.2f}× full's FLOPs" if reach is not None else "never (within its run)"))
            lines.append(f"`{p}` ({e['selection_vs_target_run']:.2f}× a target run to select) " + "; ".join(per))
        wins = [p for p, e in reuse["policies"].items()
                if any(a["equal_compute"].get(t, {}).get("hi", 1) < 0 for a in e["amortized"].values())]
        out.append(f"3. **Reused selection at equal total compute** (a {reuse['flops_ratio']:.1f}× target replaying "
                   f"the proxy's shards − the target's `full` at the same total FLOPs, selection counted and "
                   f"amortized over R target runs, {t}): " + "; ".join(lines) + ". "
                   + (f"**Reuse pays for selection: {', '.join(wins)}.**" if wins else
                      "**No reused selection beats `full` at equal total compute.**"))
    return out


def _stage_table(r: dict[str, Any]) -> list[str]:
    st = r.get("stage_times") or {}
    rows = ["| stage | wall (min) | process CPU (min) | pieces |", "|---|---|---|---|"]
    rows += [f"| {k} | {v['wall'] / 60:.1f} | {v['cpu'] / 60:.1f} | {v['pieces']} |" for k, v in st.items()]
    if st:
        rows.append(f"| **total** | {sum(v['wall'] for v in st.values()) / 60:.1f} | "
                    f"{sum(v['cpu'] for v in st.values()) / 60:.1f} | |")
    return rows


def results_md(r: dict[str, Any], figs: dict[str, str], command: str, *, hardware: str, reading: str = "") -> str:
    s, t = r["setting"], r["target_set"]
    sets = list(r["eval_sets"])
    ff = r["flops"]["full"]["total"]
    full_t = statistics.fmean(r["step_seconds"]["full"])
    b, tb = r["bases"]["proxy"], r["bases"]["target"]
    lines = ["# BLADE quality benchmark (real public text)", "",
             f"Produced by `{command}` ({hardware}). Stage times below (added up over the resumed pieces).", "",
             "## Three answers (generated from the numbers)", "", *answers(r), ""]
    if reading:
        lines += [reading.strip(), ""]
    lines += [
        "## Setting", "",
        f"- **Proxy** (the selector): Llama {s['hidden']}×{s['layers']}, {b['parameters'] / 1e6:.2f}M parameters; "
        f"**target**: Llama {s['target_hidden']}×{s['target_layers']}, {tb['parameters'] / 1e6:.2f}M parameters, "
        f"{r['reuse'].get('flops_ratio', float('nan')):.2f}× the proxy's training FLOPs per token. Tied embeddings, "
        f"vocabulary {s['vocab']} ({'tokenizer ' + s['tokenizer'] if s['tokenizer'] else 'BPE trained on the pool'}), "
        f"context {s['seq_len']}.",
        f"- **Bases**, pretrained from scratch on general text only ({b['unique_tokens'] / 1e6:.2f}M tokens: C4, "
        "WikiText-2, LAMBADA, BoolQ, PubMedQA, Tiny Shakespeare, US presidential speeches; held-out slices excluded): "
        f"proxy {b['epochs']:.1f} epochs = **{b['tokens_per_parameter']:.1f} tokens per parameter** "
        f"(final held-out general loss {b['final_val']:.3f}); target {tb['epochs']:.1f} epochs = "
        f"**{tb['tokens_per_parameter']:.1f} tokens per parameter** ({tb['final_val']:.3f}); constant lr "
        f"{s['base_lr']}, {s['base_batch']} sequences per step (figure `bases.png`).",
        f"- **Pool**: {sum(c['sequences'] for c in r['pool_counts'].values())} sequences, {r['math_share'] * 100:.0f}% "
        "math (GSM8K train after the validation slice, OpenIntro, HoTT), the rest general text disjoint from the bases.",
        f"- **Continual pre-training**: {s['steps']} proxy steps × {s['batch']} × {s['seq_len']} tokens per policy, "
        f"γ = {s['gamma']}, W = {s['warmup']}, τ = {s['tau']}, {s['seeds']} seeds; lr {s['lr']} (AdamW, wd 0.01, "
        f"clip 1.0, constant). RHO-1's static reference: {s['rho1_steps']} steps on the validation slice from the base.",
        "- Validation (target) = first 500 GSM8K train problems (not in the pool). Evaluation sets (never used for any "
        "choice): " + ", ".join(f"{k} ({r['eval_documents'][k]} docs; {g})" for k, g in r["eval_sets"].items()) + ".",
        "- Metric: whole-document token loss (nats per token). Paired by seed: mean over seeds, 95% t interval; one "
        "seed (the target runs): document bootstrap.", "",
        "## Stage times", "", *_stage_table(r), "",
        f"## Refresh strength at equal compute (blade, seed 0; chosen by validation loss at {r['sweep_budget']:.3g} "
        "FLOPs, the cheapest candidate's whole run)", "",
        "| K | K/τ | refresh batch | η_w | λ | FLOPs vs full | validation at the budget | final validation | chosen |",
        "|---|---|---|---|---|---|---|---|---|"]
    for row in r["sweep"]:
        st = row["setting"]
        lines.append(f"| {st['refresh_steps']} | {row['kt']:.2g} | {st.get('refresh_batch_size')} | {st['ref_lr']} | "
                     f"{st['lam']} | {row['flops_vs_full']:.2f}× | {row['val_at_budget']:.3f} | {row['val_loss']:.3f} | "
                     f"{'**yes**' if row['chosen'] else ''} |")
    lines += ["", f"## Held-out loss per policy after {s['steps']} proxy steps (mean ± std over seeds)", "",
              "| policy | " + " | ".join(sets) + " | validation | FLOPs vs full | time/step vs full |",
              "|---|" + "---|" * (len(sets) + 3),
              "| base (no CPT) | " + " | ".join(f"{r['base_eval'][k]:.3f}" for k in sets) + " | | | |"]
    for p in POLICIES:
        lines.append(f"| {p} | " + " | ".join(_fmt([e[k] for e in r["eval"][p]]) for k in sets)
                     + f" | {_fmt(r['final_val'][p])} | {r['flops'][p]['total'] / ff:.2f}× | "
                     f"{statistics.fmean(r['step_seconds'][p]) / full_t:.2f}× |")
    ref = r["static_reference"]
    lines.append("| static RHO-1 reference | " + " | ".join(f"{ref[k]:.3f}" for k in sets) + " | | | |")
    lines += ["", "## Paired differences vs `full` (policy − full; negative = the policy is better)", "",
              f"Equal tokens: both after {s['steps']} steps. Equal compute: `full` after the steps with the same FLOPs ("
              + ", ".join(f"{p}: {r['equal_compute_steps'][p]}" for p in POLICIES[2:]) + "), snapshots of one run per seed.",
              "", "| policy | compared at | " + " | ".join(sets) + " |", "|---|---|" + "---|" * len(sets)]
    for p in POLICIES[1:]:
        for how, key in (("equal tokens", "vs_full_equal_tokens"), ("equal compute", "vs_full_equal_compute")):
            lines.append(f"| {p} | {how} | " + " | ".join(_iv(r[key][p][k]) for k in sets) + " |")
    lines += ["", "| pair (equal tokens) | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
    for label, key in (("blade − rho1", "blade_vs_rho1"), ("blade − blade-nosync", "blade_vs_nosync")):
        lines.append(f"| {label} | " + " | ".join(_iv(r[key][k]) for k in sets) + " |")
    steps = [n for n, _ in r["test_curves"]["full"][0]]
    lines += ["", f"## The long horizon: {t} over steps (mean over seeds)", "",
              "| policy | " + " | ".join(str(n) for n in steps) + " | passed the static reference by "
              f"{r['pass_margin']} nats at (per seed) |", "|---|" + "---|" * (len(steps) + 1)]
    for p in POLICIES:
        lines.append(f"| {p} | " + " | ".join(f"{v:.3f}" for _, v in _mean_curve(r["test_curves"][p])) + " | "
                     + ", ".join("never" if x is None else str(x) for x in r["passed_static_reference"][p]) + " |")
    lines += ["", f"Static reference on {t}: {ref[t]:.3f}.", "",
              "## Δ over time (pooled over seeds; the paper's Fig. 3)", "",
              "| policy | episode | tokens | Δ median | Δ 90% | Δ 99% | share Δ > 0 |", "|---|---|---|---|---|---|---|"]
    for p in ("rho1", "blade", "blade-nosync"):
        rows = r["delta_over_time"][p]
        picks = sorted({0, len(rows) // 4, len(rows) // 2, 3 * len(rows) // 4, len(rows) - 1}) if rows else []
        for i in picks:
            x = rows[i]
            lines.append(f"| {p} | {x['episode']} | {x['tokens']} | {x['q0.5']:+.3f} | {x['q0.9']:+.3f} | "
                         f"{x['q0.99']:+.3f} | {x['positive'] * 100:.1f}% |")
    lines += _reuse_md(r, sets)
    lines += ["", "## Compute per policy (analytic FLOPs; measured time)", "",
              "| policy | proxy fwd+bwd | reference scoring | reference training | total vs full | measured time vs full | "
              "refresh / scoring / selection (ms per step, wall) |", "|---|---|---|---|---|---|---|"]
    for p in POLICIES:
        f, parts = r["flops"][p], r["part_seconds"][p]
        lines.append(f"| {p} | {f['proxy']:.3g} | {f['scoring']:.3g} | {f['refresh']:.3g} | {f['total'] / ff:.2f}× | "
                     f"{statistics.fmean(r['step_seconds'][p]) / full_t:.2f}× | "
                     + " / ".join(f"{parts[k] * 1e3:.0f}" for k in ("refresh", "score", "select")) + " |")
    lines += ["", "## Kept share per source (seed 0)", "", "| source | pool share | " + " | ".join(POLICIES) + " |",
              "|---|---|" + "---|" * len(POLICIES)]
    for src in sorted(r["pool_share"]):
        lines.append(f"| {src} | {r['pool_share'][src] * 100:.1f}% | " + " | ".join(
            "–" if r["kept_share"][p].get(src) is None else f"{r['kept_share'][p][src] * 100:.0f}%" for p in POLICIES)
            + " |")
    lines += ["", "## Figures", ""] + [f"![{name}](figures/{name})" for name in figs] + [""]
    return "\n".join(lines)


def _reuse_md(r: dict[str, Any], sets: list[str]) -> list[str]:
    reuse, s, t = r.get("reuse") or {}, r["setting"], r["target_set"]
    if not reuse:
        return []
    lines = ["", f"## Reuse: the target ({reuse['flops_ratio']:.2f}× the proxy's FLOPs per token) replaying the "
             "proxy's selected shards (seed 0)", "",
             f"Each target run continues the target's base for {s['steps']} steps of {s['batch']} sequences, on the "
             "same sequences in the same order; `full` trains on every token (and runs on to "
             f"{reuse['full_steps']} steps for the equal-compute points). Selection compute = the proxy's whole "
             "run (proxy, reference scoring, refreshes, static reference; `random` needs no model: 0), amortized over R "
             f"target runs. `full`'s final {t} loss: {reuse['full_final'][t]:.3f} (base {reuse['base'][t]:.3f}).", "",
             "| replayed | selection ÷ target run | compared at | " + " | ".join(sets) + " | FLOPs to reach full's final "
             f"{t} loss (× full's) |", "|---|---|---|" + "---|" * (len(sets) + 1)]
    for p, e in reuse["policies"].items():
        lines.append(f"| {p} | {e['selection_vs_target_run']:.2f} | equal target steps | "
                     + " | ".join(_iv(e["equal_steps"][k]) for k in sets) + " | |")
        for n, a in e["amortized"].items():
            reach = a["vs_full_flops"]
            lines.append(f"| {p} | | equal total compute, R = {n} | "
                         + " | ".join(_iv(a["equal_compute"][k]) if k in a["equal_compute"] else "n/a" for k in sets)
                         + f" | {'never' if reach is None else f'{reach:.2f}×'} |")
    lines += ["", "| target model | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets),
              "| base (no CPT) | " + " | ".join(f"{reuse['base'][k]:.3f}" for k in sets) + " |",
              f"| full, {s['steps']} steps | " + " | ".join(f"{reuse['full_final'][k]:.3f}" for k in sets) + " |"]
    lines += [f"| replay {p} | " + " | ".join(f"{e['final'][k]:.3f}" for k in sets) + " |"
              for p, e in reuse["policies"].items()]
    lines += ["", "Target curves (" + t + " loss at target step): "
              + "; ".join(f"{p}: " + ", ".join(f"{n} {v:.3f}" for n, v in e["curve_steps"])
                          for p, e in reuse["policies"].items()) + "."]
    return lines
