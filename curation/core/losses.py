"""Per-token losses of a causal LM and the glue to get logits out of a model.

Conventions used everywhere in :mod:`curation` (docs/DESIGN.md §2):

* A batch is ``tokens`` of shape ``(b, L)`` plus an optional boolean ``valid`` of the same shape
  marking real tokens (``False`` for padding or tokens the caller wants ignored).
* Loss arrays are aligned with ``tokens``: position ``n`` holds
  ``ℓ_n = -log p(tokens[:, n] | tokens[:, :n])``, computed from ``logits[:, n - 1]``. Position 0
  predicts nothing and is never valid. Every mask in this package (validity, selection α) is over
  these *target* positions, so a selection mask can be written next to ``tokens`` unchanged.

Pure torch: no ray, no composer.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curation.core.host_sync import pinned, queues

__all__ = [
    "CPU_CHUNK_ELEMENTS",
    "autocast",
    "DEFAULT_CHUNK_ELEMENTS",
    "TokenBatch",
    "as_token_batch",
    "hidden_token_losses",
    "model_logits",
    "model_token_losses",
    "target_valid",
    "token_losses",
]

#: Upper bound on ``rows × vocab`` logits upcast to float32 at once by :func:`token_losses` on a GPU
#: (2**25 floats = 128 MiB). Bounds the extra memory of the float32 upcast for bf16 logits.
DEFAULT_CHUNK_ELEMENTS = 1 << 25
#: The same bound on a CPU, where it is chosen for the cache instead (2**21 floats = 8 MiB): for a 32k
#: vocabulary the cross-entropy of cache-sized chunks runs ≈ 2.2× faster without gradients and ≈ 1.3×
#: with them than in one piece (2 threads, 2048 rows). The values do not depend on the block size.
CPU_CHUNK_ELEMENTS = 1 << 21
#: Rows of the output-head GEMMs of :func:`hidden_token_losses` come in multiples of this, and at least
#: _MIN_GEMM_ROWS of them (a 64-row GEMM with a 32k vocabulary ran ≈ 1.3× slower per row on this CPU).
_ROW_BLOCK = 64
_MIN_GEMM_ROWS = 256


def autocast(precision: str, device: torch.device) -> torch.autocast:
    """The autocast context of a ``precision`` setting (``fp32`` | ``amp_bf16``) on ``device``.

    ``amp_bf16`` is bf16 autocast on CUDA, as Composer's ``amp_bf16`` runs the trainer's forward; on a CPU
    every precision runs in float32 (the trainer refuses ``amp_bf16`` there). One function for the reference
    scorer, the scoring workers and the refresh, so ℓ(u) and ℓ(w̃) are computed at the same precision.
    """
    if precision not in ("fp32", "amp_bf16"):
        raise ValueError(f"precision must be 'fp32' or 'amp_bf16', got {precision!r}")
    enabled = precision == "amp_bf16" and device.type == "cuda"
    return torch.autocast(device.type if device.type == "cuda" else "cpu", dtype=torch.bfloat16, enabled=enabled)


def target_valid(tokens: Tensor, valid: Tensor | None = None) -> Tensor:
    """Validity of the loss positions of ``tokens``.

    Position ``n`` is valid iff ``n > 0`` and ``valid[:, n]``. The context of a valid target is
    not checked: for *left*-padded input, also mark the first real token of each row invalid
    (it has no context) before calling.

    Args:
        tokens: ``(b, L)`` token ids.
        valid: optional ``(b, L)`` boolean mask of real tokens; ``None`` means all real.

    Returns:
        ``(b, L)`` boolean tensor on ``tokens.device``.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape (b, L), got {tuple(tokens.shape)}")
    if valid is None:
        out = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    else:
        if valid.shape != tokens.shape:
            raise ValueError(
                f"valid has shape {tuple(valid.shape)} but tokens have shape {tuple(tokens.shape)}"
            )
        if valid.dtype != torch.bool:
            raise TypeError(f"valid must be a bool tensor, got {valid.dtype}")
        out = valid.to(device=tokens.device, copy=True)
    out[:, 0] = False
    return out


def _nll_rows(logits: Tensor, targets: Tensor) -> Tensor:
    """``-log softmax(logits)[targets]`` per row, in float32: the row's log-sum-exp minus the target's logit.

    The same value as ``F.cross_entropy(logits.float(), targets, reduction="none")`` (to float32 rounding), but
    as one reduction: compiled (:func:`_fused_nll`), it reads low-precision logits once, with no float32 copy
    and no ``log_softmax`` output written back."""
    x = logits.float()
    return torch.logsumexp(x, dim=-1) - x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


