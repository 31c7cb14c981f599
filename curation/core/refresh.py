"""Reference refresh (BLADE's inner problem) and the RHO-1 static reference (docs/DESIGN.md §2).

``refresh_reference`` starts from a *copy* of the proxy ``u`` (synchronisation, ``w_0 ← u``), or of
the previous reference for the ``blade-nosync`` ablation, and takes ``K`` AdamW steps on

    L_val(w) + λ · L_train(α, w),

where ``L_val`` is the mean token loss on a validation batch and ``L_train`` the α-masked mean
loss on a recent candidate batch with its current selection. ``train_static_reference`` is the same
loop with ``λ = 0`` started from the base model (RHO-1's reference, trained once a priori). Both take the
run's :class:`RefreshSettings` (``K``, ``λ``, the reference AdamW's settings, clipping, precision; the paper's
defaults) as one object, and only the models and batches of the call besides.

The proxy and its optimizer are never touched: the reference is a copy with its own AdamW. A caller
that refreshes repeatedly passes a :class:`RefreshWorkspace`: the reference module and its AdamW are
then built once and reused, refresh after refresh (``w_0`` copied into the same parameters on the same
device, the AdamW moments zeroed in place), which gives the same values as a fresh copy and a fresh
optimizer without allocating a model and its optimizer state per refresh.

Pure torch: no ray, no composer.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from curation.core.divergence import check_reference
from curation.core.host_sync import queues
from curation.core.losses import TokenBatch, as_token_batch
from curation.core.refresh_losses import joint_losses, mean_loss

if TYPE_CHECKING:  # (types only: the core imports nothing of schemas at run time)
    from schemas.train_config import SelectionConfig

#: Builds a module equal to a given one (``copy.deepcopy``; a sharded model: :func:`training.blocks.sharding.sharded_clone`).
Clone = Callable[[nn.Module], nn.Module]

__all__ = [
    "CONTINUE",
    "FROM_PROXY",
    "RefreshResult",
    "RefreshSettings",
    "RefreshStart",
    "RefreshWorkspace",
    "copy_buffers",
    "joint_forward_on",
    "refresh_reference",
    "train_static_reference",
]


@dataclass(frozen=True)
class RefreshSettings:
    """The settings of every refresh of a run (the defaults are the paper's; see ``schemas.train_config``).

    Attributes:
        seed: the selection seed (the validation batches' streams are seeded from it).
        refresh_steps: ``K``, AdamW steps per refresh.
        lam: ``λ``, the weight of ``L_train(α, w)``.
        lr: ``η_w``.
        weight_decay: the reference AdamW's weight decay.
        betas: the reference AdamW's betas.
        eps: the reference AdamW's epsilon.
        grad_clip: max total gradient norm (``None`` or ``0``: no clipping).
        rho1_steps: steps of RHO-1's static reference.
        batch_size: rows per validation and per candidate batch of a refresh step.
        precision: ``fp32`` / ``amp_bf16`` of the refresh's forward passes (bf16 autocast on CUDA; float32 on a CPU).
        joint_forward: a refresh step's validation and candidate rows in one forward (stacked, when their lengths
            match) instead of two; ``None``: on a GPU only. The losses are the same sums over the same rows; a GPU
            runs a small refresh batch at the host's pace (on an H200 a refresh cost about the same at rb = 2 and
            rb = 8, ~0.6 s for K = 6), so one forward fewer per step is a third less host work. On a CPU the
            forwards are compute-bound and stay separate (bit for bit as before). ``selection.refresh_joint_forward``.

    Raises:
        ValueError: a step count that is not an int >= 0, ``lr <= 0``, ``lam < 0`` or ``grad_clip < 0``.
    """

    seed: int = 0
    refresh_steps: int = 3
    lam: float = 1.0
    lr: float = 8e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    rho1_steps: int = 0
    batch_size: int = 4
    precision: str = "fp32"
    joint_forward: bool | None = None

    def __post_init__(self) -> None:
        for name in ("refresh_steps", "rho1_steps"):
            steps = getattr(self, name)
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                raise ValueError(f"{name} must be an int >= 0, got {steps!r}")
        if not self.lr > 0:
            raise ValueError(f"lr (η_w) must be > 0, got {self.lr!r}")
        if not self.lam >= 0:
            raise ValueError(f"lam (λ) must be >= 0, got {self.lam!r}")
        if self.grad_clip is not None and not self.grad_clip >= 0:
            raise ValueError(f"grad_clip must be >= 0 or None, got {self.grad_clip!r}")

    @classmethod
    def of(cls, selection: SelectionConfig, *, lr: float, batch_size: int, precision: str) -> RefreshSettings:
        """The refresh settings of a run's selection config, with the values resolved from the rest of its
        config (``TrainConfig.ref_lr``, ``TrainConfig.refresh_batch_size``, ``precision``)."""
        return cls(seed=selection.seed, refresh_steps=selection.refresh_steps, lam=selection.lam, lr=lr,
                   weight_decay=selection.ref_weight_decay, grad_clip=selection.ref_grad_clip,
                   rho1_steps=selection.rho1_steps, batch_size=batch_size, precision=precision,
                   joint_forward=selection.refresh_joint_forward)


def reference_adamw(params: list[Tensor], **settings: Any) -> torch.optim.AdamW:
    """The reference's AdamW over ``params``: fused (one kernel for every tensor) on a GPU (``host_sync.queues``),
    torch's default on a CPU (the bit-exact oracle tests)."""
    return torch.optim.AdamW(params, **settings, fused=True if params and queues(params[0].device) else None)


