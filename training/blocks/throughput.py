"""Throughput of a run: tokens/s, kept tokens/s, MFU and the time left, with the reference's work counted apart.

Every trainer gets :func:`throughput_callbacks` (``throughput:`` of its config):

* Composer's ``SpeedMonitor`` (:class:`HostSpeedMonitor`: its FLOPs counted on the host) logs the rolling
  (``window`` steps) ``throughput/tokens_per_sec``, ``samples_per_sec``, ``flops_per_sec`` and
  ``throughput/device/mfu``: the proxy's FLOPs (a training step of every candidate token, :class:`ProxyFlops` set
  on the model as ``flops_per_batch``: analytic for the Llama family, :mod:`curation.evaluation.flops`; measured for
  any other causal LM once per sequence length, :mod:`curation.evaluation.flop_count`) per second of training wall
  time, divided by the device's peak (``throughput.peak_flops``, or Composer's table of
  common GPUs at the run's precision; on a CPU only when given). The reference's work is part of that wall time:
  this MFU is the *useful* one.
* :class:`Throughput`, over the same window and clock (Composer's training wall time, evaluation excluded), adds
  ``throughput/kept_tokens_per_sec``; the in-process reference's work (``ℓ(w̃)`` scoring: one forward per scored
  token; refreshes and RHO-1's static training: K training steps on validation and candidate batches)
  as ``throughput/device/reference_flops_per_sec`` and ``throughput/device/mfu_with_reference``; its time as
  ``time/score_seconds`` and ``time/refresh_seconds`` (cumulative) and ``blade/refresh_seconds`` (the refresh of this
  step); and ``time/eta_seconds``: the steps left at the window's proxy-only seconds per step, plus the
  refreshes, scored steps and evaluations left at their measured mean durations (:func:`eta_seconds`; before the
  first refresh its cost is estimated from its tokens). The progress bar shows tokens/s, kept tokens/s, MFU and
  the time left (when stdout and stderr are terminals; else, e.g. under ``> log`` or ``ray job submit``, a line every
  ``throughput.log_interval`` steps with step, loss, tokens/s, kept/s, MFU and ETA: :func:`interactive`);
  :meth:`Throughput.summary` is the run's ``throughput`` in ``summary.json`` (the whole run: its
  counters are checkpointed).
* Memory, logged every step beside them: ``memory/host_peak_rss_gib``, the trainer process's peak resident set
  (``getrusage``), and on a GPU ``memory/device_peak_allocated_gib``, the allocator's peak
  (``torch.cuda.max_memory_allocated``); the summary's ``memory`` holds both in bytes (the maximum over every
  process of a resumed run: checkpointed).

Under data-parallel training every rank runs both callbacks (``SpeedMonitor`` sums the ranks' FLOPs with one
``all_reduce`` per step); rank 0's loggers write. The engine's scoring workers and refresh actor are other processes:
their work is in the engine's part of the summary, not here.
"""

from __future__ import annotations

import resource
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from composer.callbacks import SpeedMonitor
from composer.core import Callback, State
from composer.loggers import Logger, ProgressBarLogger
from composer.models import ComposerModel
from composer.utils import dist
from torch import nn

from curation.core.host_sync import matmul_settings
from curation.core.schedule import Schedule
from curation.evaluation.flop_count import measured_forward_flops_per_token
from curation.evaluation.flops import TRAIN_PASSES, ModelShape, forward_flops_per_token
from curation.io.progress import interactive
from schemas.train_config import ReplayConfig, TrainConfig
from training.blocks.callbacks import StepSelections
from training.blocks.data import Batch
from training.blocks.model import MaskedCausalLM

__all__ = ["HostSpeedMonitor", "ProxyFlops", "ReferenceWork", "Remaining", "remaining_work", "eta_seconds",
           "Throughput", "throughput_callbacks", "format_seconds", "host_peak_rss", "device_peak_allocated", "interactive"]

_GIB = float(1 << 30)


def host_peak_rss() -> int:
    """This process's peak resident set size in bytes (``getrusage``'s ``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def device_peak_allocated(device: torch.device) -> int | None:
    """The CUDA allocator's peak on ``device`` in bytes (``torch.cuda.max_memory_allocated``); None off a GPU."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


