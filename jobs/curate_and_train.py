"""The main job: online BLADE curation on Ray (coordinator, scoring workers, refresh) + Composer training.

    python jobs/curate_and_train.py                          # embedded demo: prepare if missing, local Ray, ~3 min on 2 CPUs
    python jobs/curate_and_train.py --set engine.mode=pipelined --set engine.snapshot_period=4
    python jobs/curate_and_train.py --set engine.refresh=overlapped --set engine.overlap_steps=5
    python jobs/curate_and_train.py --set train.parallel.workers=2   # the trainer as 2 Ray Train workers (exact mode)
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/curate_and_train.py --config my.yaml

Writes under ``train.output_dir`` (scored/ or selected/ shards, engine/, checkpoints/, summary.json, plots/,
final/): see training/runs/engine_job.py for the layout. A rerun with the same output_dir resumes.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from curation.engine.plan import EngineError, WorkerGroupFailed
from curation.io.cli import parse_job_config
from curation.io.outdir import report_job_errors
from curation.io.stop import StopRequested, exit_code
from schemas.engine_config import CurateAndTrainConfig


def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_job_config(CurateAndTrainConfig, description=__doc__.splitlines()[0],
                              default=CurateAndTrainConfig.demo_default, argv=argv,
                              set_example="engine.mode=pipelined --set train.output_dir=runs/demo/pipelined")
    # Imported after the config is parsed (Composer, Ray and torch take seconds): --help and bad settings answer at once.
    from training.runs.engine_job import curate_and_train

    try:
        out = report_job_errors(lambda: curate_and_train(cfg), f"curate_and_train into {cfg.train.output_dir} failed",
                                expected=(EngineError, WorkerGroupFailed))
    except StopRequested as e:  # SIGTERM / SIGINT (see training.runs.engine_job.curate_and_train)
        print(e, file=sys.stderr)
        return exit_code(e.signum)
    if out is None:
        return 1
    with open(out.summary, encoding="utf-8") as f:
        s = json.load(f)
    e = s["engine"]
    print(f"trained {s['steps']} steps; kept {s['tokens']['kept']} of {s['tokens']['valid']} tokens")
    for name, c in s["tokens"]["per_source"].items():
        print(f"  {name}: kept {c['kept_fraction']:.1%} of {c['valid_tokens']} tokens")
    if s["validation"]:
        print(f"validation loss {s['validation'][0]['loss']:.3f} → {s['validation'][-1]['loss']:.3f}")
    print(f"engine: {e['mode']}, {e['workers']} workers, trainer waited {e['trainer_wait_seconds']:.1f}s, "
          f"{e['units_redone_after_restart']} units redone, {e['job_seconds_this_run']:.0f}s in all")
    from curation.io.storage import display  # an object-store run's paths as its s3:// URLs, not cache paths

    print(f"summary: {display(out.summary)}; selected-token shards: {display(out.selected)}; "
          f"final weights: {display(out.final)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