def joint_forward_on(setting: bool | None, device: torch.device) -> bool:
    """Whether a refresh on ``device`` runs its steps' validation and candidate rows in one forward
    (:attr:`RefreshSettings.joint_forward`; ``None``: on a GPU only)."""
    return queues(device) if setting is None else setting


@dataclass
class RefreshResult:
    """Outcome of :func:`refresh_reference` / :func:`train_static_reference`.

    Attributes:
        model: the new reference ``w̃`` (its own module, or the workspace's when one was given; in eval
            mode, no gradients kept).
        optimizer_state: the reference AdamW ``state_dict()`` after the last step, to carry into the
            next refresh (``blade-nosync``) or to checkpoint.
        val_losses: ``L_val(w)`` before each step (length ``K``).
        train_losses: ``L_train(α, w)`` before each step (length ``K``; empty when ``λ = 0``).
        objectives: ``L_val + λ L_train`` before each step (length ``K``).
        grad_norms: total gradient norm before clipping at each step (length ``K``).
    """

    model: nn.Module
    optimizer_state: dict[str, Any]
    val_losses: list[float] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    objectives: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Number of optimizer steps taken (``K``)."""
        return len(self.objectives)

    def log_entry(self, *, step: int, version: int) -> dict[str, Any]:
        """The run log's record of this refresh (first/last validation loss and objective)."""
        return {
            "step": step, "version": version, "steps": self.steps,
            "val_loss_first": self.val_losses[0] if self.val_losses else None,
            "val_loss_last": self.val_losses[-1] if self.val_losses else None,
            "objective_first": self.objectives[0] if self.objectives else None,
            "objective_last": self.objectives[-1] if self.objectives else None,
        }

    def state_dict(self) -> dict[str, Tensor]:
        """The reference weights (``model.state_dict()``)."""
        return self.model.state_dict()


#: ``optimizer_state`` value that continues the workspace's AdamW as the last refresh left it (``blade-nosync``).
CONTINUE = "continue"