class HostSpeedMonitor(SpeedMonitor):
    """Composer's ``SpeedMonitor`` without the round trip of a step's FLOPs through the device in one process: its
    ``batch_end`` sums the ranks' FLOPs with an ``all_reduce`` and reads the sum (``.item()``, a host read every step);
    one process's FLOPs are its own, counted on the host."""

    def batch_end(self, state: State, logger: Logger) -> None:
        model = state.model if isinstance(state.model, ComposerModel) else state.model.module
        flops = getattr(model, "flops_per_batch", None)
        if dist.get_world_size() > 1 or flops is None:
            super().batch_end(state, logger)
            return
        n = float(flops(state.batch))  # (on the host: ProxyFlops measures once per length, on fake tensors)
        if getattr(model, "flops_per_batch", None) is not flops:  # (ProxyFlops removed itself: no FLOPs to count)
            super().batch_end(state, logger)
            return
        self.history_flops.append(n)
        del model.flops_per_batch  # (super() appends none and logs the window's FLOPs rate from the history)
        try:
            super().batch_end(state, logger)
        finally:
            model.flops_per_batch = flops


class ProxyFlops:
    """The model's FLOPs: ``flops_per_batch`` (read by ``SpeedMonitor``: a training step on every token of the batch)
    and the forward FLOPs per token behind it, analytic for the Llama family (:mod:`curation.evaluation.flops`),
    else measured once per sequence length on a fake copy of the model (:mod:`curation.evaluation.flop_count`).
    A model whose forward cannot be measured has no FLOPs: :attr:`unavailable` says why (in the summary, and
    printed once), never a silent null; ``owner``'s ``flops_per_batch`` (this) is then removed, so ``SpeedMonitor``
    logs no FLOPs rather than zeros."""

    def __init__(self, model: nn.Module, owner: MaskedCausalLM | None = None) -> None:
        self.model = model  # the HF model: its config, and its class for a measured count
        self.owner = owner
        self.method = "analytic" if ModelShape.of_hf_config(model.config, 1) is not None else "measured"
        self.unavailable: str | None = None
        self._measured: dict[int, float | None] = {}

    def forward_per_token(self, context: int) -> float | None:
        """Forward FLOPs per token with sequences of ``context`` tokens (None: unavailable)."""
        shape = ModelShape.of_hf_config(self.model.config, context)
        if shape is not None:
            return forward_flops_per_token(shape)
        if context not in self._measured:
            try:
                self._measured[context] = measured_forward_flops_per_token(self.model, context)
            except Exception as e:  # noqa: BLE001 - any failure of an architecture's forward on fake tensors
                self.unavailable = (f"the FLOPs of {type(self.model).__name__} could not be measured (its forward on "
                                    f"fake tensors failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}): no "
                                    "FLOPs or MFU for this run")
                self._measured[context] = None
                print(f"note: {self.unavailable}", file=sys.stderr, flush=True)
        return self._measured[context]

    def __call__(self, batch: Batch) -> float:
        rows, length = batch["tokens"].shape
        per_token = self.forward_per_token(int(length))
        if per_token is None and getattr(self.owner, "flops_per_batch", None) is self:
            del self.owner.flops_per_batch
        return TRAIN_PASSES * per_token * rows * length if per_token is not None else 0.0


@dataclass(frozen=True)
class ReferenceWork:
    """What the in-process reference's work costs on one rank (its counts and refresh log say how much was done).

    Attributes:
        score_tokens: tokens this rank scores per scored step (its rows × ``L``): one forward each.
        refresh_tokens: tokens of one refresh step (a validation batch, and a candidate batch when ``λ ≠ 0``;
            RHO-1's static training: the validation batch): one training step each.
        refresh_steps: ``K`` (the ETA's estimate of a refresh not measured yet).
        refreshes: whether the policy refreshes its reference every ``τ`` steps (``blade``, ``blade-nosync``).
    """

    score_tokens: int
    refresh_tokens: int
    refresh_steps: int
    refreshes: bool

    @classmethod
    def of(cls, cfg: TrainConfig, *, rows: int, seq_len: int, static: bool) -> ReferenceWork:
        """The reference of ``cfg`` scoring ``rows`` sequences of ``seq_len`` tokens per step on this rank."""
        batches = 1 if static or cfg.selection.lam == 0 else 2
        return cls(score_tokens=rows * seq_len, refresh_tokens=batches * cfg.refresh_batch_size * seq_len,
                   refresh_steps=cfg.selection.refresh_steps, refreshes=not static)

    def flops(self, per_token: float, counts: Mapping[str, int], refresh_log: Sequence[Mapping[str, object]]) -> float:
        """FLOPs of the work done with ``per_token`` forward FLOPs per token (the reference is the proxy's
        architecture): the scored steps (``counts["score_steps"]``: a forward) and the logged refreshes' steps."""
        refresh_steps = sum(int(r.get("steps") or 0) for r in refresh_log)
        return per_token * (counts.get("score_steps", 0) * self.score_tokens
                            + TRAIN_PASSES * refresh_steps * self.refresh_tokens)


