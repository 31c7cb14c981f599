"""See what a run selected: one self-contained HTML page (token view, kept share per source, Δ, losses; two runs
side by side).

    python jobs/show_selection.py runs/demo/curate_and_train/blade          # → …/blade/selection/index.html
    python jobs/show_selection.py runs/demo/train/blade runs/demo/train/rho1  # blade vs rho1 on the same candidates
    python jobs/show_selection.py s3://bucket/runs/blade --max-tokens 2e7     # a bucket's run; a larger sample

Any run of jobs/train.py, jobs/curate_and_train.py, jobs/curate.py or jobs/replay.py (a replay shows the shards it
trained on). On a large run the selected shards are sampled (parts spread over the run, --max-tokens in all) and
streamed; the kept tokens per source come from the manifest, exactly. (Not `inspect.py`: a script of that name in
jobs/ would shadow the standard library's `inspect` module for everything it imports.)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from curation.io.outdir import report_job_errors


def _count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number ≥ 1, got {text}")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Writes RUN_DIR/selection/index.html (or --out) and prints a one-line summary.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's output directory (local or s3://); a second "
                   "one to compare with the first (the same candidates: e.g. blade vs rho1)")
    p.add_argument("--out", help="the page's path (default: RUN_DIR/selection/index.html)")
    p.add_argument("--tokenizer", help="tokenizer.json to decode with (default: the run's, from its config)")
    p.add_argument("--max-tokens", type=_count, default=8_000_000, metavar="N",
                   help="tokens of selected shards read per run at most (default 8e6; parts spread over the run)")
    p.add_argument("--view-steps", type=_count, default=6, metavar="N", help="steps shown in the token view (default 6)")
    p.add_argument("--rows", type=_count, default=2, metavar="N",
                   help="rows of every source per shown step (default 2)")
    p.add_argument("--positions", type=_count, default=256, metavar="N",
                   help="positions shown of each row (default 256)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if len(args.runs) > 2:
        print(f"error: give one run directory, or two to compare (got {len(args.runs)})", file=sys.stderr)
        return 2
    from curation.inspector.show import show_selection  # (after the arguments: --help answers at once)

    shown = report_job_errors(lambda: show_selection(
        args.runs, out=args.out, tokenizer=args.tokenizer, max_tokens=args.max_tokens, view_steps=args.view_steps,
        rows_per_source=args.rows, positions=args.positions, progress=not args.no_progress),
        f"writing the page of {args.runs[0]} failed")
    if shown is None:
        return 1
    print(shown.line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
