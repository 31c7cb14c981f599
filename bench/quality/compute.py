"""The quality benchmark's compute accounting: analytic FLOPs of each policy's run, the amortization of a
selector's run over the target runs that reuse its shards, and comparisons on loss-versus-compute curves.

Pure arithmetic (no torch): every number here is tested against hand-computed values
(``tests/training/test_quality_compute.py``).

FLOPs of one run of ``steps`` proxy steps of ``b`` sequences of ``L`` tokens (``f`` = forward FLOPs per
token, ``curation.evaluation.flops``; training = 3 f):

* proxy: ``3 f · b L · steps``: every candidate token, kept or not (a masked token is still in the sequence);
* scoring: the reference's forward on every candidate batch after the ``W`` warm-up steps, ``f · b L`` each;
* refresh: blade / blade-nosync run ``K`` AdamW steps before steps ``W, W + τ, …`` (``Schedule``), each on a
  validation batch and (λ ≠ 0) a candidate batch of ``r`` sequences: ``3 f · r L · (2 or 1) · K`` per
  refresh; rho1 trains its static reference once, ``rho1_steps`` steps on validation batches of ``r``.

A **selector's run** is everything a policy needs to emit its selected-token shards: the three parts above.
``random`` needs no model to draw its masks, so its selection costs nothing; ``full`` selects nothing.
Reused by a target, the selection is **amortized** over the ``R`` target runs that replay the same shards:
the target's total is ``target training + selection / R``. Two accountings: **free** (the proxy's base model is
taken as given) and **base charged** (the proxy's base pretraining, ``3 f · tokens``, is part of the selection:
a team that wants BLADE or RHO-1 shards has to train that small model first; ``random`` needs no model, so
nothing is charged to it either way).

**Break-even R** (:func:`break_even_runs`): with the replay's final loss ``L`` after the target's ``T`` FLOPs and
``full``'s (smoothed) loss-versus-compute curve ``f``, reuse pays at R when ``L < f(T + C/R)``; ``f`` falling,
that holds while ``T + C/R < X`` with ``X`` the compute ``full`` needs to reach ``L``, so ``R* = C / (X − T)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from curation.core.schedule import Schedule

__all__ = ["Compute", "RunShape", "run_flops", "equal_compute_steps", "selection_flops", "amortized_total",
           "loss_at", "flops_to_reach", "base_flops", "charged_selection", "smooth", "mean_curve", "break_even_runs"]


@dataclass(frozen=True)
class Compute:
    """FLOPs of one run, by part."""

    proxy: float  # forward + backward of the proxy on every candidate token
    scoring: float  # reference forward on the candidate batches after the warm-up
    refresh: float  # reference training: the refreshes (blade) or the static reference (rho1)

    @property
    def total(self) -> float:
        return self.proxy + self.scoring + self.refresh

    def as_dict(self) -> dict[str, float]:
        return {"proxy": self.proxy, "scoring": self.scoring, "refresh": self.refresh, "total": self.total}


@dataclass(frozen=True)
class RunShape:
    """What a run's FLOPs depend on besides its policy and length."""

    forward_flops: float  # forward FLOPs per token of the trained model (and of its reference)
    batch: int  # b: sequences per proxy step
    seq_len: int  # L
    warmup: int  # W
    tau: int  # τ
    rho1_steps: int  # the static reference's training steps