@dataclass(frozen=True)
class Remaining:
    """Work left in a run."""

    steps: int
    refreshes: int
    scored_steps: int
    evaluations: int


def remaining_work(done: int, total: int, *, schedule: Schedule | None = None, refreshes: bool = False,
                   scores: bool = False, eval_interval: int | None = None) -> Remaining:
    """The proxy steps, in-process refreshes (before steps ``W, W + τ, …``), steps the in-process reference scores
    (from ``W`` on) and evaluations (every ``eval_interval`` steps and at the end) left after ``done`` steps."""
    n_refresh = n_scored = n_eval = 0
    if schedule is not None and refreshes:  # the episode starts in [done, stop): O(1), this runs every step
        stop = total if schedule.total_steps is None else min(total, schedule.total_steps)
        n_refresh = len(schedule.episode_starts(stop)) - len(schedule.episode_starts(min(done, stop)))
    if schedule is not None and scores:
        n_scored = len(range(max(done, schedule.warmup), total))
    if eval_interval is not None and total > done:  # multiples of the interval in (done, total], and the end
        n_eval = total // eval_interval - done // eval_interval + (total % eval_interval != 0)
    return Remaining(steps=max(0, total - done), refreshes=n_refresh, scored_steps=n_scored, evaluations=n_eval)


def eta_seconds(left: Remaining, *, step_s: float, refresh_s: float = 0.0, score_s: float = 0.0,
                eval_s: float = 0.0) -> float:
    """Seconds left: each kind of remaining work at its seconds per unit (a proxy step without the reference's work,
    a refresh, a scored step, an evaluation)."""
    return left.steps * step_s + left.refreshes * refresh_s + left.scored_steps * score_s + left.evaluations * eval_s


