"""Train a proxy with online token selection (exact BLADE or another policy) on candidate shards.

    python jobs/prepare.py && python jobs/train.py       # embedded demo: blade → runs/demo/train/blade
    python jobs/train.py --set policy=rho1                # full | random | rho1 | blade | blade-nosync → runs/demo/train/rho1
    python jobs/train.py --config jobs/configs/train_demo.yaml --set max_steps=60 --set selection.gamma=0.5
    python jobs/train.py --print-config
    python jobs/train.py --set parallel.workers=2         # 2 data-parallel trainer processes (Ray Train, gloo on CPUs)

Writes checkpoints (rerun the same command to resume), selected-token shards, logs/metrics.jsonl,
summary.json and plots/ under output_dir (see training/runs/wiring.py for the layout).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from curation.io.cli import parse_job_config
from curation.io.outdir import report_job_errors
from curation.io.stop import GracefulStop, StopRequested, exit_code
from curation.io.storage import display  # an object-store run's paths as its s3:// URLs, not cache paths
from schemas.train_config import POLICY_CHOICES, TrainConfig

#: Short override names accepted by --set (e.g. --set policy=rho1).
ALIASES = {"policy": "selection.policy", "gamma": "selection.gamma"}


def _default(sets: dict[str, str]) -> TrainConfig:
    # The embedded default writes to runs/demo/train/<policy>, so policies do not overwrite each other
    # (an unknown policy is reported by the config validation).
    policy = sets.get("selection.policy", "blade")
    return TrainConfig.demo_default(policy=policy if policy in POLICY_CHOICES else "blade")


def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_job_config(TrainConfig, description=__doc__.splitlines()[0], default_for=_default, argv=argv,
                              aliases=ALIASES, set_example="selection.gamma=0.5 --set max_steps=300")
    if (cfg.data.candidates == TrainConfig.demo_default().data.candidates  # the demo's (others: checked by the run)
            and not os.path.exists(os.path.join(cfg.data.candidates, "index.json"))):
        print(f"error: no candidate shards in {cfg.data.candidates}; run `python jobs/prepare.py` first",
              file=sys.stderr)
        return 1
    # Imported after the config is parsed (Composer and Ray take seconds): --help and bad settings answer at once,
    # and a single-process run does not import Ray. Imported before the stop handler is installed: Composer installs
    # its own SIGTERM/SIGINT handler (exit at once) when first imported, which would replace the project's.
    from curation.engine.plan import WorkerGroupFailed
    from training.runs.train_job import train  # (parallel.workers > 1: a Ray Train worker group, on Ray)

    try:  # SIGTERM / SIGINT: training ends after the step in progress, with a checkpoint there (a second: at once)
        with GracefulStop(what="the training step in progress and its checkpoint"):
            out = report_job_errors(lambda: train(cfg), f"training into {cfg.output_dir} failed", expected=(WorkerGroupFailed,))
    except StopRequested as e:
        print(e, file=sys.stderr)
        return exit_code(e.signum)
    if out is None:
        return 1
    _report(out)
    return 0


def _report(out) -> None:  # noqa: ANN001 - a training.runs.finish.Finished (imported with Composer)
    s = json.load(open(out.summary, encoding="utf-8"))
    t = s["tokens"]
    print(f"{s['policy']}: {s['steps']} steps, kept {t['kept']:,} of {t['valid']:,} candidate tokens"
          + (f" (resumed from {display(s['resumed_from'])})" if s.get("resumed_from") else ""))
    for src, c in t["per_source"].items():
        frac = c["kept_fraction"]
        print(f"  {src:>12}: kept {c['kept_tokens']:>9,} / {c['valid_tokens']:>9,}"
              + (f"  ({frac:.1%})" if frac is not None else ""))
    if s["validation"]:
        first, last = s["validation"][0], s["validation"][-1]
        print(f"validation loss: {first['loss']:.3f} (step {first['step']}) → {last['loss']:.3f} (step {last['step']}),"
              f" perplexity {last['perplexity']:.1f}")
    if s["refreshes"]:
        print(f"reference refreshes at steps {[r['step'] for r in s['refreshes']]}")
    print(f"time (s): {', '.join(f'{k} {v:.1f}' for k, v in s['seconds'].items())}")
    print(f"summary: {display(out.summary)}  plots: {display(os.path.dirname(out.plots[0])) if out.plots else '-'}")
    if out.selected:
        print(f"selected-token shards: {display(out.selected)}")
    print(f"final weights: {display(out.final_weights)}")


if __name__ == "__main__":
    sys.exit(main())
