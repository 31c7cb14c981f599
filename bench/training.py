"""Exact-mode BLADE time per proxy step ÷ plain (full-policy) time per step, and peak RSS:
``jobs/bench_training.py``.

Both runs go through the same trainer (Composer, the BLADE algorithm, the same candidate stream),
each in its own subprocess so that peak RSS is measured fairly; only the policy differs (``full``
vs ``blade``). A step's time is measured from one BATCH_END to the next, so it includes the
refresh and the reference scoring done before the step (amortised over the measured steps).
Warm-up steps and the first episode (one-off allocations) are excluded: whole episodes are measured,
each with exactly one refresh. Times are process CPU time with one torch thread by default, and the
fastest measured episode of each policy is compared (runs alternate ``full``/``blade``), so that other
load on a shared machine does not decide the ratio; ``--clock wall --threads N`` for wall-clock time. Evaluation, checkpoints and shard
writing are off in both runs; ‖u − w‖ is measured once per episode. Neither run synchronises per step or per phase
(as in production); ``--phase-pass`` times BLADE's phases with CUDA events instead (read once, at the end). GPU-shaped
models (``--heads``): head_dim ``hidden / heads`` and an MLP width that is a multiple of 128.

Predicted ratio from counting passes (docs/DESIGN.md §6, issue 4): plain step = 1 forward+backward over
b sequences; scoring the same batch with the reference ≈ 1/3 (a forward only); a refresh step =
one forward+backward over ``rb`` validation and ``rb`` candidate sequences = 2·rb/b plain steps,
done K times every τ steps:  1 + 1/3 + (K/τ)·(2·rb/b).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from composer.core import Callback
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from curation.core.refresh import joint_forward_on
from curation.ingest.prepare import prepare
from curation.io.models import build_causal_lm, resolve_device
from schemas.config import PrepareConfig
from schemas.manifest import Manifest
from schemas.train_config import ModelConfig, TrainConfig, demo_model_config
from training.blocks.meters import Meters
from training.runs.wiring import TrainRun, build_training

__all__ = ["PAPER_RATIO", "run", "worker_main", "worker", "report", "ensure_data"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The job, run again for each policy's process (``--worker``).
JOB = os.path.join(REPO, "jobs", "bench_training.py")
PAPER_RATIO = 1.57


def _config(args: argparse.Namespace, policy: str, out_dir: str) -> TrainConfig:
    steps = args.warmup + (args.episodes + 1) * args.tau
    cfg = TrainConfig.demo_default(os.path.dirname(os.path.abspath(args.data)), policy=policy)
    data = cfg.model_dump(mode="json")
    data.update(
        data={"candidates": os.path.join(args.data, "candidates"), "validation": os.path.join(args.data, "validation"),
              "tokenizer": None, "scored": None},
        model=_model(args),
        output_dir=out_dir, batch_size=args.batch_size, max_steps=steps, progress_bar=False, plots=False,
        write_selected=False, threads=args.threads, device=args.device, distance_interval=args.tau,
        precision=args.precision,
        eval={"interval": 10**9, "batch_size": 16, "max_batches": 1},
        checkpoint={"interval": 10**9, "keep": 1, "resume": False},
    )
    data["selection"].update(warmup_steps=args.warmup, tau=args.tau, refresh_steps=args.refresh_steps,
                             refresh_batch_size=args.refresh_batch_size,
                             refresh_joint_forward={"auto": None, "on": True, "off": False}[args.refresh_joint_forward])
    return TrainConfig.model_validate(data)


def _model(args: argparse.Namespace) -> dict:
    """The demo Llama at the bench's size (``--heads``: its head count, for GPU-shaped head dimensions)."""
    model = demo_model_config(_vocab(args.data), hidden=args.hidden, layers=args.layers,
                              seq_len=args.seq_len).model_dump(mode="json")
    if args.heads is not None:  # GPU-shaped: head_dim = hidden / heads, the MLP width a multiple of 128 (2048 at 768)
        model["hf_config"].update(num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                  intermediate_size=max(128, round(args.hidden * 8 / 3 / 128) * 128))
    return model


