"""Data for the trainer: the candidate stream consumed by step, validation batches, replay of
selected-token shards (token ids checked against the model's vocabulary on read).

Batch dicts (what :class:`training.blocks.model.MaskedCausalLM` consumes):

* ``tokens``: ``(b, L)`` int64; ``loss_mask`` (optional): ``(b, L)`` bool over loss positions;
* ``source``: list of source labels; ``step``: proxy step (candidate stream); ``sample_id``;
* ``kept_total`` / ``rows_total``: written on the full batch by :func:`annotate_batch` so the
  loss is normalised over the whole batch's kept tokens under microbatching.

The training loaders are :class:`StepBatches`: one pre-collated batch per proxy step, starting at any
step; :class:`StreamBatches` reads them from :class:`curation.io.stream_reader.StreamReader` (the engine's
loader, :class:`training.runs.engine_feed.EngineMaskedBatches`, from the engine's parts) and reads each step's
rows once, whoever asks for them (the loader, the reference scoring the coming steps, a data-parallel rank's
record of the whole batch); :class:`RankBatches` is a data-parallel rank's share of each batch. Composer saves their
position in the checkpoint (``state_dict``/``load_state_dict``: the dataset resumes itself, nothing is
replayed). The directory checks (shard schema, manifest, tokenizer) are in :mod:`curation.io.shards`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from composer.core import DataSpec
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from curation.core.distributed import Ranks
from curation.core.host_sync import pinned, queues
from curation.core.losses import target_valid
from curation.core.stream import CandidateStream
from curation.io.bad_shards import blame
from curation.io.models import check_token_range
from curation.io.shards import open_shards
from curation.io.stream_reader import StreamReader

#: A batch dict (module docstring): tensors (``tokens``, ``loss_mask``, ``score``, ``sample_id``, ...), the rows'
#: ``source`` labels, numbers (``step``, ``episode``, ``ref_version``, ``kept_total``, ``rows_total``).
Batch = dict[str, "Tensor | list[str] | int"]
#: One row of a row dataset: ``tokens`` (and ``loss_mask``) tensors, its ``source`` label.
Row = dict[str, "Tensor | str"]

__all__ = [
    "StepBatches",
    "StreamBatches",
    "RankBatches",
    "rank_slice",
    "TokenRows",
    "collate_rows",
    "annotate_batch",
    "make_data_spec",
    "split_batch",
    "stream_loader",
    "rows_loader",
]


# ------------------------------------------------------------------------------------------------
# training stream
# ------------------------------------------------------------------------------------------------
class StepBatches(IterableDataset):
    """One batch per proxy step ``start_step ≤ t < stop_step`` of a candidate stream (:meth:`batch`).

    Implements Composer's dataset resumption protocol (``state.dataset_state``) once for every
    step-indexed loader: the position is the step, so a resumed run starts at the checkpoint's step and
    replays nothing; a checkpoint of another stream (candidates, batch size or seed) is refused.

    Args:
        stream: the candidate stream the steps index.
        stop_step: the step after the last one (``max_steps``).
        model_vocab: the model's vocabulary (subclasses check token ids against it).
    """

    def __init__(self, stream: CandidateStream, stop_step: int, *, model_vocab: int | None = None) -> None:
        super().__init__()
        self.stream = stream
        self.start_step = 0
        self.stop_step = stop_step
        self.model_vocab = model_vocab
        self.pin_for: torch.device | None = None  # the trainer's device: batches are pinned for it (stream_loader)

    def batch(self, step: int) -> Batch:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Batch]:
        for t in range(self.start_step, self.stop_step):
            self.release_before(t)
            batch = self.batch(t)
            if self.pin_for is not None:  # (on a GPU: copied to the device without blocking)
                batch = {k: pinned(v, self.pin_for) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            yield batch

    def release_before(self, step: int) -> None:
        """The loader is at ``step``: rows kept in memory for earlier steps are not needed any more."""

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, object]:
        b = self.stream.batch_size
        done = num_samples // b if from_beginning else self.start_step + num_samples // b
        return {"step": int(done), "stream": self.stream.to_dict()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        if state.get("stream") != self.stream.to_dict():
            raise ValueError(
                f"checkpoint was taken on candidate stream {state.get('stream')}, this run uses "
                f"{self.stream.to_dict()} (same candidates, batch_size and seed are needed to resume)"
            )
        self.start_step = int(state["step"])


class StreamBatches(StepBatches):
    """The candidate stream's batches read from its shards (the single-process trainer's loader).

    Args:
        reader: the candidate stream and shards.
        stop_step: the step after the last one (``max_steps``).
        model_vocab: the model's vocabulary (token ids are checked against it).
        keep_behind: trained steps whose rows stay in memory (the refresh's recent candidate batches).
    """

    def __init__(self, reader: StreamReader, stop_step: int, *, model_vocab: int | None = None,
                 keep_behind: int = 0) -> None:
        super().__init__(reader.stream, stop_step, model_vocab=model_vocab)
        self.reader = reader
        self.keep_behind = keep_behind
        # Steps read (as stored: uint16/uint32 tokens): the loader's current step, the ones the reference scored
        # ahead of it, and the last ``keep_behind`` trained ones (the next refresh's L_train reads their rows).
        self._read: dict[int, Any] = {}

    def batch(self, step: int) -> Batch:
        """The collated batch of ``step`` (also used by the reference to pre-compute scores), read from the shards
        once: asked for again (by the loader after the reference scored it, or by a data-parallel rank's record
        of the whole batch) it comes from memory until the loader has passed it."""
        sb = self._read.get(step)
        if sb is None:
            sb = self.reader.read(step)
            if self.model_vocab is not None:
                try:
                    check_token_range(sb.tokens, self.model_vocab, f"{self.reader.path} (step {step})")
                except ValueError as e:  # blames the shards of the rows holding such ids
                    bad = sb.sample_ids[(sb.tokens >= self.model_vocab).any(axis=1)]
                    blame(e, *_shard_paths(self.reader.dataset, bad))
                    raise
            self._read[step] = sb
        return {
            "tokens": torch.from_numpy(sb.tokens.astype(np.int64)),
            "sample_id": torch.from_numpy(sb.sample_ids),
            "source": list(sb.sources),
            "step": int(step),
        }

    def release_before(self, step: int) -> None:
        for old in [t for t in self._read if t < step - self.keep_behind]:
            del self._read[old]


class RankBatches(StepBatches):
    """This rank's rows of each step's candidate batch (resumes by step like every :class:`StepBatches`:
    Composer counts the samples of every rank, so the saved position is the global step and resuming works
    with any number of workers)."""

    def __init__(self, stream: StreamBatches, ranks: Ranks) -> None:
        super().__init__(stream.stream, stream.stop_step, model_vocab=stream.model_vocab)
        self.full = stream
        self.ranks = ranks

    def batch(self, step: int) -> Batch:
        return rank_slice(self.full.batch(step), self.ranks)

    def release_before(self, step: int) -> None:
        self.full.release_before(step)


def rank_slice(batch: Batch, ranks: Ranks) -> Batch:
    """The rows of ``ranks`` of a collated batch dict (tensors and lists by row, other values copied)."""
    rows = ranks.rows(int(batch["tokens"].shape[0]))
    return {k: v[rows] if isinstance(v, torch.Tensor | list | tuple) else v for k, v in batch.items()}


def annotate_batch(batch: Batch) -> Batch:
    """Write ``kept_total`` and ``rows_total`` on a full batch (before Composer splits it).

    ``kept_total`` counts ``loss_mask`` positions that are valid loss positions (position 0 and
    invalid tokens never count); without a mask, every valid loss position. The BLADE algorithm
    overwrites it once it knows what it will keep.
    """
    tokens = batch["tokens"]
    valid = batch.get("valid")
    v = target_valid(tokens.cpu(), None if valid is None else valid.cpu().bool())
    mask = batch.get("loss_mask")
    kept = v if mask is None else (mask.bool().cpu() & v)
    batch["kept_total"] = int(kept.sum())
    batch["rows_total"] = int(tokens.shape[0])
    return batch


def _num_samples(batch: Batch) -> int:
    return int(batch["tokens"].shape[0])


def _num_tokens(batch: Batch) -> int:
    return int(batch["tokens"].numel())


def split_batch(batch: Batch, microbatch_size: int | float) -> list[Batch]:
    """Split a batch dict into consecutive microbatches of ``microbatch_size`` rows.

    Same order as Composer's default split (the BLADE algorithm counts kept tokens per microbatch
    on that basis), but a batch shorter than a microbatch (the last validation batch) is one
    microbatch without a warning. Tensors and lists are sliced by row; other values are copied.
    """
    rows = int(batch["tokens"].shape[0])
    mb = int(microbatch_size)
    if mb <= 0:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size!r}")
    out = []
    for start in range(0, rows, mb):
        part = {}
        for k, v in batch.items():
            part[k] = v[start : start + mb] if isinstance(v, torch.Tensor | list | tuple) else v
        out.append(part)
    return out


def make_data_spec(dataloader: DataLoader) -> DataSpec:
    """A Composer ``DataSpec`` for our batch dicts (annotated for whole-batch loss normalisation)."""
    return DataSpec(
        dataloader,
        batch_transforms=annotate_batch,
        split_batch=split_batch,
        get_num_samples_in_batch=_num_samples,
        get_num_tokens_in_batch=_num_tokens,
    )


def stream_loader(dataset: StepBatches, device: torch.device | None = None) -> DataLoader:
    """The training DataLoader: batches are pre-collated by step, read in the main process; for a GPU ``device``
    each batch's tensors are pinned as they are yielded (what ``DataLoader(pin_memory=True)`` does without worker
    processes), so Composer's copies to the device do not block."""
    dataset.pin_for = device if queues(device) else None
    return DataLoader(dataset, batch_size=None, num_workers=0)


