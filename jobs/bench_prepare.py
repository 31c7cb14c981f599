"""Benchmark: prepare's tokens/s against the raw tokenizer's on the same texts, with 1 worker and with all workers.

    python jobs/bench_prepare.py                           # 45 MB of real text from ../shared/data, GPT-2, L = 1024
    python jobs/bench_prepare.py --workers 1 2 --json
    python jobs/bench_prepare.py --input corpus.jsonl --tokenizer tok.json --workers 1 8 16
    python jobs/bench_prepare.py --huge-doc 20 100 --json   # peak RSS of jobs/prepare.py on one huge document
    python jobs/bench_prepare.py --two-nodes 2 --mb 10     # tokens/s per task: 2 tasks on one vs two local Ray nodes

What is measured and how: bench/prepare.py (bench/two_nodes.py for --two-nodes).
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout's packages
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", help="a .jsonl of {\"text\": ...} records (default: --mb MB built from ../shared/data)")
    p.add_argument("--mb", type=float, default=45.0, help="size of the input built from ../shared/data")
    p.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizer_gpt2", "gpt2_tokenizer.json"))
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--unit-mb", type=float, default=None, help="prepare.unit_bytes in MB (default: its default)")
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help="Ray worker counts (default: 1 and the machine's CPUs)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold jobs/prepare.py run")
    p.add_argument("--json", action="store_true", help="print one JSON object (after the text report)")
    p.add_argument("--huge-doc", type=float, nargs="+", default=None, metavar="MB",
                   help="measure the peak RSS of jobs/prepare.py on one document of each size instead")
    p.add_argument("--two-nodes", type=int, default=None, metavar="N",
                   help="instead, N tasks on one and on two local Ray nodes: tokens/s per task (bench/two_nodes.py)")
    p.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)  # the one-core raw run (a subprocess)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.two_nodes:  # the nodes it starts are secured by Ray's token; Ray reads this once, as it is imported
        os.environ["RAY_AUTH_MODE"] = "token"
    # imported after the arguments are parsed (tokenizers and Ray take seconds): --help answers at once
    from bench.prepare import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
