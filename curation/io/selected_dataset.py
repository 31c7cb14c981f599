"""Selected-token shards as training examples for any trainer: ``input_ids`` and ``labels`` (the HF convention).

A selected row (docs/DESIGN.md §5) holds ``tokens`` and ``loss_mask``, aligned with each other: ``loss_mask[n] = 1``
says that the loss of *predicting* ``tokens[n]`` (from the logits at position ``n − 1``) is trained on, and position
0, which nothing predicts, never counts (:func:`curation.core.losses.target_valid`). HF causal LMs take ``labels``
aligned with ``input_ids`` the same way and shift them themselves (the logits at ``n − 1`` against ``labels[n]``,
``-100`` ignored), so the labels are the tokens where the mask is 1 and ``-100`` elsewhere, position 0 included:
HF's mean over the labelled positions is then exactly our masked mean ``Σ α ℓ / Σ α`` on the same batch
(``tests/curation/io/test_selected_dataset.py`` trains a tiny Llama with ``transformers.Trainer`` and checks it).
A trainer that ignores ``loss_mask`` (llm-foundry's text collator sets labels = input_ids) trains on every token:
the selection is lost.

Two readers, the same examples:

* :class:`SelectedTokens`: map-style, over this project's MDS reader (a local directory or an ``s3://`` URL through
  its cache; every shard's ``xxh64`` hashes checked when first read; no ``streaming`` needed, nothing written
  beside the shards).
* :class:`StreamingSelectedTokens`: ``streaming.StreamingDataset`` (0.12 or 0.13) with the usual ``remote`` /
  ``local`` pair, shuffling and distributed partitioning; give ``local`` its own cache directory (it decompresses
  the shards there), never the run's ``selected/`` itself when ``remote`` is set.

Both yield ``{"input_ids": int64 (L,), "labels": int64 (L,)}``; ``torch.utils.data.default_collate`` (or HF's
``default_data_collator``) stacks them into a batch. llm-foundry's registered dataloader is
:mod:`training.blocks.foundry` (it needs Composer).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from streaming import StreamingDataset
from torch import Tensor

from curation.io import storage
from curation.io.shards import open_shards

__all__ = ["IGNORE_INDEX", "hf_labels", "hf_example", "SelectedTokens", "StreamingSelectedTokens"]

#: The label HF's (and PyTorch's) cross-entropy ignores.
IGNORE_INDEX = -100


def hf_labels(tokens: Tensor, loss_mask: Tensor) -> Tensor:
    """HF ``labels`` of a row (``(L,)``) or batch (``(b, L)``): ``tokens`` where ``loss_mask`` is set and
    ``-100`` elsewhere and at position 0 (no token predicts it, so our loss never counts it).

    Raises:
        ValueError: the mask's shape is not the tokens' shape.
    """
    if tuple(loss_mask.shape) != tuple(tokens.shape):
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, tokens have {tuple(tokens.shape)}")
    keep = loss_mask.to(torch.bool).clone()
    keep[..., 0] = False
    return tokens.to(torch.int64).masked_fill(~keep, IGNORE_INDEX)


def hf_example(sample: Mapping[str, Any]) -> dict[str, Tensor]:
    """``{"input_ids", "labels"}`` (int64) of one decoded selected-token sample (``tokens``, ``loss_mask``).

    Raises:
        KeyError: the sample has no ``loss_mask`` (not a selected-token shard: candidates carry no selection).
    """
    if "loss_mask" not in sample:
        raise KeyError("the sample has no 'loss_mask' column: this is not a selected-token shard directory "
                       "(the trainer's or curate.py's selected/)")
    tokens = torch.from_numpy(np.asarray(sample["tokens"]).astype(np.int64))
    mask = torch.from_numpy(np.asarray(sample["loss_mask"]).astype(np.bool_))
    return {"input_ids": tokens, "labels": hf_labels(tokens, mask)}


class SelectedTokens(torch.utils.data.Dataset):
    """The selected rows of a ``selected/`` directory in their written order (step, then row), as HF examples.

    Args:
        path: a selected-token directory (local, or ``s3://bucket/prefix`` read through the local cache with
            the credentials of the environment); its columns are checked against the selected spec first.
    """

    def __init__(self, path: str) -> None:
        local = storage.local_path(path)
        storage.refresh(os.path.join(local, "index.json"))  # a URL's index may have grown since it was cached
        self.path = path
        self.reader = open_shards(local, "selected")

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, idx: int) -> dict[str, Tensor]:
        return hf_example(self.reader[idx])


class StreamingSelectedTokens(StreamingDataset):
    """``streaming.StreamingDataset`` over selected-token shards, yielding HF examples instead of raw columns.

    Takes every ``StreamingDataset`` argument (``remote``, ``local``, ``shuffle``, ``batch_size``,
    ``validate_hash="xxh64"`` ...); works with mosaicml-streaming 0.12 (llm-foundry 0.22's pin) and 0.13.
    """

    def __getitem__(self, idx: int) -> dict[str, Tensor]:  # type: ignore[override]
        return hf_example(super().__getitem__(idx))
