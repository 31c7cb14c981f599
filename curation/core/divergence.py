"""A diverging reference stops the run: a refresh whose validation loss ends above a uniform guess (``ln V``), grows
by :data:`GROWTH` over the refresh, or leaves a weight that is not finite. A diverging proxy stops it too: a training
loss that is not finite, or above ``ln V`` by :data:`MARGIN` for :data:`PATIENCE` steps in a row
(:func:`check_proxy`).

Such a reference scores every token as equally learnable (or as nothing at all): selection goes on silently with
meaningless scores (issue 32: ``selection.ref_lr=1e3`` ran to the end, the reference's largest weight at 7.9e5, its
validation loss the uniform ``ln V``). The check is pure (losses and tensors in, :class:`DivergenceError` out); the
trainer reports the error as one line naming the setting to change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["DivergenceError", "GROWTH", "MARGIN", "BLOWUP", "PATIENCE", "check_reference", "check_proxy"]

#: The factor by which a refresh's validation loss may grow from its first step to its last before the reference
#: counts as diverged (a refresh of K AdamW steps lowers it, or keeps it level between batches).
GROWTH = 1.25

#: How far (nats) above ``ln V`` the loss may end: a freshly initialised model sits a little above a uniform guess
#: (random logits), and a refresh of one may nudge it up; a diverged one lands far above (or collapses to uniform
#: from a lower start, which :data:`GROWTH` catches).
MARGIN = 0.5

#: A loss within the refresh above this many times its start is a blow-up even when the refresh ends lower (a
#: diverged reference often jumps, then collapses to the uniform guess); a sound refresh may rise a little first.
BLOWUP = 4.0


#: Steps in a row the proxy's training loss may sit above ``ln V + MARGIN`` before the run stops: one noisy batch (or
#: the first steps of a model that starts far from the data) is not a divergence; a proxy that stays worse than a
#: uniform guess is (``optim.lr=1e3`` sends it there within a few steps and keeps it there).
PATIENCE = 5


class DivergenceError(ValueError):
    """The reference diverged in a refresh; the message names what was seen and the setting to change."""


def check_reference(val_losses: Sequence[float], weights: Iterable[Tensor], *, vocab_size: int | None,
                    lr: float, setting: str = "selection.ref_lr") -> None:
    """Raise :class:`DivergenceError` when the refresh that measured ``val_losses`` (before each of its steps) and
    left ``weights`` diverged: a loss or a weight not finite, a loss within it above :data:`BLOWUP` times the
    first, or the last one more than :data:`MARGIN` above ``ln vocab_size`` (a uniform guess over the vocabulary)
    or above :data:`GROWTH` times the first. ``lr`` and ``setting``: the learning rate used and
    the config key that sets it (named in the message)."""
    fix = f"lower {setting} (now {lr:g})"
    losses = [float(v) for v in val_losses]
    if any(not math.isfinite(v) for v in losses):
        raise DivergenceError(f"the reference diverged in a refresh: its validation loss became {losses[-1]}; {fix}")
    local = [w.to_local() if hasattr(w, "to_local") else w for w in weights]  # (a sharded weight: this rank's shard)
    finite = [torch.isfinite(w).all() for w in local if w.is_floating_point() and w.numel()]
    if finite and not bool(torch.stack([f.to(finite[0].device) for f in finite]).all()):  # one read for all weights
        raise DivergenceError(f"the reference diverged in a refresh: its weights are no longer finite; {fix}")
    if len(losses) < 2:
        return
    first, last, worst = losses[0], losses[-1], max(losses[1:])
    uniform = math.log(vocab_size) if vocab_size else math.inf
    if worst > BLOWUP * first:
        why, seen = f"more than {BLOWUP}× its start", worst
    elif last > uniform + MARGIN:
        why, seen = f"above ln V = {uniform:.3f}, a uniform guess over the {vocab_size} ids", last
    elif last > GROWTH * first:
        why, seen = f"more than {GROWTH}× its start", last
    else:
        return
    raise DivergenceError(f"the reference diverged in a refresh: its validation loss went from {first:.3f} to "
                          f"{seen:.4g} in {len(losses)} steps ({why}); {fix}")


def check_proxy(recent_losses: Iterable[float] | Sequence[float], *, vocab_size: int | None, lr: float, setting: str = "optim.lr") -> None:
    """Raise :class:`DivergenceError` when the proxy diverged: the last of ``recent_losses`` (its training loss at
    each step, oldest first) is not finite, or the last :data:`PATIENCE` of them are all more than :data:`MARGIN`
    above ``ln vocab_size``. ``lr`` and ``setting``: the proxy's learning rate and the key that sets it."""
    recent_losses = list(recent_losses)
    if not recent_losses:
        return
    fix = f"lower {setting} (now {lr:g})"
    last = float(recent_losses[-1])
    if not math.isfinite(last):
        raise DivergenceError(f"the proxy diverged: its training loss became {last}; {fix}")
    if not vocab_size or len(recent_losses) < PATIENCE:
        return
    uniform = math.log(vocab_size)
    window = [float(v) for v in list(recent_losses)[-PATIENCE:]]
    if min(window) > uniform + MARGIN:
        raise DivergenceError(f"the proxy diverged: its training loss stayed above ln V = {uniform:.3f} (a uniform "
                              f"guess over the {vocab_size} ids) for {PATIENCE} steps, at {last:.4g}; {fix}")
