"""Batch curation as a library function (what ``jobs/curate.py`` calls): score and select a candidate corpus with
given checkpoints on Ray workers, no training.

Every block of ``batch_size`` sequences is one candidate batch; its top-γ tokens by ``Δ = ℓ(u) − ℓ(w̃)`` are kept
(``u``: the proxy checkpoint, or the base model of ``model`` without one). Writes ``output_dir/selected/``
(selected-token shards in per-worker subdirectories, a merged ``index.json`` and a ``manifest.json`` with
per-source kept counts) and ``output_dir/summary.json``. A rerun with the same config and output directory skips
finished parts; bad data stops the job with the shard and record named, keeping what was finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator

from curation.engine.ledger import LedgerSpec
from curation.engine.plan import PROXY, REFERENCE, plan_batch_units
from curation.engine.ray_backend import RayEngine, check_shared, ray_session
from curation.engine.weights import Weights
from curation.engine.work import EngineWork
from curation.engine.workers import BatchOrder, WorkerSpec
from curation.io import objects, storage
from curation.io.atomic import atomic_write_text
from curation.io.models import build_causal_lm, check_vocab
from curation.io.outdir import OutputDirLock
from curation.io.outputs import localize, open_output, urls_in
from curation.io.shards import check_tokenizer, shard_dir_info
from curation.io.stop import GracefulStop, StopRequested
from schemas.engine_config import CurateConfig
from schemas.manifest import Manifest

__all__ = ["curate"]


def _weights(path: str, what: str) -> Weights:
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path} does not exist")
    return Weights.load(path)


@contextlib.contextmanager
def _shared(needs: dict[str, str], cfg: CurateConfig) -> Iterator[None]:
    """Refuse a local path some node able to run a scoring worker cannot reach (in the Ray session)."""
    check_shared(needs, resources=cfg.workers.resources)
    yield


def curate(cfg: CurateConfig) -> dict:
    """Run (or resume) the curation; returns the summary dict. Raises EngineError / ValueError.

    Holds ``output_dir``'s lock; a rerun resumes only with the config recorded in ``output_dir/config.yaml``.
    """
    cfg = localize(cfg)  # s3:// directories and weights: their local caches (curation.io.storage)
    mark = objects.upload_mark()  # this run's uploads are counted from here
    with open_output(cfg.output_dir, "curate", {"config.yaml": cfg}) as lock:
        return _curate(cfg, lock, mark)


def _curate(cfg: CurateConfig, lock: OutputDirLock, mark: int) -> dict:
    start = time.perf_counter()
    cand = shard_dir_info(cfg.candidates, "candidate")
    fingerprint = check_tokenizer([cand], cfg.tokenizer)
    base = build_causal_lm(cfg.model)
    check_vocab(base, cand.vocab_size, what=Manifest.path_in(cand.path))
    reference = _weights(cfg.reference_weights, "reference_weights")
    proxy = _weights(cfg.proxy_weights, "proxy_weights") if cfg.proxy_weights else Weights.from_state_dict(base)
    del base
    num = cand.manifest.totals().sequences
    order = BatchOrder("blocks", num, cfg.batch_size, seed=cfg.seed, shuffle=cfg.shuffle)
    units = plan_batch_units(order.num_steps, cfg.workers.range_steps)
    out = os.path.join(cfg.output_dir, "selected")
    fps = {"reference": reference.fingerprint(), "proxy": proxy.fingerprint()}
    run_key = {"candidates": storage.canonical(cfg.candidates), "order": order.to_dict(), "gamma": cfg.gamma,
               "model": cfg.model.model_dump(mode="json"), "weights": fps, "range_steps": cfg.workers.range_steps}
    ledger = LedgerSpec(out, kind="selected", job="curate", run_key=run_key, config=urls_in(cfg.model_dump(mode="json")),
                        vocab_size=cand.vocab_size, seq_len=cand.seq_len, tokenizer_fingerprint=fingerprint,
                        model_fingerprints=fps, extra={"order": order.to_dict()})
    spec = WorkerSpec(
        candidates=cfg.candidates, out_dir=out, model=cfg.model, order=order,
        vocab_size=cand.vocab_size, policy="blade", gamma=cfg.gamma, schedule=None, device=cfg.workers.device,
        threads=cfg.workers.threads, score_batch_size=cfg.workers.score_batch_size, needs_proxy=True,
        precision=cfg.precision,
    )
    lock.write_records()
    # SIGTERM / SIGINT: the workers finish their units in progress (RayEngine.close), then the job stops;
    # entered after ray.init, which sets its own SIGTERM handler (a second signal stops at once)
    needs = {k: p for k, p in (("candidates", cfg.candidates), ("output_dir", cfg.output_dir))
             if storage.url_of(p) is None}  # (local paths: every node of a cluster must reach them)
    try:
        with ray_session(cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.include_dashboard,
                         need_cpus=cfg.workers.count * cfg.workers.threads), _shared(needs, cfg), GracefulStop(
                what="the work units in progress"), RayEngine(
                EngineWork(units=units, worker_spec=spec, ledger=ledger,
                           engine_dir=os.path.join(cfg.output_dir, "engine")),
                cfg.workers, fixed_weights={(REFERENCE, 0): reference, (PROXY, 0): proxy},
        ) as engine:
            engine.run(progress=cfg.progress, desc="curate")
            report = engine.report()
            elsewhere = engine.finish({"report": {"stats": report.stats.to_dict(), "progress": report.progress.to_dict()}})
    except StopRequested as e:
        storage.refresh(Manifest.path_in(out))  # (the coordinator's, written on whatever node it ran)
        kept = Manifest.load_if_exists(out)
        n = len({s.state.get("unit") for s in kept.shards if s.complete}) if kept is not None else 0
        raise StopRequested(e.signum, f"with {n} of {len(units)} work units finished in {out}; rerun the same "
                                      f"command to do the other {len(units) - n} (finished parts are kept)") from None
    elsewhere += sum(r.get("uploaded", 0) for r in engine.worker_results.values())  # (the workers, once closed)
    storage.refresh(Manifest.path_in(out))  # (the coordinator's, written on whatever node it ran)
    manifest = Manifest.load(out)
    seconds = time.perf_counter() - start
    per_source = {s: {"sequences": c.sequences, "tokens": c.tokens, "kept_tokens": c.kept_tokens,
                      "kept_fraction": c.kept_tokens / max(c.tokens - c.sequences, 1)}
                  for s, c in sorted(manifest.sources.items())}
    summary = {
        "selected_dir": storage.display(out), "parts": len(manifest.shards), "sequences": manifest.totals().sequences,
        "tokens": manifest.totals().tokens, "kept_tokens": manifest.totals().kept_tokens, "per_source": per_source,
        "proxy": storage.display(cfg.proxy_weights) if cfg.proxy_weights else "base model (reference-only pass)",
        "reference": storage.display(cfg.reference_weights),
        "gamma": cfg.gamma, "workers": cfg.workers.count, "redone_units": report.progress.redone,
        "seconds_this_run": seconds, "scored_tokens_per_second_this_run": report.stats.tokens / seconds,
    }
    atomic_write_text(os.path.join(cfg.output_dir, "summary.json"), json.dumps(summary, indent=1))
    uploaded = storage.push_all(cfg.output_dir, since=mark, elsewhere=elsewhere)  # an object-store output_dir: the rest
    if uploaded is not None:
        print(uploaded, flush=True)
    return summary
