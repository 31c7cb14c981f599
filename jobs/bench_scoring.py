"""Benchmark: scoring-worker throughput vs a bare forward pass, and 1 vs 2 workers on Ray (DESIGN.md §6).

    python jobs/bench_scoring.py                    # CPU, one torch thread per worker (and for the baseline)
    python jobs/bench_scoring.py --device cuda      # on a GPU (bf16 autocast, as the workers run there)
    python jobs/bench_scoring.py --json

In one process, on a synthetic candidate corpus (random tokens, zstd MDS shards) and a Llama of about
GPT-2-small size built from a config (no download; 86M parameters, vocabulary 32k: the per-token
cross-entropy, which a worker computes and a bare forward does not, costs ≈ V exps per token, a share
of the forward that shrinks as models grow):

1. **bare forward**: ``model(input_ids).logits`` under ``inference_mode`` on the same batches, already in
   memory: the pass a trainer would run anyway. Timed interleaved with the worker, unit by unit, in CPU
   time of the process with one CPU thread (robust to other load on a shared machine), else wall-clock.
2. **worker**: :class:`curation.workers.ScoringWorker` scoring work units end to end: reading and
   decompressing the candidate shards, the forward, the per-token loss ``ℓ(w̃)`` (float32 cross-entropy
   from the logits), float16, writing the scored MDS part. Headline: worker tokens/s ÷ bare forward
   tokens/s (goal ≥ 0.90), with the time split into forward / loss / data + writing.
3. **Ray scaling**: the same units through :class:`curation.ray_engine.RayEngine` with 1 and with 2
   workers (``--threads`` each, default 1: on a 2-core machine two one-thread workers use both cores),
   timed from the moment the weights are published (actors already up) to the last recorded part.
   Scaling efficiency = throughput(2) ÷ (2 × throughput(1)).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

import numpy as np
import torch

from curation.engine import REFERENCE, Weights, WorkUnit
from curation.losses import token_losses
from curation.models import build_causal_lm
from curation.shards import merge_part_indexes, write_part
from curation.workers import BatchOrder, ScoringWorker, WorkerSpec
from schemas.shards import CANDIDATE
from schemas.train_config import ModelConfig

GOAL = 0.90


def _corpus(root: str, n: int, length: int, vocab: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    cand = os.path.join(root, "candidates")
    half = n // 2
    rows = [{"tokens": rng.integers(0, vocab, length).astype(np.uint16 if vocab <= 65536 else np.uint32),
             "source": "a" if i < half else "b"} for i in range(n)]
    write_part(os.path.join(cand, "part-00000"), CANDIDATE, rows[:half], vocab_size=vocab)
    write_part(os.path.join(cand, "part-00001"), CANDIDATE, rows[half:], vocab_size=vocab)
    merge_part_indexes(cand, ["part-00000", "part-00001"])
    return cand


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the baseline and of each worker")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (one forward)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--range-steps", type=int, default=3, help="steps per work unit")
    p.add_argument("--steps", type=int, default=9, help="steps timed in-process (worker and bare forward)")
    p.add_argument("--ray-steps", type=int, default=12, help="steps scored in each Ray run")
    p.add_argument("--no-ray", action="store_true", help="skip the 1 vs 2 workers part")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model_cfg = ModelConfig(hf_config={
        "model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
        "intermediate_size": args.intermediate, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads, "max_position_embeddings": args.seq_len, "tie_word_embeddings": False,
    }, init_seed=args.seed)
    ref = Weights.from_state_dict(build_causal_lm(model_cfg))
    steps_needed = args.steps + args.range_steps + (0 if args.no_ray else args.ray_steps)
    work = tempfile.mkdtemp(prefix="bench_scoring-")
    cand = _corpus(work, steps_needed * args.batch, args.seq_len, args.vocab, args.seed)
    order = BatchOrder("blocks", steps_needed * args.batch, args.batch)

    def spec(out: str, threads: int | None) -> WorkerSpec:
        return WorkerSpec(candidates=cand, out_dir=out, model=model_cfg.model_dump(mode="json"), order=order.to_dict(),
                          vocab_size=args.vocab, device=args.device, threads=threads, score_batch_size=args.batch,
                          needs_proxy=False)

    # --- 1 + 2: in-process worker vs bare forward ------------------------------------------------------
    worker = ScoringWorker(spec(os.path.join(work, "scored"), args.threads), 0)
    worker.set_weights(REFERENCE, 0, ref)
    model = worker.scorers[REFERENCE].model
    warm = WorkUnit(0, args.range_steps, "scored", 0)
    worker.run(warm, lambda k, v: ref)  # warm-up (allocations, kernels)
    first = args.range_steps
    units = [WorkUnit(a, min(a + args.range_steps, first + args.steps), "scored", 0)
             for a in range(first, first + args.steps, args.range_steps)]
    tokens = args.steps * args.batch * args.seq_len
    # One thread on a CPU: CPU time of this process, which other processes on a shared machine do not
    # inflate; otherwise (GPU, several threads) wall-clock time with device synchronisation.
    clock = time.process_time if device.type == "cpu" and args.threads == 1 else time.perf_counter
    autocast = device.type == "cuda"
    t_worker, fwd, loss = 0.0, [], []
    for u in units:  # worker and baseline interleaved unit by unit, so drifts hit both alike
        _sync(device)
        start = clock()
        worker.run(u, lambda k, v: ref)
        _sync(device)
        t_worker += clock() - start
        batches = [torch.from_numpy(worker.read_step(t)[0].astype(np.int64)).to(device) for t in u.steps]
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            for tok in batches:
                _sync(device)
                t0 = clock()
                logits = model(input_ids=tok).logits
                _sync(device)
                t1 = clock()
                token_losses(logits, tok)
                _sync(device)
                fwd.append(t1 - t0)
                loss.append(clock() - t1)
    t_forward, t_loss = sum(fwd), sum(loss)
    ratio = t_forward / t_worker
    result = {
        "device": str(device), "threads": args.threads, "batch": args.batch, "seq_len": args.seq_len,
        "model": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "params_millions": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)},
        "steps": args.steps, "tokens": tokens, "clock": clock.__name__,
        "bare_forward_tokens_per_s": tokens / t_forward, "worker_tokens_per_s": tokens / t_worker,
        "worker_over_forward": ratio, "goal": GOAL, "ok": ratio >= GOAL,
        "worker_seconds": {"total": t_worker, "forward": t_forward, "loss": t_loss,
                           "data_and_write": max(0.0, t_worker - t_forward - t_loss)},
        "forward_median_ms": statistics.median(fwd) * 1e3,
    }

    # --- 3: 1 vs 2 workers on Ray ----------------------------------------------------------------------
    if not args.no_ray:
        from curation.ray_engine import RayEngine, init_ray

        init_ray("local", num_cpus=max(os.cpu_count() or 1, 2 * args.threads), need_cpus=2 * args.threads)
        first = args.range_steps + args.steps
        ray_units = [WorkUnit(a, min(a + args.range_steps, first + args.ray_steps), "scored", 0)
                     for a in range(first, first + args.ray_steps, args.range_steps)]
        scaling = {}
        try:
            for n in (1, 2):
                out = os.path.join(work, f"ray-{n}")
                engine = RayEngine(units=ray_units, worker_spec=spec(out, args.threads), workers=n, threads=args.threads,
                                   ledger=dict(out_dir=out, kind="scored", job="bench", run_key={"n": n},
                                               vocab_size=args.vocab),
                                   engine_dir=os.path.join(out, "engine"), device=args.device,
                                   gpus=None if args.device == "cuda" else 0)
                try:
                    engine.pids  # noqa: B018 - waits until every worker has loaded its model
                    start = time.perf_counter()
                    engine.publish_weights(REFERENCE, 0, ref)  # units become ready: the clock starts
                    engine.run(progress=False)
                    elapsed = time.perf_counter() - start
                finally:
                    engine.close()
                scaling[n] = args.ray_steps * args.batch * args.seq_len / elapsed
        finally:
            import ray

            ray.shutdown()
        result["ray"] = {"steps": args.ray_steps, "tokens_per_s_1_worker": scaling[1],
                         "tokens_per_s_2_workers": scaling[2], "speedup": scaling[2] / scaling[1],
                         "scaling_efficiency": scaling[2] / (2 * scaling[1]),
                         "threads_per_worker": args.threads, "cpu_count": os.cpu_count(),
                         "load_average_1min": os.getloadavg()[0]}

    if args.json:
        print(json.dumps(result))
        return 0
    m, w = result["model"], result["worker_seconds"]
    print(f"Llama {m['params_millions']}M params (vocab {m['vocab']}, hidden {m['hidden']}, {m['layers']} layers) on "
          f"{device}, {args.threads} thread(s), {args.steps} steps of {args.batch} × {args.seq_len} tokens "
          f"(clock: {result['clock']})")
    print(f"  bare forward     {result['bare_forward_tokens_per_s']:10,.0f} tokens/s")
    print(f"  scoring worker   {result['worker_tokens_per_s']:10,.0f} tokens/s  (time: forward {w['forward']:.2f}s, "
          f"loss {w['loss']:.2f}s, data + write {w['data_and_write']:.2f}s of {w['total']:.2f}s)")
    print(f"worker / bare forward = {ratio:.3f}  (goal >= {GOAL:.2f}: {'ok' if result['ok'] else 'MISSED'})")
    if "ray" in result:
        r = result["ray"]
        print(f"Ray, {r['threads_per_worker']} thread(s) per worker on {r['cpu_count']} CPUs "
              f"(1-min load average {r['load_average_1min']:.1f}): 1 worker {r['tokens_per_s_1_worker']:,.0f} tokens/s, "
              f"2 workers {r['tokens_per_s_2_workers']:,.0f} tokens/s → speed-up {r['speedup']:.2f}×, "
              f"scaling efficiency {r['scaling_efficiency']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