# ------------------------------------------------------------------------------------------------
# row datasets: validation shards, selected-token shards
# ------------------------------------------------------------------------------------------------
class TokenRows(Dataset):
    """Map-style rows of an MDS directory: ``tokens`` (+ ``loss_mask`` when ``use_mask``).

    Args:
        path: shard directory.
        spec: shard spec to validate against (``candidate``, ``selected``, ...).
        use_mask: read the ``loss_mask`` column (selected-token shards: replay honours it).
        model_vocab: check token ids against the model's vocabulary.
    """

    def __init__(self, path: str, spec: str, *, use_mask: bool = False, model_vocab: int | None = None) -> None:
        self.path = path
        self.use_mask = use_mask
        self.model_vocab = model_vocab
        self.dataset = open_shards(path, spec)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Row:
        row = self.dataset[int(i)]
        tokens = np.asarray(row["tokens"])
        if self.model_vocab is not None:
            try:
                check_token_range(tokens, self.model_vocab, f"{self.path} (sample {i})")
            except ValueError as e:
                blame(e, *_shard_paths(self.dataset, [i]))
                raise
        out: Row = {"tokens": torch.from_numpy(tokens.astype(np.int64)), "source": str(row.get("source", ""))}
        if self.use_mask:
            out["loss_mask"] = torch.from_numpy(np.asarray(row["loss_mask"]).astype(bool))
        return out


def _shard_paths(dataset: object, ids: np.ndarray | list[int]) -> list[str]:
    """The shard files holding samples ``ids`` of ``dataset`` (a :class:`~curation.io.shards.ShardReader`; none
    for another dataset)."""
    where = getattr(dataset, "shard_path", None)
    return sorted({where(int(i)) for i in ids}) if where is not None else []


def collate_rows(items: list[Row]) -> Batch:
    """Stack rows into a batch dict."""
    out: Batch = {"tokens": torch.stack([x["tokens"] for x in items]), "source": [x["source"] for x in items]}
    if "loss_mask" in items[0]:
        out["loss_mask"] = torch.stack([x["loss_mask"] for x in items])
    return out


def rows_loader(
    rows: TokenRows, *, batch_size: int, shuffle: bool = False, seed: int = 0, max_batches: int | None = None,
    drop_last: bool = False,
) -> DataLoader:
    """A DataLoader over :class:`TokenRows` (optionally only the first ``max_batches`` batches)."""
    dataset: Dataset = rows
    if max_batches is not None:
        dataset = torch.utils.data.Subset(rows, range(min(len(rows), max_batches * batch_size)))
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator,
                      collate_fn=collate_rows, drop_last=drop_last, num_workers=0)
