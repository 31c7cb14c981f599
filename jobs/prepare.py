"""Prepare corpora into packed candidate + validation shards (MDS).

    python jobs/prepare.py                                  # embedded demo corpus → runs/demo/data
    python jobs/prepare.py --config jobs/configs/prepare_gsm8k.yaml
    python jobs/prepare.py --config my.yaml --set seq_len=512 --print-config
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from curation.ingest.prepare import prepare
from curation.io.cli import parse_job_config
from curation.io.outdir import report_job_errors
from curation.io.stop import GracefulStop, StopRequested, exit_code
from schemas.config import PrepareConfig


def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_job_config(
        PrepareConfig, description=__doc__.splitlines()[0], default=PrepareConfig.demo_default, argv=argv,
        set_example="seq_len=256 --set sources.0.text_field=body",
    )

    def ray_pool(workers: int | None, units: int, needs):  # noqa: ANN001, ANN202 - imported only for Ray workers
        from curation.engine.ray_backend.prepare_pool import ray_unit_pool

        return ray_unit_pool(cfg.ray, workers, units, needs, resources=cfg.resources)

    try:  # SIGTERM / SIGINT: the part in progress is finished, then the job stops (a second signal: at once)
        with GracefulStop(what="the part in progress"):
            result = report_job_errors(lambda: prepare(cfg, pool=ray_pool), f"preparing into {cfg.output_dir} failed")
    except StopRequested as e:
        print(f"{e}; rerun the same command to resume from the next part (finished parts are kept)", file=sys.stderr)
        return exit_code(e.signum)
    if result is None:
        return 1
    from curation.io.storage import display  # an object-store run's paths as its s3:// URLs, not cache paths

    for group, m in result.manifests.items():
        t = m.totals()
        print(f"{group}: {t.sequences} sequences × {m.seq_len} tokens from {t.documents} documents "
              f"({t.bad_records} bad records skipped, {t.dropped_tokens} remainder tokens dropped) → {display(result.dirs[group])}")
        for name, c in m.sources.items():
            print(f"  {name}: {c.documents} docs, {c.tokens} tokens, {c.sequences} sequences")
    print(f"tokenizer: {display(result.tokenizer.path)} (vocab {result.tokenizer.vocab_size}, sha256 {result.tokenizer.fingerprint[:12]})")
    print(f"tokenized {result.tokens_processed} tokens in {result.seconds:.1f}s: "
          f"{result.tokens_per_second:,.0f} tokens/s ({result.workers} worker{'s' if result.workers > 1 else ''})")
    if result.uploaded is not None:
        print(result.uploaded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
