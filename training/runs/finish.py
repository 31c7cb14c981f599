"""How every run finishes: :func:`finish`, the one writer of ``final/`` and ``summary.json``.

``jobs/train.py`` (one process or a data-parallel group), ``jobs/replay.py`` and ``jobs/curate_and_train.py`` end
here, in the process that holds the output directory's lock, with the run's :class:`~training.runs.rank.RankResult`
(rank 0's) and, for the main job, the engine's :class:`~curation.engine.report.EngineReport`:

* ``final/model.safetensors`` + ``final/config.json`` + the shards' tokenizer's files: the trained model, which
  ``AutoModelForCausalLM`` and ``AutoTokenizer`` load;
* ``final/reference.safetensors``: the last reference ``w̃``: the in-process reference's weights, or a copy of the
  engine's last ``reference-NNNN.safetensors`` (each file written whole, atomically);
* ``summary.json`` (+ ``plots/``): one schema for every job (:data:`~training.blocks.summary.SCHEMA_VERSION`;
  docs/REFERENCE.md, "summary.json", lists every key and the names they replaced), one name per fact;
* an object-store output directory: what is not in the bucket yet is uploaded.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

from curation.engine.report import EngineReport
from curation.io import storage
from curation.io.hf_export import save_tokenizer
from curation.io.models import save_weights
from training.blocks.summary import SCHEMA_VERSION, selection_sections, write_summary
from training.runs.rank import RankResult
from training.runs.wiring import TrainRun

__all__ = ["Finished", "finish", "summary_of"]


@dataclass(frozen=True)
class Finished:
    """What a finished run wrote (paths in the local cache of an object-store output directory).

    Attributes:
        output_dir: the run's output directory.
        final: ``final/``; ``final_weights``: the model in it; ``final_reference``: the reference (``None``: none).
        summary: ``summary.json``; ``plots``: the PNG plots.
        selected: the selected-token shards (``None``: none written).
        result: the run's :class:`~training.runs.rank.RankResult`; ``engine``: the engine's report (the main job).
        run: the wired run when it trained in this process (one worker), for a caller that looks inside it.
    """

    output_dir: str
    final: str
    final_weights: str
    final_reference: str | None
    summary: str
    plots: tuple[str, ...]
    selected: str | None
    result: RankResult
    engine: EngineReport | None = None
    run: TrainRun | None = None

    @property
    def validation(self) -> tuple[object, ...]:
        """``{step, loss, perplexity}`` after each evaluation."""
        return self.result.validation


def finish(output_dir: str, result: RankResult, engine_report: EngineReport | None = None, *,
           plots: bool = True) -> Finished:
    """Write ``final/`` and ``summary.json`` (+ ``plots/``) of a finished run (module docstring); returns the paths.

    Raises:
        ValueError: the result holds no weights (a stopped run, or a rank other than 0: nothing to finish).
    """
    if result.weights is None:
        raise ValueError(f"{output_dir}: rank {result.rank}'s result holds no weights to finish the run with"
                         + (f" (it stopped after step {result.stopped_at})" if result.stopped_at is not None else ""))
    final = os.path.join(output_dir, "final")
    weights = save_weights(result.weights.model, os.path.join(final, "model.safetensors"))
    result.weights.config.to_json_file(os.path.join(final, "config.json"))
    if result.weights.tokenizer is not None:
        save_tokenizer(result.weights.tokenizer, final)
    else:
        print(f"note: {final} has no tokenizer (the shards' manifests name none that is still there; set the "
              "data's tokenizer to have it copied)", file=sys.stderr, flush=True)
    reference = _write_reference(final, result, engine_report)
    summary, pngs = write_summary(output_dir, summary_of(result, engine_report), plots=plots)
    # an object-store output directory: what is not in the bucket yet, but not the engine's folders: its actors,
    # on any node, upload what they write there themselves (this cache may hold what they have since replaced or pruned)
    skip = [os.path.relpath(d, output_dir) for d in (engine_report.engine_dir, engine_report.out_dir)] \
        if engine_report is not None else []
    uploaded = storage.push_all(output_dir, skip=[d for d in skip if not d.startswith("..")])
    if uploaded is not None:
        print(uploaded, flush=True)
    return Finished(output_dir, final, weights, reference, summary, tuple(pngs), result.selected_dir, result,
                    engine_report)


def _write_reference(final: str, result: RankResult, engine_report: EngineReport | None) -> str | None:
    target = os.path.join(final, "reference.safetensors")
    if engine_report is not None:  # the engine's last reference version, copied as it is
        source = engine_report.final_reference
        if source is None:
            return None
        if not storage.fetch(source):  # (the refresh actor's node's cache held it: the bucket has it too)
            raise FileNotFoundError(f"{source}: the engine's last reference is missing")
        shutil.copyfile(source, target + ".tmp")
        os.replace(target + ".tmp", target)
        return target
    assert result.weights is not None
    if result.weights.reference is None:
        return None
    return save_weights(result.weights.reference, target)


def summary_of(result: RankResult, engine_report: EngineReport | None = None) -> dict[str, object]:
    """The run's ``summary.json`` (schema :data:`~training.blocks.summary.SCHEMA_VERSION`): every key in every job's
    summary, ``null`` (or empty) where the job has no such thing."""
    sel = selection_sections(result.stats) if result.stats is not None else {
        "policy": None, "steps": result.steps, "tokens": None, "delta_quantiles_per_episode": {},
        "delta_histograms": {}, "param_distance": [], "train_loss": [], "refreshes": [], "seconds": {}, "counts": {},
        "per_step": []}
    engine = None
    if engine_report is not None:
        sel["refreshes"] = list(engine_report.refreshes)  # the engine refreshed the reference, not the trainer
        engine = engine_report.section(trainer_wait_seconds=result.wait_seconds, trainer_waits=result.waits,
                                       publish_seconds=result.publish_seconds)
    return {
        "schema_version": SCHEMA_VERSION, "policy": sel.pop("policy"), "steps": sel.pop("steps"),
        "world_size": result.world_size, "resumed_from": result.resumed_from,
        "stream": result.stream.to_dict() if result.stream is not None else None,
        "selected_dir": result.selected_dir, "tokens": sel.pop("tokens"), "validation": list(result.validation),
        **sel, "throughput": result.throughput, "memory": result.memory, "engine": engine,
    }
