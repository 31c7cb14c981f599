"""Excess-loss scores, top-γ token selection (the Frank–Wolfe LMO of docs/DESIGN.md §2) and the
masked proxy objective.

``select_top_fraction`` is the only selection code path: every policy (``full``, ``random``,
``rho1``, ``blade``, ``blade-nosync``) produces scores and calls it.

Pure torch: no ray, no composer.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from curation.core.host_sync import queues

__all__ = [
    "check_gamma",
    "excess_loss",
    "masked_mean",
    "num_selected",
    "random_scores",
    "select_top_fraction",
]


def excess_loss(proxy_losses: Tensor, ref_losses: Tensor) -> Tensor:
    """Score ``Δ = ℓ(u) − ℓ(w̃)`` in float32.

    High where the proxy ``u`` is still bad and the reference ``w̃`` is good: those tokens are kept.

    Args:
        proxy_losses: per-token losses of the proxy, any floating dtype.
        ref_losses: per-token losses of the reference, same shape (e.g. float16 from a scored shard).

    Returns:
        float32 tensor of the broadcast shape.
    """
    if proxy_losses.shape != ref_losses.shape:
        raise ValueError(
            f"proxy_losses {tuple(proxy_losses.shape)} and ref_losses {tuple(ref_losses.shape)} differ in shape"
        )
    return proxy_losses.float() - ref_losses.to(device=proxy_losses.device, dtype=torch.float32)


def check_gamma(gamma: float) -> float:
    """Validate γ: a real number in (0, 1]. Returns it as a float.

    Raises:
        TypeError: if ``gamma`` is not a real number.
        ValueError: if it is outside (0, 1] (or NaN); the message names the value.
    """
    if isinstance(gamma, bool) or not isinstance(gamma, Real):
        raise TypeError(f"gamma must be a real number in (0, 1], got {gamma!r}")
    g = float(gamma)
    if not (0.0 < g <= 1.0):  # also rejects NaN
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
    return g


def num_selected(gamma: float, n_valid: int) -> int:
    """Number of tokens kept out of ``n_valid``: ``k = round(γ · n_valid)``, at least 1.

    Rounding is *half up*, ``floor(γ · n + 0.5)`` (not Python's banker's ``round``), applied to
    the float product: ``γ = 0.5`` keeps 3 of 5 tokens. When ``n_valid > 0`` at least one token
    is kept; when ``n_valid == 0`` none is.

    Raises:
        ValueError: if ``gamma`` is outside (0, 1] or ``n_valid < 0``.
    """
    g = check_gamma(gamma)
    if n_valid < 0:
        raise ValueError(f"n_valid must be >= 0, got {n_valid}")
    if n_valid == 0:
        return 0
    return min(n_valid, max(1, math.floor(g * n_valid + 0.5)))


def random_scores(shape: torch.Size | tuple[int, ...], generator: torch.Generator,
                  device: torch.device | None = None) -> Tensor:
    """Uniform random scores in [0, 1) drawn from ``generator`` (the ``random`` policy).

    Drawn on the generator's device (``device``: the device of the batch, of the generator's type; a CPU
    generator's draw stays on the CPU unless ``device`` is a CPU device too), so a CPU generator gives the same
    scores whatever device the batch lives on. Top-γ of these is a uniformly random γ-subset of the valid tokens.
    """
    on = device if device is not None and torch.device(device).type == generator.device.type else generator.device
    return torch.rand(tuple(shape), generator=generator, device=on, dtype=torch.float32)


def select_top_fraction(
    scores: Tensor | None,
    valid: Tensor | None,
    gamma: float,
    generator: torch.Generator | None = None,
    *,
    sync: bool | None = None,
) -> Tensor:
    """Keep the top-γ valid positions of the whole batch by score (Frank–Wolfe LMO, η_α = 1).

    Exactly ``k = num_selected(gamma, valid.sum())`` valid positions are kept: those with the
    largest scores, ties broken by lower flat (row-major) index. Invalid positions are never kept
    and their scores are not read (they may be NaN). The result is the minimiser of
    ``⟨−scores, α⟩`` over ``{α ∈ {0, 1}^N : Σα = k, α = 0 off valid}``, i.e. with
    ``scores = ℓ(u) − ℓ(w̃)`` the LMO ``argmin ⟨ℓ(w̃) − ℓ(u), α⟩`` of docs/DESIGN.md §2.

    Runs in O(N) (one ``kthvalue`` + elementwise ops), with no Python loop over tokens. That path reads
    three numbers on the host (the non-finite check, ``#valid`` and the count above the threshold), which on
    a GPU are three synchronisations (≈ 0.1 ms each, whatever the size). With ``sync=False`` (the default
    off the CPU) the same mask is computed without any: ``k`` stays on the device and the kept positions are
    the first ``k`` of a stable descending sort (O(N log N) on the device, ties in flat order as above); the
    non-finite check is then an asynchronous device assertion (an internal invariant: the callers check
    ℓ(u) and ℓ(w̃) before selecting), which on CUDA fails at the next synchronisation.

    Args:
        scores: scores of any shape (floating; low precision is upcast to float32, exactly), or
            ``None`` to draw uniform random scores from ``generator`` (the ``random`` policy).
        valid: boolean mask of the same shape; ``None`` means every position is valid.
        gamma: fraction to keep, in (0, 1].
        generator: only with ``scores=None``: the seeded generator random scores come from.
        sync: ``True``: the ``kthvalue`` path (host reads); ``False``: the synchronisation-free path;
            ``None``: ``False`` where the device queues its work (:func:`~curation.core.host_sync.queues`: CUDA),
            ``True`` elsewhere (a CPU). Both give the same mask.

    Returns:
        Boolean mask of the shape of ``valid`` (or ``scores``), on the same device.

    Raises:
        ValueError: if ``gamma`` is outside (0, 1], if a valid position has a non-finite score
            (the message names the value and its position), or on shape mismatch.
        TypeError: if ``valid`` is not boolean, or ``generator`` is given together with scores.
    """
    g = check_gamma(gamma)
    scores, valid = _checked(scores, valid, generator)
    s = scores.reshape(-1)
    if s.dtype not in (torch.float32, torch.float64):
        s = s.float()  # exact for fp16/bf16, so the order (and ties) is unchanged
    v = valid.reshape(-1).to(s.device)
    bad = v & ~torch.isfinite(s)
    if sync is None:
        sync = not queues(s.device)
    if not sync:
        torch._assert_async(~bad.any(), "select_top_fraction: non-finite score at a valid position")
        return _top_k_without_sync(s, v, g).view(valid.shape)
    if bool(bad.any()):
        flat = int(bad.nonzero()[0, 0])
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), scores.shape))
        raise ValueError(
            f"non-finite score {float(s[flat])} at valid position {pos} (scores shape {tuple(scores.shape)}); "
            "check the proxy and reference losses"
        )
    return _top_k_with_sync(s, v, g).view(valid.shape)


def _checked(scores: Tensor | None, valid: Tensor | None, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """:func:`select_top_fraction`'s scores (drawn from ``generator`` when ``None``) and valid mask (all of them when
    ``None``), checked (its Raises)."""
    if scores is None:
        if generator is None:
            raise TypeError("select_top_fraction needs scores, or scores=None with a generator")
        if valid is None:
            raise TypeError("select_top_fraction with scores=None needs the valid mask (for the shape)")
        scores = random_scores(valid.shape, generator).to(valid.device)
    elif generator is not None:
        raise TypeError("generator is only used to draw random scores: pass scores=None with it")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"scores must be floating point, got {scores.dtype}")
    if valid is None:
        valid = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor, got {valid.dtype}")
    if valid.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and valid {tuple(valid.shape)} differ in shape")
    return scores, valid


def _top_k_with_sync(s: Tensor, v: Tensor, gamma: float) -> Tensor:
    """The flat top-k mask of :func:`select_top_fraction` by one ``kthvalue`` (``k`` and the ties read on the host);
    ``s`` finite at the valid positions ``v``."""
    n_valid = int(v.sum())
    k = num_selected(gamma, n_valid)
    if k == 0:
        return torch.zeros(s.shape, dtype=torch.bool, device=s.device)
    if k == n_valid:
        return v.clone()
    # Invalid positions sort below every (finite) valid score, and k <= n_valid, so they are never
    # reached. The k-th largest key is the threshold; everything above it is kept, and of the keys
    # equal to it, the first (k - #above) in flat order.
    key = torch.where(v, s, torch.full((), -math.inf, dtype=s.dtype, device=s.device))
    threshold = key.kthvalue(key.numel() - k + 1).values
    above = key > threshold
    at = key == threshold
    need = k - int(above.sum())
    return above | (at & (torch.cumsum(at, 0) <= need))


def _top_k_without_sync(s: Tensor, v: Tensor, gamma: float) -> Tensor:
    """The mask of :func:`select_top_fraction` with no host synchronisation (flat ``s``, ``v``).

    ``k = num_selected(γ, #valid)`` computed on the device (float64, half up, at least 1 when anything is
    valid, at most ``#valid``); then the positions whose rank in a stable descending sort of the scores
    (invalid ones at −∞, so after every valid one) is below ``k``: the largest scores, ties in flat order.
    """
    n_valid = v.sum()
    k = torch.floor(n_valid.double() * gamma + 0.5).clamp(min=1).minimum(n_valid.double())
    key = torch.where(v, s, torch.full((), -math.inf, dtype=s.dtype, device=s.device))
    order = torch.sort(key, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return (rank < k) & v


def masked_mean(losses: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``losses`` over the kept positions: ``Σ α ℓ / Σ α`` (the proxy objective).

    ``mask`` may be boolean (α ∈ {0, 1}) or floating weights (α ∈ [0, 1]). Unkept positions are
    excluded with ``torch.where``, so NaN/inf there does not leak into the value or the gradient.
    Accumulates in float32.

    When nothing is kept (``Σ α = 0``) the result is a 0 that is still connected to the graph of
    ``losses``: ``backward()`` works and gives zero gradients (a step on an empty selection is a
    no-op for plain SGD). No host synchronisation.

    Args:
        losses: per-token losses.
        mask: α of the same shape.

    Returns:
        0-dim float32 tensor.
    """
    if mask.shape != losses.shape:
        raise ValueError(f"losses {tuple(losses.shape)} and mask {tuple(mask.shape)} differ in shape")
    losses = losses.float()
    mask = mask.to(losses.device)
    if mask.dtype == torch.bool:
        keep, weights = mask, mask.float()
    else:
        weights = mask.float()
        keep = weights != 0
    zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
    num = (torch.where(keep, losses, zero) * weights).sum()
    den = weights.sum()
    return num / torch.where(den > 0, den, torch.ones_like(den))
