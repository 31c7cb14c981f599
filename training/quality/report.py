"""The quality benchmark's report: statistics over seeds, figures and the generated RESULTS.md.

Pure functions of the results dict written by :func:`training.quality.runs.run_experiment` (no training).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import numpy as np

from curation.evaluation.heldout import Interval
from training.quality.setting import POLICIES

__all__ = ["seed_interval", "make_figures", "results_md"]

# two-sided 95% quantiles of Student's t by degrees of freedom (1..10); larger: 1.96 would be optimistic, so 2.2
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def seed_interval(diffs: list[float]) -> Interval:
    """Mean of paired per-seed differences with a 95% t interval (n − 1 degrees of freedom)."""
    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return Interval(m, m, m)
    half = _T975.get(len(diffs) - 1, 2.2) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return Interval(m, m - half, m + half)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(xs: list[float]) -> str:
    m, sd = _mean_std(xs)
    return f"{m:.3f} ± {sd:.3f}" if len(xs) > 1 else f"{m:.3f}"


def _iv(d: dict[str, Any]) -> str:
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def _verdict(d: dict[str, Any]) -> str:
    if d["hi"] < 0:
        return "better"
    if d["lo"] > 0:
        return "worse"
    return "no significant difference"


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

    color = {p: f"C{i}" for i, p in enumerate(POLICIES)}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p, curves in r["val_curves"].items():
        for i, v in enumerate(curves):
            ax.plot([x["step"] for x in v], [x["loss"] for x in v], color=color[p], alpha=1.0 if i == 0 else 0.35,
                    label=p if i == 0 else None)
    ax.set(xlabel="proxy step", ylabel="validation loss (GSM8K train slice)", title="Validation loss per policy")
    ax.legend()
    save(fig, "val_loss.png")

    # loss versus compute: validation curves against cumulative FLOPs (seed 0), the long full run included
    s = r["setting"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for p in POLICIES:
        curve = r["full_long_curves"][0] if p == "full" else r["val_curves"][p][0]
        at = r["flops_at_step"][p]
        axes[0].plot([at[str(x["step"])] for x in curve], [x["loss"] for x in curve], color=color[p],
                     label=p + (" (long run)" if p == "full" else ""))
    axes[0].set(xlabel="FLOPs (analytic)", ylabel="validation loss", title="Validation loss vs compute (seed 0)")
    axes[0].legend(fontsize=8)
    target = next(iter(r["eval_sets"]))
    eq = r["equal_compute_steps"]
    xs = sorted(set(eq.values()))
    full_at = {n: None for n in xs}
    for p in POLICIES[1:]:
        full_at[eq[p]] = statistics.fmean(e[target] for e in r["eval_equal_compute_full"][p])
    full_pts = sorted((n, v) for n, v in full_at.items() if v is not None)
    f_full = r["flops"]["full"]["proxy"] / s["steps"]
    axes[1].plot([n * f_full for n, _ in full_pts], [v for _, v in full_pts], "o-", color=color["full"],
                 label="full at each policy's compute")
    for p in POLICIES[1:]:
        axes[1].plot([r["flops"][p]["total"]], [statistics.fmean(e[target] for e in r["eval"][p])], "s",
                     color=color[p], label=p)
    axes[1].set(xlabel="FLOPs (analytic)", ylabel=f"{target} loss (mean over seeds)",
                title=f"{target} vs compute after {s['steps']} steps")
    axes[1].legend(fontsize=8)
    save(fig, "loss_vs_compute.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p, curve in r["long_val_curves"].items():
        ax.plot([x["step"] for x in curve], [x["loss"] for x in curve], color=color[p], label=p)
    if r.get("static_reference"):
        ax.axhline(r["static_reference"]["gsm8k_val"], color="gray", ls="--",
                   label="static reference (trained on this slice)")
    ax.set(xlabel="proxy step", ylabel="validation loss", title="Long horizon")
    ax.legend()
    save(fig, "long_horizon.png")

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    for col, p in enumerate(("blade", "rho1")):
        hists = r["delta_histograms"][p]
        keys = sorted(hists, key=int)
        picks = [keys[0], keys[len(keys) // 2], keys[-1]] if len(keys) >= 3 else keys
        for ax, k in zip(axes, picks, strict=False):
            h = hists[k]
            edges = np.asarray(h["edges"])
            counts = np.asarray(h["counts"][1:-1] if len(h["counts"]) == len(edges) + 1 else h["counts"], float)
            ax.plot((edges[:-1] + edges[1:]) / 2, counts / max(counts.sum(), 1), color=f"C{col}",
                    label=f"{p} (episode {k})")
            ax.set(xlabel="Δ = ℓ(u) − ℓ(w)", title=f"point {picks.index(k) + 1}")
            ax.legend(fontsize=7)
    axes[0].set_ylabel("share of tokens")
    save(fig, "delta_hist.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p in ("blade", "blade-nosync", "rho1"):
        pts = r["param_distance"].get(p) or []
        ax.plot([x["step"] for x in pts], [x["value"] for x in pts], label=p)
    ax.set(xlabel="proxy step", ylabel="‖u − w‖₂", title="Proxy–reference distance (with vs without sync)")
    ax.legend()
    save(fig, "param_distance.png")

    for key, xlabel, name in (("gamma_sweep", "γ", "gamma_sweep.png"), ("tau_sweep", "τ", "tau_sweep.png")):
        sw = r[key]
        if len(sw) < 2:
            continue
        xs = sorted(sw, key=float)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([float(x) for x in xs], [sw[x]["val"] for x in xs], "o-", label="validation")
        ax.plot([float(x) for x in xs], [sw[x][target] for x in xs], "s-", label=target)
        ax.set(xlabel=xlabel, ylabel="token loss", title=f"BLADE, {xlabel} sweep")
        ax.legend()
        save(fig, name)
    return figs


# ------------------------------------------------------------------------------------------------
# RESULTS.md
# ------------------------------------------------------------------------------------------------
def results_md(r: dict[str, Any], figs: dict[str, str], command: str, *, hardware: str) -> str:
    s = r["setting"]
    sets = list(r["eval_sets"])
    target = sets[0]
    full_t = statistics.fmean(r["step_seconds"]["full"])
    ff = r["flops"]["full"]["total"]
    lines = [
        "# BLADE quality benchmark (real public text)", "",
        f"Produced by `{command}` in {r['wall_seconds'] / 60:.1f} minutes ({hardware})"
        + (f"; {len(r['reused_runs'])} runs finished by an earlier invocation with the same settings were reused, "
           "so this is not the from-scratch time." if r.get("reused_runs") else "."), "",
        "## Setting", "",
        f"- Llama {s['hidden']}×{s['layers']} (tied embeddings), vocabulary {s['vocab']}"
        f" ({'tokenizer ' + s['tokenizer'] if s['tokenizer'] else 'BPE trained on the pool'}), context {s['seq_len']}; "
        f"base pretrained {s['base_steps']} steps on off-domain text only.",
        f"- Candidate pool: {sum(c['sequences'] for c in r['pool_counts'].values())} sequences, "
        f"{r['math_share'] * 100:.0f}% math (GSM8K train minus the validation slice, OpenIntro, HoTT).",
        f"- {s['steps']} proxy steps × {s['batch']} × {s['seq_len']} tokens per policy, γ = {s['gamma']}, "
        f"W = {s['warmup']}, τ = {s['tau']}, {s['seeds']} seed(s); lr {s['lr']} (AdamW, wd 0.01, clip 1.0, constant).",
        f"- RHO-1: static reference trained {s['rho1_steps']} steps on the validation slice from the base model.",
        "- Validation (target) = first 500 GSM8K train problems (not in the pool). Evaluation sets (in no pool and "
        "no validation set, never used for any choice): "
        + ", ".join(f"{k} ({r['eval_documents'][k]} docs; {g})" for k, g in r["eval_sets"].items()) + ".",
        "- Metric: whole-document token loss (`curation.evaluation.heldout`, nats per token, mean over all tokens of a set). "
        "Differences are paired by seed: mean over seeds with a 95% t interval (one seed: a document bootstrap).",
        "",
        "## Held-out loss per policy at equal proxy steps (lower is better; mean ± std over seeds)", "",
        "| policy | " + " | ".join(sets) + " | validation | FLOPs vs full | time/step vs full |",
        "|---|" + "---|" * (len(sets) + 3),
        "| base (no CPT) | " + " | ".join(f"{r['base_eval'][k]:.3f}" for k in sets) + " | | | |",
    ]
    for p in POLICIES:
        lines.append(f"| {p} | " + " | ".join(_fmt([e[k] for e in r["eval"][p]]) for k in sets)
                     + f" | {_fmt(r['final_val'][p])} | {r['flops'][p]['total'] / ff:.2f}× | "
                     f"{statistics.fmean(r['step_seconds'][p]) / full_t:.2f}× |")
    lines += ["", "## Paired differences vs `full` (policy − full; negative = the policy is better)", "",
              f"Equal tokens: both after {s['steps']} steps. Equal compute: `full` after the steps with the same "
              "analytic FLOPs (" + ", ".join(f"{p}: {r['equal_compute_steps'][p]} steps" for p in POLICIES[2:])
              + "), taken from one long `full` run per seed.", "",
              "| policy | compared at | " + " | ".join(sets) + " |", "|---|---|" + "---|" * len(sets)]
    for p in POLICIES[1:]:
        for how, key in (("equal tokens", "vs_full_equal_tokens"), ("equal compute", "vs_full_equal_compute")):
            lines.append(f"| {p} | {how} | " + " | ".join(_iv(r[key][p][k]) for k in sets) + " |")
    lines += ["", "| pair (equal tokens) | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
    for label, key in (("blade − rho1", "blade_vs_rho1"), ("blade − blade-nosync", "blade_vs_nosync")):
        lines.append(f"| {label} | " + " | ".join(_iv(r[key][k]) for k in sets) + " |")
    lines += ["", "## Compute per policy (analytic FLOPs of the proxy steps; measured time)", "",
              "| policy | proxy fwd+bwd | reference scoring | reference training | total vs full | "
              "measured time vs full | measured refresh / scoring / selection (ms per step, wall clock) |",
              "|---|---|---|---|---|---|---|"]
    for p in POLICIES:
        f = r["flops"][p]
        parts = r.get("part_seconds", {}).get(p)
        measured = " / ".join(f"{parts[k] * 1e3:.0f}" for k in ("refresh", "score", "select")) if parts else ""
        lines.append(f"| {p} | {f['proxy']:.3g} | {f['scoring']:.3g} | {f['refresh']:.3g} | {f['total'] / ff:.2f}× | "
                     f"{statistics.fmean(r['step_seconds'][p]) / full_t:.2f}× | {measured} |")
    lines += ["", "## Refresh-strength sweep (blade, seed 0; chosen by validation loss)", "",
              "| setting | final validation loss | mean ‖u − w‖ |", "|---|---|---|"]
    for row in r["sweep"]:
        d = row["param_distance_mean"]
        lines.append(f"| `{json.dumps(row['setting'])}` | {row['val_loss']:.3f} | {'' if d is None else f'{d:.2f}'} |")
    lines += ["", f"Chosen: `{json.dumps(r['best_refresh'])}`.", "", "## Kept share per source (seed 0)", "",
              "| source | pool share | " + " | ".join(POLICIES) + " |", "|---|---|" + "---|" * len(POLICIES)]
    for src in sorted(r["pool_share"]):
        lines.append(f"| {src} | {r['pool_share'][src] * 100:.1f}% | "
                     + " | ".join(_pct(r["kept_share"][p].get(src)) for p in POLICIES) + " |")
    for key, sym in (("gamma_sweep", "γ"), ("tau_sweep", "τ")):
        if len(r[key]) > 1:
            lines += ["", f"## {sym} sweep (blade, seed 0)", "", f"| {sym} | validation | " + " | ".join(sets) + " |",
                      "|---|---|" + "---|" * len(sets)]
            lines += [f"| {g} | {v['val']:.3f} | " + " | ".join(f"{v[k]:.3f}" for k in sets) + " |"
                      for g, v in r[key].items()]
    lines += ["", f"## Long horizon ({s['long_steps']} steps, seed 0)", "",
              "| policy | final validation | " + " | ".join(sets) + " |", "|---|---|" + "---|" * len(sets)]
    lines += [f"| {p} | {r['long_val_curves'][p][-1]['loss']:.3f} | "
              + " | ".join(f"{r['long_eval'][p][k]:.3f}" for k in sets) + " |" for p in r["long_val_curves"]]
    if r.get("static_reference"):
        ref = r["static_reference"]
        lines.append(f"| static rho1 reference | {ref['gsm8k_val']:.3f} (in-sample) | "
                     + " | ".join(f"{ref[k]:.3f}" for k in sets) + " |")
    if r["transfer"]:
        lines += ["", f"## Transfer (BLADE-Tr): Llama {s['big_hidden']}×{s['big_layers']} replaying selected tokens", "",
                  "| selected tokens from | " + " | ".join(sets) + " | validation |", "|---|" + "---|" * (len(sets) + 1),
                  "| (big base, no CPT) | " + " | ".join(f"{r['big_base_eval'][k]:.3f}" for k in sets) + " | |"]
        for k, v in r["transfer"].items():
            val = f"{v['val']:.3f}" if v["val"] is not None else ""
            lines.append(f"| {k} (seed 0, γ = {s['gamma']}) | " + " | ".join(f"{v[x]:.3f}" for x in sets) + f" | {val} |")
    lines += ["", "## Figures", ""] + [f"![{name}](figures/{name})" for name in figs]
    lines += ["", "## What the numbers say (generated)", ""] + _verdicts(r, sets, target) + [""]
    return "\n".join(lines)


def _verdicts(r: dict[str, Any], sets: list[str], target: str) -> list[str]:
    out = []
    means = {p: statistics.fmean(e[target] for e in r["eval"][p]) for p in POLICIES}
    best = min(means, key=means.get)
    out.append(f"- Equal tokens, {target}: lowest loss {best} ({means[best]:.3f}); vs full: "
               + "; ".join(f"{p} {_iv(r['vs_full_equal_tokens'][p][target])} ({_verdict(r['vs_full_equal_tokens'][p][target])})"
                           for p in POLICIES[1:]) + ".")
    eq = r["vs_full_equal_compute"]
    winners = [p for p in POLICIES[2:] if eq[p][target]["hi"] < 0]
    losers = [p for p in POLICIES[2:] if eq[p][target]["lo"] > 0]
    out.append(f"- Equal compute, {target}: " + "; ".join(
        f"{p} − full with {r['equal_compute_steps'][p]} steps {_iv(eq[p][target])} ({_verdict(eq[p][target])})"
        for p in POLICIES[2:]) + ". " + (f"Winner at equal compute: {', '.join(winners)}." if winners else
                                         "Winner at equal compute: full" + (f" (beats {', '.join(losers)})." if losers
                                                                            else ": no policy beats it significantly.")))
    for group in dict.fromkeys(r["eval_sets"].values()):
        names = [k for k, g in r["eval_sets"].items() if g == group and k != target]
        if not names:
            continue
        for how, key in (("equal tokens", "vs_full_equal_tokens"), ("equal compute", "vs_full_equal_compute")):
            out.append(f"- {group}, {how}: " + "; ".join(
                f"{p} " + ", ".join(f"{k} {_iv(r[key][p][k])}" for k in names) for p in POLICIES[2:]) + ".")
    ref = r.get("static_reference")
    if ref:
        steps = []
        for p, curve in r["long_val_curves"].items():
            hit = next((pt["step"] for pt in curve if pt["loss"] < ref["gsm8k_val"]), None)
            steps.append(f"{p} at step {hit}" if hit is not None else f"{p} not within {r['setting']['long_steps']} steps")
        out.append(f"- Static reference: {ref['gsm8k_val']:.3f} on the validation slice it was trained on (in-sample), "
                   f"{ref[target]:.3f} on {target}; the proxies' (packed-sequence) validation loss passes this (whole-document) "
                   "in-sample loss: " + ", ".join(steps)
                   + f". On {target} after {r['setting']['long_steps']} steps: "
                   + ", ".join(f"{p} {v[target]:.3f}" for p, v in r["long_eval"].items()) + ".")
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"
