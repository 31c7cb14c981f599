"""The tokenizer beside a run's final weights, so that ``final/`` loads in Hugging Face like a model directory:
``AutoModelForCausalLM.from_pretrained(final)`` (``config.json``, ``model.safetensors``) and
``AutoTokenizer.from_pretrained(final)`` (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``).

:func:`run_tokenizer` finds the tokenizer the run's shards were made with: the configured one (checked against the
manifests already), else the ``tokenizer.json`` a manifest names whose sha256 is the shards' fingerprint;
:func:`save_tokenizer` writes it as ``save_pretrained`` does. An HF tokenizer directory (a model's own, with its
``tokenizer_config.json``) is copied through ``AutoTokenizer``, keeping its special tokens; a bare ``tokenizer.json``
(one ``jobs/prepare.py`` trained) becomes a ``PreTrainedTokenizerFast`` whose EOS (and BOS) is the token the shards
were packed with.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from curation.io import storage
from curation.io.shards import ShardDirInfo
from schemas.manifest import sha256_file

__all__ = ["TokenizerFiles", "run_tokenizer", "save_tokenizer", "DEFAULT_EOS"]

#: The EOS token of a manifest that records none (the prepare default).
DEFAULT_EOS = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerFiles:
    """A run's tokenizer: ``path`` (a ``tokenizer.json`` or an HF tokenizer directory) and the EOS token the shards
    were packed with."""

    path: str
    eos_token: str = DEFAULT_EOS


def _eos(infos: Sequence[ShardDirInfo]) -> str:
    for info in infos:
        tok = info.manifest.config.get("tokenizer")
        if isinstance(tok, dict) and isinstance(tok.get("eos_token"), str):
            return tok["eos_token"]
    return DEFAULT_EOS


def run_tokenizer(infos: Sequence[ShardDirInfo], tokenizer: str | None) -> TokenizerFiles | None:
    """The tokenizer of shards ``infos`` (module docstring); ``tokenizer``: the configured one. None when no
    manifest names one that is still there unchanged."""
    if tokenizer is not None:
        return TokenizerFiles(tokenizer, _eos(infos))
    for info in infos:
        data = info.manifest.config.get("data")
        named = [info.manifest.extra.get("tokenizer_path"), data.get("tokenizer") if isinstance(data, dict) else None]
        for path in (p for p in named if isinstance(p, str)):
            try:
                found = storage.tokenizer_json_path(path)
            except FileNotFoundError:
                continue
            if info.tokenizer_fingerprint is None or sha256_file(found) == info.tokenizer_fingerprint:
                return TokenizerFiles(found, _eos(infos))
    return None


def save_tokenizer(tokenizer: TokenizerFiles, directory: str) -> list[str]:
    """Write ``tokenizer`` into ``directory`` as ``save_pretrained`` does (each file replaced whole). Returns the
    paths written."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src = tokenizer.path
    storage.fetch(src)  # a cache path this process has not read (a rank on another node did): from the bucket
    if os.path.isdir(src) and os.path.isfile(os.path.join(src, "tokenizer_config.json")):
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    else:
        tok = PreTrainedTokenizerFast(tokenizer_file=storage.tokenizer_json_path(src), eos_token=tokenizer.eos_token,
                                      bos_token=tokenizer.eos_token)
    os.makedirs(directory, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=directory)
    try:
        names = [os.path.basename(p) for p in tok.save_pretrained(tmp)]
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(directory, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [os.path.join(directory, n) for n in names]