class RefreshWorkspace:
    """The reference module and AdamW a refresh reuses (see the module docstring).

    Holds at most one model and one optimizer; the model built by the first refresh is returned in
    every :class:`RefreshResult` (the caller must not keep a previous result's model as a different
    reference: it is overwritten by the next refresh).

    Args:
        keep_optimizer_state: keep the AdamW moments between refreshes (``blade-nosync`` continues them:
            ``optimizer_state=CONTINUE``). Otherwise (``blade``: a fresh optimizer every refresh) they are released
            after each refresh, so that between refreshes the reference costs its weights only, not three times them.
    """

    def __init__(self, *, keep_optimizer_state: bool = False) -> None:
        self.keep_optimizer_state = keep_optimizer_state
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.AdamW | None = None
        self._parked: list[tuple[Tensor, torch.Size]] = []  # the module's tensors and shapes while parked

    def start(self, proxy: nn.Module, previous: nn.Module | Mapping[str, Tensor] | None,
              clone: Clone = copy.deepcopy) -> nn.Module:
        """``w_0`` in the reused module, on the proxy's device: the proxy's weights, or ``previous``'s
        (``clone`` builds the module the first time). A module :meth:`park`-ed or moved to the host in between
        comes back without being rebuilt: ``previous`` being the module itself is moved back as it is (its
        weights are ``w_0``), otherwise its memory is allocated again and ``w_0`` copied in."""
        source = previous if previous is not None else proxy
        device = next(proxy.parameters()).device
        if self.model is None:
            built = clone(source) if isinstance(source, nn.Module) else _copy_with(proxy, source, clone)
            self.model = built.to(device)
            return self.model
        if source is self.model:
            return self.model.to(device)
        if self._parked or next(self.model.parameters()).device != device:
            self._allocate(device)  # w_0 is copied in below
            copy_buffers(self.model, proxy)
        state = source.state_dict() if isinstance(source, nn.Module) else source
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                t.copy_(state[name])  # (sharded: DTensor to DTensor, shard by shard)
        return self.model

    def park(self, *, weights: bool) -> None:
        """Between refreshes, keep the module and its AdamW (the next refresh rebuilds neither) but release their
        memory: the AdamW moments always (``blade`` starts afresh; ``blade-nosync``'s caller keeps a copy), and
        the weights too with ``weights`` (the caller keeps what it needs of them): every tensor of the module
        keeps its object (the optimizer holds the parameters) but gives up its storage."""
        if self.optimizer is not None:
            self.optimizer.state.clear()
        if weights and self.model is not None:
            for t in self._tensors():
                self._parked.append((t, t.shape))
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def _tensors(self) -> list[Tensor]:
        assert self.model is not None
        return [*self.model.parameters(), *self.model.buffers()]  # tied weights once

    def _allocate(self, device: torch.device) -> None:
        """Storage for every tensor of the module on ``device`` (uninitialised), in the same tensor objects."""
        shapes = self._parked or [(t, t.shape) for t in self._tensors()]
        for t, shape in shapes:
            t.data = torch.empty(shape, dtype=t.dtype, device=device)
        self._parked = []

    def adamw(self, params: list[Tensor], state: Mapping[str, Any] | str | None, **settings: Any) -> torch.optim.AdamW:
        """The AdamW over ``params`` (built once, reused while the parameters are the same objects), with ``settings``:

        * ``state=None``: in its initial state (moments and step counts zeroed in place when reused);
        * ``state=CONTINUE``: as the last refresh left it (a parked optimizer has released its moments: fresh);
        * a state dict: that state loaded; the optimizer takes its tensors (no copy).
        """
        opt = self.optimizer
        held = [p for g in opt.param_groups for p in g["params"]] if opt is not None else []
        if opt is None or len(held) != len(params) or any(a is not b for a, b in zip(held, params, strict=True)):
            self.optimizer = opt = reference_adamw(params, **settings)
        if isinstance(state, Mapping):
            opt.load_state_dict(state)
        elif state is None:
            for values in opt.state.values():
                for value in values.values():
                    if isinstance(value, Tensor):
                        value.zero_()
        elif state != CONTINUE:
            raise ValueError(f"optimizer_state must be a state dict, {CONTINUE!r} or None, got {state!r}")
        for group in opt.param_groups:
            group.update(settings)
        return opt


