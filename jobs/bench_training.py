"""Benchmark: exact-mode BLADE time per proxy step ÷ plain (full-policy) time per step, and peak RSS.

    python jobs/bench_training.py                      # paper setting K/τ = 0.3 (τ = 20, K = 6), CPU
    python jobs/bench_training.py --tau 30 --refresh-steps 30 --hidden 256 --layers 4
    python jobs/bench_training.py --device cuda --precision amp_bf16 --seq-len 1024 --json

What is measured and how, and the predicted ratio: bench/training.py.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout's packages (also in the worker subprocesses)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None,
                   help="prepared data (candidates/, validation/); the demo corpus is prepared there if absent "
                   "(default: runs/demo/data, or runs/demo/data-L<seq-len> for another --seq-len)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (the demo corpus is packed to it)")
    p.add_argument("--precision", choices=["fp32", "amp_bf16"], default="fp32",
                   help="the trainer's precision (amp_bf16: CUDA only; governs the reference work too)")
    p.add_argument("--json", action="store_true", help="print one JSON object (after the text report)")
    p.add_argument("--tau", type=int, default=20)
    p.add_argument("--refresh-steps", type=int, default=6, help="K (default: K/τ = 0.3, the paper's)")
    p.add_argument("--episodes", type=int, default=2, help="measured episodes (one more runs first, unmeasured)")
    p.add_argument("--repeats", type=int, default=2, help="runs per policy, alternating full / blade")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (not measured)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[16],
                   help="b; several (e.g. 8 32) run one after the other in each policy's process (one start-up each), "
                   "and the JSON holds one report per b under by_batch")
    p.add_argument("--refresh-batch-size", type=int, default=None, help="rb (default b/4)")
    p.add_argument("--refresh-joint-forward", choices=["auto", "on", "off"], default="auto",
                   help="selection.refresh_joint_forward: a refresh step's validation and candidate rows in one "
                        "forward (auto: on a GPU only)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads (default: the demo's hidden/16, head_dim 16; GPU-shaped models: head_dim 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--phase-pass", action="store_true",
                   help="time BLADE's phases (select, score, refresh, distance) on the device with CUDA events, read "
                        "once at the end (phase_device_seconds); the headline ratios never synchronise per phase")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is then a stable measure)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="cpu: process CPU time (robust to other load on a shared machine); wall: elapsed time")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--no-bare", action="store_true", help="skip the bare PyTorch loop of the same model")
    p.add_argument("--profile-refresh", metavar="DIR", default=None,
                   help="profile BLADE's second refresh at each batch size (torch.profiler: CPU, and CUDA on a GPU) "
                        "into DIR/refresh-b<b>.txt, its operators by self time (the profiler's overhead then counts in "
                        "the first measured episode: profile in a run of its own, not in one whose ratios you report)")
    p.add_argument("--worker", choices=["full", "blade", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.heads is not None and (args.heads < 1 or args.hidden % args.heads):
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if args.data is None:
        name = "data" if args.seq_len == 128 else f"data-L{args.seq_len}"
        args.data = os.path.join("runs", "demo", name)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _args(argv)
    # imported after the arguments are parsed (torch and Composer take seconds): --help answers at once
    from bench.training import run, worker_main

    return worker_main(args) if args.worker else run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
