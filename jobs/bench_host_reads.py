"""Count the host reads of steady steps on the CPU, a GPU run's branches taken (bench/host_read_scenarios.py).

    python jobs/bench_host_reads.py --json                       # every scenario, one JSON line
    python jobs/bench_host_reads.py --only trainer_blade worker_selected

A host read (a value read from the device, a blocking copy, a synchronize) drains a GPU's queue; each is counted
with its file:line and owner (project, composer, torch, other). Exit 0 when every target is met (<= 1 per steady
trainer and worker step, <= 2 per episode start and per weight load).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

#: bench.host_read_scenarios.SCENARIOS' names (here: --help answers before torch loads; a test holds them equal)
SCENARIO_NAMES = ("trainer_full", "trainer_random", "trainer_rho1", "trainer_blade", "trainer_blade_microbatched",
                  "trainer_engine", "trainer_engine_exact", "episode_start", "refresh", "worker_scored",
                  "worker_selected", "weight_load")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    p.add_argument("--only", nargs="+", choices=SCENARIO_NAMES, help="these scenarios only")
    p.add_argument("--dir", default=None, help="where the generated corpus and runs go (default: a temporary one)")
    args = p.parse_args(argv)
    from bench.host_read_scenarios import run  # after the arguments: --help answers before torch loads

    return run(args.dir, only=args.only, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