def _vocab(data_dir: str) -> int:
    return int(Manifest.load(os.path.join(data_dir, "candidates")).vocab_size)


def _at_batch(args: argparse.Namespace, b: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "batch_size": b})


def worker(args: argparse.Namespace) -> dict:
    """Train one policy at each batch size in turn, in this process; per batch size, what :func:`worker_run` reports
    (its peak RSS: this process's so far, the batch sizes run in ascending order)."""
    return {str(b): (bare if args.worker == "bare" else worker_run)(_at_batch(args, b))
            for b in sorted(set(args.batch_size))}


def worker_run(args: argparse.Namespace) -> dict:
    """Train one policy; report each measured episode's mean step time and phase timers, and peak RSS."""
    first = args.warmup + args.tau  # whole episodes after the first one (one-off allocations) are measured
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    class EpisodeClock(Callback):
        def __init__(self) -> None:
            self.marks: list[tuple[float, dict[str, float]]] = []

        def batch_end(self, state, logger) -> None:
            step = int(state.timestamp.batch)  # steps done; a step's time includes its refresh and scoring
            if step >= first and (step - first) % args.tau == 0:  # (a synchronisation at the marks only)
                if state.device.name == "gpu":
                    torch.cuda.synchronize()
                self.marks.append((clock(), dict(run.algorithm.timers)))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args, args.worker, tmp)
        episode_clock = EpisodeClock()
        # Both policies run as in production: no synchronisation around BLADE's phases (on a GPU, ~2 device-wide
        # syncs per step, which production does not have, biased the ratio); with --phase-pass the phases' device
        # times come from CUDA events in this run (read once, at its end)
        meters = Meters(clock=clock, events=args.phase_pass and args.worker == "blade")
        run = build_training(cfg, callbacks=[episode_clock], meters=meters)
        refresh_ms = _time_refreshes(run, args) if args.worker == "blade" else []
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        run.trainer.fit()
        run.trainer.close()
        phase_device_seconds = meters.resolve() if meters.events else None
    gpu_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    # What of the host RSS is pinned memory (the reference's compact copy, the tokens staged for the GPU): the
    # caching host allocator rounds each block up to a power of two, so its reserved bytes may exceed the buffers'.
    pinned, reference = None, getattr(run.algorithm, "reference", None)
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        pinned = {k: stats.get(k, 0) / 2**20 for k in ("reserved_bytes.peak", "allocated_bytes.peak",
                                                        "reserved_bytes.current", "allocated_bytes.current")}
        if reference is not None and hasattr(reference, "compact"):
            pinned["compact_reference_mb"] = reference.compact.nbytes / 2**20
            pinned["host_optimizer_state_mb"] = reference.optimizer_host.nbytes / 2**20
    episodes = []
    for (t0, tm0), (t1, tm1) in zip(episode_clock.marks[:-1], episode_clock.marks[1:], strict=True):
        episodes.append({"step_seconds": (t1 - t0) / args.tau,
                         "timers": {k: (tm1[k] - tm0.get(k, 0.0)) / args.tau for k in tm1}})
    return {
        "policy": args.worker,
        "episodes": episodes,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_mb": gpu_peak,
        "pinned_host_mb": pinned,
        "params": sum(p.numel() for p in run.model.parameters()),
        "threads": torch.get_num_threads(),
        "refresh_batch_size": cfg.refresh_batch_size,
        "refresh_ms": refresh_ms,
        "phase_device_seconds": phase_device_seconds,
        "refresh_joint_forward": joint_forward_on(cfg.selection.refresh_joint_forward,
                                                  next(run.model.parameters()).device),
    }


