"""A diverging reference stops the run: a refresh whose validation loss ends above a uniform guess (``ln V``), grows
by :data:`GROWTH` over the refresh, or leaves a weight that is not finite.

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

__all__ = ["DivergenceError", "GROWTH", "MARGIN", "BLOWUP", "check_reference"]

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
    for w in weights:
        w = w.to_local() if hasattr(w, "to_local") else w  # (a sharded weight: this rank's shard)
        if w.is_floating_point() and not bool(torch.isfinite(w).all()):
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
