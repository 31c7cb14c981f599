"""Batch curation: score and select a candidate corpus with given checkpoints on Ray workers (no training).

    python jobs/curate.py                      # demo: the main job's final proxy + reference on the demo pool
    python jobs/curate.py --config my.yaml --set workers.count=8 --set gamma=0.4
    python jobs/curate.py --set proxy_weights=null     # reference only: a static, RHO-1-style pass

Every block of ``batch_size`` sequences is one candidate batch; its top-γ tokens by
``Δ = ℓ(u) − ℓ(w̃)`` are kept (``u``: the proxy checkpoint, or the base model of ``model`` without one).
Writes ``output_dir/selected/`` (selected-token shards in per-worker subdirectories, a merged
``index.json`` and a ``manifest.json`` with per-source kept counts) and ``output_dir/summary.json``.
A rerun with the same config and output directory skips finished parts; bad data stops the job with
the shard and record named, keeping what was finished.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from curation.io.cli import parse_job_config
from curation.io.outdir import report_job_errors
from curation.io.stop import StopRequested, exit_code
from schemas.engine_config import CurateConfig


def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_job_config(CurateConfig, description=__doc__.splitlines()[0], default=CurateConfig.demo_default,
                              argv=argv, set_example="gamma=0.4 --set output_dir=runs/demo/curate/gamma0.4")
    # Imported after the config is parsed (Ray and torch take seconds): --help and bad settings answer at once.
    from curation.engine.batch_curation import curate
    from curation.engine.plan import EngineError

    try:
        s = report_job_errors(lambda: curate(cfg), f"curating into {cfg.output_dir} failed", expected=(EngineError,))
    except StopRequested as e:  # SIGTERM / SIGINT (see curation.engine.batch_curation)
        print(e, file=sys.stderr)
        return exit_code(e.signum)
    if s is None:
        return 1
    from curation.io.storage import display  # an object-store run's paths as its s3:// URLs, not cache paths

    print(f"selected-token shards: {display(s['selected_dir'])} ({s['parts']} parts, {s['sequences']} sequences)")
    for name, c in s["per_source"].items():
        print(f"  {name}: kept {c['kept_tokens']} of {c['tokens']} tokens ({c['kept_fraction']:.1%} of predicted)")
    print(f"{s['workers']} workers, {s['redone_units']} units redone after a restart, "
          f"{s['scored_tokens_per_second_this_run']:,.0f} tokens/s this run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
