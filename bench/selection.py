"""Cost of Δ + top-γ selection relative to one forward pass (goal < 2%, docs/DESIGN.md §6): ``jobs/bench_selection.py``.

Builds a small Llama from a config (no download), times in one process, median of repeats:

* ``forward``: ``model(input_ids).logits`` under ``inference_mode`` (the pass the trainer runs
  anyway);
* ``delta+select``: ``excess_loss(ℓ(u), ℓ(w̃))`` with ``ℓ(w̃)`` in float16 as read from a scored
  shard, then ``select_top_fraction`` over the whole batch: the work BLADE adds per step;
* ``token_losses`` (reported for information): per-token float32 cross entropy from the logits,
  which replaces the mean cross entropy a plain trainer computes anyway.

The headline ratio is ``delta+select / forward``. ``select_top_fraction`` runs its default path for the
device (``kthvalue`` with host reads on a CPU, the synchronisation-free sort on a GPU); ``--sync on|off``
forces one, and the other path is timed too, for information. On a GPU each call is timed alone (host launches
and one synchronisation included: the headline); ``queued_ms`` adds the device time per call of calls queued back to
back, as in a training step whose host runs ahead of the GPU (information).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from curation.core.losses import token_losses
from curation.core.selection import excess_loss, select_top_fraction

__all__ = ["GOAL", "run"]

GOAL = 0.02


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _queued_seconds(fn: Callable[[], object], calls: int, device: torch.device) -> float | None:
    """On a GPU, the device time per call of ``calls`` calls queued back to back (CUDA events around them): what a
    call costs a pipeline whose host runs ahead of the device, as a training step's does, where a call timed alone
    also pays its launches' latency. ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def run(args: argparse.Namespace) -> int:
    """Time, then print the figures (``args.json``: one JSON object); returns the exit status."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
    )
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
    valid = torch.ones_like(tokens, dtype=torch.bool)

    with torch.inference_mode():
        logits = model(input_ids=tokens).logits
        t_forward = _median_seconds(lambda: model(input_ids=tokens).logits, args.repeats, 1, device)
        t_losses = _median_seconds(lambda: token_losses(logits, tokens, valid), args.repeats, 1, device)
        proxy_losses, target_valid = token_losses(logits, tokens, valid)
        # a reference that differs from the proxy, stored at the scored-shard precision
        ref_losses = (proxy_losses + torch.randn(proxy_losses.shape, generator=gen).to(device)).half()
        mask = select_top_fraction(excess_loss(proxy_losses, ref_losses), target_valid, args.gamma)

        sync = {"auto": None, "on": True, "off": False}[args.sync]
        default_sync = device.type == "cpu" if sync is None else sync

        def delta_select(sync: bool | None = sync) -> torch.Tensor:
            return select_top_fraction(excess_loss(proxy_losses, ref_losses), target_valid, args.gamma, sync=sync)

        t_select = _median_seconds(delta_select, args.select_repeats, 5, device)
        t_other = _median_seconds(lambda: delta_select(not default_sync), args.select_repeats, 5, device)
        t_queued = _queued_seconds(delta_select, args.select_repeats, device)
        t_forward_queued = _queued_seconds(lambda: model(input_ids=tokens).logits, args.repeats, device)
        assert torch.equal(delta_select(True), delta_select(False)), "the two selection paths disagree"

    ratio = t_select / t_forward
    result = {
        "device": str(device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "model": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "heads": args.heads},
        "params_millions": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "gamma": args.gamma,
        "kept": int(mask.sum()),
        "valid": int(target_valid.sum()),
        "forward_ms": round(t_forward * 1e3, 3),
        "delta_select_ms": round(t_select * 1e3, 4),
        "token_losses_ms": round(t_losses * 1e3, 3),
        "delta_select_over_forward": ratio,
        "selection_path": "kthvalue (host reads)" if default_sync else "sync-free",
        "other_path_ms": round(t_other * 1e3, 4),
        "token_losses_over_forward": t_losses / t_forward,
        # on a GPU, calls queued back to back (the host ahead, as in a training step): device time per call
        "queued_ms": None if t_queued is None else {"delta_select": round(t_queued * 1e3, 4),
                                                    "forward": round(t_forward_queued * 1e3, 3)},
        "queued_delta_select_over_forward": None if t_queued is None else t_queued / t_forward_queued,
        "goal": GOAL,
        "ok": ratio < GOAL,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"small Llama ({result['params_millions']}M params, {args.dtype}) on {device}, "
            f"{torch.get_num_threads()} threads, batch {args.batch} × {args.seq_len}, γ = {args.gamma}"
        )
        print(f"  forward pass            {result['forward_ms']:10.3f} ms  (median of {args.repeats})")
        print(
            f"  Δ + selection           {result['delta_select_ms']:10.4f} ms  (median of {args.select_repeats}; "
            f"{result['selection_path']}; the other path {result['other_path_ms']:.4f} ms)"
        )
        print(f"  token_losses (info)     {result['token_losses_ms']:10.3f} ms  (median of {args.repeats})")
        if result["queued_ms"] is not None:
            q = result["queued_ms"]
            print(f"  queued back to back     Δ + selection {q['delta_select']:.4f} ms, forward {q['forward']:.3f} ms "
                  f"per call (device time): {result['queued_delta_select_over_forward']:.4%} (information)")
        print(
            f"(Δ + selection) / forward = {ratio:.4%}  (goal < {GOAL:.0%}: {'ok' if result['ok'] else 'MISSED'}); "
            f"token_losses / forward = {result['token_losses_over_forward']:.2%}"
        )
    return 0

