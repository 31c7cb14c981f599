"""One GPU check: the ``gpu`` tests, the benchmarks and the demo main job, then one JSON object of headline ratios.

    bash .gpu-kit/setup.sh && export PYTHONPATH=$PWD && python3 jobs/bench_gpu.py --json   # one H100/H200, < 6 min
    python jobs/bench_gpu.py --tiny --json       # every step at tiny sizes on a CPU (tests/jobs/test_bench_gpu.py)
    python jobs/bench_gpu.py --skip main_job,gpu_tests --json

What runs, in which order, and the headline figures: bench/gpu.py (which, like this job, imports nothing outside
the standard library).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from bench.gpu import STEPS, run  # noqa: E402 - (the standard library only: --help answers at once)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes on a CPU (tries every step without a GPU)")
    p.add_argument("--skip", default="", help=f"comma-separated steps to leave out, of: {', '.join(STEPS)}")
    p.add_argument("--step-timeout", type=float, default=150.0, help="seconds one step may run")
    p.add_argument("--budget", type=float, default=345.0,
                   help="seconds for the whole check: a step gets at most what is left, and is skipped under 15 s")
    p.add_argument("--data", default=None, help="where the benches' demo corpora and outputs go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(STEPS):
        p.error(f"--skip: unknown steps {sorted(skip - set(STEPS))}; steps: {', '.join(STEPS)}")
    return run(args, skip)


if __name__ == "__main__":
    sys.exit(main())