def _time_refreshes(run: TrainRun, args: argparse.Namespace) -> list[float]:
    """Time each of BLADE's refreshes (wall clock, synchronised on a GPU) into the returned list as they happen, and,
    with ``--profile-refresh``, profile the second one (the first carries one-off allocations and kernel loads)."""
    reference, times = run.algorithm.reference, []
    plain = reference.refresh
    cuda = torch.cuda.is_available() and args.device != "cpu"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def refresh(*a, **k):
        profile = args.profile_refresh is not None and len(times) == 1
        sync()
        start = time.perf_counter()
        if profile:
            acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
            with torch_profile(activities=acts) as prof:
                plain(*a, **k)
                sync()
        else:
            plain(*a, **k)
            sync()
        times.append((time.perf_counter() - start) * 1e3)
        if profile:
            os.makedirs(args.profile_refresh, exist_ok=True)
            table = prof.key_averages()
            with open(os.path.join(args.profile_refresh, f"refresh-b{args.batch_size}.txt"), "w", encoding="utf-8") as f:
                attention = sum(e.count for e in table if e.key == "aten::scaled_dot_product_attention")
                f.write(f"refresh {len(times)} at b = {args.batch_size}: {times[-1]:.1f} ms wall (profiled); "
                        f"aten::scaled_dot_product_attention × {attention} (one per layer and forward)\n")
                for key in ("self_cpu_time_total", *(["self_device_time_total"] if cuda else [])):
                    f.write(f"\n--- by {key}\n" + table.table(sort_by=key, row_limit=30) + "\n")

    reference.refresh = refresh
    return times


def bare(args: argparse.Namespace) -> dict:
    """The plain step's floor: the same Llama (built by the trainer's code), ``torch.optim.AdamW`` with the run's
    settings and gradient clipping, the same precision (bf16 autocast for ``amp_bf16``), HF's own mean loss, on
    random tokens already in memory; timed over the same episodes as the runs."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args, "full", tmp)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    model = build_causal_lm(ModelConfig.model_validate(_model(args))).to(device).train()
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    first = args.warmup + args.tau
    steps = args.warmup + (args.episodes + 1) * args.tau
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen).to(device) for _ in range(4)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    marks = []
    for step in range(1, steps + 1):
        tokens = batches[step % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and args.precision == "amp_bf16"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if o.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= first and (step - first) % args.tau == 0:
            marks.append(clock())
    return {
        "policy": "bare",
        "episodes": [{"step_seconds": (t1 - t0) / args.tau, "timers": {}}
                     for t0, t1 in zip(marks[:-1], marks[1:], strict=True)],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "refresh_batch_size": None,
    }


def ensure_data(path: str, seq_len: int) -> None:
    """The demo corpus packed to ``seq_len`` at ``path`` (prepared when absent; refused when it holds another length)."""
    if os.path.exists(os.path.join(path, "candidates", "index.json")):
        have = Manifest.load(os.path.join(path, "candidates")).config.get("seq_len")
        if have is not None and int(have) != seq_len:
            raise SystemExit(f"{path} holds sequences of {have} tokens, not --seq-len {seq_len}: pass another --data")
        return
    print(f"preparing the demo corpus ({seq_len}-token sequences) into {path} ...", flush=True)
    root = os.path.dirname(os.path.abspath(path))
    cfg = PrepareConfig.demo_default(root)
    prepare(cfg.model_copy(update={"output_dir": path, "progress": False, "seq_len": seq_len}))


def _run_worker(args: argparse.Namespace, policy: str, argv: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, JOB, *argv, "--data", args.data, "--worker", policy, "--out", out]
    subprocess.run(cmd, check=True)
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    os.unlink(out)
    return result


def worker_main(args: argparse.Namespace) -> int:
    """One policy's process (``--worker``): :func:`worker`'s report into ``args.out``."""
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(worker(args), f)
    return 0


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The benchmark of the module docstring (``argv``: the job's arguments, handed on to the policies' processes);
    its text report printed (``args.json``: also one JSON object); the exit status."""
    args.batch_size = sorted(set(args.batch_size))  # ascending: each b's peak RSS is at most the next one's
    ensure_data(args.data, args.seq_len)
    t0 = time.perf_counter()
    runs: dict[str, list[dict]] = {"full": [], "blade": [], "bare": []}
    for _ in range(args.repeats):  # alternate, so slow phases of a shared machine hit every run alike
        for policy in ("full", "blade") if args.no_bare else ("full", "blade", "bare"):
            runs[policy].append(_run_worker(args, policy, argv))
    seconds = time.perf_counter() - t0
    results = {str(b): report(_at_batch(args, b), *([r[str(b)] for r in runs[p]] for p in ("full", "blade")), seconds,
                              bares=[r[str(b)] for r in runs["bare"]])
               for b in args.batch_size}
    if args.json:  # one b: its report as it is; several: each under by_batch
        [one] = results.values() if len(results) == 1 else [{"batch_sizes": args.batch_size, "by_batch": results}]
        print(json.dumps(one))
    return 0