#: The compiled :func:`_nll_rows` for scoring on CUDA: ``None`` until first needed, ``False`` once it failed.
_FUSED: dict[str, Any] = {"fn": None, "error": None}


def _fused_nll() -> Any:
    if _FUSED["fn"] is None:
        _FUSED["fn"] = torch.compile(_nll_rows, dynamic=True, fullgraph=True)
    return _FUSED["fn"]


def _cross_entropy_rows(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-row float32 NLL of ``(r, V)`` logits. Scoring on CUDA (no gradients) runs the compiled one-pass
    reduction: the float32 upcast and the ``log_softmax`` output of ``F.cross_entropy`` made the per-token loss
    0.13-0.17 of a forward on an H200 (bf16, b = 8 and 32; issue 31 asks ≤ 0.05); on memory traffic alone the
    fused pass moves 2 bytes per logit instead of about 14. Elsewhere (CPU: the bit-exact oracle tests;
    training: gradients) it is ``F.cross_entropy``, unchanged. A compile that fails (no Triton, no C compiler)
    is reported once on stderr and the eager function is used from then on."""
    fused = _fused_rows(logits, targets)
    return fused if fused is not None else F.cross_entropy(logits.float(), targets, reduction="none")


def _fused_rows(logits: Tensor, targets: Tensor) -> Tensor | None:
    """The compiled one-pass NLL of ``(r, V)`` logits when it applies (CUDA, no gradients, not failed before), else
    None (the caller runs ``F.cross_entropy``)."""
    if logits.device.type != "cuda" or torch.is_grad_enabled() or _FUSED["fn"] is False:
        return None
    try:
        return _fused_nll()(logits, targets)
    except Exception as e:  # torch._dynamo / Inductor / Triton errors have no common public base
        _FUSED["fn"], _FUSED["error"] = False, f"{type(e).__name__}: {e}"
        print(f"curation.core.losses: the compiled per-token loss failed ({_FUSED['error'][:300]}); using the "
              "eager cross-entropy", file=sys.stderr)
        return None


def scoring_loss_path(device: torch.device) -> tuple[str, str | None]:
    """Which per-token loss scoring (no gradients) runs on ``device``, and why not the compiled one if it failed:
    ``("cross_entropy", None)`` off CUDA; on CUDA ``("compiled", None)``, or ``("eager", error)`` once its compile
    failed."""
    if device.type != "cuda":
        return "cross_entropy", None
    return ("eager", _FUSED["error"]) if _FUSED["fn"] is False else ("compiled", None)


def token_losses(
    logits: Tensor,
    tokens: Tensor,
    valid: Tensor | None = None,
    *,
    chunk_elements: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token negative log-likelihood of ``tokens`` under ``logits``, in float32.

    ``losses[:, n] = -log softmax(logits[:, n - 1])[tokens[:, n]]`` for valid ``n`` and 0
    elsewhere. Logits of any floating dtype are upcast to float32 chunk by chunk (at most
    ``chunk_elements`` logits at a time), so bf16/fp16 logits never materialise a full float32
    copy. Differentiable with respect to ``logits``.

    Args:
        logits: ``(b, L, V)`` next-token logits, as returned by a causal LM for ``tokens``.
        tokens: ``(b, L)`` integer token ids. Ids at invalid positions are not read (they may be
            out of range, e.g. ``-100``).
        valid: optional ``(b, L)`` boolean mask of real tokens (see :func:`target_valid`).
        chunk_elements: memory bound of the float32 upcast, in logits; ``None``:
            :data:`CPU_CHUNK_ELEMENTS` for CPU logits, :data:`DEFAULT_CHUNK_ELEMENTS` otherwise.
            The values do not depend on it.

    Returns:
        ``(losses, valid)``: float32 ``(b, L)`` losses (0 at invalid positions) and the boolean
        ``(b, L)`` validity of each loss position (position 0 always ``False``).

    Raises:
        ValueError: on inconsistent shapes.
    """
    tokens, out_valid, chunk_elements = _checked_inputs("logits", "V", logits, tokens, valid, chunk_elements)
    b, length, vocab = logits.shape
    if length < 2 or b == 0:
        return torch.zeros((b, length), dtype=torch.float32, device=logits.device), out_valid

    targets = _shifted_targets(tokens, out_valid)
    # Whole sequences over all L positions: a contiguous (b, L, V) reshapes to (b·L, V) without a copy,
    # whereas the strided slice `logits[:, :-1]` would be copied (for a large vocabulary that copy costs as
    # much as the cross-entropy itself). The loss of the last position is computed and dropped (1/L extra
    # work). Rows go through the cross-entropy `chunk_elements` logits at a time (bounds the float32
    # upcast of low-precision logits; on a CPU, cache-sized chunks are also faster for large
    # vocabularies), taken with `split`: views whose gradients are gathered by one concatenation.
    # (Slicing blocks out of `logits` and writing them into a preallocated result would instead allocate
    # a full-size zero gradient per block in the backward pass: 1.7x slower training steps.) Row-wise,
    # the values are those of the sliced computation.
    flat = logits.reshape(b * length, vocab)
    flat_targets = targets.reshape(-1)
    rows = max(1, chunk_elements // max(vocab, 1))
    # Scoring on CUDA: one compiled pass over every row, which holds no float32 copy to bound (chunks of 2^25
    # logits made 32 calls per step at b = 32 and a 32k vocabulary, each with its guards and launches: the loss
    # was 0.08 of a forward on an H200); the eager chunks below if the compile failed.
    if flat.shape[0] <= rows:
        nll_all = _cross_entropy_rows(flat, flat_targets)
    elif (nll_all := _fused_rows(flat, flat_targets)) is None:
        nll_all = torch.cat([
            _cross_entropy_rows(chunk, tgt)
            for chunk, tgt in zip(flat.split(rows), flat_targets.split(rows), strict=True)
        ])
    return _aligned_losses(nll_all.view(b, length), out_valid), out_valid


def _checked_inputs(
    what: str, last: str, x: Tensor, tokens: Tensor, valid: Tensor | None, chunk_elements: int | None
) -> tuple[Tensor, Tensor, int]:
    """Shape/dtype checks shared by the loss functions; ``(tokens on x's device, validity, chunk bound)``."""
    if x.dim() != 3 or x.shape[:2] != tokens.shape:
        raise ValueError(
            f"{what} must have shape (b, L, {last}) matching tokens {tuple(tokens.shape)}, got {tuple(x.shape)}"
        )
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got {tokens.dtype}")
    tokens = tokens.to(x.device)
    out_valid = target_valid(tokens, None if valid is None else valid.to(x.device))
    if chunk_elements is None:
        chunk_elements = CPU_CHUNK_ELEMENTS if x.device.type == "cpu" else DEFAULT_CHUNK_ELEMENTS
    return tokens, out_valid, chunk_elements


def _shifted_targets(tokens: Tensor, out_valid: Tensor) -> Tensor:
    """``targets[:, n]`` = the token predicted at position ``n`` (``tokens[:, n + 1]``); 0 where that target
    is invalid and in the last column (which predicts nothing), so that out-of-range ids are never read."""
    zero = torch.zeros((), dtype=tokens.dtype, device=tokens.device)
    tv = out_valid[:, 1:]
    return torch.cat([torch.where(tv, tokens[:, 1:], zero), torch.zeros_like(tokens[:, :1])], dim=1).long()


def _aligned_losses(nll_all: Tensor, out_valid: Tensor) -> Tensor:
    """``(b, L)`` losses aligned with the tokens from the ``(b, L)`` NLL of each prediction position."""
    b = nll_all.shape[0]
    # torch.where (not multiplication) so that a non-finite logit at an invalid position stays out.
    nll = torch.where(out_valid[:, 1:], nll_all[:, :-1], torch.zeros((), dtype=nll_all.dtype, device=nll_all.device))
    return torch.cat([torch.zeros((b, 1), dtype=nll.dtype, device=nll.device), nll], dim=1)


def hidden_token_losses(
    hidden: Tensor,
    head: Tensor,
    tokens: Tensor,
    valid: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    chunk_elements: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token losses from the final hidden states, without materialising the ``(b, L, V)`` logits.

    The same values as ``token_losses(F.linear(hidden, head, bias), tokens, valid)``: rows of ``hidden``
    go through the output head, the float32 log-sum-exp and the target gather about ``chunk_elements``
    logits at a time (a multiple of 64 rows, at least 256), so at most one chunk of logits (and a
    ``chunk_elements`` float32 upcast) exists at once. On a CPU in float32 the values are bit for bit those of :func:`token_losses` on the full logits
    (every GEMM gets the same number of rows, which gives the rows of one big GEMM exactly; tested). Under bf16 (autocast or bf16 weights) each chunk's
    logits are bf16, as the full logits would be, and the cross-entropy runs in float32.

    Differentiable, but it pays only without gradients (scoring): with a graph every chunk's softmax is
    kept for the backward pass anyway.

    Args:
        hidden: ``(b, L, H)`` final hidden states (after the last norm).
        head: ``(V, H)`` output-embedding weight.
        tokens: ``(b, L)`` token ids.
        valid: optional ``(b, L)`` boolean mask of real tokens.
        bias: optional ``(V,)`` bias of the head.
        chunk_elements: logits per chunk; ``None``: as :func:`token_losses`.

    Returns:
        ``(losses, valid)`` as :func:`token_losses`.
    """
    tokens, out_valid, chunk_elements = _checked_inputs("hidden", "H", hidden, tokens, valid, chunk_elements)
    if head.dim() != 2 or head.shape[1] != hidden.shape[2]:
        raise ValueError(f"head must have shape (V, {hidden.shape[2]}), got {tuple(head.shape)}")
    b, length, width = hidden.shape
    if length < 2 or b == 0:
        return torch.zeros((b, length), dtype=torch.float32, device=hidden.device), out_valid
    flat = hidden.reshape(b * length, width)
    flat_targets = _shifted_targets(tokens, out_valid).reshape(-1)
    total, vocab = flat.shape[0], max(head.shape[0], 1)
    # Every head GEMM gets exactly `rows` rows (a multiple of 64, at least _MIN_GEMM_ROWS: small GEMMs run
    # slower), or all rows at once: a BLAS kernel may round a row differently when it is one of a few
    # left-over rows, so the last chunk is the *last* `rows` rows, overlapping the previous one, of which only
    # the new ones are kept. The cross-entropy then runs `chunk_elements` logits at a time (cache-sized on a
    # CPU; it bounds the float32 upcast of bf16 logits).
    rows = min(total, max(_MIN_GEMM_ROWS, chunk_elements // vocab // _ROW_BLOCK * _ROW_BLOCK))
    ce_rows = max(1, chunk_elements // vocab)
    parts = []
    for start in range(0, total, rows):
        first = min(start, total - rows)
        logits = F.linear(flat[first : first + rows], head, bias)
        targets = flat_targets[first : first + rows]
        nll = torch.cat([_cross_entropy_rows(lg, tg)
                         for lg, tg in zip(logits.split(ce_rows), targets.split(ce_rows), strict=True)])
        parts.append(nll[start - first :])
    nll_all = torch.cat(parts) if len(parts) > 1 else parts[0]
    return _aligned_losses(nll_all.view(b, length), out_valid), out_valid


@dataclass(frozen=True)
class TokenBatch:
    """A batch of token sequences with optional validity and selection masks.

    Attributes:
        tokens: ``(b, L)`` integer token ids.
        valid: optional ``(b, L)`` boolean mask of real tokens (``None``: all real).
        mask: optional ``(b, L)`` selection mask α over loss positions (bool or float weights);
            ``None`` means every valid position.
    """

    tokens: Tensor
    valid: Tensor | None = None
    mask: Tensor | None = None

    def to(self, device: torch.device | str) -> TokenBatch:
        """Return a copy with every tensor moved to ``device``. To a CUDA device, a host tensor is staged in pinned
        memory and copied asynchronously: a copy from pageable memory would make the host wait until the device
        has finished everything queued before it."""
        device = torch.device(device)

        def move(t: Tensor | None) -> Tensor | None:
            if t is None or t.device == device:
                return t
            if queues(device) and t.device.type == "cpu":
                return pinned(t, device).to(device, non_blocking=True)
            return t.to(device)

        return TokenBatch(move(self.tokens), move(self.valid), move(self.mask))


def as_token_batch(batch: Any) -> TokenBatch:
    """Normalise the accepted batch forms into a :class:`TokenBatch`.

    Accepted: a :class:`TokenBatch`; a ``(b, L)`` token tensor; a tuple/list
    ``(tokens[, valid[, mask]])``; or a mapping with ``tokens`` (or ``input_ids``) and optional
    ``valid`` (or ``attention_mask``) and ``mask`` (or ``loss_mask``).

    Raises:
        TypeError: for anything else.
    """
    if isinstance(batch, TokenBatch):
        return batch
    if isinstance(batch, Tensor):
        return TokenBatch(batch)
    if isinstance(batch, tuple | list) and 1 <= len(batch) <= 3:
        return TokenBatch(*batch)
    if isinstance(batch, Mapping):
        tokens = batch.get("tokens", batch.get("input_ids"))
        if tokens is None:
            raise TypeError(f"batch mapping needs a 'tokens' or 'input_ids' key, got keys {sorted(batch)}")
        valid = batch.get("valid", batch.get("attention_mask"))
        if valid is not None and valid.dtype != torch.bool:
            valid = valid.bool()
        mask = batch.get("mask", batch.get("loss_mask"))
        return TokenBatch(tokens, valid, mask)
    raise TypeError(
        "a batch must be a TokenBatch, a token tensor, a (tokens, valid, mask) tuple or a mapping, "
        f"got {type(batch).__name__}"
    )


def _accepts_input_ids(model: nn.Module) -> tuple[bool, bool]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # builtins / C extensions without a signature
        return False, False
    return "input_ids" in params, "attention_mask" in params


def model_logits(model: nn.Module, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
    """Run ``model`` on ``tokens`` and return its ``(b, L, V)`` logits.

    Works with any HF ``AutoModelForCausalLM``-like module (``forward(input_ids=...,
    attention_mask=...)`` returning an object with ``.logits``) and with plain modules called as
    ``model(tokens)`` that return a logits tensor (or a tuple whose first item is one). The
    attention mask is passed only when some position is invalid.

    Args:
        model: the causal LM.
        tokens: ``(b, L)`` token ids (moved to the model's device if needed).
        valid: optional ``(b, L)`` boolean mask of real tokens.

    Returns:
        The logits tensor.
    """
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = tokens.device
    tokens = tokens.to(device)
    has_ids, has_mask = _accepts_input_ids(model)
    if has_ids:
        kwargs: dict[str, Tensor] = {}
        if has_mask and valid is not None and not bool(valid.all()):
            kwargs["attention_mask"] = valid.to(device=device, dtype=torch.long)
        out = model(input_ids=tokens, **kwargs)
    else:
        out = model(tokens)
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, tuple | list) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(f"cannot find logits in the output of {type(model).__name__}: {type(out).__name__}")


#: HF ``model_type`` values whose logits are exactly ``lm_head(final hidden state)`` (no soft-capping or
#: scaling after the head), so :func:`model_token_losses` may skip the full logits.
_PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "olmo", "olmo2"})


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP-sharded (``fully_shard``), without importing ``torch.distributed.fsdp`` (≈ 0.9 s of
    CPU, sympy included, at the start of every process that scores): a process that never imported it holds no
    sharded model."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def _plain_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(decoder, head)`` when the model's logits are ``head(decoder(...).last_hidden_state)`` (and the model
    is not FSDP-sharded: its decoder and head hold their full weights only inside its own forward)."""
    if is_fsdp(model):
        return None
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None
    if getattr(config, "final_logit_softcapping", None) is not None or getattr(config, "logit_scale", None):
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    decoder = getattr(model, "base_model", None)
    if not isinstance(head, nn.Linear) or decoder is None or decoder is model:
        return None
    return decoder, head


def model_token_losses(
    model: nn.Module, tokens: Tensor, valid: Tensor | None = None, *, chunk_elements: int | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token losses of ``tokens`` under ``model`` (``(losses, valid)`` as :func:`token_losses`).

    For HF causal LMs whose logits are the output head applied to the decoder's last hidden state
    (Llama, Mistral, Qwen, GPT-2, ...), the decoder is run alone and :func:`hidden_token_losses` computes
    the losses chunk by chunk: the ``(b, L, V)`` logits are never materialised (for a 32k vocabulary
    they are ≈ 30× the hidden states). Other models go through :func:`model_logits` and
    :func:`token_losses`. On a CPU in float32 both give the same values bit for bit.
    """
    plain = _plain_head(model)
    if plain is None:
        logits = model_logits(model, tokens, valid)
        return token_losses(logits, tokens, valid, chunk_elements=chunk_elements)
    decoder, head = plain
    device = head.weight.device
    tokens = tokens.to(device)
    kwargs: dict[str, Tensor] = {}
    if valid is not None and not bool(valid.all()):
        kwargs["attention_mask"] = valid.to(device=device, dtype=torch.long)
    out = decoder(input_ids=tokens, **kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden_token_losses(hidden, head.weight, tokens, valid, bias=head.bias, chunk_elements=chunk_elements)
