"""Scoring-worker throughput vs a bare forward pass, and 1 vs 2 workers on Ray (docs/DESIGN.md §6):
``jobs/bench_scoring.py``.

In one process, on a synthetic candidate corpus (random tokens, zstd MDS shards) and a Llama of about
GPT-2-small size built from a config (no download; 86M parameters, vocabulary 32k: the per-token
cross-entropy, which a worker computes and a bare forward does not, costs ≈ V exps per token, a share
of the forward that shrinks as models grow):

1. **bare forward**: ``model(input_ids).logits`` under ``inference_mode`` on the same batches, already in
   memory: the pass a trainer would run anyway. Timed interleaved with the worker, unit by unit, in CPU
   time of the process with one CPU thread (robust to other load on a shared machine), else wall-clock.
2. **worker**: :class:`curation.engine.workers.ScoringWorker` scoring work units end to end: reading and
   decompressing the candidate shards, the decoder forward, the per-token loss ``ℓ(w̃)`` from the final
   hidden states in chunks (no full logits), float16, writing the scored MDS part. Headline: worker tokens/s ÷ bare forward tokens/s (goal ≥ 0.90).
   For information, what the per-token loss adds to the bare forward (which ends with the full logits), both
   ways, each timed on its own between two synchronisations: ``token_losses`` on those logits; and
   ``hidden_token_losses`` (head GEMM, log-sum-exp and gather in chunks of ``--loss-chunk-elements``) on the
   decoder's hidden states (the worker's way; it includes the head GEMM the bare forward also runs, so it is
   an upper bound of what the loss adds); with the logits each holds at once.
   The in-process worker is also timed in wall-clock time, for the comparison with Ray.
3. **Ray**: the same kind of units through :class:`curation.engine.ray_backend.RayEngine`, 1 then 2 workers
   (``--threads`` each). The clock starts when the weights are published (actors already up); the first
   unit each worker scores carries the one-off start-up (fetching the weights from the object store,
   first kernels), so the **steady-state** throughput is counted from the end of the first recorded unit
   to the end of the last (``--ray-steps`` of them, default 36). Reported next to the in-process worker's
   wall-clock throughput (goal: Ray 1 worker ≥ 0.9 of it) and with the start-up time, which is where a
   short run loses its throughput (measured on an H100: 88k tokens/s over 12 steps including start-up
   vs 378k in-process). Scaling efficiency = steady throughput(2) ÷ (2 × steady throughput(1)).

``--pipeline-only`` measures instead the worker's *host* cost per token, its forward replaced by a stub of
negligible cost (everything else is the worker's code), in CPU time of the process, at the GPU shapes
(L = 1024, b = 8 and 32; ``--batch`` picks one, ``--seq-len`` another length): the figure that shows on a CPU whether the host
can keep up with a GPU (goal ≥ 5M tokens/s on one core at every shape).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from curation.core import losses
from curation.core.losses import CPU_CHUNK_ELEMENTS, DEFAULT_CHUNK_ELEMENTS, hidden_token_losses, token_losses
from curation.engine.ledger import LedgerSpec
from curation.engine.plan import REFERENCE, WorkUnit
from curation.engine.ray_backend import RayEngine, ray_session
from curation.engine.weights import Weights
from curation.engine.work import EngineWork
from curation.engine.workers import BatchOrder, ScoringWorker, WorkerSpec
from curation.io.models import build_causal_lm
from curation.io.shards import merge_part_indexes, write_part
from schemas.engine_config import WorkersConfig
from schemas.shards import CANDIDATE
from schemas.train_config import ModelConfig

__all__ = ["GOAL", "PIPELINE_GOAL", "run", "pipeline_only", "ray_text", "worker_precision"]

GOAL = 0.90


def _corpus(root: str, n: int, length: int, vocab: int, seed: int, parts: int = 2) -> str:
    """``n`` random sequences in ``parts`` parts (one zstd shard each), the first half of source ``a``."""
    rng = np.random.default_rng(seed)
    cand = os.path.join(root, "candidates")
    rows = [{"tokens": rng.integers(0, vocab, length).astype(np.uint16 if vocab <= 65536 else np.uint32),
             "source": "a" if i < n // 2 else "b"} for i in range(n)]
    cuts = np.linspace(0, n, parts + 1).astype(int)
    names = [f"part-{p:05d}" for p in range(parts)]
    for name, a, b in zip(names, cuts[:-1], cuts[1:], strict=True):
        write_part(os.path.join(cand, name), CANDIDATE, rows[a:b], vocab_size=vocab)
    merge_part_indexes(cand, names)
    return cand


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def run(args: argparse.Namespace) -> int:
    """The benchmark of the module docstring, printed (``args.json``: one JSON object); the exit status."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device visible")
    torch.set_num_threads(args.threads)
    # the decompressed copies of the bench's random shards go to a scratch cache, not the user's
    os.environ["BLADE_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_scoring-cache-")
    if args.pipeline_only:
        return _report(pipeline_only(args), args.json)
    args.batch, args.seq_len, args.steps = args.batch or 8, args.seq_len or 256, args.steps or 9
    setup = _Setup.of(args)
    result = _in_process(args, setup)
    if not args.no_ray:
        result["ray"] = _ray(args, setup, result["worker_wall_tokens_per_s"])
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(_text(args, result)))
    return 0


