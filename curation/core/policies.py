"""Selection policies behind one interface (docs/DESIGN.md §2).

A policy decides only two things: the *scores* of a candidate batch, and *whether and how the
reference is refreshed*. Selection itself always goes through
:func:`curation.core.selection.select_top_fraction`:

============== ======================= =====================================================
name           scores                  reference
============== ======================= =====================================================
full           0 (γ forced to 1)       none: every valid token is kept (Base-CT)
random         uniform, seeded         none: a uniform γ-subset of the valid tokens
rho1           ℓ(u) − ℓ(w̃)            static: trained once a priori, never refreshed
blade          ℓ(u) − ℓ(w̃)            sync: every τ steps, ``w_0 ← u`` then K steps
blade-nosync   ℓ(u) − ℓ(w̃)            continue: every τ steps, K more steps from the
                                        previous reference (from ``u`` the first time)
============== ======================= =====================================================

Pure torch: no ray, no composer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from curation.core.refresh import (
    FROM_PROXY,
    RefreshResult,
    RefreshSettings,
    RefreshStart,
    refresh_reference,
    train_static_reference,
)
from curation.core.selection import check_gamma, excess_loss, random_scores, select_top_fraction

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "RefreshMode",
    "ScoreKind",
    "SelectionPolicy",
    "get_policy",
    "train_static_reference",
]


class ScoreKind(StrEnum):
    """What a policy's scores are made of."""

    NONE = "none"  # constant scores, everything valid kept
    RANDOM = "random"  # uniform random scores from a seeded generator
    EXCESS_LOSS = "excess_loss"  # Δ = ℓ(u) − ℓ(w̃)


class RefreshMode(StrEnum):
    """How (and whether) a policy's reference model is produced and refreshed."""

    NONE = "none"  # no reference model at all
    STATIC = "static"  # trained once a priori on validation data (train_static_reference)
    SYNC = "sync"  # every τ steps: w_0 ← u, then K steps (BLADE)
    CONTINUE = "continue"  # every τ steps: K more steps from the previous reference (ablation)


@dataclass(frozen=True)
class SelectionPolicy:
    """One selection policy; see the module docstring for the table of policies.

    Attributes:
        name: registry name (``full``, ``random``, ``rho1``, ``blade``, ``blade-nosync``).
        score_kind: what the scores are.
        refresh_mode: how the reference is produced and refreshed.
    """

    name: str
    score_kind: ScoreKind
    refresh_mode: RefreshMode

    @property
    def needs_reference(self) -> bool:
        """Whether scoring needs reference losses ``ℓ(w̃)``."""
        return self.score_kind is ScoreKind.EXCESS_LOSS

    @property
    def refreshes(self) -> bool:
        """Whether the reference is refreshed every τ steps (``blade``, ``blade-nosync``)."""
        return self.refresh_mode in (RefreshMode.SYNC, RefreshMode.CONTINUE)

    @property
    def needs_generator(self) -> bool:
        """Whether scoring needs a seeded ``torch.Generator`` (``random``)."""
        return self.score_kind is ScoreKind.RANDOM

    def effective_gamma(self, gamma: float) -> float:
        """The γ actually used: 1 for ``full``, ``gamma`` otherwise."""
        return 1.0 if self.score_kind is ScoreKind.NONE else gamma

    def scores(
        self,
        proxy_losses: Tensor,
        ref_losses: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Scores of a candidate batch (higher is kept first), float32, shape of ``proxy_losses``.

        Args:
            proxy_losses: ``ℓ(u)`` per position.
            ref_losses: ``ℓ(w̃)`` per position; required by ``rho1``/``blade``/``blade-nosync``.
            generator: seeded generator; required by ``random``.

        Raises:
            ValueError: when a required input is missing.
        """
        if self.score_kind is ScoreKind.NONE:
            return torch.zeros(proxy_losses.shape, dtype=torch.float32, device=proxy_losses.device)
        if self.score_kind is ScoreKind.RANDOM:
            if generator is None:
                raise ValueError(f"policy {self.name!r} needs a seeded torch.Generator")
            return random_scores(proxy_losses.shape, generator).to(proxy_losses.device)
        if ref_losses is None:
            raise ValueError(f"policy {self.name!r} needs reference losses (ref_losses)")
        return excess_loss(proxy_losses, ref_losses)

    def select(
        self,
        proxy_losses: Tensor,
        valid: Tensor,
        gamma: float,
        *,
        ref_losses: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Score a candidate batch and keep its top-γ valid tokens (all valid ones for ``full``).

        Args:
            proxy_losses: ``ℓ(u)`` per position, ``(b, L)``.
            valid: validity of the loss positions.
            gamma: fraction to keep, in (0, 1] (validated even for ``full``).
            ref_losses: ``ℓ(w̃)``, for the excess-loss policies.
            generator: for ``random``.

        Returns:
            ``(mask, scores)``: the boolean selection α and the scores it was computed from.
        """
        scores = self.scores(proxy_losses, ref_losses, generator=generator)
        check_gamma(gamma)  # a bad γ is an error even for `full`, which ignores it
        return select_top_fraction(scores, valid, self.effective_gamma(gamma)), scores

    def refresh(
        self,
        proxy: nn.Module,
        val_batches: Iterable[Any],
        cand_batches: Iterable[Any] | None,
        settings: RefreshSettings,
        start: RefreshStart = FROM_PROXY,
    ) -> RefreshResult:
        """Refresh the reference as this policy prescribes (``blade`` / ``blade-nosync`` only).

        ``blade`` restarts from the proxy (``start``'s ``previous`` and ``optimizer_state`` are ignored: each
        episode's reference gets a fresh optimizer). ``blade-nosync`` continues from ``start.previous``
        (module or state dict) and its ``optimizer_state``; the first time (``previous=None``) it
        starts from the proxy. ``settings`` and the rest of ``start`` go to
        :func:`~curation.core.refresh.refresh_reference` as they are.

        Raises:
            ValueError: for policies that are never refreshed.
        """
        if self.refresh_mode is RefreshMode.SYNC:
            return refresh_reference(proxy, val_batches, cand_batches, settings, start.from_proxy())
        if self.refresh_mode is RefreshMode.CONTINUE:
            return refresh_reference(proxy, val_batches, cand_batches, settings,
                                     start if start.previous is not None else start.from_proxy())
        raise ValueError(
            f"policy {self.name!r} has refresh mode {self.refresh_mode.value!r}: its reference is never refreshed"
        )


POLICIES: Mapping[str, SelectionPolicy] = MappingProxyType(
    {
        p.name: p
        for p in (
            SelectionPolicy("full", ScoreKind.NONE, RefreshMode.NONE),
            SelectionPolicy("random", ScoreKind.RANDOM, RefreshMode.NONE),
            SelectionPolicy("rho1", ScoreKind.EXCESS_LOSS, RefreshMode.STATIC),
            SelectionPolicy("blade", ScoreKind.EXCESS_LOSS, RefreshMode.SYNC),
            SelectionPolicy("blade-nosync", ScoreKind.EXCESS_LOSS, RefreshMode.CONTINUE),
        )
    }
)
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def get_policy(name: str | SelectionPolicy) -> SelectionPolicy:
    """Look a policy up by name (a :class:`SelectionPolicy` is returned unchanged).

    Raises:
        ValueError: for an unknown name, listing the valid ones.
    """
    if isinstance(name, SelectionPolicy):
        return name
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown selection policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        ) from None