def _fastest(results: list[dict]) -> dict:
    """The measured episode with the lowest mean step time over all runs (least disturbed by other load)."""
    return min((e for r in results for e in r["episodes"]), key=lambda e: e["step_seconds"])


def report(args: argparse.Namespace, plains: list[dict], blades: list[dict], seconds: float, *,
           bares: list[dict] | None = None) -> dict:
    """Print one batch size's text report; returns its JSON object."""
    b, tau, k, rb = args.batch_size, args.tau, args.refresh_steps, blades[0]["refresh_batch_size"]
    plain, blade = _fastest(plains), _fastest(blades)
    t_plain, t_blade = plain["step_seconds"], blade["step_seconds"]
    per = {name: blade["timers"][name] for name in ("score", "refresh", "select", "distance")}
    proxy = t_blade - sum(per.values())
    refresh_step_cost = 2 * rb / b
    predicted = 1 + 1 / 3 + (k / tau) * refresh_step_cost
    measured = t_blade / t_plain
    all_p = sorted(e["step_seconds"] for r in plains for e in r["episodes"])
    all_b = sorted(e["step_seconds"] for r in blades for e in r["episodes"])
    median_ratio = all_b[len(all_b) // 2] / all_p[len(all_p) // 2]
    print()
    print(f"BLADE training benchmark: {plains[0]['params']:,}-parameter Llama, b = {b}, τ = {tau}, K = {k} "
          f"(K/τ = {k / tau:.2f}), rb = {rb}, L = {args.seq_len}, {blades[0]['threads']} thread(s), device {args.device}, "
          f"precision {args.precision}, "
          f"{'process CPU time' if args.clock == 'cpu' else 'wall-clock time'}; fastest of "
          f"{len(all_p)} measured episodes ({args.repeats} runs × {args.episodes}) per policy")
    print(f"  plain (full policy) step: {t_plain * 1e3:8.1f} ms   (episodes: {_span(all_p)})")
    print(f"  BLADE step:               {t_blade * 1e3:8.1f} ms   (episodes: {_span(all_b)})")
    print(f"  BLADE / plain per proxy step: {measured:.3f}×  (median episodes: {median_ratio:.3f}×)")
    print("  breakdown (per proxy step, in plain steps):           measured | predicted from counting passes")
    rows = [
        ("proxy forward+backward (+data, logging)", proxy / t_plain, 1.0),
        ("reference scoring (forward)", per["score"] / t_plain, 1 / 3),
        (f"refresh, amortised over τ (K/τ × {refresh_step_cost:.2f})", per["refresh"] / t_plain,
         (k / tau) * refresh_step_cost),
        ("selection (Δ, top-γ, bookkeeping)", per["select"] / t_plain, 0.0),
        ("‖u − w‖ (once per episode)", per["distance"] / t_plain, 0.0),
    ]
    for name, m, p in rows:
        print(f"    {name:<52} {m:6.3f} | {p:6.3f}")
    print(f"    {'total':<52} {measured:6.3f} | {predicted:6.3f}   "
          f"(measured / predicted = {measured / predicted:.3f}; goal: within 10%)")
    print(f"  paper setting K/τ = 0.3: {'yes' if abs(k / tau - 0.3) < 1e-9 else 'no'}; {measured:.3f}× vs the "
          f"paper's measured {PAPER_RATIO}× ({'at or below' if measured <= PAPER_RATIO else 'ABOVE'}); "
          "docs/DESIGN.md goal ≤ 1.5×")
    if blades[0].get("refresh_ms"):
        print("  each refresh (wall clock, ms; the first with one-off allocations): "
              + ", ".join(f"{t:.1f}" for t in blades[0]["refresh_ms"]))
    p_rss, b_rss = max(r["peak_rss_mb"] for r in plains), max(r["peak_rss_mb"] for r in blades)
    pmb = plains[0]["params"] * 4 / 2**20
    print(f"  peak RSS (separate processes): plain {p_rss:.0f} MB, BLADE {b_rss:.0f} MB, ratio {b_rss / p_rss:.3f} "
          f"(goal ≤ 1.10). Parameters: {pmb:.1f} MB; during a refresh BLADE adds the reference, its gradients "
          f"and AdamW moments (≈ 4 × {pmb:.1f} MB), between refreshes only the offloaded reference ({pmb:.1f} MB)")
    result = {
        "blade_over_plain": measured, "blade_over_plain_median": median_ratio, "predicted": predicted,
        "plain_step_ms": t_plain * 1e3, "blade_step_ms": t_blade * 1e3,
        "breakdown": {name: m for name, m, _ in rows}, "peak_rss_ratio": b_rss / p_rss,
        "peak_rss_mb": {"plain": p_rss, "blade": b_rss}, "params": plains[0]["params"],
        "heads": args.heads, "tau": tau, "refresh_joint_forward": blades[0]["refresh_joint_forward"],
        "refresh_steps": k, "refresh_batch_size": rb, "batch_size": b, "seq_len": args.seq_len,
        "precision": args.precision, "device": args.device, "threads": blades[0]["threads"], "clock": args.clock,
        "pinned_host_mb": {"plain": plains[0].get("pinned_host_mb"), "blade": blades[0].get("pinned_host_mb")},
        "goal_blade_over_plain": 1.5, "goal_peak_ratio": 1.1,
        # each refresh's wall-clock ms in the first BLADE run (the first carries one-off allocations): a refresh's
        # cost apart from its amortisation, to set against K × a step of 2·rb rows
        "refresh_ms": blades[0].get("refresh_ms"),
    }
    if plains[0].get("peak_gpu_mb") is not None:
        p_gpu = max(r["peak_gpu_mb"] for r in plains)
        b_gpu = max(r["peak_gpu_mb"] for r in blades)
        result["peak_gpu_mem_ratio"] = b_gpu / p_gpu
        result["peak_gpu_mb"] = {"plain": p_gpu, "blade": b_gpu}
        print(f"  peak GPU memory (torch allocator): plain {p_gpu:.0f} MB, BLADE {b_gpu:.0f} MB, "
              f"ratio {b_gpu / p_gpu:.3f} (goal ≤ 1.10)")
    if bares:
        t_bare = _fastest(bares)["step_seconds"]
        bare_rss = max(r["peak_rss_mb"] for r in bares)
        result.update(bare_step_ms=t_bare * 1e3, plain_over_bare=t_plain / t_bare, goal_plain_over_bare=1.05)
        result["peak_rss_mb"]["bare"] = bare_rss
        print(f"  bare PyTorch loop of the same model (AdamW, clipping, same precision, random tokens): "
              f"{t_bare * 1e3:.1f} ms per step; plain / bare = {t_plain / t_bare:.3f} (goal ≤ 1.05); "
              f"its peak RSS {bare_rss:.0f} MB")
        if bares[0].get("peak_gpu_mb") is not None and "peak_gpu_mb" in result:
            result["peak_gpu_mb"]["bare"] = max(r["peak_gpu_mb"] for r in bares)
    print(f"  {seconds:.0f} s for {len(plains) + len(blades) + len(bares or [])} runs (every batch size); command: "
          "python jobs/bench_training.py " + " ".join(sys.argv[1:]))
    return result


def _span(values: list[float]) -> str:
    return f"{min(values) * 1e3:.0f}–{max(values) * 1e3:.0f} ms"

