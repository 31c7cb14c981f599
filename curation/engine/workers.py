"""The scoring worker of the engine (no ray).

:class:`ScoringWorker` scores work units (step ranges of the candidate stream) with a reference ``w̃``
(and, for selected output, a proxy ``u``), and writes each unit as one MDS part into its own subdirectory.
Models are built once; new weights arrive as :class:`~curation.engine.weights.Weights` with a version and
are loaded into the same modules. Scoring reuses :class:`curation.core.scorer.TokenLossScorer`
(``torch.inference_mode``, bf16 autocast on CUDA). The reference refresh is
:mod:`curation.engine.refresh_runner`.

Runs in-process in tests and, unchanged, inside the Ray worker actors of :mod:`curation.engine.ray_backend`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curation.core.host_sync import HostCopies, PinnedRing, Ticket, queues, set_matmul_precision
from curation.core.losses import target_valid
from curation.core.policies import get_policy
from curation.core.schedule import Schedule
from curation.core.scorer import TokenLossScorer, check_finite_losses
from curation.core.step import SelectionStep
from curation.core.stream import CandidateStream
from curation.engine.ledger import PartResult
from curation.engine.plan import PROXY, REFERENCE, ScoringDataError, WorkUnit, worker_dir
from curation.engine.weights import Weights
from curation.io.bad_shards import blame
from curation.io.mds import RowBlock
from curation.io.models import build_scorer, check_token_range, model_vocab_size
from curation.io.shards import open_shards, write_part
from schemas.shards import SCORED, SELECTED
from schemas.train_config import ModelConfig, ScorerConfig

__all__ = ["BatchOrder", "WorkerSpec", "ScoringWorker", "f16_scores"]


def f16_scores(x: np.ndarray) -> np.ndarray:
    """Scores at shard precision (float16; |Δ| beyond the float16 range is clipped, NaN kept)."""
    return np.clip(x, -65504.0, 65504.0).astype(np.float16)


@dataclass(frozen=True)
class BatchOrder:
    """Which candidate sequences form step ``t``.

    ``stream``: the training stream (:class:`curation.core.stream.CandidateStream`: endless seeded epochs).
    ``blocks``: one pass for batch curation: blocks of ``batch_size`` consecutive sequences in file order
    (or in one seeded permutation with ``shuffle``); the last block may be shorter.
    """

    kind: str
    num_samples: int
    batch_size: int
    seed: int = 0
    shuffle: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("stream", "blocks"):
            raise ValueError(f"order kind must be 'stream' or 'blocks', got {self.kind!r}")
        CandidateStream(self.num_samples, self.batch_size, self.seed)  # validates the numbers

    @property
    def num_steps(self) -> int:
        """Steps of one ``blocks`` pass."""
        return -(-self.num_samples // self.batch_size)

    @cached_property
    def _stream(self) -> CandidateStream:
        return CandidateStream(self.num_samples, self.batch_size, self.seed)

    def ids(self, step: int) -> np.ndarray:
        stream = self._stream
        if self.kind == "stream":
            return stream.batch_ids(step)
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step {step} outside the pass of {self.num_steps} steps")
        start, stop = step * self.batch_size, min((step + 1) * self.batch_size, self.num_samples)
        return stream.positions(start, stop) if self.shuffle else np.arange(start, stop, dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_samples": self.num_samples, "batch_size": self.batch_size,
                "seed": self.seed, "shuffle": self.shuffle}


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a scoring worker needs (handed to the actor as it is; workers read no config files or env vars).

    Attributes:
        candidates: candidate-shard directory.
        out_dir: output directory (the worker writes ``out_dir/worker-NN/<unit>``).
        model: the architecture of proxy and reference.
        order: which candidate sequences form each step.
        vocab_size: the candidate shards' vocabulary (token column dtype).
        policy: selection policy (scores ``Δ = ℓ(u) − ℓ(w̃)``).
        gamma: γ.
        schedule: the run's, for the ``episode`` column of selected output (``None``: episode 0, batch curation).
        device: ``auto`` / ``cpu`` / ``cuda``.
        threads: torch CPU threads (``None``: leave the process setting alone).
        score_batch_size: sequences per forward (``None``: the whole batch).
        needs_proxy: build a proxy model (selected output).
        precision: ``fp32`` / ``amp_bf16`` (bf16 autocast on CUDA), the trainer's setting, so that the
            workers' ℓ(w̃) (and pipelined ℓ(u)) are computed as the trainer computes ℓ(u).
    """

    candidates: str
    out_dir: str
    model: ModelConfig
    order: BatchOrder
    vocab_size: int
    policy: str = "blade"
    gamma: float = 0.6
    schedule: Schedule | None = None
    device: str = "auto"
    threads: int | None = None
    score_batch_size: int | None = None
    needs_proxy: bool = True
    precision: str = "fp32"


