"""Causal LMs from a :class:`~schemas.train_config.ModelConfig`, and their weights as safetensors.

Everything is local: a model is built from a HF config dict (random init, seeded) or loaded from a
local directory (``local_files_only``); ``trust_remote_code`` is off unless the config asks.
Weights travel as safetensors (no pickle). No ray, no composer.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from torch import Tensor, nn

from curation.core.scorer import TokenLossScorer
from schemas.train_config import ModelConfig, ScorerConfig

__all__ = [
    "resolve_device",
    "build_causal_lm",
    "check_positions",
    "model_vocab_size",
    "weights_fingerprint",
    "save_weights",
    "load_weights",
    "read_weights",
    "load_state",
    "check_vocab",
    "check_token_range",
    "build_scorer",
]


def resolve_device(device: str) -> torch.device:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is visible; use device=cpu or auto")
    return torch.device(device)


def build_causal_lm(cfg: ModelConfig) -> nn.Module:
    """An ``AutoModelForCausalLM`` described by ``cfg`` (float32, train mode).

    Raises:
        ValueError: the config dict is not a known model type, or ``cfg.path`` is not a model directory.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.hf_config is not None:
        data = dict(cfg.hf_config)
        model_type = data.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **data)
        except ValueError as e:
            raise ValueError(f"model.hf_config: {e}") from e
        # Seed only the initialisation, without disturbing the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    else:
        assert cfg.path is not None
        if not os.path.isdir(cfg.path):
            raise ValueError(f"model.path {cfg.path!r} is not a local model directory")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.path, local_files_only=True, trust_remote_code=cfg.trust_remote_code, dtype=torch.float32
            )
        except (RuntimeError, OSError, ValueError, SafetensorError) as e:  # one line naming the file, not 30–50
            weights = next((os.path.join(cfg.path, n) for n in ("model.safetensors", "model.safetensors.index.json",
                                                                 "pytorch_model.bin")
                            if os.path.exists(os.path.join(cfg.path, n))), cfg.path)
            raise ValueError(f"model.path: {weights}: cannot be loaded as the model its config.json describes "
                             f"({_first_lines(e)})") from None
    if cfg.weights is not None:
        load_weights(model, cfg.weights)
    model.train()
    return model


def model_vocab_size(model: nn.Module) -> int:
    """Rows of the model's input embedding (ids it can embed)."""
    return int(model.get_input_embeddings().weight.shape[0])


#: The config attributes in which an architecture states the longest sequence it embeds positions for: Llama,
#: Mistral, Qwen, GPT-NeoX, OPT... (``max_position_embeddings``), GPT-2 (``n_positions``, ``n_ctx``), MPT
#: (``max_seq_len``), Falcon/others (``max_sequence_length``, ``seq_length``).
POSITION_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                  "seq_length")


def check_positions(model: nn.Module, seq_len: int, *, what: str, setting: str = "model") -> None:
    """Fail clearly when the model embeds positions for fewer tokens than a sequence of the data holds (a GPT-2
    then ends in an ``IndexError`` deep in its embedding, a Llama trains silently past what it was built for).

    Raises:
        ValueError: naming the setting, both numbers and ``what`` (the file the sequence length comes from).
    """
    config = getattr(model, "config", None)
    for attr in POSITION_ATTRS:
        n = getattr(config, attr, None)
        if isinstance(n, int) and not isinstance(n, bool) and 0 < n < seq_len:
            attr = getattr(config, "attribute_map", {}).get(attr, attr)  # (GPT-2's alias: n_positions)
            raise ValueError(
                f"{setting}: the model embeds positions for {n} tokens ({attr}) but the sequences of {what} hold "
                f"{seq_len}: set {setting}.hf_config.{attr} >= {seq_len}, or prepare the data with seq_len <= {n}")


def check_vocab(model: nn.Module, vocab_size: int, *, what: str, setting: str = "model",
                fix: str | None = None) -> None:
    """Fail clearly when a tokenizer/shard vocabulary of ``vocab_size`` ids does not fit the model.

    The one check of a *declared* vocabulary (a manifest's or a tokenizer's) against the model; the ids
    actually read are checked by :func:`check_token_range`.

    Args:
        model: the causal LM.
        vocab_size: ids the data can contain (from a shard manifest or a tokenizer).
        what: where ``vocab_size`` comes from (a file), named in the message.
        setting: the config key (or directory) of the model, named in the message.
        fix: what to do about it; default: set ``<setting>.hf_config.vocab_size`` or use the model's tokenizer.

    Raises:
        ValueError: when the model embeds fewer ids than the data holds.
    """
    n = model_vocab_size(model)
    if n < vocab_size:
        fix = fix or f"set {setting}.hf_config.vocab_size >= {vocab_size} or use the model's tokenizer"
        raise ValueError(
            f"vocabulary mismatch: {what} has vocab_size {vocab_size} but the model ({setting}) embeds only {n} ids; "
            f"{fix}"
        )


