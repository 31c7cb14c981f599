"""Quality benchmark on real public text: the paper's comparison, ablations and transfer in miniature,
at equal tokens and at equal compute, on held-out sets for the target, other math styles and forgetting, in two
settings (GSM8K train in the pool; the paper's regime without it).

    python jobs/bench_quality.py --preset cpu --out /work/qruns/v8   # CPU preset, ≈ 3 h on 2 idle cores (planned)
    python jobs/bench_quality.py --preset gpu --out runs/quality-gpu # one H100-class GPU (not run)
    python jobs/bench_quality.py --quick --out /tmp/q                # CI smoke version (≈ 1 min of CPU)

The setting (data, models, presets, compute model) is in bench/quality/setting.py, the runs in
bench/quality/runs.py, the verdict rules in bench/quality/verdicts.py and the report in
bench/quality/report.py. Everything that is chosen (BLADE's refresh setting, RHO-1's reference, full+val's share)
is chosen at equal compute on a dev split of GSM8K train, never on an evaluation set. The CPU preset uses the arms
of the v7 report (docs/results/v7/results.json) while this machine reproduces its floats bit for bit
(bench/quality/recorded.py; --recorded none trains them). Outputs under ``--out``:
RESULTS.md, results.json, figures/*.png, models/<policy>-seed<k>/ (HF save_pretrained + tokenizer),
runs/<run>/ (each training run). A rerun with the same ``--out`` reuses every finished run whose settings
match and resumes unfinished ones from their checkpoints, so a preset can be run in pieces.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

#: The names of bench/quality/setting.py's PRESETS, here so that --help answers before torch loads (a test keeps them
#: equal).
PRESET_NAMES = ("cpu", "gpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("runs", "quality"), help="output directory")
    ap.add_argument("--preset", choices=PRESET_NAMES, default="cpu", help="cpu (default) or gpu (one H100-class GPU)")
    ap.add_argument("--quick", action="store_true", help="CI smoke setting (tiny data and models, ≈ 1 min of CPU)")
    ap.add_argument("--seeds", type=int, default=None, help="override the number of seeds")
    ap.add_argument("--steps", type=int, default=None, help="override the proxy steps per run")
    ap.add_argument("--parallel-runs", type=int, default=None, metavar="N",
                    help="training runs at a time in the sweep, main and reuse stages (default: the preset's; each "
                    "run keeps the preset's threads, so any N gives the same results)")
    ap.add_argument("--recorded", default=None, metavar="PATH",
                    help="a results.json of an earlier run of the same preset whose arms stand in while this machine "
                    "reproduces its floats (default: the preset's; 'none': train every arm)")
    ap.add_argument("--until", default=None, help="train the stages up to this one (data, bases, sweep, main, reuse), "
                    "then stop without evaluating: a piece of a run resumed by the next invocation")
    args = ap.parse_args(argv)
    # Imported after the arguments are parsed (bench.quality imports torch): --help answers at once.
    from bench.quality.setting import PRESETS, QUICK, SHARED

    if not os.path.isdir(SHARED):
        print(f"error: the quality benchmark reads real text from {os.path.abspath(SHARED)}, which is absent",
              file=sys.stderr)
        return 2
    s = QUICK if args.quick else PRESETS[args.preset]
    if args.seeds:
        s = replace(s, seeds=args.seeds)
    if args.steps:
        s = replace(s, steps=args.steps)
    if args.recorded is not None:
        path = None if args.recorded == "none" else os.path.abspath(args.recorded)
        if path is not None and not os.path.isfile(path):
            ap.error(f"--recorded {args.recorded}: no such file")
        s = replace(s, recorded=path)
    if args.parallel_runs is not None:
        if args.parallel_runs < 1:
            ap.error(f"--parallel-runs must be at least 1, got {args.parallel_runs}")
        s = replace(s, parallel_runs=args.parallel_runs)
    from bench.quality.analysis import run_benchmark

    command = "python jobs/bench_quality.py" + (" --quick" if args.quick else f" --preset {args.preset}") + \
        (f" --seeds {args.seeds}" if args.seeds else "") + (f" --steps {args.steps}" if args.steps else "") + \
        (f" --parallel-runs {args.parallel_runs}" if args.parallel_runs is not None else "") + \
        (f" --recorded {args.recorded}" if args.recorded is not None else "") + \
        f" --out {args.out}"
    report = run_benchmark(s, args.out, until=args.until, command=command,
                           preset="quick" if args.quick else args.preset)
    print(f"[done] {report}" if report else
          f"[done] stages up to {args.until} in {args.out}; rerun without --until to evaluate and report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
