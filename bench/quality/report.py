"""The quality benchmark's report: statistics over seeds, figures and the generated RESULTS.md.

Pure functions of the results dict written by :func:`bench.quality.analysis.analyse` (no training). The
first lines of RESULTS.md answer the questions for both settings side by side, whichever way they go: BLADE vs
RHO-1 at the long horizon; native selection at equal compute; reused selection at equal total compute (base
charged, every R); the arms against `full+val`; λ = 1 against the chosen λ. Then forgetting at a glance (the
summary's second sentence, generated), the pre-stated outcomes with which held, the goal table (against `full`
and `full+val`), the forgetting table, and the verdict rules (``bench.quality.verdicts``), before any other table;
a hand-written reading, when ``--out`` holds a ``READING.md``, after them. Every interval is shown as
``mean [3-seed t interval] ⟨pooled-SD interval⟩``.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.quality.verdicts import rules_md
from curation.evaluation.heldout import Interval

__all__ = ["seed_interval", "results_md", "answers", "forgetting_sentence", "sweep_label", "mean_over_seeds",
           "share_text", "POLICIES", "SETTING_TITLES"]

SETTING_TITLES = {"gsm8k-in-pool": "GSM8K train in the pool", "paper": "the paper's regime (no GSM8K train in the pool)"}

#: every arm of the report, in its order (bench.quality.setting.POLICIES; repeated: this module has no torch)
POLICIES = ("full", "random", "rho1", "blade", "blade-nosync", "blade-lam1", "full+val")
SELECTORS = ("rho1", "blade", "blade-nosync", "blade-lam1")
GENERAL = ("c4_heldout", "wikitext2_heldout", "lambada_heldout")
SHORT = {"c4_heldout": "C4", "wikitext2_heldout": "WikiText-2", "lambada_heldout": "LAMBADA"}
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
    p = d.get("pooled")
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" + (f" ⟨{p['lo']:+.3f}, {p['hi']:+.3f}⟩" if p else "")


def _verdict(d: dict[str, Any], better: str = "better", worse: str = "worse") -> str:
    return better if d["hi"] < 0 else worse if d["lo"] > 0 else "no significant difference"


def mean_over_seeds(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    return [(pts[0][0], statistics.fmean(p[1] for p in pts)) for pts in zip(*curves, strict=False)]


def sweep_label(row: dict[str, Any]) -> str:
    st = row["setting"]
    if row["policy"] == "rho1":
        return f"reference {st['rho1_steps']} steps" + (f", η_w {st['ref_lr']}" if "ref_lr" in st else "")
    if row["policy"] == "full+val":
        return f"share {share_text(st['validation_share'])} of each batch"
    return f"K {st['refresh_steps']}, η_w {st['ref_lr']}, λ {st['lam']}, batch {st['refresh_batch_size']}"


def share_text(x: float) -> str:
    from fractions import Fraction

    f = Fraction(x).limit_denominator(64)
    return f"{f.numerator}/{f.denominator}"


# ------------------------------------------------------------------------------------------------
# RESULTS.md
# ------------------------------------------------------------------------------------------------
def _answer_cells(r: dict[str, Any], st: dict[str, Any]) -> list[str]:
    """The answers of one setting, one cell each."""
    t, v = r["target_set"], st["verdicts"]
    ff = st["flops"]["full"]["total"]
    one = f"`blade` − `rho1` = {_iv(st['blade_vs_rho1'][t])}: **{v['blade_vs_rho1']}**"
    two = "; ".join(f"`{p}` {_iv(st['vs_full_equal_compute'][p][t])} ({st['flops'][p]['total'] / ff:.2f}×"
                    f" FLOPs): **{v['native'][p]}**" for p in st["arms"] if p in SELECTORS)
    reuse = st.get("reuse") or {}
    if reuse:
        three = "; ".join(
            f"`{p}`: {e['accountings']['charged']['summary']}; break-even R "
            f"{reuse['break_even'][p]['charged']['label']} (base charged), {reuse['break_even'][p]['free']['label']} (free)"
            for p, e in reuse["policies"].items())
    else:
        three = "not run"
    if st.get("vs_fullval_equal_compute"):
        four = "; ".join(f"`{p}` {_iv(d[t])}: **{v['vs_fullval'][p][t]}**"
                         for p, d in st["vs_fullval_equal_compute"].items() if p in SELECTORS) + \
            f" (`full+val` − `full` {_iv(st['vs_full_equal_compute']['full+val'][t])}; share " \
            f"{share_text(st['validation_share'])})"
    else:
        four = "not run (budget)"
    five = f"`blade-lam1` − `blade` = {_iv(st['lam1_vs_blade'][t])}: **{v['lam1_vs_blade']}** " \
           f"({st['flops']['blade-lam1']['total'] / st['flops']['blade']['total']:.2f}× blade's FLOPs)"
    return [one, two, three, four, five]


def answers(r: dict[str, Any]) -> list[str]:
    """The answers for both settings side by side, generated from the numbers (whichever way they go)."""
    t, s = r["target_set"], r["setting"]
    names = list(r["settings"])
    cells = {n: _answer_cells(r, r["settings"][n]) for n in names}
    questions = (f"1. BLADE vs RHO-1 at the long horizon ({s['steps']} proxy steps, {s['seeds']} seeds, equal tokens)",
                 "2. Native selection at equal compute (policy − `full` with the same analytic FLOPs)",
                 f"3. Reused selection at equal total compute ({len(r['reuse_seeds'])} seeds; selection + the proxy's "
                 f"base charged, amortized over R ∈ {{{', '.join(map(str, r['reuse_runs']))}}} target runs)",
                 "4. Against `full+val` (the target examples mixed into every batch) at equal compute",
                 "5. The paper's λ = 1 against the chosen `blade` (equal proxy steps)")
    out = [f"On {t} (nats per token; paired 95% intervals over seeds `[t]` and with the pooled SD of their family "
           "`⟨pooled⟩`; negative = the first is better).", "",
           "| question | " + " | ".join(SETTING_TITLES.get(n, n) for n in names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {q} | " + " | ".join(cells[n][i] for n in names) + " |" for i, q in enumerate(questions)]
    return out


def forgetting_sentence(r: dict[str, Any]) -> str:
    """The summary's second sentence, generated: forgetting against `full` at equal compute (and against
    `full+val` where it ran), the range over the selection policies per general set and setting."""
    parts = []
    for name, st in r["settings"].items():
        sel = [p for p in st["arms"] if p in SELECTORS]
        per = []
        for k in GENERAL:
            xs = [st["vs_full_equal_compute"][p][k]["mean"] for p in sel]
            per.append(f"{SHORT[k]} {min(xs):+.2f} to {max(xs):+.2f}")
        text = f"{SETTING_TITLES.get(name, name)}: " + ", ".join(per)
        if st.get("vs_fullval_equal_compute"):
            fv = [f"{SHORT[k]} " + ", ".join(f"{st['vs_fullval_equal_compute'][p][k]['mean']:+.2f}" for p in sel)
                  for k in GENERAL]
            text += " (against `full+val`: " + "; ".join(fv) + f" for {', '.join(sel)})"
        parts.append(text)
    return ("Forgetting (a selection policy's loss on held-out general text minus `full`'s at equal compute, nats; "
            "the range over " + ", ".join(f"`{p}`" for p in SELECTORS) + "): " + "; ".join(parts) + ".")


def _outcomes_md(r: dict[str, Any]) -> list[str]:
    lines = ["## Pre-stated outcomes (fixed in `bench/quality/verdicts.py` before the runs)", "",
             "| outcome | read in | rule | held | evidence |", "|---|---|---|---|---|"]
    for o in r.get("outcomes", []):
        held = o.get("finding") if o["id"] == "lambda" else o["held"]
        if isinstance(held, dict):
            held = "; ".join(f"{k}: {v}" for k, v in held.items())
        held = {True: "**held**", False: "did not hold",
                None: "not decided (arms not run, or fewer than 3 seeds)"}.get(held, held)
        ev = "; ".join(f"{k}: {v}" for k, v in (o.get("evidence") or {}).items())
        lines.append(f"| {o['statement']} | {o['setting']} | {o['rule']} | {held} | {ev} |")
    return lines


def _goal_md(r: dict[str, Any]) -> list[str]:
    g = r["goal"]
    lines = [f"## The goal: reach at R = {g['runs']} with the base charged (≤ {g['reach']}×) and forgetting "
             f"(≤ {g['forgetting']} nats on each general set), against `full` and against `full+val`", "",
             "Reach: the total FLOPs the replay (its selection and the proxy's base amortized over R) needs to reach the "
             "comparison's final target-set loss on smoothed mean curves, ÷ the comparison's compute; forgetting: the "
             "replay's loss minus the comparison's at equal target steps (mean over seeds), C4 / WikiText-2 / LAMBADA.",
             "", "| setting | replayed | reach vs full | forgetting vs full | goal vs full | reach vs full+val | "
             "forgetting vs full+val | goal vs full+val | search (full runs) |", "|---|---|---|---|---|---|---|---|---|"]

    def reach(x):
        return "never" if x is None else f"{x:.2f}×"

    def forget(d):
        return " / ".join(f"{d[k]:+.3f}" for k in GENERAL)

    for name, st in r["settings"].items():
        goal = (st.get("reuse") or {}).get("goal") or {}
        for p, row in goal.get("policies", {}).items():
            a, b = row["vs_full"], row.get("vs_fullval")
            lines.append(f"| {name} | {p} | {reach(a['reach'])} | {forget(a['forgetting'])} | "
                         f"{'met' if a['met'] else 'not met'} | " + (
                             f"{reach(b['reach'])} | {forget(b['forgetting'])} | {'met' if b['met'] else 'not met'} | "
                             if b else "not run | | | ") + f"{st['search_full_runs'].get(p, 0):.1f} |")
    return lines


def _forgetting_md(r: dict[str, Any]) -> list[str]:
    lines = ["## Forgetting: loss on held-out general text against `full`, `full+val` and the base", "",
             "Proxy arms after the run (`full`, `full+val` at the arm's equal-compute step; the base the runs started "
             "from); the target's replays at equal target steps. Paired intervals over seeds `[t]` `⟨pooled⟩`.", "",
             "| setting | level | arm | against | " + " | ".join(SHORT[k] for k in GENERAL) + " |",
             "|---|---|---|---|" + "---|" * len(GENERAL)]
    for name, st in r["settings"].items():
        for p in st["arms"]:
            rows = [("base", st["forgetting_vs_base"][p])]
            if p != "full":
                rows.insert(0, ("full (equal compute)", st["vs_full_equal_compute"][p]))
            if p in st.get("vs_fullval_equal_compute", {}):
                rows.insert(1, ("full+val (equal compute)", st["vs_fullval_equal_compute"][p]))
            for against, d in rows:
                lines.append(f"| {name} | proxy | {p} | {against} | " + " | ".join(_iv(d[k]) for k in GENERAL) + " |")
        reuse = st.get("reuse") or {}
        for p, e in reuse.get("policies", {}).items():
            rows = [("target full", e["equal_steps"]), ("target base", e["forgetting_vs_base"])]
            if "vs_fullval_equal_steps" in e:
                rows.insert(1, ("target full+val", e["vs_fullval_equal_steps"]))
            for against, d in rows:
                lines.append(f"| {name} | target | replay {p} | {against} | " + " | ".join(_iv(d[k]) for k in GENERAL)
                             + " |")
        if reuse:
            lines.append(f"| {name} | target | full | target base | " +
                         " | ".join(_iv(reuse["full_forgetting_vs_base"][k]) for k in GENERAL) + " |")
            if reuse.get("fullval_forgetting_vs_base"):
                lines.append(f"| {name} | target | full+val | target base | " +
                             " | ".join(_iv(reuse["fullval_forgetting_vs_base"][k]) for k in GENERAL) + " |")
    return lines


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
    p, budget = r.get("pauses") or {}, r.get("budget_minutes")
    if budget:
        total = sum(v["wall"] for v in st.values()) / 60
        rows += ["", f"Budget: {budget} min of wall time; recorded {total:.1f} min "
                 f"({'within' if total <= budget else f'over by {total - budget:.1f} min'}); planned "
                 f"{sum(est.values())} min." + (
                     " Contingencies in the plan: " + ", ".join(f"{k} +{v} min" for k, v in
                                                                 r["plan"]["contingencies_minutes"].items()) + "."
                     if r.get("plan") else "")]
    if p:
        rows += ["", "The pause log (`pauses.jsonl`, written by the stage clock) holds " + (
            f"{p['count']} stopped interval{'s' if p['count'] != 1 else ''}, {p['minutes']:.1f} min in all, none of it "
            "counted: " + ", ".join(f"{x['stage']} {x['seconds'] / 60:.1f} min from {x['from']}" for x in p["log"]) + "."
            if p["count"] else "no stopped interval.")]
    return rows


def _recorded_md(r: dict[str, Any]) -> list[str]:
    rec = r.get("recorded")
    if not rec:
        return []
    lines = ["## Arms from the recorded report", "",
             f"`{rec['path']}` (sha256 {rec['sha256'][:12]}): "
             + ("**used**: " if rec["used"] else "**not used**: ")
             + "; ".join(f"{n}: {', '.join(a) or 'none'} (replays: {', '.join(rec['replays'].get(n, [])) or 'none'})"
                         for n, a in rec["arms"].items())
             + ". They stand in only while every number trained again equals the recorded one bit for bit:", "",
             "| check | numbers | equal | max abs difference |", "|---|---|---|---|"]
    if rec["differences"]:
        lines.insert(3, "The preset differs from the recorded run's in: " + "; ".join(rec["differences"]) + ".")
    lines += [f"| {c['what']} | {c['numbers']} | {'yes' if c['equal'] else '**no**'} | {c['max_abs_diff']:.3g} |"
              for c in rec["checks"]]
    return lines


def _sweep_md(r: dict[str, Any]) -> list[str]:
    lines = [f"## The choices, on the dev split at equal compute (seed 0; {r['dev_split']['documents']} GSM8K train "
             "problems in no pool, no reference's training data and no evaluation set: overlaps by document hash "
             + ", ".join(f"{k} {v}" for k, v in r["dev_split"]["overlap"].items()) + ")", "",
             "Each family's candidates are compared at the cheapest one's whole-run FLOPs (figure `sweep_frontier.png`); "
             "their runs are the family's search, charged in the `search` column only.", "",
             "| setting | family | candidate | FLOPs vs full | dev loss at the budget | final dev loss | final validation "
             "| chosen |", "|---|---|---|---|---|---|---|---|"]
    for row in r["sweep"]:
        lines.append(f"| {row['in_setting']}{' (recorded)' if row.get('recorded') else ''} | {row['policy']} | "
                     f"{sweep_label(row)}" + (f" (K/τ = {row['kt']:.2g})" if "kt" in row else "")
                     + f" | {row['flops_vs_full']:.2f}× | {row['dev_at_budget']:.3f} | {row['curve'][-1][1]:.3f} | "
                     f"{row['val_loss']:.3f} | {'**yes**' if row['chosen'] else ''} |")
    lines += ["", "| setting | family | candidates | budget (FLOPs) | search (full runs) |", "|---|---|---|---|---|"]
    for name, st in r["settings"].items():
        for fam, x in st["search"].items():
            lines.append(f"| {name} | {fam} | {x['candidates']} | {r['sweep_budgets'][name][fam]:.3g} | "
                         f"{x['full_runs']:.2f}{' (recorded run)' if x['recorded'] else ''} |")
    return lines


def results_md(r: dict[str, Any], figs: dict[str, str], command: str, *, hardware: str, reading: str = "") -> str:
    s = r["setting"]
    sets = list(r["eval_sets"])
    b, tb = r["bases"]["proxy"], r["bases"]["target"]
    lines = ["# BLADE quality benchmark (real public text)", "",
             f"Produced by `{command}` ({hardware}). Stage times below (added up over the resumed pieces).", "",
             "## Answers, both settings (generated from the numbers)", "", *answers(r), "",
             forgetting_sentence(r), "", *_outcomes_md(r), "", *_goal_md(r), "", *_forgetting_md(r), "",
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
        "- **Two settings**, every arm in each (`full+val` in " + ", ".join(s["full_val_settings"]) + "): " + "; ".join(
            f"**{SETTING_TITLES.get(n, n)}**: pool of {sum(c['sequences'] for c in st['pool_counts'].values())} "
            f"sequences, {st['math_share'] * 100:.0f}% math" for n, st in r["settings"].items()) + ".",
        f"- **Continual pre-training**: {s['steps']} proxy steps × {s['batch']} × {s['seq_len']} tokens per arm, "
        f"γ = {s['gamma']}, W = {s['warmup']}, τ = {s['tau']}, {s['seeds']} seeds; lr {s['lr']} (AdamW, wd 0.01, "
        "clip 1.0, constant). Chosen on the dev split: " + "; ".join(
            f"{n}: " + ", ".join(f"{fam} {c}" for fam, c in best.items()) for n, best in r["best"].items()) + ".",
        "- **Arms**: " + "; ".join(f"`{p}`: {r['arm_text'][p]}" for p in r["arms"]) + ".",
        f"- The target's `full` runs {r['target_steps']} steps (to the equal-compute point of R = "
        f"{r['target_full_decides_r']}, base charged, of the costliest reused selection); its `full+val` and the "
        f"replays {s['steps']}.",
        "- Validation (target; the references train on it, `full+val` mixes it in) = first 500 GSM8K train problems. "
        "Evaluation sets (never used for any choice): " + ", ".join(f"{k} ({r['eval_documents'].get(k)} docs; {g})"
                                                                 for k, g in r["eval_sets"].items()) + ".",
        "- Metric: whole-document token loss (nats per token). Paired by seed: mean over seeds, 95% t interval, and "
        "the pooled-SD interval of its family.", "",
        "## Stage times", "", *_stage_table(r), "", *_recorded_md(r), "", *_sweep_md(r)]
    for name, st in r["settings"].items():
        lines += _setting_md(r, name, st, sets)
    lines += ["", "## Compute per arm (analytic FLOPs; search: the candidates' whole runs, in `full` runs)", "",
              "| setting | arm | proxy fwd+bwd | reference scoring | reference training | total vs full | search |",
              "|---|---|---|---|---|---|---|"]
    for name, st in r["settings"].items():
        ff = st["flops"]["full"]["total"]
        for p in st["arms"]:
            f = st["flops"][p]
            lines.append(f"| {name} | {p} | {f['proxy']:.3g} | {f['scoring']:.3g} | {f['refresh']:.3g} | "
                         f"{f['total'] / ff:.2f}× | {st['search_full_runs'][p]:.2f} |")
    lines += ["", "## Figures", ""] + [f"![{name}](figures/{name})" for name in figs] + [""]
    return "\n".join(lines)


def _setting_md(r: dict[str, Any], name: str, st: dict[str, Any], sets: list[str]) -> list[str]:
    s, t = r["setting"], r["target_set"]
    arms = st["arms"]
    full_t = statistics.fmean(st["step_seconds"]["full"])
    lines = ["", f"## Setting `{name}`: {SETTING_TITLES.get(name, name)}", "",
             f"Arms from the recorded report: {', '.join(st['recorded_arms']) or 'none'}.", "",
             f"### Held-out loss per arm after {s['steps']} proxy steps (mean ± std over seeds)", "",
             "| arm | " + " | ".join(sets) + " | validation | time/step vs full |", "|---|" + "---|" * (len(sets) + 2),
             "| base (no CPT) | " + " | ".join(f"{r['base_eval'][k]:.3f}" for k in sets) + " | | |"]
    for p in arms:
        lines.append(f"| {p} | " + " | ".join(_fmt([e[k] for e in st["eval"][p]]) for k in sets)
                     + f" | {_fmt(st['final_val'][p])} | {statistics.fmean(st['step_seconds'][p]) / full_t:.2f}× |")
    ref = st["static_reference"]
    lines.append("| static RHO-1 reference | " + " | ".join(f"{ref[k]:.3f}" for k in sets) + " | | |")
    lines += ["", "### Paired differences (negative = the first is better; `[t]` `⟨pooled⟩`)", "",
              "Equal compute: `full` (and `full+val`) after the steps with the same FLOPs ("
              + ", ".join(f"{p}: {st['equal_compute_steps'][p]}" for p in arms if p != "full") + ").", "",
              "| comparison | compared at | " + " | ".join(sets) + " |", "|---|---|" + "---|" * len(sets)]
    for p in arms[1:]:
        for how, key in (("equal tokens", "vs_full_equal_tokens"), ("equal compute", "vs_full_equal_compute")):
            lines.append(f"| {p} − full | {how} | " + " | ".join(_iv(st[key][p][k]) for k in sets) + " |")
    for p, d in st.get("vs_fullval_equal_compute", {}).items():
        lines.append(f"| {p} − full+val | equal compute | " + " | ".join(_iv(d[k]) for k in sets) + " |")
    for label, key in (("blade − rho1", "blade_vs_rho1"), ("blade − blade-nosync", "blade_vs_nosync"),
                       ("blade-lam1 − blade", "lam1_vs_blade")):
        lines.append(f"| {label} | equal tokens | " + " | ".join(_iv(st[key][k]) for k in sets) + " |")
    wins = {p: sum(v == "worse" for v in st["verdicts"]["native_all_sets"][p].values()) for p in arms[1:]}
    lines += ["", "Sets on which `full` is significantly better at equal compute: "
              + ", ".join(f"{p} {n} of {len(sets)}" for p, n in wins.items()) + "."]
    steps = [n for n, _ in st["test_curves"]["full"][0]]
    lines += ["", f"### {t} over steps (mean over seeds)", "",
              "| arm | " + " | ".join(str(n) for n in steps) + f" | passed the static reference by {st['pass_margin']}"
              " nats at (per seed) |", "|---|" + "---|" * (len(steps) + 1)]
    for p in arms:
        lines.append(f"| {p} | " + " | ".join(f"{v:.3f}" for _, v in mean_over_seeds(st["test_curves"][p])) + " | "
                     + ", ".join("never" if x is None else str(x) for x in st["passed_static_reference"][p]) + " |")
    lines += ["", "### Kept share per source (seed 0)", "", "| source | pool share | " + " | ".join(arms) + " |",
              "|---|---|" + "---|" * len(arms)]
    for src in sorted(set(st["pool_share"]) | {k for p in arms for k in st["kept_share"][p]}):
        share = st["pool_share"].get(src)
        lines.append(f"| {src} | {'–' if share is None else f'{share * 100:.1f}%'} | " + " | ".join(
            "–" if st["kept_share"][p].get(src) is None else f"{st['kept_share'][p][src] * 100:.0f}%" for p in arms)
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
             f"{t} loss (smoothed mean): {reuse['full_level_smoothed']:.3f} (base {reuse['base'][t]:.3f})"
             + (f"; the target's `full+val` ends at {reuse['fullval_level']:.3f} ({_iv(reuse['fullval_vs_full_equal_steps'][t])}"
                " against `full` at equal steps)" if "fullval_level" in reuse else "")
             + f". Replays from the recorded report: {', '.join(reuse['recorded_replays']) or 'none'}.", "",
             f"| replayed | accounting | compared at | {t} | verdict | FLOPs to reach full's final loss (× full's) | "
             + " | ".join(k for k in sets if k != t) + " |", "|---|---|---|---|---|---|" + "---|" * (len(sets) - 1)]
    for p, e in reuse["policies"].items():
        lines.append(f"| {p} | | equal target steps | {_iv(e['equal_steps'][t])} | {e['equal_steps_verdict']} | | "
                     + " | ".join(_iv(e["equal_steps"][k]) for k in sets if k != t) + " |")
        if "vs_fullval_equal_steps" in e:
            lines.append(f"| {p} − full+val | | equal target steps | {_iv(e['vs_fullval_equal_steps'][t])} | "
                         f"{e['vs_fullval_verdict']} | | "
                         + " | ".join(_iv(e["vs_fullval_equal_steps"][k]) for k in sets if k != t) + " |")
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
              + ("full+val: " + ", ".join(f"{n:.0f} {v:.3f}" for n, v in reuse["fullval_curve_steps"]) + "; "
                 if reuse.get("fullval_curve_steps") else "")
              + "; ".join(f"{p}: " + ", ".join(f"{n:.0f} {v:.3f}" for n, v in e["curve_steps"])
                          for p, e in reuse["policies"].items()) + "."]
    return lines