@dataclass(frozen=True, eq=False)
class RefreshStart:
    """The start state of a refresh: where ``w_0`` and its AdamW come from and what the refresh reuses. One object
    for every refresh call (:func:`refresh_reference`, :meth:`SelectionPolicy.refresh
    <curation.core.policies.SelectionPolicy.refresh>`, :meth:`RefreshData.refresh
    <curation.core.refresh_data.RefreshData.refresh>`), built by the caller that owns the reference (the
    single-process trainer's :class:`~training.selection.reference.InProcessReference`, the engine's
    :class:`~curation.engine.refresh_runner.RefreshRunner`); the policy decides what of it a refresh uses
    (:meth:`from_proxy`).

    Attributes:
        previous: start from these weights (module or state dict) instead of the proxy's (``blade-nosync``).
        optimizer_state: the AdamW state to resume from, or :data:`CONTINUE` (needs ``workspace``).
        workspace: the reference module and AdamW reused refresh after refresh (built on first use).
        clone: builds ``w_0``'s module from the proxy (or ``previous``); a sharded proxy needs
            :func:`training.blocks.sharding.sharded_clone`.
    """

    previous: nn.Module | Mapping[str, Tensor] | None = None
    optimizer_state: Mapping[str, Any] | str | None = None
    workspace: RefreshWorkspace | None = None
    clone: Clone = copy.deepcopy

    def from_proxy(self) -> RefreshStart:
        """The same start from the proxy: no previous weights, a fresh AdamW (the workspace and clone kept)."""
        return dataclasses.replace(self, previous=None, optimizer_state=None)


#: The default start: from the proxy, a fresh AdamW, new modules.
FROM_PROXY = RefreshStart()


def copy_buffers(dst: nn.Module, src: nn.Module) -> None:
    """Copy every buffer of ``src`` into ``dst``'s buffer of the same name, the non-persistent ones (e.g. rotary
    frequencies, which no state dict holds) included."""
    theirs = dict(src.named_buffers())
    with torch.no_grad():
        for name, b in dst.named_buffers():
            b.copy_(theirs[name])


def _copy_with(proxy: nn.Module, weights: Mapping[str, Tensor], clone: Clone = copy.deepcopy) -> nn.Module:
    ref = clone(proxy)
    ref.load_state_dict(weights)
    return ref


def _next_batch(it: Iterator[Any], what: str, step: int, steps: int) -> TokenBatch:
    try:
        return as_token_batch(next(it))
    except StopIteration:
        raise ValueError(f"{what} ran out after {step} of {steps} refresh steps") from None


def _read_logged(result: RefreshResult, logged: dict[str, list[Tensor]], device: torch.device) -> None:
    """Fill ``result``'s per-step lists from the device tensors the steps left, in one device→host read."""
    flat = [t.detach().to(device=device, dtype=torch.float32).reshape(()) for ts in logged.values() for t in ts]
    values = torch.stack(flat).tolist() if flat else []
    i = 0
    for name, ts in logged.items():
        getattr(result, name).extend(values[i:i + len(ts)])
        i += len(ts)


