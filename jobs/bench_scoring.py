"""Benchmark: scoring-worker throughput vs a bare forward pass, and 1 vs 2 workers on Ray (docs/DESIGN.md §6).

    python jobs/bench_scoring.py                    # CPU, one torch thread per worker (and for the baseline)
    python jobs/bench_scoring.py --device cuda      # on a GPU (bf16 autocast, as the workers run there)
    python jobs/bench_scoring.py --json
    python jobs/bench_scoring.py --pipeline-only --json   # the host side alone (L = 1024, b = 8 and 32)

What is measured and how: bench/scoring.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the baseline and of each worker")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per step (one forward); default 8 (--pipeline-only: 8, then 32)")
    p.add_argument("--seq-len", type=int, default=None, help="default 256 (--pipeline-only: 1024, the GPU shape)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--range-steps", type=int, default=3, help="steps per work unit")
    p.add_argument("--steps", type=int, default=None,
                   help="steps timed in-process (worker and bare forward); default 9 (--pipeline-only: 90)")
    p.add_argument("--rounds", type=int, default=3,
                   help="--pipeline-only: timed rounds per shape (the figure is their median)")
    p.add_argument("--parts", type=int, default=16,
                   help="--pipeline-only: parts (zstd shards) of the candidate pool, read in the training stream's "
                        "random order")
    p.add_argument("--ray-steps", type=int, default=36,
                   help="steps scored in each Ray run after the first unit (start-up, not counted)")
    p.add_argument("--no-ray", action="store_true", help="skip the 1 vs 2 workers part")
    p.add_argument("--loss-chunk-elements", type=int, default=None,
                   help="logits per chunk of the timed per-token loss (default: curation.core.losses' for the device)")
    p.add_argument("--pipeline-only", action="store_true",
                   help="the worker's own host cost: the forward replaced by a stub of negligible cost, one core")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    # imported after the arguments are parsed (torch takes seconds): --help answers at once
    from bench.scoring import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
