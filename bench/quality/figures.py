"""The quality benchmark's figures (pure functions of the results dict; matplotlib, Agg)."""

from __future__ import annotations

import os
from typing import Any

from bench.quality.compute import smooth
from bench.quality.report import POLICIES, mean_over_seeds, sweep_label

__all__ = ["make_figures"]


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
    color["target full+val"] = "C7"

    fig, ax = plt.subplots(figsize=(6.5, 4))  # the bases flatten
    for role, b in r["bases"].items():
        tok = s["base_batch"] * s["seq_len"]
        ax.plot([p["step"] * tok / b["parameters"] for p in b["curve"]], [p["loss"] for p in b["curve"]], "o-", ms=3,
                label=f"{role} ({b['parameters'] / 1e6:.2f}M parameters, {b['epochs']:.2f} epochs)")
    ax.set(xlabel="tokens per parameter", ylabel="loss on held-out general text", title="Base pretraining")
    ax.legend(fontsize=8)
    save(fig, "bases.png")

    panels = [(st, fam) for st in r["settings"] for fam in ("blade", "rho1", "full+val")
              if any(x["in_setting"] == st and x["policy"] == fam for x in r["sweep"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)  # the choices: frontiers
    for ax, (st, fam) in zip(axes[0], panels, strict=True):
        for row in (x for x in r["sweep"] if x["in_setting"] == st and x["policy"] == fam):
            ax.plot(*zip(*row["curve"], strict=True), "o-", ms=3, label=sweep_label(row) + (" (chosen)" if row["chosen"] else ""))
        ax.axvline(r["sweep_budgets"][st][fam], color="gray", ls="--", label="equal-compute budget")
        ax.set(xlabel="FLOPs (analytic)", ylabel="dev loss (GSM8K train dev split)", title=f"{fam} in {st} (seed 0)")
        ax.legend(fontsize=6)
    save(fig, "sweep_frontier.png")

    for name, st in r["settings"].items():
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))  # curves over steps: validation and the target set
        for p in st["arms"]:
            val = mean_over_seeds([[(x["step"], x["loss"]) for x in c] for c in st["val_curves"][p]])
            axes[0].plot(*zip(*val, strict=True), color=color[p], label=p)
            axes[1].plot(*zip(*mean_over_seeds(st["test_curves"][p]), strict=True), "o-", ms=3, color=color[p], label=p)
        axes[1].axhline(st["static_reference"][target], color="gray", ls="--", label="static RHO-1 reference")
        axes[0].set(xlabel="proxy step", ylabel="validation loss (mean over seeds)", title=f"Validation ({name})")
        axes[1].set(xlabel="proxy step", ylabel=f"{target} loss (mean over seeds)", title=f"{target} ({name})")
        for ax in axes:
            ax.legend(fontsize=8)
        save(fig, f"curves-{name}.png")
        reuse = st.get("reuse") or {}
        if reuse:
            runs = list(r["reuse_runs"])
            w = s["smooth_window"]
            fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), sharey=True)
            for ax, n in zip(axes if len(runs) > 1 else [axes], runs, strict=True):
                # every curve smoothed alike (the replays' curves are smoothed over `smooth_window` snapshots)
                ax.plot(*zip(*smooth(reuse["full_curve"], w), strict=True), "o-", ms=3, color=color["full"],
                        label=f"full (target, mean of seeds, smoothed over {w})")
                if reuse.get("fullval_curve_steps"):
                    per = reuse["target_step_flops"]
                    ax.plot(*zip(*smooth([(x * per, v) for x, v in reuse["fullval_curve_steps"]], w), strict=True),
                            "s-", ms=3, color=color["target full+val"], label="full+val (target, smoothed)")
                for p, e in reuse["policies"].items():
                    ax.plot(*zip(*e["accountings"]["charged"]["runs"][str(n)]["curve"], strict=True), "o-", ms=3,
                            color=color[p], label=f"replay {p} (smoothed)")
                ax.axhline(reuse["full_level_smoothed"], color="gray", ls="--", label="full's final loss")
                ax.set(xlabel="total FLOPs (target + (selection + proxy base) / R)", ylabel=f"{target} loss",
                       title=f"{name}: R = {n}, base charged")
                ax.legend(fontsize=7)
            save(fig, f"reuse-{name}.png")
    return figs