def _vocab_size(model: nn.Module) -> int | None:
    """The ids an HF causal LM predicts over (its output embedding's rows); None for another module."""
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    weight = getattr(out, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else None


def _start_module(proxy: nn.Module, start: RefreshStart) -> nn.Module:
    """``w_0`` of :func:`refresh_reference` (a copy of ``proxy``, or its architecture with ``start.previous``'s
    weights; in ``start.workspace``'s module when given), zero gradients, in train mode."""
    previous, workspace, clone = start.previous, start.workspace, start.clone
    if workspace is not None:
        ref = workspace.start(proxy, previous, clone)
        for p, q in zip(ref.parameters(), proxy.parameters(), strict=True):  # it may have been frozen for scoring
            p.requires_grad_(q.requires_grad)
    elif isinstance(previous, nn.Module):
        ref = clone(previous)
    else:
        ref = _copy_with(proxy, previous, clone) if previous is not None else clone(proxy)
    ref.zero_grad(set_to_none=True)
    ref.train()
    return ref


def _start_optimizer(params: list[Tensor], settings: RefreshSettings, start: RefreshStart) -> torch.optim.AdamW:
    """The reference's AdamW of :func:`refresh_reference`: fresh, or with ``start.optimizer_state`` (this call's
    settings win over the carried ones), in ``start.workspace`` when given."""
    adamw = {"lr": settings.lr, "betas": settings.betas, "eps": settings.eps, "weight_decay": settings.weight_decay}
    if start.workspace is not None:
        return start.workspace.adamw(params, start.optimizer_state, **adamw)
    if start.optimizer_state == CONTINUE:
        raise ValueError(f"optimizer_state={CONTINUE!r} continues a workspace's AdamW: pass the workspace")
    opt = reference_adamw(params, **adamw)
    if start.optimizer_state is not None:
        opt.load_state_dict(start.optimizer_state)
        for group in opt.param_groups:  # this call's settings win over the carried ones
            group.update(adamw)
    return opt


def _refresh_step(ref: nn.Module, params: list[Tensor], opt: torch.optim.Optimizer, vb: TokenBatch,
                  cb: TokenBatch | None, settings: RefreshSettings, device: torch.device, *, joint: bool,
                  logged: dict[str, list[Tensor]]) -> None:
    """One step of :func:`refresh_reference`: ``L_val(w) + λ · L_train(α, w)``, its gradient clipped, AdamW; its
    figures appended to ``logged`` as device tensors."""
    pair = joint_losses(ref, vb, cb, device, precision=settings.precision) if joint and cb is not None else None
    if pair is not None:
        l_val, l_train = pair
    else:
        l_val = mean_loss(ref, vb, device, use_mask=False, precision=settings.precision)
        if cb is not None:
            l_train = mean_loss(ref, cb, device, use_mask=True, precision=settings.precision)
    objective = l_val
    if cb is not None:
        objective = l_val + settings.lam * l_train
        logged["train_losses"].append(l_train.detach())
    objective.backward()
    # max_norm=inf measures the total norm without clipping
    norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip or float("inf"))
    opt.step()
    logged["val_losses"].append(l_val.detach())
    logged["objectives"].append(objective.detach())
    logged["grad_norms"].append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # sharded: Σ ranks