def run_flops(shape: RunShape, policy: str, steps: int, sel: dict[str, Any] | None = None) -> Compute:
    """Analytic FLOPs of ``steps`` proxy steps of ``policy``; ``sel`` holds the refresh setting (keys of
    ``SelectionConfig``: ``refresh_steps``, ``lam``, ``refresh_batch_size``; its ``warmup_steps``/``tau``
    override the shape's)."""
    sel = sel or {}
    f, tokens = shape.forward_flops, shape.batch * shape.seq_len
    warm, tau = sel.get("warmup_steps", shape.warmup), sel.get("tau", shape.tau)
    proxy = 3.0 * f * tokens * steps
    if policy in ("full", "random"):
        return Compute(proxy, 0.0, 0.0)
    rb = sel.get("refresh_batch_size") or max(1, shape.batch // 4)
    scoring = f * tokens * max(0, steps - warm)
    if policy == "rho1":
        return Compute(proxy, scoring, 3.0 * f * rb * shape.seq_len * sel.get("rho1_steps", shape.rho1_steps))
    if policy not in ("blade", "blade-nosync"):
        raise ValueError(f"unknown policy {policy!r}")
    refreshes = Schedule(warm, tau, steps).num_refreshes()
    per_step = rb * shape.seq_len * (2 if sel.get("lam", 1.0) != 0 else 1)
    return Compute(proxy, scoring, 3.0 * f * per_step * sel.get("refresh_steps", 20) * refreshes)


def equal_compute_steps(shape: RunShape, policy: str, steps: int, sel: dict[str, Any] | None = None) -> int:
    """Steps of ``full`` with the FLOPs of ``steps`` steps of ``policy`` (rounded to the nearest step)."""
    return max(1, round(run_flops(shape, policy, steps, sel).total / run_flops(shape, "full", 1).total))


def selection_flops(shape: RunShape, policy: str, steps: int, sel: dict[str, Any] | None = None) -> float:
    """FLOPs of the selector's whole run that emits ``policy``'s shards (0 for ``random`` and ``full``)."""
    return 0.0 if policy in ("full", "random") else run_flops(shape, policy, steps, sel).total


def amortized_total(target_flops: float, selection: float, runs: int) -> float:
    """A target run's total compute when one selection is reused by ``runs`` target runs."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    return target_flops + selection / runs


def _checked(curve: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    pts = [(float(x), float(y)) for x, y in curve]
    if not pts:
        raise ValueError("empty curve")
    if any(b[0] <= a[0] for a, b in zip(pts, pts[1:], strict=False)):
        raise ValueError("curve compute values must be strictly increasing")
    return pts


def loss_at(curve: Sequence[tuple[float, float]], flops: float) -> float | None:
    """The loss of a (compute, loss) curve at ``flops``, linearly interpolated between its points; ``None``
    outside the curve's range (no extrapolation)."""
    pts = _checked(curve)
    if flops < pts[0][0] or flops > pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= flops <= x1:
            return y0 + (y1 - y0) * (flops - x0) / (x1 - x0)
    return pts[0][1]  # a one-point curve at exactly flops


def flops_to_reach(curve: Sequence[tuple[float, float]], loss: float) -> float | None:
    """The first compute at which a (compute, loss) curve reaches ``loss`` or lower, linearly interpolated
    within the segment where it crosses; ``None`` when it never does."""
    pts = _checked(curve)
    if pts[0][1] <= loss:
        return pts[0][0]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if y1 <= loss:
            return x0 + (x1 - x0) * (y0 - loss) / (y0 - y1)
    return None


def base_flops(forward_flops: float, tokens: int) -> float:
    """Training FLOPs of a base model's pretraining on ``tokens`` tokens (``3 f`` per token)."""
    return 3.0 * forward_flops * tokens


def charged_selection(policy: str, selection: float, base: float, *, charged: bool) -> float:
    """The selection compute of one accounting: with ``charged``, the proxy's base pretraining ``base`` is added
    for every policy that scores with a model (not ``random``, not ``full``)."""
    return selection + (base if charged and policy not in ("full", "random") else 0.0)


def smooth(curve: Sequence[tuple[float, float]], window: int = 3) -> list[tuple[float, float]]:
    """A centred moving average of a curve's losses over ``window`` neighbouring points, so that one noisy
    snapshot cannot decide whether (or where) a curve reaches a loss; compute values unchanged. Points closer to
    an end than ``window // 2`` average the widest centred window they have, and the two ends keep their values
    (a one-sided average would pull a run's final loss toward its earlier, higher losses)."""
    pts = _checked(curve)
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window must be odd and >= 1, got {window}")
    out = []
    for i, (x, _) in enumerate(pts):
        h = min(window // 2, i, len(pts) - 1 - i)
        near = pts[i - h:i + h + 1]
        out.append((x, sum(y for _, y in near) / len(near)))
    return out


def mean_curve(curves: Sequence[Sequence[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The pointwise mean over seeds of curves read at the same compute values."""
    if not curves:
        raise ValueError("no curves to average")
    xs = [x for x, _ in curves[0]]
    if any([x for x, _ in c] != xs for c in curves):
        raise ValueError("curves to average must share their compute values")
    return [(x, sum(c[i][1] for c in curves) / len(curves)) for i, x in enumerate(xs)]


def break_even_runs(selection: float, target_flops: float, full_curve: Sequence[tuple[float, float]],
                    replay_loss: float, *, window: int = 3, most: int = 64) -> dict[str, Any]:
    """The number of target runs R from which reusing one selection of ``selection`` FLOPs pays: the replay's
    final loss ``replay_loss`` (after ``target_flops``) below ``full``'s smoothed curve at ``target_flops +
    selection / R``. Returns ``{"runs": R* or None, "label": ...}``:

    * ``never``: ``full`` reaches the replay's loss by ``target_flops`` (no amount of reuse helps);
    * ``any R``: a free selection (``random``) whose replay beats ``full`` at equal steps;
    * ``beyond <most>``: R* above ``most``;
    * ``≤ x``: ``full``'s run ends before reaching the replay's loss, so R* is at most what its end implies;
    * otherwise R* itself (interpolated on the smoothed curve; ``≤ 1`` means it pays from the first run).
    """
    curve = smooth(full_curve, window)
    need = flops_to_reach(curve, replay_loss)
    if need is not None and need <= target_flops:
        return {"runs": None, "label": "never", "full_flops_to_match": need}
    if selection == 0:
        return {"runs": 0.0, "label": "any R", "full_flops_to_match": need}
    if need is None:
        end = curve[-1][0]
        bound = selection / (end - target_flops) if end > target_flops else None
        label = "beyond full's run" if bound is None else f"≤ {bound:.3g}"
        return {"runs": bound, "label": label, "upper_bound": True, "full_flops_to_match": None}
    runs = selection / (need - target_flops)
    return {"runs": runs, "label": f"beyond {most}" if runs > most else f"{runs:.3g}", "full_flops_to_match": need}
