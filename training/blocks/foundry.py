"""llm-foundry's dataloader for selected-token shards: the selection kept in an llm-foundry run.

llm-foundry's own ``text`` loader reads our ``tokens`` column but its collator sets ``labels = input_ids``, so
``loss_mask`` is ignored and every token is trained on. This loader yields ``input_ids`` and ``labels`` with
``-100`` wherever ``loss_mask`` is 0 (:mod:`curation.io.selected_dataset`), which llm-foundry's HF models
(``hf_causal_lm``: the HF model's own loss of ``labels``) and its token counting (``loss_generating`` tokens) honour.

llm-foundry (0.22 pins mosaicml-streaming <0.13, mlflow <3, transformers <4.52) cannot share this project's
environment; in its own, install this package without dependencies (``pip install --no-deps -e
/path/to/blade-curation``): the entry point ``llmfoundry_dataloaders: blade_selected`` (pyproject.toml) puts
:func:`build_selected_dataloader` in llm-foundry's registry, and a YAML names it::

    train_loader:
      name: blade_selected
      dataset: {remote: /runs/x/selected, local: /tmp/blade-selected-cache, shuffle: true}
      drop_last: true
      num_workers: 2

(:func:`register` does the same by hand.) llm-foundry is imported only inside this module's functions; the check
against its real code is ``python jobs/check_foundry.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from composer.core import DataSpec
from torch.utils.data import DataLoader, default_collate

from curation.io.selected_dataset import StreamingSelectedTokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["NAME", "build_selected_dataloader", "register"]

#: The name in llm-foundry's ``dataloaders`` registry (``train_loader.name``).
NAME = "blade_selected"


def _truncate(max_seq_len: int | None):
    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = default_collate(rows)
        if max_seq_len is not None:  # as llm-foundry's text dataset: the first max_seq_len tokens of each row
            batch = {k: v[:, :max_seq_len] for k, v in batch.items()}
        return batch

    return collate


def build_selected_dataloader(
    tokenizer: PreTrainedTokenizerBase | None,
    device_batch_size: int | float,
    dataset: Mapping[str, object],
    drop_last: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    timeout: float = 0,
) -> DataSpec:
    """The ``blade_selected`` loader of llm-foundry's registry (called by ``llmfoundry.data.build_dataloader``).

    Args:
        tokenizer: llm-foundry's tokenizer (unused: the shards hold token ids; it must be the one they were made with).
        device_batch_size: rows per batch on this device.
        dataset: ``streaming.StreamingDataset`` arguments (``remote``, ``local``, ``split``, ``shuffle``,
            ``shuffle_seed``, ``predownload``, ``validate_hash``, ...) and optionally ``max_seq_len`` (rows cut to
            their first ``max_seq_len`` tokens, as llm-foundry's text dataset does).
        drop_last, num_workers, pin_memory, prefetch_factor, persistent_workers, timeout: ``DataLoader``'s.

    Raises:
        ValueError: a ``dataset`` key that neither ``StreamingDataset`` nor this loader takes (named).
    """
    del tokenizer
    cfg = dict(dataset)
    max_seq_len = cfg.pop("max_seq_len", None)
    known = set(inspect.signature(StreamingSelectedTokens).parameters)
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"train_loader.dataset.{unknown[0]}: not an argument of the {NAME} loader "
                         f"(streaming.StreamingDataset's, or max_seq_len)")
    batch = int(device_batch_size)
    ds = StreamingSelectedTokens(batch_size=batch, **cfg)
    dl = DataLoader(ds, batch_size=batch, collate_fn=_truncate(max_seq_len), drop_last=drop_last,
                    num_workers=num_workers, pin_memory=pin_memory,
                    prefetch_factor=prefetch_factor if num_workers > 0 else None,
                    persistent_workers=persistent_workers and num_workers > 0, timeout=timeout)
    # llm-foundry's token counting (loss_generating = labelled positions), imported last: a bad key is named without it
    from llmfoundry.data.utils import get_tokens_per_batch_func

    return DataSpec(dataloader=dl, get_num_tokens_in_batch=get_tokens_per_batch_func())


def register() -> None:
    """Put :func:`build_selected_dataloader` in llm-foundry's registry as ``blade_selected`` (what the entry point
    does when this package is installed in llm-foundry's environment)."""
    from llmfoundry.registry import dataloaders

    dataloaders.register(NAME, func=build_selected_dataloader)
