"""Chaos soak of the main job: kill workers, the refresh actor and the trainer on a seeded schedule, rerun, compare.

    python jobs/soak.py --steps 2000 --json            # the full soak (≤ 30 min on 2 cores)
    python jobs/soak.py --steps 60 --seed 3 --trainer-kills 1 --actor-kills 2   # the short smoke (CI)

Runs jobs/curate_and_train.py once uninterrupted and once under the schedule (rerun after every trainer death), then
checks that the final weights, selected rows and scores are equal, that every work unit was done exactly once (from
the ledger), that a SIGTERM'd trainer stopped cleanly (exit 143, nothing of its session left running) and that the
driver's and the workers' RSS and open file descriptors grew by at most --max-growth between the first and the last
quarter of the last attempt (bench/soak.py). Exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/soak", help="output directory (the demo corpus is prepared under it)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainer-kills", type=int, default=3)
    p.add_argument("--actor-kills", type=int, default=6)
    p.add_argument("--max-growth", type=float, default=0.10)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    if args.steps < 20:
        p.error("--steps must be at least 20")
    from bench.soak import SoakSettings, soak  # after the arguments: --help answers at once

    r = soak(SoakSettings(out=args.out, steps=args.steps, seed=args.seed, trainer_kills=args.trainer_kills,
                          actor_kills=args.actor_kills, max_growth=args.max_growth, timeout_s=args.timeout_s))
    if args.json:
        import json

        print(json.dumps(r, indent=1))
    else:
        print(f"soak of {r['steps']} steps, seed {r['seed']}: {'ok' if r['ok'] else 'FAILED'} "
              f"({r['attempts']} attempts, {len(r['events'])} kills, {r['seconds']:.0f}s)")
        for name, ok in r["checks"].items():
            print(f"  {name}: {ok}")
        print(f"  kills: {r['kills']}; redone: {r['redone']}")
        for role, g in r["growth"].items():
            print(f"  {role}: RSS {g['rss']}, FDs {g['fds']} (growth, last attempt)")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