@dataclass(frozen=True)
class _Setup:
    """What every part measures with: the model, its reference weights, the candidate corpus, the batch order."""

    device: torch.device
    precision: str
    model: ModelConfig
    ref: Weights
    work: str
    candidates: str
    order: BatchOrder

    @classmethod
    def of(cls, args: argparse.Namespace) -> _Setup:
        model_cfg = ModelConfig(hf_config={
            "model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
            "max_position_embeddings": args.seq_len, "tie_word_embeddings": False,
        }, init_seed=args.seed)
        ref = Weights.from_state_dict(build_causal_lm(model_cfg))
        steps_needed = args.steps + args.range_steps + (0 if args.no_ray else args.ray_steps + 2 * args.range_steps)
        work = tempfile.mkdtemp(prefix="bench_scoring-")
        cand = _corpus(work, steps_needed * args.batch, args.seq_len, args.vocab, args.seed)
        device = torch.device(args.device)
        return cls(device, worker_precision(device), model_cfg, ref, work, cand,
                   BatchOrder("blocks", steps_needed * args.batch, args.batch))

    def spec(self, args: argparse.Namespace, out: str, threads: int | None) -> WorkerSpec:
        return WorkerSpec(candidates=self.candidates, out_dir=out, model=self.model, order=self.order,
                          vocab_size=args.vocab, device=args.device, threads=threads, score_batch_size=args.batch,
                          needs_proxy=False, precision=self.precision)


