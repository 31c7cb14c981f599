"""Benchmark: cost of Δ + top-γ selection relative to one forward pass (goal < 2%, docs/DESIGN.md §6).

    python jobs/bench_selection.py                      # small Llama, batch 8 × 512, this machine
    python jobs/bench_selection.py --device cuda --json # on a GPU, machine-readable

What is timed and how: bench/selection.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--gamma", type=float, default=0.6)
    p.add_argument("--repeats", type=int, default=5, help="timed forward passes (median)")
    p.add_argument("--select-repeats", type=int, default=101, help="timed Δ + selection runs (median)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync", choices=["auto", "on", "off"], default="auto",
                   help="selection path: auto (the device's default), on (kthvalue + host reads), off (sync-free)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    # imported after the arguments are parsed (torch and transformers take seconds): --help answers at once
    from bench.selection import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
