"""Benchmark: trainer tokens/s with 1 vs N data-parallel workers (Ray Train + Composer), and the efficiency.

    python jobs/bench_scaling.py                          # CPU: 1 vs 2 workers, 1 torch thread each
    python jobs/bench_scaling.py --policy full --steps 40 --json
    python jobs/bench_scaling.py --workers 1 8 --gpus     # GPUs: 1 vs all of them (one GPU per worker)

What is measured and how: bench/scaling.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=os.path.join("runs", "demo", "data"),
                   help="prepared demo data (candidates/, validation/); prepared there if absent")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare (first = base)")
    p.add_argument("--policy", default="blade", choices=["full", "random", "rho1", "blade", "blade-nosync"])
    p.add_argument("--steps", type=int, default=30, help="proxy steps per run")
    p.add_argument("--skip", type=int, default=5, help="first steps not measured")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--gpus", action="store_true", help="one GPU per worker (CUDA, nccl)")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"],
                   help="parallel.strategy of the runs with N > 1 workers (fsdp: sharded proxy and reference)")
    p.add_argument("--json", action="store_true", help="print one JSON object (after the text report)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    # imported after the arguments are parsed (torch, Composer and Ray take seconds): --help answers at once
    from bench.scaling import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