def _in_process(args: argparse.Namespace, setup: _Setup) -> dict:
    """Parts 1 and 2: the in-process worker against the bare forward, unit by unit."""
    device, precision, ref = setup.device, setup.precision, setup.ref
    worker = ScoringWorker(setup.spec(args, os.path.join(setup.work, "scored"), args.threads), 0)
    worker.set_weights(REFERENCE, 0, ref)
    model = worker.scorers[REFERENCE].model
    worker.run(WorkUnit(0, args.range_steps, "scored", 0), lambda k, v: ref)  # warm-up (allocations, kernels)
    with torch.inference_mode(), losses.autocast(precision, device):
        tok = torch.from_numpy(worker.read_step(0)[0].astype(np.int64)).to(device)  # the timed calls' shapes
        token_losses(model(input_ids=tok).logits, tok, chunk_elements=args.loss_chunk_elements)
        hidden_token_losses(model.model(input_ids=tok).last_hidden_state, model.lm_head.weight, tok,
                            chunk_elements=args.loss_chunk_elements)
    first = args.range_steps
    units = [WorkUnit(a, min(a + args.range_steps, first + args.steps), "scored", 0)
             for a in range(first, first + args.steps, args.range_steps)]
    tokens = args.steps * args.batch * args.seq_len
    # One thread on a CPU: CPU time of this process, which other processes on a shared machine do not
    # inflate; otherwise (GPU, several threads) wall-clock time with device synchronisation.
    clock = time.process_time if device.type == "cpu" and args.threads == 1 else time.perf_counter
    t_worker, t_worker_wall, fwd, loss, hloss, last = _interleaved(args, setup, worker, units, clock)
    # Direct timings (each its own interval between synchronisations), never a difference of two totals.
    t_forward, t_loss, t_hloss = sum(fwd), sum(loss), sum(hloss)
    ratio = t_forward / t_worker
    loss_path, loss_path_error = losses.scoring_loss_path(device)
    return {
        "device": str(device), "precision": precision, "threads": args.threads, "batch": args.batch,
        "seq_len": args.seq_len,
        "model": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "params_millions": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)},
        "steps": args.steps, "tokens": tokens, "clock": clock.__name__,
        "bare_forward_tokens_per_s": tokens / t_forward, "worker_tokens_per_s": tokens / t_worker,
        "worker_over_forward": ratio, "goal": GOAL, "ok": ratio >= GOAL,
        "worker_wall_tokens_per_s": tokens / t_worker_wall,
        "worker_ms_per_unit": t_worker_wall / len(units) * 1e3,  # wall-clock, as a Ray worker's unit is timed
        "worker_seconds": {"total": t_worker, "forward": t_forward, "loss_full_logits": t_loss,
                           "loss_hidden_chunks": t_hloss},
        "loss_over_forward": {"full_logits": t_loss / t_forward, "hidden_chunks": t_hloss / t_forward,
                              "goal": 0.05},
        "loss_memory": _loss_memory(args, setup, model, last),
        "loss_path": loss_path, "loss_path_error": loss_path_error,  # the compiled one-pass loss on CUDA?
        "forward_median_ms": statistics.median(fwd) * 1e3,
    }


def _interleaved(args: argparse.Namespace, setup: _Setup, worker: ScoringWorker, units: list[WorkUnit],
                 clock: Callable[[], float]) -> tuple[float, float, list[float], list[float], list[float], torch.Tensor]:
    """The worker and the baseline interleaved unit by unit, so drifts hit both alike: the worker's time (``clock``,
    wall), and per step the bare forward's, the loss from its logits, the decoder + chunked loss; the last batch."""
    device, precision, ref = setup.device, setup.precision, setup.ref
    model = worker.scorers[REFERENCE].model
    t_worker, t_worker_wall, fwd, loss, hloss = 0.0, 0.0, [], [], []  # hloss: decoder + chunked loss
    batches = []
    for u in units:
        _sync(device)
        start, wall = clock(), time.perf_counter()
        worker.run(u, lambda k, v: ref)
        _sync(device)
        t_worker += clock() - start
        t_worker_wall += time.perf_counter() - wall
        batches = [torch.from_numpy(worker.read_step(t)[0].astype(np.int64)).to(device) for t in u.steps]
        with torch.inference_mode(), losses.autocast(precision, device):
            for tok in batches:
                _sync(device)
                t0 = clock()
                logits = model(input_ids=tok).logits
                _sync(device)
                t1 = clock()
                token_losses(logits, tok, chunk_elements=args.loss_chunk_elements)
                _sync(device)
                t2 = clock()
                del logits
                hidden = model.model(input_ids=tok).last_hidden_state  # the worker's way: decoder, then
                _sync(device)
                t3 = clock()
                hidden_token_losses(hidden, model.lm_head.weight, tok,  # the head in chunks, timed alone
                                    chunk_elements=args.loss_chunk_elements)
                _sync(device)
                fwd.append(t1 - t0)
                loss.append(t2 - t1)
                hloss.append(clock() - t3)
    return t_worker, t_worker_wall, fwd, loss, hloss, batches[-1]