class ScoringWorker:
    """Scores work units and writes them as parts (see the module docstring).

    Args:
        spec: the worker's settings.
        worker_id: its index (names its output subdirectory).
    """

    def __init__(self, spec: WorkerSpec, worker_id: int) -> None:
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.worker_id = worker_id
        self.subdir = worker_dir(worker_id)
        self.order = spec.order
        self.policy = get_policy(spec.policy)
        self.select = SelectionStep(self.policy, spec.gamma)  # the trainer's step, on one worker's rows
        self.schedule = spec.schedule
        self.candidates = open_shards(spec.candidates, "candidate")
        if len(self.candidates) != self.order.num_samples:
            raise ValueError(f"{spec.candidates}: holds {len(self.candidates)} sequences, the plan expects "
                             f"{self.order.num_samples}")
        batch = spec.score_batch_size or self.order.batch_size
        scorer_cfg = ScorerConfig(model=spec.model, device=spec.device, batch_size=batch, precision=spec.precision)
        self.scorers: dict[str, TokenLossScorer] = {REFERENCE: build_scorer(scorer_cfg)}
        if spec.needs_proxy:
            self.scorers[PROXY] = build_scorer(scorer_cfg)
        self.model_vocab = model_vocab_size(self.scorers[REFERENCE].model)
        self.versions: dict[str, int | None] = {k: None for k in self.scorers}
        self.device = self.scorers[REFERENCE].device
        self.cuda = queues(self.device)  # a GPU (or the host-read counter's stand-in): pipelined steps
        self.matmul = set_matmul_precision(self.device)  # the trainer's and the refresh's setting
        # A step's tokens in, its results out: pinned buffers in rings of 3 slots (the step being finished, the one
        # launched after it, the next one loaded), reused step after step, one event per step
        self.staging = PinnedRing(self.device, slots=3)
        self.copies = HostCopies(self.device, slots=3)
        self.stats = {"units": 0, "tokens": 0, "seconds": 0.0, "weight_loads": 0, "host_waits": 0}

    # --- weights -----------------------------------------------------------------------------
    def set_weights(self, kind: str, version: int, weights: Weights) -> None:
        scorer = self.scorers[kind]  # (on a GPU: one copy per dtype from the scorer's reused pinned buffer)
        scorer.load_weights(weights.state_dict(), version)
        self.versions[kind] = version
        self.stats["weight_loads"] += 1

    def _ensure(self, unit: WorkUnit, fetch: Callable[[str, int], Weights]) -> None:
        for kind, version in unit.needs():
            if self.versions.get(kind) != version:
                self.set_weights(kind, version, fetch(kind, version))

    # --- data --------------------------------------------------------------------------------
    def where(self, sample: int, step: int) -> str:
        shard, record = self.candidates.locate(sample)
        return f"{self.spec.candidates}: shard {shard}, record {record} (sample {sample}, step {step})"

    def read_step(self, step: int) -> tuple[np.ndarray, list[str], np.ndarray]:
        """``(tokens (b, L), sources, sample ids)`` of ``step``; bad records raise :class:`ScoringDataError`."""
        ids = self.order.ids(step)
        columns = self.candidates.gather(ids)  # the whole step at once; None: row by row, naming a bad record
        if columns is not None and columns["tokens"].ndim == 2:
            batch, sources = columns["tokens"], columns["source"]
        else:
            batch, sources = self._read_rows(ids, step)
        if batch.size and int(batch.max()) >= self.model_vocab:  # one reduction per step; the bad row named
            bad = int(np.argmax((batch >= self.model_vocab).any(axis=1)))
            try:
                check_token_range(batch[bad], self.model_vocab, self.where(int(ids[bad]), step), error=ScoringDataError)
            except ScoringDataError as e:
                blame(e, self.candidates.shard_path(int(ids[bad])))
                raise
        return batch, sources, ids

    def _read_rows(self, ids: np.ndarray, step: int) -> tuple[np.ndarray, list[str]]:
        rows, length = [], None
        for i in ids:
            try:
                row = self.candidates[int(i)]
                tokens = np.asarray(row["tokens"])
            except Exception as e:  # a corrupt shard: name it
                raise blame(ScoringDataError(f"{self.where(int(i), step)}: cannot decode the record ({e})"),
                            self.candidates.shard_path(int(i))) from e
            if tokens.ndim != 1 or (length is not None and tokens.shape[0] != length):
                raise blame(ScoringDataError(f"{self.where(int(i), step)}: sequence of shape {tokens.shape}, "
                                             f"expected ({length},)"), self.candidates.shard_path(int(i)))
            length = tokens.shape[0]
            rows.append((tokens, str(row["source"])))
        return np.stack([t for t, _ in rows]), [s for _, s in rows]

    def _check(self, kind: str, losses: Tensor, ids: np.ndarray, step: int) -> None:
        """Raise :class:`ScoringDataError` naming the record whose ``kind`` loss is not finite (a synchronisation)."""
        try:
            check_finite_losses(losses, "reference")
        except ValueError as e:  # non-finite loss: name the record
            msg = str(e)
            row = None
            if "(row, position)" in msg:
                try:
                    row = int(msg.split("(row, position) (")[1].split(",")[0])
                except (IndexError, ValueError):
                    row = None
            where = self.where(int(ids[row]), step) if row is not None else f"{self.spec.candidates}: step {step}"
            raise ScoringDataError(f"{where}: {kind} {msg}") from e

    def _load_step(self, step: int) -> tuple[np.ndarray, list[str], np.ndarray, Tensor]:
        """:meth:`read_step` plus the int64 token tensor, in pinned memory when scoring on CUDA (so the
        scorer's copy to the device is asynchronous)."""
        tokens_np, sources, ids = self.read_step(step)
        tokens = torch.from_numpy(tokens_np.astype(np.int64))
        if self.cuda:  # into the ring's pinned buffer (this slot's earlier copy is done: its step was finished)
            tokens = self.staging.buffer(self.staging.next(), "tokens", tokens.shape, tokens.dtype).copy_(tokens)
        return tokens_np, sources, ids, tokens

    # --- one unit ----------------------------------------------------------------------------
    # A step is *launched* (its device work queued, its results' copy to the host queued behind it) before the
    # previous one is *finished* (the host waits for that step's results alone, checks them, makes its rows):
    # on a GPU the forward of step t+1 runs while the host turns step t into rows, writes them and reads step
    # t+2, so neither waits for the other per step. On a CPU the same code runs synchronously (no pinned
    # buffers, no events): the same values.
    #
    # All of it runs in the calling thread. The host's work per token (reading, decoding, the rows, encoding,
    # compressing: about 0.1 µs, `jobs/bench_scoring.py --pipeline-only`) is a tenth of a GPU forward's, so the
    # queued forward hides it. A reader and a writer thread (this worker had them) cost more host time than the
    # work they moved: each step's two hand-offs and their GIL switches took 150-400 µs of CPU, as much as the
    # work itself at b = 8, L = 256, and Python holds the GIL for all but zstd and the file writes.
    def _launch(self, unit: WorkUnit, step: int, loaded: tuple[np.ndarray, list[str], np.ndarray, Tensor]
                ) -> _Launched:
        tokens_np, sources, ids, tokens = loaded
        if self.cuda:  # (from the ring's pinned buffer: not a wait)
            tokens = tokens.to(self.device, non_blocking=True)
        device, out = {}, {}
        if unit.ref_version >= 0:
            device[REFERENCE] = self.scorers[REFERENCE].queue_losses(tokens)
        if unit.output == "scored":
            assert REFERENCE in device, "scored units always have a reference"
            out["ref_loss"] = device[REFERENCE].to(torch.float16)
            # The finite-loss check rides on the results' copy: a flag computed on the device, not a wait of its own.
            # The sum is non-finite if any loss is (a cheaper reduction than isfinite().all(); a sum that overflows
            # only sends the step to the exact check, which then passes).
            out["finite"] = device[REFERENCE].sum().isfinite()
        else:
            valid = target_valid(tokens)  # (on the device)
            selecting = REFERENCE in device  # else warm-up: every valid token, no score
            ref16, proxy = None, None
            if selecting:
                ref, proxy = device[REFERENCE], self.scorers[PROXY].queue_losses(tokens)
                device[PROXY] = proxy
                # One flag for both models, read with the results; a non-finite loss is named then (_finish) and
                # the selection sees 0 in its place until that (a GPU's top-k would assert on it)
                out["finite"] = ref.sum().isfinite() & proxy.sum().isfinite()
                ref16 = torch.where(torch.isfinite(ref), ref, 0.0).to(torch.float16)  # as stored in a scored shard
                proxy = torch.where(torch.isfinite(proxy), proxy, 0.0)
            # Exactly the trainer's exact-mode step: float32 ℓ(u), float16 ℓ(w̃) as stored in a scored shard.
            sel = self.select(step, proxy, valid, ref16, selecting=selecting)
            out["loss_mask"] = sel.mask.to(torch.uint8)
            out["score"] = sel.scores.float()
        # into pinned buffers of the ring, asynchronously; the event marks this step's results on the host
        return _Launched(step, tokens_np, sources, ids, self.copies.put(out), device)

    def _finish(self, unit: WorkUnit, launched: _Launched, counts: dict[str, dict[str, int]],
                dtype: np.dtype) -> RowBlock:
        """Step ``launched``'s rows, once its results are on the host (counts per source accumulated)."""
        host = self.copies.get(launched.ticket)  # this step's results alone; the next step's work stays queued
        if self.cuda:
            self.stats["host_waits"] += 1
        step, sources, tokens_np = launched.step, launched.sources, launched.tokens_np
        if "finite" in host and not bool(host["finite"]):
            for kind in (REFERENCE, PROXY):
                if kind in launched.device:
                    self._check(kind, launched.device[kind], launched.ids, step)
        length = tokens_np.shape[1]
        tokens = tokens_np.astype(dtype, copy=False)
        if unit.output == "scored":
            for src in sources:
                c = counts.setdefault(src, {"sequences": 0, "tokens": 0, "kept_tokens": 0})
                c["sequences"] += 1
                c["tokens"] += length
            return RowBlock({"tokens": tokens, "source": sources, "ref_loss": host["ref_loss"].numpy().copy(),
                             "episode": int(unit.ref_version)}, len(sources))
        mask_np = host["loss_mask"].numpy().copy()
        kept = mask_np.sum(axis=1, dtype=np.int64).tolist()
        for src, k in zip(sources, kept, strict=True):
            c = counts.setdefault(src, {"sequences": 0, "tokens": 0, "kept_tokens": 0})
            c["sequences"] += 1
            c["tokens"] += length
            c["kept_tokens"] += k
        episode = self.schedule.episode(step) if self.schedule is not None else 0
        return RowBlock({"tokens": tokens, "loss_mask": mask_np, "score": f16_scores(host["score"].numpy()),
                         "source": sources, "step": int(step), "episode": int(episode)}, len(sources))

    def rows(self, unit: WorkUnit, counts: dict[str, dict[str, int]]) -> Iterator[RowBlock]:
        """The rows of a unit's part, one :class:`~curation.io.mds.RowBlock` per step (iterate one for its rows as
        dicts; counts per source are accumulated into ``counts``).

        Step t+1 is launched before step t is finished (see :meth:`_launch`); an error of step t (a non-finite
        loss) is raised before one of step t+1 (a bad record), as in step order."""
        dtype = self.candidates[0]["tokens"].dtype
        pending: _Launched | None = None
        for step in (*unit.steps, None):
            try:
                launched = self._launch(unit, step, self._load_step(step)) if step is not None else None
            except BaseException:
                if pending is not None:
                    self._finish(unit, pending, counts, dtype)  # the earlier step's error first
                raise
            if pending is not None:
                yield self._finish(unit, pending, counts, dtype)
            pending = launched

    def run(self, unit: WorkUnit, fetch: Callable[[str, int], Weights]) -> PartResult:
        """Score ``unit`` and write its part (replacing any leftover of an earlier attempt).

        Args:
            unit: the work unit.
            fetch: ``(kind, version) → Weights``; called only when the held version differs.

        Raises:
            ScoringDataError: bad candidate data (names shard file and record).
        """
        start = time.perf_counter()
        self._ensure(unit, fetch)
        spec = SCORED if unit.output == "scored" else SELECTED
        name = f"{self.subdir}/{unit.name}"
        counts: dict[str, dict[str, int]] = {}
        # `write_part` consumes the rows into `<part>.tmp` and renames it once whole: an error mid-unit leaves
        # only the .tmp, which the redo replaces.
        n = write_part(os.path.join(self.spec.out_dir, name), spec, self.rows(unit, counts),
                       vocab_size=self.spec.vocab_size)
        tokens = sum(c["tokens"] for c in counts.values())
        seconds = time.perf_counter() - start
        self.stats["units"] += 1
        self.stats["tokens"] += tokens
        self.stats["seconds"] += seconds
        return PartResult(
            worker=self.worker_id, unit=unit.name, name=name, first=unit.first, stop=unit.stop, samples=n,
            tokens=tokens, kept_tokens=sum(c["kept_tokens"] for c in counts.values()), sources=counts,
            seconds=seconds, scored_tokens=tokens * (1 + int(unit.proxy_version is not None)),
        )


@dataclass
class _Launched:
    """One step whose device work is queued: what the host needs to finish it once its results are back."""

    step: int
    tokens_np: np.ndarray
    sources: list[str]
    ids: np.ndarray
    ticket: Ticket  # the results' copies to the host (on a GPU: pinned buffers of the ring, and an event)
    device: dict[str, Tensor]  # the losses on the device, to name a non-finite one
