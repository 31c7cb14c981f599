"""The scoring worker of the engine (no ray).

:class:`ScoringWorker` scores work units (step ranges of the candidate stream) with a reference ``w̃``
(and, for selected output, a proxy ``u``), and writes each unit as one MDS part into its own subdirectory.
Models are built once; new weights arrive as :class:`~curation.engine.weights.Weights` with a version and
are loaded into the same modules. Scoring reuses :class:`curation.engine.scorer.TokenLossScorer`
(``torch.inference_mode``, bf16 autocast on CUDA). The reference refresh is
:mod:`curation.engine.refresh_runner`.

Runs in-process in tests and, unchanged, inside the Ray worker actors of :mod:`curation.engine.ray_backend`.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curation.core.losses import target_valid
from curation.core.policies import get_policy
from curation.core.schedule import Schedule
from curation.core.step import SelectionStep
from curation.core.stream import CandidateStream
from curation.engine.ledger import PartResult
from curation.engine.plan import PROXY, REFERENCE, ScoringDataError, WorkUnit, worker_dir
from curation.engine.scorer import TokenLossScorer, check_finite_losses
from curation.engine.weights import Weights
from curation.io.models import check_token_range, model_vocab_size
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

    def ids(self, step: int) -> np.ndarray:
        stream = CandidateStream(self.num_samples, self.batch_size, self.seed)
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
        self.scorers: dict[str, TokenLossScorer] = {REFERENCE: TokenLossScorer(scorer_cfg)}
        if spec.needs_proxy:
            self.scorers[PROXY] = TokenLossScorer(scorer_cfg)
        self.model_vocab = model_vocab_size(self.scorers[REFERENCE].model)
        self.versions: dict[str, int | None] = {k: None for k in self.scorers}
        self.cuda = self.scorers[REFERENCE].device.type == "cuda"
        self.stats = {"units": 0, "tokens": 0, "seconds": 0.0, "weight_loads": 0, "host_waits": 0}

    # --- weights -----------------------------------------------------------------------------
    def set_weights(self, kind: str, version: int, weights: Weights) -> None:
        scorer = self.scorers[kind]
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
        rows, length = [], None
        for i in ids:
            try:
                row = self.candidates[int(i)]
                tokens = np.asarray(row["tokens"])
            except Exception as e:  # a corrupt shard: name it
                raise ScoringDataError(f"{self.where(int(i), step)}: cannot decode the record ({e})") from e
            if tokens.ndim != 1 or (length is not None and tokens.shape[0] != length):
                raise ScoringDataError(f"{self.where(int(i), step)}: sequence of shape {tokens.shape}, expected "
                                       f"({length},)")
            length = tokens.shape[0]
            rows.append((tokens, str(row["source"])))
        batch = np.stack([t for t, _ in rows])
        if batch.size and int(batch.max()) >= self.model_vocab:  # one reduction per step; the bad row named
            bad = int(np.argmax((batch >= self.model_vocab).any(axis=1)))
            check_token_range(batch[bad], self.model_vocab, self.where(int(ids[bad]), step), error=ScoringDataError)
        return batch, [s for _, s in rows], ids

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
        if self.cuda:
            tokens = tokens.pin_memory()
        return tokens_np, sources, ids, tokens

    def _prefetched(self, steps: range, pool: ThreadPoolExecutor) -> Iterator[tuple[int, Any]]:
        """``(step, loaded step)`` in order, the next step read and decoded in ``pool`` while the caller
        scores the current one. A bad record raises when its step is reached, as without prefetching."""
        it = iter(steps)
        step = next(it, None)
        pending = pool.submit(self._load_step, step) if step is not None else None
        while step is not None:
            nxt = next(it, None)
            following = pool.submit(self._load_step, nxt) if nxt is not None else None
            try:
                loaded = pending.result()
            except BaseException:
                if following is not None:
                    following.cancel()
                raise
            yield step, loaded
            step, pending = nxt, following

    # --- one unit ----------------------------------------------------------------------------
    # A step is *launched* (its device work queued, its results' copy to the host queued behind it) before the
    # previous one is *finished* (the host waits for that step's results alone, checks them, makes its rows):
    # on a GPU the forward of step t+1 runs while the host turns step t into rows, so neither waits for the
    # other per step. On a CPU the same code runs synchronously (no pinned buffers, no events): the same values.
    def _launch(self, unit: WorkUnit, step: int, loaded: tuple[np.ndarray, list[str], np.ndarray, Tensor]
                ) -> _Launched:
        tokens_np, sources, ids, tokens = loaded
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
            valid = target_valid(tokens)
            selecting = REFERENCE in device  # else warm-up: every valid token, no score
            ref16, proxy = None, None
            if selecting:  # a non-finite loss is named before the selection sees it (one wait per model)
                self._check(REFERENCE, device[REFERENCE], ids, step)
                ref16 = device[REFERENCE].to(torch.float16)  # as stored in a scored shard
                proxy = self.scorers[PROXY].queue_losses(tokens)
                self._check(PROXY, proxy, ids, step)
            # Exactly the trainer's exact-mode step: float32 ℓ(u), float16 ℓ(w̃) as stored in a scored shard.
            sel = self.select(step, proxy, valid.to(proxy.device) if selecting else valid, ref16, selecting=selecting)
            out["loss_mask"] = sel.mask.to(torch.uint8)
            out["score"] = sel.scores.float()
        host, ready = out, None
        if self.cuda:  # into pinned buffers, asynchronously; the event marks this step's results on the host
            host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                    for k, v in out.items()}
            ready = torch.cuda.Event()
            ready.record()
        return _Launched(step, tokens_np, sources, ids, host, device, ready)

    def _finish(self, unit: WorkUnit, launched: _Launched, counts: dict[str, dict[str, int]],
                dtype: np.dtype) -> list[dict[str, Any]]:
        if launched.ready is not None:
            launched.ready.synchronize()  # this step's results alone; the next step's work stays queued
            self.stats["host_waits"] += 1
        host, step, sources, tokens_np = launched.host, launched.step, launched.sources, launched.tokens_np
        if "finite" in host and not bool(host["finite"]):
            self._check(REFERENCE, launched.device[REFERENCE], launched.ids, step)
        rows = []
        length = tokens_np.shape[1]
        if unit.output == "scored":
            ref_np = host["ref_loss"].numpy()
            episode = int(unit.ref_version)
            for i, src in enumerate(sources):
                c = counts.setdefault(src, {"sequences": 0, "tokens": 0, "kept_tokens": 0})
                c["sequences"] += 1
                c["tokens"] += length
                rows.append({"tokens": tokens_np[i].astype(dtype, copy=False), "source": src, "ref_loss": ref_np[i],
                             "episode": episode})
            return rows
        mask_np = host["loss_mask"].numpy()
        score_np = f16_scores(host["score"].numpy())
        episode = self.schedule.episode(step) if self.schedule is not None else 0
        for i, src in enumerate(sources):
            c = counts.setdefault(src, {"sequences": 0, "tokens": 0, "kept_tokens": 0})
            c["sequences"] += 1
            c["tokens"] += length
            c["kept_tokens"] += int(mask_np[i].sum())
            rows.append({"tokens": tokens_np[i].astype(dtype, copy=False), "loss_mask": mask_np[i], "score": score_np[i],
                         "source": src, "step": int(step), "episode": int(episode)})
        return rows

    def rows(
        self, unit: WorkUnit, counts: dict[str, dict[str, int]], *, pool: ThreadPoolExecutor | None = None
    ) -> Iterator[list[dict[str, Any]]]:
        """The rows of a unit's part, one list per step (counts per source are accumulated into ``counts``).

        With ``pool``, the next step is read and decoded there while the current one is scored. Step t+1 is
        launched before step t is finished (see :meth:`_launch`); an error of step t (a non-finite loss) is
        raised before one of step t+1 (a bad record), as in step order."""
        dtype = self.candidates[0]["tokens"].dtype
        loaded_steps = iter(self._prefetched(unit.steps, pool) if pool is not None
                            else ((t, self._load_step(t)) for t in unit.steps))
        pending: _Launched | None = None
        while True:
            try:
                item = next(loaded_steps, None)
                launched = self._launch(unit, *item) if item is not None else None
            except BaseException:
                if pending is not None:
                    self._finish(unit, pending, counts, dtype)  # the earlier step's error first
                raise
            if pending is not None:
                yield self._finish(unit, pending, counts, dtype)
            if launched is None:
                return
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
        # Three stages overlap: a reader thread decodes step t+1, this thread scores step t, and a writer
        # thread compresses and writes the rows of step t−1 (`write_part` consumes them into `<part>.tmp`
        # and renames it at the end), so a crash mid-unit leaves only a .tmp that the redo replaces.
        with ThreadPoolExecutor(2, thread_name_prefix=f"worker{self.worker_id}-io") as pool:
            n = _write_behind(pool, lambda rows: write_part(os.path.join(self.spec.out_dir, name), spec, rows,
                                                            vocab_size=self.spec.vocab_size),
                              self.rows(unit, counts, pool=pool))
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
    host: dict[str, Tensor]  # results on the host (on a GPU: pinned buffers, filled once ``ready`` has passed)
    device: dict[str, Tensor]  # the losses on the device, to name a non-finite one
    ready: Any  # torch.cuda.Event on a GPU, else None


_DONE = object()


class _Aborted(Exception):
    """Tells the writer thread that producing the rows failed (the part must not be completed)."""


def _write_behind(pool: ThreadPoolExecutor, write: Callable[[Iterator[dict[str, Any]]], int],
                  steps: Iterator[list[dict[str, Any]]]) -> int:
    """``write(rows)`` in a ``pool`` thread while this thread produces the rows, a list per step; returns what
    ``write`` returns.

    The steps' lists go through a small queue (a few steps), so the producer runs at most that far ahead. An
    error while producing is raised here after the writer has stopped *without* completing (its row
    iterator raises); an error while writing stops the producer and is raised here.
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=4)

    def consume() -> Iterator[dict[str, Any]]:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Aborted):
                raise item
            yield from item

    writer = pool.submit(write, consume())

    def put(item: Any) -> None:
        while True:
            try:
                q.put(item, timeout=0.05)
                return
            except queue.Full:
                if writer.done():  # the writer failed: raise its error
                    writer.result()
                    raise RuntimeError("the part writer stopped early") from None

    try:
        for rows in steps:
            put(rows)
    except BaseException:
        if not writer.done():
            try:
                put(_Aborted())
            except BaseException:  # noqa: S110 - the writer's own error is secondary to this one
                pass
        try:
            writer.result()
        except BaseException:  # noqa: S110 - expected: the writer stops on _Aborted
            pass
        raise
    put(_DONE)
    return writer.result()