def refresh_reference(
    proxy: nn.Module,
    val_batches: Iterable[Any],
    cand_batches: Iterable[Any] | None,
    settings: RefreshSettings,
    start: RefreshStart = FROM_PROXY,
) -> RefreshResult:
    """Compute a new reference ``w̃`` by ``K = settings.refresh_steps`` AdamW steps from ``w_0``.

    ``w_0`` is a deep copy of ``proxy`` (BLADE: synchronisation), or, when ``start.previous`` is given,
    the proxy's architecture loaded with ``previous``'s weights (``blade-nosync``: the reference
    continues from its last weights). Each step draws one validation batch and (when ``λ ≠ 0``)
    one candidate batch and minimises ``L_val(w) + λ · masked_mean(ℓ(w), α)``; gradients are
    clipped to ``settings.grad_clip`` (total L2 norm) before the step. The AdamW (``η_w``, weight decay,
    betas, epsilon; constant LR) and the forward passes' precision are ``settings``'s; its defaults are the
    paper's (η_w = 8e-5, weight decay 0.01, λ = 1, clipping 1.0).

    Batches may be :class:`~curation.core.losses.TokenBatch`, token tensors, ``(tokens, valid, mask)``
    tuples or mappings (see :func:`~curation.core.losses.as_token_batch`); a candidate batch's ``mask``
    is its current selection α over loss positions (``None``: all valid tokens).

    ``proxy`` is not modified (parameters, buffers, gradients, train/eval mode), and its optimizer
    is not involved. The reference gets a fresh AdamW unless ``optimizer_state`` is given: a previous
    :class:`RefreshResult`'s state dict (loaded into the AdamW, which takes its tensors and updates them in
    place: pass a copy to keep yours), or :data:`CONTINUE` (the workspace's AdamW as the last refresh left it).

    Args:
        proxy: the proxy model ``u`` (HF causal LM or a module returning logits).
        val_batches: iterable of validation batches (at least ``K`` of them).
        cand_batches: iterable of candidate batches with selections; may be ``None`` if ``λ = 0``.
        settings: ``K`` (``refresh_steps``; 0 returns a copy of ``w_0`` unchanged), ``λ``, the AdamW's settings,
            clipping and precision (its seed, batch size and ``rho1_steps`` are not used here).
        start: ``previous`` weights, ``optimizer_state``, ``workspace``, ``clone`` (:class:`RefreshStart`; default:
            from the proxy, a fresh AdamW, new modules).

    Returns:
        A :class:`RefreshResult` with the reference module, optimizer state and per-step losses.

    Raises:
        ValueError: ``cand_batches`` missing while ``λ ≠ 0``, a bad ``optimizer_state``, or an iterator that
            runs out before ``K`` batches.
        DivergenceError: the reference diverged (:func:`curation.core.divergence.check_reference`).
    """
    steps, lam = settings.refresh_steps, settings.lam
    if lam != 0 and cand_batches is None and steps > 0:
        raise ValueError("cand_batches is required when lam != 0")
    ref = _start_module(proxy, start)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = _start_optimizer(params, settings, start)
    try:
        device = next(ref.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    result = RefreshResult(model=ref, optimizer_state={})
    val_it = iter(val_batches)
    cand_it = iter(cand_batches) if (cand_batches is not None and lam != 0) else None
    # the per-step figures stay on the device until the last step: the host never waits for a step to finish
    # (on a GPU it queues step k+1 while step k runs), and reads them all at once at the end
    logged: dict[str, list[Tensor]] = {"val_losses": [], "objectives": [], "grad_norms": [], "train_losses": []}
    joint = joint_forward_on(settings.joint_forward, device)
    with torch.inference_mode(False), torch.enable_grad():
        for step in range(steps):
            vb = _next_batch(val_it, "val_batches", step, steps)
            opt.zero_grad(set_to_none=True)
            cb = _next_batch(cand_it, "cand_batches", step, steps) if cand_it is not None else None
            _refresh_step(ref, params, opt, vb, cb, settings, device, joint=joint, logged=logged)
    opt.zero_grad(set_to_none=True)
    _read_logged(result, logged, device)
    if steps:  # a diverged reference stops the run (one line naming selection.ref_lr), not scores on silently
        check_reference(result.val_losses, params, vocab_size=_vocab_size(ref), lr=settings.lr)
    ref.eval()
    result.optimizer_state = opt.state_dict()
    if start.workspace is not None and not start.workspace.keep_optimizer_state:
        opt.state.clear()  # released once the caller drops the result; the next step re-creates them lazily, zeroed
    return result


def train_static_reference(
    base_model: nn.Module,
    val_batches: Iterable[Any],
    settings: RefreshSettings,
    *,
    clone: Clone = copy.deepcopy,
) -> RefreshResult:
    """RHO-1's reference: a copy of ``base_model`` trained a priori on validation data.

    The same loop as :func:`refresh_reference` with ``λ = 0`` (validation loss only) for
    ``settings.rho1_steps`` steps, run once before training; the ``rho1`` policy never refreshes it.
    ``base_model`` is not modified.

    Args:
        base_model: the model the proxy starts from.
        val_batches: iterable of at least ``settings.rho1_steps`` validation batches.
        settings: ``rho1_steps`` (``N``), the AdamW's settings, clipping and precision (see
            :func:`refresh_reference`; its ``refresh_steps`` and ``lam`` are not used here).
        clone: builds the reference's module from ``base_model`` (see :func:`refresh_reference`).

    Returns:
        A :class:`RefreshResult` holding the static reference.
    """
    static = dataclasses.replace(settings, refresh_steps=settings.rho1_steps, lam=0.0)
    return refresh_reference(base_model, val_batches, None, static, RefreshStart(clone=clone))