def format_seconds(s: float) -> str:
    """``3h02m``, ``4m05s``, ``12s``."""
    s = max(0, int(round(s)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _percent(x: float) -> str:
    """``12.3%``; a small share with two significant digits (``0.015%``: a CPU run is not ``0.0%``)."""
    return f"{x:.1%}" if x >= 0.001 else f"{x * 100:.2g}%"


@dataclass(frozen=True)
class _Point:
    """The run's counters at a step end."""

    seconds: float  # training wall time (Composer's, evaluation excluded)
    steps: int
    tokens: float  # every rank's
    kept: float  # every rank's
    reference_flops: float  # this rank's
    reference_seconds: float  # this rank's scoring + refreshes


class Throughput(Callback):
    """Kept tokens/s, the reference's FLOPs, MFU with and without it, the time left, the progress bar and the
    summary (module docstring). Reads the peak FLOPs the run's ``SpeedMonitor`` found at init.

    Args:
        speed: the run's ``SpeedMonitor``.
        window: steps of the rolling rates (the monitor's window).
        total_steps: the run's steps.
        proxy: the model's FLOPs per batch (its architecture without a FLOPs model: no FLOPs, no MFU).
        selections: what each step kept (None: a plain trainer, e.g. replay, keeps the batch's ``kept_total``).
        reference: the in-process reference's work (None: there is none, or the engine does it).
        schedule: the run's schedule (the refreshes and scored steps left).
        eval_interval: steps between evaluations (None: no validation).
        lines_every: print a progress line every this many steps (and at the last one) on stdout; None: none.
        peak_given: the monitor's peak was configured (``throughput.peak_flops``): kept on any device.
    """

    def __init__(self, speed: SpeedMonitor, *, window: int, total_steps: int, proxy: ProxyFlops,
                 selections: StepSelections | None = None, reference: ReferenceWork | None = None,
                 schedule: Schedule | None = None, eval_interval: int | None = None,
                 lines_every: int | None = None, peak_given: bool = False) -> None:
        self.speed = speed
        self.lines_every = lines_every
        self.peak_given = peak_given
        self.total_steps = total_steps
        self.proxy = proxy
        self.selections = selections
        self.reference = reference
        self.schedule = schedule
        self.eval_interval = eval_interval
        self.history: deque[_Point] = deque(maxlen=window + 1)
        # the whole run's (checkpointed)
        self.kept_tokens = 0.0
        self.eval_seconds = 0.0
        self.evaluations = 0
        self.seq_len: int | None = None
        self.rank_step_tokens: int | None = None
        self._refresh_mark = (0, 0.0)  # refreshes and refresh seconds at the last step end
        self.device = torch.device("cpu")
        self.host_peak = 0  # bytes, the maximum over the processes of the run (checkpointed)
        self.device_peak: int | None = None

    # --- what the selection tells ------------------------------------------------------------------
    def _timers(self) -> dict[str, float]:
        return self.selections.timers if self.selections is not None else {}

    def _counts(self) -> dict[str, int]:
        return self.selections.counts if self.selections is not None else {}

    def per_token(self) -> float | None:
        """The model's forward FLOPs per token at the run's sequence length (None: not known yet, or unavailable)."""
        return self.proxy.forward_per_token(self.seq_len) if self.seq_len else None

    def reference_flops(self) -> float:
        per_token = self.per_token()
        if self.reference is None or per_token is None or self.selections is None:
            return 0.0
        return self.reference.flops(per_token, self._counts(), self.selections.refresh_log)

    def reference_seconds(self) -> float:
        t = self._timers()
        return float(t.get("score", 0.0) + t.get("refresh", 0.0))

    @property
    def peak(self) -> float | None:
        """Peak FLOP/s of one device (given, or Composer's table; None: unknown, no MFU)."""
        return float(self.speed.gpu_flops_available) if self.speed.gpu_flops_available else None

    def mfu(self, *, seconds: float, tokens: float, reference_flops: float = 0.0) -> float | None:
        """FLOPs utilisation of one device: the proxy's training FLOPs of ``tokens`` (every rank's) and this rank's
        ``reference_flops`` in ``seconds``, over the peak. None when the peak or the FLOPs model is unknown."""
        per_token, peak = self.per_token(), self.peak
        if per_token is None or peak is None or seconds <= 0:
            return None
        return (TRAIN_PASSES * per_token * tokens / dist.get_world_size() + reference_flops) / seconds / peak

    # --- events ------------------------------------------------------------------------------------
    def memory(self) -> dict[str, Any]:
        """Peak host and device memory so far (bytes): the summary's ``memory``."""
        self.host_peak = max(self.host_peak, host_peak_rss())
        device = device_peak_allocated(self.device)
        if device is not None:
            self.device_peak = max(self.device_peak or 0, device)
        return {"host_peak_rss_bytes": self.host_peak, "device_peak_allocated_bytes": self.device_peak,
                "device": str(self.device)}

    def _memory_metrics(self) -> dict[str, float]:
        m = self.memory()
        out = {"memory/host_peak_rss_gib": m["host_peak_rss_bytes"] / _GIB}
        if m["device_peak_allocated_bytes"] is not None:
            out["memory/device_peak_allocated_gib"] = m["device_peak_allocated_bytes"] / _GIB
        return out

    def fit_start(self, state: State, logger: Logger) -> None:
        self.device = next(state.model.parameters()).device
        if not self.peak_given and state.device.name != "gpu":
            # Composer's table looks the peak up for any visible GPU: a run on the CPU of a GPU machine has none.
            self.speed.gpu_flops_available = None
        self.history.clear()
        self._refresh_mark = (self._counts().get("refreshes", 0), float(self._timers().get("refresh", 0.0)))

    def eval_end(self, state: State, logger: Logger) -> None:
        self.eval_seconds += state.eval_timestamp.total_wct.total_seconds()
        self.evaluations += 1

    def batch_end(self, state: State, logger: Logger) -> None:
        tokens = state.batch["tokens"]
        self.seq_len, self.rank_step_tokens = int(tokens.shape[1]), int(tokens.numel())
        # The step's kept tokens, known on the host before the step (every rank's: the selection's K)
        self.kept_tokens += float(state.batch.get("kept_total", tokens.numel()))
        self.history.append(_Point(state.timestamp.total_wct.total_seconds(), int(state.timestamp.batch),
                                   float(state.timestamp.token.value), self.kept_tokens, self.reference_flops(),
                                   self.reference_seconds()))
        metrics = {**self.rates(), **self._reference_times(), **self._memory_metrics()}
        eta = self.eta()
        if eta is not None:
            metrics["time/eta_seconds"] = eta
        logger.log_metrics(metrics)
        self._show(logger, metrics)
        step = int(state.timestamp.batch)
        if self.lines_every is not None and (step % self.lines_every == 0 or step >= self.total_steps):
            for reads in state.algorithms:  # the step's loss (read once per line, not per step: StepReads)
                if hasattr(reads, "drain"):
                    reads.drain()
            loss = (state.total_loss_dict or {}).get("loss/train/total")
            print(self.line(None if loss is None else float(loss), metrics.get("time/eta_seconds")), flush=True)

    # --- numbers -----------------------------------------------------------------------------------
    def rates(self) -> dict[str, float]:
        """The window's rates, logged like ``SpeedMonitor``'s: once the window is full (``window + 1`` step ends)."""
        if len(self.history) < (self.history.maxlen or 2):
            return {}
        a, b = self.history[0], self.history[-1]
        dt = b.seconds - a.seconds
        if dt <= 0:
            return {}
        out = {"throughput/kept_tokens_per_sec": (b.kept - a.kept) / dt}
        if self.reference is not None and self.per_token() is not None:
            out["throughput/device/reference_flops_per_sec"] = (b.reference_flops - a.reference_flops) / dt
            mfu = self.mfu(seconds=dt, tokens=b.tokens - a.tokens, reference_flops=b.reference_flops - a.reference_flops)
            if mfu is not None:
                out["throughput/device/mfu_with_reference"] = mfu
        return out

    def _reference_times(self) -> dict[str, float]:
        if self.reference is None:
            return {}
        t, count = self._timers(), self._counts().get("refreshes", 0)
        refresh = float(t.get("refresh", 0.0))
        out = {"time/score_seconds": float(t.get("score", 0.0)), "time/refresh_seconds": refresh}
        if count > self._refresh_mark[0]:  # a refresh ran in this step
            out["blade/refresh_seconds"] = refresh - self._refresh_mark[1]
        self._refresh_mark = (count, refresh)
        return out

    def eta(self) -> float | None:
        """Seconds left (:func:`eta_seconds`); None until two step ends are in the window."""
        if len(self.history) < 2 or self.history[-1].steps <= self.history[0].steps:
            return None
        a, b = self.history[0], self.history[-1]
        # a proxy step without the reference's work, over the window
        step_s = max(0.0, (b.seconds - a.seconds) - (b.reference_seconds - a.reference_seconds)) / (b.steps - a.steps)
        ref = self.reference
        left = remaining_work(b.steps, self.total_steps, schedule=self.schedule,
                              refreshes=ref is not None and ref.refreshes, scores=ref is not None,
                              eval_interval=self.eval_interval)
        refresh_s = score_s = 0.0
        if ref is not None:
            t, c, per_token = self._timers(), self._counts(), step_s / max(1, self.rank_step_tokens or 1)
            refresh_s = (t.get("refresh", 0.0) / c["refreshes"] if c.get("refreshes")  # measured, else K training
                         else ref.refresh_steps * ref.refresh_tokens * per_token)  # steps at the proxy's s/token
            score_s = (t.get("score", 0.0) / c["score_steps"] if c.get("score_steps")
                       else ref.score_tokens * per_token / 3.0)  # a forward: a third of a training step
        eval_s = self.eval_seconds / self.evaluations if self.evaluations else 0.0
        return eta_seconds(left, step_s=step_s, refresh_s=refresh_s, score_s=score_s, eval_s=eval_s)

    def line(self, loss: float | None, eta: float | None) -> str:
        """``step 40/150 | loss 5.1234 | tok/s 12.3k | kept/s 7.4k | mfu 12.3% | eta 3m05s``: every field, ``-`` while
        unknown (rates over the steps in the window so far; MFU needs the peak FLOP/s)."""
        b = self.history[-1]
        a = self.history[0] if len(self.history) > 1 else None
        dt = b.seconds - a.seconds if a is not None else 0.0
        tok = kept = mfu = "-"
        if a is not None and dt > 0:
            tok, kept = _si((b.tokens - a.tokens) / dt), _si((b.kept - a.kept) / dt)
            value = self.mfu(seconds=dt, tokens=b.tokens - a.tokens)
            mfu = _percent(value) if value is not None else "-"
        return (f"step {b.steps}/{self.total_steps} | loss {'-' if loss is None else f'{loss:.4f}'} | tok/s {tok} | "
                f"kept/s {kept} | mfu {mfu} | eta {'-' if eta is None else format_seconds(eta)}")

    def _show(self, logger: Logger, metrics: dict[str, float]) -> None:
        bars = [d for d in logger.destinations if isinstance(d, ProgressBarLogger) and d.train_pbar is not None]
        if not bars or len(self.history) < 2:
            return
        a, b = self.history[0], self.history[-1]
        shown = {"tok/s": _si((b.tokens - a.tokens) / (b.seconds - a.seconds)) if b.seconds > a.seconds else "-"}
        if "throughput/kept_tokens_per_sec" in metrics:
            shown["kept/s"] = _si(metrics["throughput/kept_tokens_per_sec"])
        mfu = self.mfu(seconds=b.seconds - a.seconds, tokens=b.tokens - a.tokens)
        if mfu is not None:
            shown["mfu"] = _percent(mfu)
        if "time/eta_seconds" in metrics:
            shown["eta"] = format_seconds(metrics["time/eta_seconds"])
        for bar in bars:  # the training bar shows only `loss/train` metrics of its own: these go first
            pbar = bar.train_pbar
            pbar.metrics = {**shown, **{k: v for k, v in pbar.metrics.items() if k not in shown}}
            pbar.pbar.set_postfix(pbar.metrics)

    def summary(self, state: State) -> dict[str, Any]:
        """The whole run's throughput (``summary.json``): tokens, kept tokens, seconds, rates, FLOPs and MFU (of the
        whole group under data-parallel training: the summary's ``world_size``; the peak memory is :meth:`memory`)."""
        seconds = state.timestamp.total_wct.total_seconds()
        tokens = float(state.timestamp.token.value)
        per_token = self.per_token()
        ref_flops = self.reference_flops()
        return {
            "steps": int(state.timestamp.batch), "tokens": tokens, "kept_tokens": self.kept_tokens,
            "train_seconds": seconds, "eval_seconds": self.eval_seconds,
            "tokens_per_sec": tokens / seconds if seconds > 0 else None,
            "kept_tokens_per_sec": self.kept_tokens / seconds if seconds > 0 else None,
            "forward_flops_per_token": per_token,
            "flops_method": self.proxy.method if per_token is not None else None,
            "flops_unavailable": self.proxy.unavailable,
            "proxy_flops": TRAIN_PASSES * per_token * tokens if per_token is not None else None,
            "reference_flops_per_device": ref_flops if per_token is not None else None,
            "reference_seconds": {"score": float(self._timers().get("score", 0.0)),
                                  "refresh": float(self._timers().get("refresh", 0.0))},
            "peak_flops_per_device": self.peak,
            "mfu": self.mfu(seconds=seconds, tokens=tokens),
            "mfu_with_reference": self.mfu(seconds=seconds, tokens=tokens, reference_flops=ref_flops)
            if self.reference is not None else None,
            # fp32 matmul precision of this process (TF32 on a GPU), the same in the workers and the refresh actor
            "matmul": matmul_settings(),
        }

    # --- checkpoint ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"kept_tokens": self.kept_tokens, "eval_seconds": self.eval_seconds, "evaluations": self.evaluations,
                "seq_len": self.seq_len, "host_peak": self.host_peak, "device_peak": self.device_peak}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.kept_tokens = float(state.get("kept_tokens", 0.0))
        self.eval_seconds = float(state.get("eval_seconds", 0.0))
        self.evaluations = int(state.get("evaluations", 0))
        self.seq_len = state.get("seq_len")
        self.host_peak = int(state.get("host_peak") or 0)
        self.device_peak = state.get("device_peak")


def throughput_callbacks(cfg: TrainConfig | ReplayConfig, model: MaskedCausalLM, *, total_steps: int,
                         selections: StepSelections | None = None, reference: ReferenceWork | None = None,
                         schedule: Schedule | None = None, validation: bool = True) -> tuple[SpeedMonitor, Throughput]:
    """Composer's ``SpeedMonitor`` and :class:`Throughput` for ``cfg``'s trainer of ``model`` (a
    :class:`~training.blocks.model.MaskedCausalLM`, given its ``flops_per_batch``: :class:`ProxyFlops`)."""
    model.flops_per_batch = proxy = ProxyFlops(model.model, owner=model)
    speed = HostSpeedMonitor(window_size=cfg.throughput.window, gpu_flops_available=cfg.throughput.peak_flops,
                             time_unit="seconds")
    meter = Throughput(speed, window=cfg.throughput.window, total_steps=total_steps, proxy=proxy,
                       selections=selections, reference=reference, schedule=schedule,
                       eval_interval=cfg.eval.interval if validation else None,
                       lines_every=cfg.throughput.log_interval if cfg.progress_bar and not interactive() else None,
                       peak_given=cfg.throughput.peak_flops is not None)
    return speed, meter
