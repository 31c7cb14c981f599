"""Online curation for a trainer: the engine's work of ``jobs/curate_and_train.py``, built from the job's config in
one place (:meth:`TrainingCuration.of`), beside its batch twin :mod:`curation.engine.batch_curation`.

Three nouns, three stages of one engine: :class:`~curation.engine.work.EngineWork` is what an engine is asked to do
(units, typed worker and refresh settings, the ledger's record, the plan); :class:`TrainingCuration` is that work
for a trainer, with what the trainer reads (the candidate stream, the workers' shard directory);
:class:`~curation.engine.ray_backend.RayEngine` is the engine running it, which the trainer reaches through an
:class:`~curation.engine.handle.EngineFeed` (:meth:`TrainingCuration.feed`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from curation.core.policies import get_policy
from curation.core.schedule import Schedule
from curation.core.stream import CandidateStream
from curation.engine.handle import EngineFeed, EngineHandle
from curation.engine.ledger import LedgerSpec
from curation.engine.plan import TrainingPlan
from curation.engine.refresh_runner import RefreshSpec
from curation.engine.work import EngineWork
from curation.engine.workers import BatchOrder, WorkerSpec
from curation.io import storage
from curation.io.outputs import urls_in
from curation.io.shards import check_tokenizer, shard_dir_info
from schemas.engine_config import CurateAndTrainConfig

__all__ = ["TrainingCuration"]


@dataclass(frozen=True)
class TrainingCuration:
    """The engine's work for one trainer and the candidate stream it scores (derived from the config, once).

    Attributes:
        work: what the engine does.
        stream: the candidate stream the workers score and the trainer consumes, by step.
        out_dir: the workers' shards: ``scored/`` (exact) or ``selected/`` (pipelined).
    """

    work: EngineWork
    stream: CandidateStream
    out_dir: str

    @property
    def plan(self) -> TrainingPlan:
        assert self.work.plan is not None
        return self.work.plan

    def feed(self, handle: EngineHandle, *, timeout_s: float) -> EngineFeed:
        """What the trainer is handed once the engine runs (``timeout_s``: ``engine.wait_timeout_s``)."""
        return EngineFeed(handle, self.out_dir, self.stream, self.plan, timeout_s)

    @classmethod
    def of(cls, cfg: CurateAndTrainConfig) -> TrainingCuration:
        """Check the data (tokenizers agree) and build the work: the one place a setting of the job reaches the
        workers (:class:`WorkerSpec`), the refresh (:class:`RefreshSpec`) and the ledger (:class:`LedgerSpec`)."""
        t, eng, wk = cfg.train, cfg.engine, cfg.workers
        cand = shard_dir_info(t.data.candidates, "candidate")
        fingerprint = check_tokenizer([cand, shard_dir_info(t.data.validation, "candidate")], t.data.tokenizer)
        policy = get_policy(t.selection.policy)
        schedule = Schedule.of(t)  # the run's: the plan, the workers, the refresh and the trainer follow this one
        pipelined = eng.mode == "pipelined"
        plan = TrainingPlan(schedule, eng.mode, policy.refreshes, eng.snapshot_period if pipelined else 1,
                            eng.overlap_steps if eng.refresh == "overlapped" else 0)
        num = cand.manifest.totals().sequences
        stream = CandidateStream(num, t.batch_size, t.seed)
        out = os.path.join(t.output_dir, "selected" if pipelined else "scored")
        engine_dir = os.path.join(t.output_dir, "engine")
        model = t.model.architecture  # the workers' model: how the trainer runs it aside
        run_key = {
            "stream": stream.to_dict(), "plan": plan.to_dict(), "policy": policy.name,
            "model": model.model_dump(mode="json"), "selection": t.selection.model_dump(mode="json"),
            "optim": t.optim.model_dump(mode="json"), "candidates": storage.canonical(t.data.candidates),
            "validation": storage.canonical(t.data.validation), "range_steps": wk.range_steps,
        }
        ledger = LedgerSpec(out, kind="selected" if pipelined else "scored", job="curate_and_train", run_key=run_key,
                            config=urls_in(cfg.model_dump(mode="json")), vocab_size=cand.vocab_size,
                            seq_len=cand.seq_len, tokenizer_fingerprint=fingerprint,
                            extra={"stream": stream.to_dict(), "policy": policy.name})
        worker_spec = WorkerSpec(
            candidates=t.data.candidates, out_dir=out, model=model, order=BatchOrder("stream", num, t.batch_size, t.seed),
            vocab_size=cand.vocab_size, policy=policy.name, gamma=t.selection.gamma, schedule=schedule,
            device=wk.device, threads=wk.threads, score_batch_size=wk.score_batch_size, needs_proxy=pipelined,
            precision=t.precision,
        )
        refresh_spec = RefreshSpec(
            model=model, validation=t.data.validation, candidates=t.data.candidates, stream=stream,
            selection=t.selection, ref_lr=t.ref_lr, refresh_batch_size=t.refresh_batch_size, engine_dir=engine_dir,
            device=eng.refresh_device, threads=eng.refresh_threads or wk.threads, precision=t.precision,
            schedule=schedule,
        )
        work = EngineWork(units=plan.units(wk.range_steps), worker_spec=worker_spec, ledger=ledger,
                          engine_dir=engine_dir, plan=plan, refresh_mode=policy.refresh_mode, refresh_spec=refresh_spec)
        return cls(work, stream, out)
