"""The BLADE loop of DESIGN.md §2 on one page: a plain-torch reference implementation (the test oracle).

:func:`blade_loop` is the algorithm read top to bottom, one proxy step at a time, for any policy of
:mod:`curation.core.policies`::

    u ← base model; W warm-up steps on every valid token
    every τ steps (t = W, W + τ, ...):  w_0 ← u (blade; blade-nosync continues from w̃), then K AdamW steps
                                        on L_val(w) + λ L_train(α, w)                       → w̃
    each step t:  Δ = ℓ(u) − ℓ(w̃) per token;  α = top-γ of Δ over the whole batch;  one AdamW step on
                  the mean loss of the kept tokens

It is a re-statement, not a wrapper: no Composer, no Ray, no shards. It reuses only the pure core
(:mod:`~curation.core.losses`, :mod:`~curation.core.selection`, :mod:`~curation.core.policies`,
:mod:`~curation.core.refresh`, :mod:`~curation.core.schedule`, :class:`~curation.core.stream.CandidateStream`)
and spells out every convention the trainers follow, so that on a CPU in float32 the single-process
trainer (exact mode), the Ray engine in exact mode and the pipelined engine with ``P = 1`` equal it bit for
bit (``tests/jobs/test_oracle.py``; on the full demo config it writes the very ``final/model.safetensors``
of ``jobs/train.py``). The conventions:

* step ``t`` trains on the sequences ``CandidateStream(N, b, seed).batch_ids(t)``;
* the proxy step is AdamW (constant LR, the total gradient norm clipped) on the mean loss of the kept
  tokens, ``Σ α ℓ(u) / Σ α`` (:func:`~curation.core.selection.masked_mean`); ℓ(u) comes from the logits
  of that same forward pass. (The Composer trainer writes ``Σ α ℓ · (1 / k)``, normalised over the whole
  batch under microbatching: the same gradient bits, since float32 ``1 / k`` equals ``1 / k`` rounded from
  float64 for every ``k`` ≤ 2·10⁶ kept tokens, all checked);
* ℓ(w̃) is computed without gradients, ``score_batch_size`` sequences per forward, and rounded to float16
  (the precision of a scored shard) before ``Δ = ℓ(u) − ℓ(w̃)`` is taken in float32;
* refresh ``e`` draws its validation batches ``e·K + k`` (``k < K``) of ``CandidateStream(N_val, rb,
  selection.seed + 1)``; its candidate batches cycle, ``rb`` rows at a time, through the last
  ``refresh_candidate_batches`` trained batches with their masks (before any step was trained, the batch
  of the refresh step with every valid token); RHO-1's static reference trains ``rho1_steps`` steps on
  batches ``0 .. rho1_steps − 1`` of ``CandidateStream(N_val, rb, selection.seed + 2)`` from the base model;
* ``random`` draws step ``t``'s scores from ``torch.Generator`` seeded with
  ``SeedSequence([selection.seed, t, 0]).generate_state(1)[0]``.

Whole-batch selection only (the trainer's ``microbatch_size < batch_size`` selects per microbatch) and
float32 only (no autocast). Pure torch: no ray, no composer.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from curation.core.losses import model_logits, model_token_losses, target_valid, token_losses
from curation.core.policies import RefreshMode, SelectionPolicy, get_policy, train_static_reference
from curation.core.refresh import RefreshSettings, RefreshStart
from curation.core.schedule import Schedule
from curation.core.selection import masked_mean
from curation.core.stream import CandidateStream

if TYPE_CHECKING:  # (types only: the core imports nothing of schemas at run time)
    from schemas.train_config import OptimConfig, SelectionConfig

__all__ = ["LoopResult", "blade_loop"]


@dataclass
class LoopResult:
    """What :func:`blade_loop` trained.

    Attributes:
        model: the final proxy ``u`` (a copy of the model passed in, trained).
        sample_ids: the candidate rows of every step, ``(b,)`` int64.
        masks: α of every step, ``(b, L)`` bool (warm-up: every valid token).
        scores: the policy's scores of every step, ``(b, L)`` float32 (NaN during warm-up).
        refresh_log: one :meth:`~curation.core.refresh.RefreshResult.log_entry` per reference computed (RHO-1: version 0 at step 0).
        reference: the last reference ``w̃`` (``None`` for ``full`` / ``random``).
    """

    model: nn.Module
    sample_ids: list[np.ndarray] = field(default_factory=list)
    masks: list[Tensor] = field(default_factory=list)
    scores: list[Tensor] = field(default_factory=list)
    refresh_log: list[dict[str, Any]] = field(default_factory=list)
    reference: nn.Module | None = None

    def record(self, sample_ids: np.ndarray, mask: Tensor, scores: Tensor) -> None:
        """What a step trained on: its rows, α, and the scores (as float32)."""
        self.sample_ids.append(sample_ids)
        self.masks.append(mask)
        self.scores.append(scores.float())


def blade_loop(
    model: nn.Module,
    candidates: Tensor,
    validation: Tensor,
    *,
    selection: SelectionConfig,
    optim: OptimConfig,
    batch_size: int,
    steps: int,
    seed: int = 0,
    refresh_batch_size: int | None = None,
    reference: nn.Module | Mapping[str, Tensor] | None = None,
) -> LoopResult:
    """Train a copy of ``model`` for ``steps`` proxy steps of ``selection.policy`` (DESIGN.md §2).

    Args:
        model: the base model (the proxy's start, and RHO-1's); not modified.
        candidates: ``(N, L)`` token ids of the candidate pool, in shard order.
        validation: ``(N_val, L)`` token ids of the validation set.
        selection: the training config's section: γ, W, τ, K, λ, η_w (``ref_lr``; ``None`` = ``optim.lr``), policy...
        optim: the proxy's AdamW settings and gradient clipping.
        batch_size: ``b``, sequences per proxy step (the candidate batch selection runs over).
        steps: proxy steps.
        seed: the candidate stream's seed.
        refresh_batch_size: sequences per validation / candidate batch of a refresh step; ``None`` =
            ``selection.refresh_batch_size`` or ``b // 4`` (at least 1), as the training config resolves it.
        reference: RHO-1's static reference, when it is given instead of trained (``selection.reference_weights``).

    Returns: a :class:`LoopResult`.

    Raises:
        ValueError: on token tensors of the wrong shape or type, ``steps < 1``, or a ``rho1`` run with
            ``selection.reference_weights`` but no ``reference``.
    """
    policy = _checked(candidates, validation, selection, steps, reference)
    schedule = Schedule(selection.warmup_steps, selection.tau, steps)
    stream = CandidateStream(candidates.shape[0], batch_size, seed)
    rb = refresh_batch_size or selection.refresh_batch_size or max(1, batch_size // 4)
    ref_settings = RefreshSettings.of(selection, lr=selection.ref_lr or optim.lr, batch_size=rb, precision="fp32")
    val = _ValidationBatches(validation, rb, selection.seed)
    recent: deque[tuple[Tensor, Tensor]] = deque(maxlen=selection.refresh_candidate_batches)

    u = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(u.parameters(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                            weight_decay=optim.weight_decay)
    out = LoopResult(model=u)
    ref_opt_state: dict[str, Any] | None = None
    ref = _static_reference(model, reference, val, selection, ref_settings, out) \
        if policy.refresh_mode is RefreshMode.STATIC else None  # RHO-1: trained once, a priori, on validation data

    for t in range(steps):
        ids = stream.batch_ids(t)
        tokens = candidates[torch.from_numpy(ids)].long()

        # Reference refresh, before step t = W + eτ: w_0 ← u (or the previous w̃), K steps on L_val + λ L_train.
        if policy.refreshes and schedule.refresh_due(t):
            e = schedule.episode(t)
            start = RefreshStart(previous=ref, optimizer_state=ref_opt_state) \
                if policy.refresh_mode is RefreshMode.CONTINUE else RefreshStart()
            result = policy.refresh(u, val.refresh(e, selection.refresh_steps),
                                    _candidate_batches(recent, tokens, rb, selection.refresh_steps), ref_settings, start)
            ref, ref_opt_state = result.model, result.optimizer_state
            out.refresh_log.append(result.log_entry(step=t, version=e))

        # Score: ℓ(u) from the forward pass the proxy step backpropagates through, Δ = ℓ(u) − ℓ(w̃).
        losses, valid = token_losses(model_logits(u, tokens), tokens)
        if schedule.is_warmup(t):  # warm-up: every valid token, no scores
            alpha = valid
            scores = torch.full(valid.shape, float("nan"))
        else:  # select: top-γ over the whole candidate batch
            alpha, scores = _select(policy, ref, tokens, losses, valid, selection, t, batch_size)

        # Proxy step on the kept tokens: their mean loss Σ α ℓ / Σ α, clipped gradient, AdamW.
        _proxy_step(u, opt, masked_mean(losses, alpha), optim.grad_clip)

        recent.append((tokens, alpha))
        out.record(ids, alpha, scores)
    opt.zero_grad(set_to_none=True)
    out.reference = ref
    return out


# ------------------------------------------------------------------------------------------------
# the loop's steps, named
# ------------------------------------------------------------------------------------------------
def _checked(candidates: Tensor, validation: Tensor, selection: SelectionConfig, steps: int,
             reference: nn.Module | Mapping[str, Tensor] | None) -> SelectionPolicy:
    """:func:`blade_loop`'s inputs checked (its Raises); the policy."""
    for name, t in (("candidates", candidates), ("validation", validation)):
        if t.dim() != 2 or t.dtype.is_floating_point or t.dtype == torch.bool or t.shape[0] == 0:
            raise ValueError(f"{name} must be a non-empty (N, L) integer token tensor, got {t.dtype} {tuple(t.shape)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    policy = get_policy(selection.policy)
    if policy.refresh_mode is RefreshMode.STATIC and selection.reference_weights and reference is None:
        raise ValueError("selection.reference_weights is set: pass its weights as `reference`")
    return policy


def _static_reference(model: nn.Module, reference: nn.Module | Mapping[str, Tensor] | None, val: _ValidationBatches,
                      selection: SelectionConfig, settings: RefreshSettings, out: LoopResult) -> nn.Module:
    """RHO-1's reference: the given one, or ``rho1_steps`` steps from the base model on validation data (logged)."""
    if reference is not None:
        return _module_with(model, reference)
    result = train_static_reference(model, val.static(selection.rho1_steps), settings)
    out.refresh_log.append(result.log_entry(step=0, version=0))
    return result.model


def _select(policy: SelectionPolicy, ref: nn.Module | None, tokens: Tensor, losses: Tensor, valid: Tensor,
            selection: SelectionConfig, t: int, batch_size: int) -> tuple[Tensor, Tensor]:
    """``(α, scores)`` of step ``t``: the policy's top-γ of the whole batch (Δ = ℓ(u) − ℓ(w̃) with a reference)."""
    ref_losses = _reference_losses(ref, tokens, selection.score_batch_size or batch_size) \
        if policy.needs_reference else None
    generator = _step_generator(selection.seed, t) if policy.needs_generator else None
    return policy.select(losses.detach(), valid, selection.gamma, ref_losses=ref_losses, generator=generator)


def _proxy_step(u: nn.Module, opt: torch.optim.Optimizer, loss: Tensor, grad_clip: float) -> None:
    """One AdamW step of the proxy on ``loss`` (the kept tokens' mean), its gradient clipped to ``grad_clip``."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(u.parameters(), max_norm=grad_clip)
    opt.step()


# ------------------------------------------------------------------------------------------------
# helpers: the batches a refresh sees, reference losses, the random policy's generator
# ------------------------------------------------------------------------------------------------
class _ValidationBatches:
    """The validation batches of refresh ``e`` (stream ``seed + 1``) and of RHO-1's reference (``seed + 2``)."""

    def __init__(self, validation: Tensor, rb: int, seed: int) -> None:
        self.validation = validation
        self._refresh = CandidateStream(validation.shape[0], rb, seed + 1)
        self._static = CandidateStream(validation.shape[0], rb, seed + 2)

    def _batches(self, stream: CandidateStream, first: int, count: int) -> Iterator[dict[str, Tensor]]:
        for k in range(first, first + count):
            yield {"tokens": self.validation[torch.from_numpy(stream.batch_ids(k))].long()}

    def refresh(self, episode: int, steps: int) -> Iterator[dict[str, Tensor]]:
        return self._batches(self._refresh, episode * steps, steps)

    def static(self, steps: int) -> Iterator[dict[str, Tensor]]:
        return self._batches(self._static, 0, steps)


def _candidate_batches(recent: deque[tuple[Tensor, Tensor]], current: Tensor, rb: int,
                       steps: int) -> Iterator[dict[str, Tensor]]:
    """``L_train``'s batches: rows ``k·rb .. (k+1)·rb − 1`` (cyclically) of the recent trained batches with
    their masks; before anything was trained, the current batch with every valid token."""
    if recent:
        tokens = torch.cat([tok for tok, _ in recent])
        masks = torch.cat([mask for _, mask in recent])
    else:
        tokens, masks = current, target_valid(current)
    for k in range(steps):
        idx = torch.arange(k * rb, (k + 1) * rb) % tokens.shape[0]
        yield {"tokens": tokens[idx], "mask": masks[idx]}


def _reference_losses(ref: nn.Module | None, tokens: Tensor, score_batch_size: int) -> Tensor:
    """ℓ(w̃) without gradients, ``score_batch_size`` sequences per forward, rounded to float16 (a scored
    shard's precision: every mode scores with these values)."""
    assert ref is not None, "a reference-based policy scores only after its reference exists"
    with torch.no_grad():
        losses = torch.cat([model_token_losses(ref, chunk)[0] for chunk in tokens.split(score_batch_size)])
    if not bool(torch.isfinite(losses).all()):
        raise ValueError("the reference's token loss is not finite: the reference diverged")
    return losses.to(torch.float16)


def _step_generator(seed: int, step: int) -> torch.Generator:
    """The ``random`` policy's generator of step ``step`` (whole batch: row offset 0)."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step, 0]).generate_state(1)[0]))


def _module_with(model: nn.Module, weights: nn.Module | Mapping[str, Tensor]) -> nn.Module:
    if isinstance(weights, nn.Module):
        return weights
    module = copy.deepcopy(model)
    module.load_state_dict(weights, strict=True)
    return module.eval()