def _loss_memory(args: argparse.Namespace, setup: _Setup, model: torch.nn.Module, tok: torch.Tensor) -> dict:
    """The logits each way of the per-token loss holds at once (plus their float32 upcast under bf16), in MiB; on a
    GPU also measured: the peak allocated above the hidden states, each way."""
    device, precision = setup.device, setup.precision
    chunk = args.loss_chunk_elements or (CPU_CHUNK_ELEMENTS if device.type == "cpu" else DEFAULT_CHUNK_ELEMENTS)
    rows_total = args.batch * args.seq_len
    rows_chunk = min(rows_total, max(256, chunk // args.vocab // 64 * 64))  # curation.core.losses' GEMM rows
    upcast_rows = max(1, chunk // args.vocab)  # float32 upcast of bf16 logits, per cross-entropy piece
    logit_bytes = 2 if precision == "amp_bf16" else 4
    memory = {
        "full_logits_mib": rows_total * args.vocab * (logit_bytes + 4 * (logit_bytes != 4)) / 2**20,
        "hidden_chunk_logits_mib": (rows_chunk * logit_bytes + upcast_rows * 4 * (logit_bytes != 4)) * args.vocab
        / 2**20,
    }
    if device.type == "cuda":
        with torch.inference_mode(), losses.autocast(precision, device):
            hidden = model.model(input_ids=tok).last_hidden_state
            for name, fn in (("full_logits_peak_mib", lambda: token_losses(model.lm_head(hidden), tok)),
                             ("hidden_chunks_peak_mib", lambda: hidden_token_losses(hidden, model.lm_head.weight, tok))):
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                memory[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return memory


def _ray(args: argparse.Namespace, setup: _Setup, in_process_wall_tokens_per_s: float) -> dict:
    """Part 3: the same kind of units through the Ray engine, 1 then 2 workers."""
    first = args.range_steps + args.steps
    stop = first + args.ray_steps + 2 * args.range_steps  # + the start-up unit of each of 2 workers
    ray_units = [WorkUnit(a, min(a + args.range_steps, stop), "scored", 0)
                 for a in range(first, stop, args.range_steps)]
    runs = {}
    with ray_session("local", num_cpus=max(os.cpu_count() or 1, 2 * args.threads), need_cpus=2 * args.threads):
        for n in (1, 2):
            out = os.path.join(setup.work, f"ray-{n}")
            engine_work = EngineWork(units=ray_units, worker_spec=setup.spec(args, out, args.threads),
                                     ledger=LedgerSpec(out, kind="scored", job="bench", run_key={"n": n},
                                                       vocab_size=args.vocab),
                                     engine_dir=os.path.join(out, "engine"))
            pool = WorkersConfig(count=n, threads=args.threads, device=args.device,
                                 gpus=None if args.device == "cuda" else 0)
            with RayEngine(engine_work, pool) as engine:
                engine.pids  # noqa: B018 - waits until every worker has loaded its model
                runs[str(n)] = _timed_ray_run(engine, setup.ref)
            runs[str(n)]["workers"] = _ray_worker_times(engine.worker_results)
    steady = {int(n): r["steady_tokens_per_s"] for n, r in runs.items()}
    return {"steps": args.ray_steps, "runs": runs, "tokens_per_s_1_worker": steady[1],
            "tokens_per_s_2_workers": steady[2], "speedup": steady[2] / steady[1],
            "scaling_efficiency": steady[2] / (2 * steady[1]),
            "ray_over_in_process": steady[1] / in_process_wall_tokens_per_s, "goal": GOAL,
            "threads_per_worker": args.threads, "cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0]}


def _text(args: argparse.Namespace, result: dict) -> list[str]:
    """The text report of :func:`run`."""
    m, w = result["model"], result["worker_seconds"]
    lo, mem = result["loss_over_forward"], result["loss_memory"]
    lines = [
        f"Llama {m['params_millions']}M params (vocab {m['vocab']}, hidden {m['hidden']}, {m['layers']} layers) on "
        f"{result['device']}, {args.threads} thread(s), {args.steps} steps of {args.batch} × {args.seq_len} tokens "
        f"(clock: {result['clock']})",
        f"  bare forward     {result['bare_forward_tokens_per_s']:10,.0f} tokens/s",
        f"  scoring worker   {result['worker_tokens_per_s']:10,.0f} tokens/s  ({w['total']:.2f}s; wall-clock "
        f"{result['worker_wall_tokens_per_s']:,.0f} tokens/s)",
        f"worker / bare forward = {result['worker_over_forward']:.3f}  (goal >= {GOAL:.2f}: "
        f"{'ok' if result['ok'] else 'MISSED'})",
        f"per-token loss / bare forward: from the full logits {lo['full_logits']:.3f}, from the hidden states in "
        f"chunks {lo['hidden_chunks']:.3f} (goal <= 0.05); logits held at once: {mem['full_logits_mib']:.1f} MiB vs "
        f"{mem['hidden_chunk_logits_mib']:.1f} MiB"
        + (f"; measured peak {mem['full_logits_peak_mib']:.1f} vs {mem['hidden_chunks_peak_mib']:.1f} MiB"
           if "full_logits_peak_mib" in mem else ""),
    ]
    return lines + (ray_text(result) if "ray" in result else [])


def ray_text(result: dict) -> list[str]:
    """The Ray part's lines of the text report (``result`` as printed with ``--json``: runs keyed "1" and "2")."""
    r = result["ray"]
    one = r["runs"]["1"]
    lines = [f"Ray, {r['threads_per_worker']} thread(s) per worker on {r['cpu_count']} CPUs "
             f"(1-min load average {r['load_average_1min']:.1f}), wall-clock, steady state after the first unit:",
             f"  1 worker {r['tokens_per_s_1_worker']:,.0f} tokens/s = {r['ray_over_in_process']:.3f} × the in-process "
             f"worker's {result['worker_wall_tokens_per_s']:,.0f} (goal >= {GOAL:.2f}); start-up (weights from the "
             f"object store + first unit) {one['startup_s']:.2f}s, whole run with it {one['whole_run_tokens_per_s']:,.0f} "
             f"tokens/s",
             f"  2 workers {r['tokens_per_s_2_workers']:,.0f} tokens/s → speed-up {r['speedup']:.2f}×, "
             f"scaling efficiency {r['scaling_efficiency']:.0%}"]
    for n, run in sorted(r["runs"].items()):
        for wid, t in run["workers"].items():
            times = ", ".join(f"{k} {t[f'{k}_ms_per_unit']:.1f}" for k in ("wait", "run", "report")
                              if f"{k}_ms_per_unit" in t)
            steady = t.get("run_ms_median_after_first")
            lines.append(f"  {n} worker(s), worker {wid}: {t['units']} units, ms per unit: {times} "
                         f"(niceness {t['niceness']})" + (f"; run of a unit after the first: median {steady:.1f} "
                                                          f"(in-process {result['worker_ms_per_unit']:.1f})"
                                                          if steady is not None else ""))
    return lines


def worker_precision(device: torch.device) -> str:
    """The workers' and the bare forward's precision: ``amp_bf16`` (bf16 autocast) on CUDA, as a trainer runs there.

    Both sides of the ratio run at it. Before, the worker kept :class:`WorkerSpec`'s ``fp32`` default while the
    forward ran under bf16 autocast: the H200 figures of 2026-11-26 (worker ≈ 150k tokens/s whatever the batch,
    0.22-0.30 of the forward) timed an fp32 worker against a bf16 forward."""
    return "amp_bf16" if device.type == "cuda" else "fp32"


PIPELINE_GOAL = 5e6  # tokens/s of host work per worker process (0.2 µs per token)
#: Issue 31's GPU shapes (L = 1024 at b = 8 and b = 32): the goal is derived from the 134M model's bf16 forward
#: at b = 32 on an H200 (1.4 µs per token; the host must take a seventh of it at most).
PIPELINE_SHAPES = ((8, 1024), (32, 1024))


def _stub_forward(tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The losses' shape, dtype and device from one elementwise pass over the tokens: a forward of negligible cost."""
    return tokens.to(torch.float32).mul_(1e-4)


def pipeline_only(args: argparse.Namespace) -> dict:
    """The scoring worker's host cost per token, its forward replaced by :func:`_stub_forward`, at each shape.

    The candidates are read as a trainer's stream reads them: in a seeded random order over a pool of ``--parts``
    shards (16), more than an in-memory cache of decompressed shards would hold. Everything else is the worker's
    own code: reading and decoding the candidate records, staging the tokens,
    the results' way back to the host, the rows, encoding, compressing and writing the part. Timed in CPU time
    of the whole process, so the figure is the host work per token on one core, whatever else loads a shared
    machine; each shape is timed ``--rounds`` times (a fresh worker and output each) and the median taken, as
    one round's CPU time moves by ±25% on a shared 2-core machine. Tokens/s ≥ :data:`PIPELINE_GOAL` at every
    shape means the host cannot bound a GPU that scores 1.4 µs per token."""
    shapes = [(batch, args.seq_len or seq_len) for batch, seq_len in PIPELINE_SHAPES if args.batch in (None, batch)]
    shapes = shapes or [(args.batch, args.seq_len or PIPELINE_SHAPES[0][1])]
    steps = args.steps or 90
    results = [_pipeline_shape(args, batch, seq_len, steps) for batch, seq_len in shapes]
    worst = max(results, key=lambda r: r["host_us_per_token"])
    return {"mode": "pipeline-only", "device": args.device, "steps": steps, "range_steps": args.range_steps,
            "order": "stream", "parts": args.parts,
            "rounds": args.rounds, "shapes": results, "host_us_per_token": worst["host_us_per_token"],
            "tokens_per_s_one_core": worst["tokens_per_s_one_core"], "goal_tokens_per_s": PIPELINE_GOAL,
            "ok": all(r["ok"] for r in results)}


def _pipeline_shape(args: argparse.Namespace, batch: int, seq_len: int, steps: int) -> dict:
    device = torch.device(args.device)
    model_cfg = ModelConfig(hf_config={  # built but never run (the stub replaces its forward): small
        "model_type": "llama", "vocab_size": args.vocab, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
        "max_position_embeddings": seq_len, "tie_word_embeddings": False}, init_seed=args.seed)
    ref = Weights.from_state_dict(build_causal_lm(model_cfg))
    n_steps = args.range_steps + steps
    work = tempfile.mkdtemp(prefix="bench_scoring-pipeline-")
    cand = _corpus(work, n_steps * batch, seq_len, args.vocab, args.seed, parts=args.parts)
    units = [WorkUnit(a, min(a + args.range_steps, n_steps), "scored", 0)
             for a in range(args.range_steps, n_steps, args.range_steps)]
    tokens = steps * batch * seq_len
    rounds, walls, waits = [], [], 0
    for r in range(max(1, args.rounds)):
        spec = WorkerSpec(candidates=cand, out_dir=os.path.join(work, f"scored-{r}"), model=model_cfg,
                          order=BatchOrder("stream", n_steps * batch, batch, seed=args.seed), vocab_size=args.vocab,
                          device=args.device, threads=1, score_batch_size=batch, needs_proxy=False)
        worker = ScoringWorker(spec, 0)
        worker.set_weights(REFERENCE, 0, ref)
        worker.scorers[REFERENCE].forward = _stub_forward
        worker.run(WorkUnit(0, args.range_steps, "scored", 0), lambda k, v: ref)  # warm-up: the shards' first read
        before = worker.stats["host_waits"]
        _sync(device)
        cpu, wall = time.process_time(), time.perf_counter()
        for u in units:
            worker.run(u, lambda k, v: ref)
        _sync(device)
        rounds.append((time.process_time() - cpu) / tokens * 1e6)
        walls.append(tokens / (time.perf_counter() - wall))
        waits = (worker.stats["host_waits"] - before) / steps
    us = statistics.median(rounds)
    return {"batch": batch, "seq_len": seq_len, "tokens": tokens, "host_us_per_token": us,
            "host_us_per_token_rounds": rounds, "tokens_per_s_one_core": 1e6 / us,
            "wall_tokens_per_s": statistics.median(walls), "host_waits_per_step": waits,
            "ok": 1e6 / us >= PIPELINE_GOAL}


def _report(result: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps(result))
        return 0
    for r in result["shapes"]:
        print(f"scoring worker, forward stubbed ({result['steps']} steps of {r['batch']} × {r['seq_len']} tokens on "
              f"{result['device']}, units of {result['range_steps']} steps, median of {result['rounds']} rounds): "
              f"host {r['host_us_per_token']:.3f} µs per token = {r['tokens_per_s_one_core']:,.0f} tokens/s on one "
              f"core (goal >= {PIPELINE_GOAL:,.0f}: {'ok' if r['ok'] else 'MISSED'}); wall-clock "
              f"{r['wall_tokens_per_s']:,.0f} tokens/s")
    return 0


def _ray_worker_times(results: dict[int, dict]) -> dict:
    """Per worker, where a unit's time went under Ray (ms per unit): asking for it (``wait``), scoring and writing it
    (``run``, the in-process worker's work), waiting for the coordinator's record of it (``report``); the first
    unit's ``run`` (weights fetched, first kernels) and the median of the others' (to set against the in-process
    worker's ``worker_ms_per_unit``); and the worker process's niceness (the driver's, unless the cluster lowers its
    workers' priority)."""
    out = {}
    for wid, r in sorted(results.items()):
        units = max(int(r.get("units", 0)), 1)
        runs = r.get("unit_run_s") or []
        out[str(wid)] = {"units": r.get("units", 0), "niceness": r.get("niceness"),
                         **{f"{k}_ms_per_unit": r[f"{k}_s"] / units * 1e3 for k in ("wait", "run", "report")
                            if f"{k}_s" in r},
                         "run_ms_first_unit": runs[0] * 1e3 if runs else None,
                         "run_ms_median_after_first": statistics.median(runs[1:]) * 1e3 if len(runs) > 1 else None}
    return out


def _timed_ray_run(engine: RayEngine, ref: Weights) -> dict:
    """Publish the weights (the clock starts) and poll the engine's progress until every unit is recorded.

    Steady state: the tokens recorded after the first recorded unit, over the time from that unit to the
    last one; start-up: from publishing to the first recorded unit."""
    start = time.perf_counter()
    engine.publish_weights(REFERENCE, 0, ref)  # units become ready
    marks = []  # (time, tokens recorded) at each change
    last = -1
    while True:
        p = engine.progress()
        if p.tokens != last:
            last = p.tokens
            marks.append((time.perf_counter(), p.tokens))
        if p.units_done >= p.units_total:
            break
        engine.check()
        time.sleep(0.005)
    end, total = marks[-1]
    t_first, first_tokens = marks[1] if len(marks) > 1 else marks[0]
    return {"startup_s": t_first - start, "whole_run_tokens_per_s": total / (end - start),
            "steady_tokens_per_s": (total - first_tokens) / max(end - t_first, 1e-9),
            "steady_tokens": total - first_tokens}