def check_token_range(tokens: np.ndarray, model_vocab: int, where: str, *,
                      error: type[Exception] = ValueError) -> None:
    """Every token id must be ``< model_vocab`` (else the embedding lookup fails obscurely, on CUDA later).

    The one check of the ids *read* (one sequence or a batch) against the model's vocabulary; a declared
    vocabulary is checked by :func:`check_vocab`.

    Args:
        tokens: ``(L,)`` or ``(b, L)`` token ids.
        model_vocab: ids the model embeds (:func:`model_vocab_size`).
        where: the file, record or step the tokens come from, named in the message.
        error: the exception class to raise (a caller's own ``ValueError`` subclass).

    Raises:
        ValueError: (or ``error``) naming ``where``, the first id out of range and its position.
    """
    if not tokens.size or int(tokens.max()) < model_vocab:
        return
    at = np.unravel_index(int(np.argmax(tokens >= model_vocab)), tokens.shape)
    pos = f"position {at[-1]}" if tokens.ndim == 1 else f"row {at[0]}, position {at[-1]}"
    raise error(f"{where}: token id {int(tokens[at])} at {pos} is outside the model's vocabulary ({model_vocab} ids): "
                "tokenizer and model do not match")


def _dedupe_shared(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Each tensor as a contiguous CPU tensor of its own: safetensors refuses tensors sharing storage (tied
    embeddings, views into one buffer). A tensor copied off its device is already its own; one on the CPU is cloned."""
    out = {}
    for k, v in sd.items():
        t = v.detach().to("cpu").contiguous()
        out[k] = t.clone() if t.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() else t
    return out


def save_weights(model: nn.Module | Mapping[str, Tensor], path: str, *, metadata: dict[str, str] | None = None) -> str:
    """Write the weights as one safetensors file (atomically). Returns ``path``."""
    from safetensors.torch import save_file

    sd = model.state_dict() if isinstance(model, nn.Module) else model
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(_dedupe_shared(sd), tmp, metadata=metadata)
    os.replace(tmp, path)
    return path


def read_weights(path: str) -> dict[str, Tensor]:
    """The tensors of a safetensors file, on the CPU.

    Raises:
        ValueError: the file does not exist.
    """
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise ValueError(f"weights file {path} does not exist")
    try:
        return load_file(path, device="cpu")
    except SafetensorError as e:  # e.g. a pickle renamed .safetensors: never unpickled, one line
        raise ValueError(f"{path}: not a safetensors file ({_first_lines(e)})") from None


def load_weights(model: nn.Module, path: str) -> None:
    """Load a safetensors file into ``model`` (strict: names and shapes must match).

    Raises:
        ValueError: naming the file on missing/unexpected keys or shape mismatches.
    """
    load_state(model, read_weights(path), what=path)


def load_state(model: nn.Module, weights: Mapping[str, Tensor], *, what: str) -> None:
    """Load ``weights`` into ``model`` (strict: names and shapes must match).

    Raises:
        ValueError: naming ``what`` (a file, a checkpoint's entry) on missing/unexpected keys or shape mismatches.
    """
    try:
        model.load_state_dict(dict(weights), strict=True)
    except RuntimeError as e:
        raise ValueError(f"{what}: weights do not fit the model: {_first_lines(e)}") from None


def _first_lines(e: BaseException, n: int = 2, limit: int = 300) -> str:
    """``e``'s message on one line: its first ``n`` non-blank lines, at most ``limit`` characters (torch lists every
    mismatching tensor, one per line)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    more = len(lines) - n
    text = " ".join(lines[:n]) + (f" … ({more} more lines)" if more > 0 else "")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def weights_fingerprint(model: nn.Module | Mapping[str, Tensor]) -> str:
    """sha256 over the names, shapes, dtypes and bytes of the weights (for manifests)."""
    sd = model.state_dict() if isinstance(model, nn.Module) else model
    h = hashlib.sha256()
    for k in sorted(sd):
        v = sd[k].detach().to("cpu").contiguous()
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype}".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def build_scorer(config: ScorerConfig, *, model: nn.Module | None = None) -> TokenLossScorer:
    """The :class:`~curation.core.scorer.TokenLossScorer` of ``config``: its model built from ``config.model`` (the
    weights of ``config.weights`` loaded over it), or ``model`` as it is; on ``config.device`` (``auto``: a GPU when
    one is visible), scoring ``config.batch_size`` sequences per forward at ``config.precision``.

    Raises:
        ValueError: a bad model config or weights file (naming it); ``cuda`` without a visible GPU.
    """
    if model is None:
        model = build_causal_lm(config.model)
        if config.weights is not None:
            load_weights(model, config.weights)
    return TokenLossScorer(model, device=resolve_device(config.device), batch_size=config.batch_size,
                           precision=config.precision)

