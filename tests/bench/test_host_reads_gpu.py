"""On a GPU: the steady steps the host-read counter measures on the CPU (tests/bench/test_host_reads.py) never
synchronise. 20 steady trainer steps of every policy and 20 scoring-worker steps run under
``torch.cuda.set_sync_debug_mode("error")``: any synchronising call (``.item()``, a blocking copy, a
``synchronize()``) raises where it is made. The allowed read of a step is an event's wait (``HostCopies.get``),
which is not a synchronising call of the device. Skipped, with the reason, without CUDA."""

from __future__ import annotations

import pytest
import torch
from composer.core import Callback

from bench.host_read_scenarios import Setting, worker_setup
from curation.engine.plan import PROXY, REFERENCE, WorkUnit
from curation.engine.weights import Weights
from curation.engine.workers import ScoringWorker
from curation.io.models import build_causal_lm
from training.runs.wiring import build_training

STEADY = 20


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.set_sync_debug_mode)")


class _Strict(Callback):
    """Sync errors from each steady step's start (after its refresh and scoring, done before it) to its end."""

    def __init__(self, first: int, stop: int) -> None:
        self.first, self.stop, self.steps = first, stop, 0

    def batch_start(self, state, logger):
        if self.first <= int(state.timestamp.batch) < self.stop:
            torch.cuda.set_sync_debug_mode("error")
            self.steps += 1

    def batch_end(self, state, logger):  # (after the algorithms' step end: the step's one read, an event's wait)
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["full", "random", "rho1", "blade"])
def test_steady_trainer_steps_never_synchronise_on_cuda(tmp_path, policy):
    _cuda()
    setting = Setting(str(tmp_path), steps=STEADY + 6)
    cfg = setting.train_config(policy, policy)
    run = build_training(cfg)
    first = cfg.selection.warmup_steps + 2  # after the warm-up, the episode's start and the step after it
    strict = _Strict(first, first + STEADY)
    run.trainer.state.callbacks.insert(0, strict)
    try:
        run.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert strict.steps == STEADY


@pytest.mark.gpu
@pytest.mark.parametrize("output", ["scored", "selected"])
def test_steady_worker_steps_never_synchronise_on_cuda(tmp_path, output):
    _cuda()
    setting = Setting(str(tmp_path))
    cfg, spec, _ = worker_setup(setting, output)
    weights = {(REFERENCE, 0): Weights.from_state_dict(build_causal_lm(cfg.model.architecture)),
               (PROXY, 2): Weights.from_state_dict(build_causal_lm(cfg.model.architecture))}
    proxy = 2 if output == "selected" else None
    worker = ScoringWorker(spec, 0)
    fetch = lambda k, v: weights[(k, v)]  # noqa: E731
    worker.run(WorkUnit(2, 4, output, 0, proxy), fetch)  # warm-up: weights on the device, rings allocated
    waits = worker.stats["host_waits"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        worker.run(WorkUnit(4, 4 + STEADY, output, 0, proxy), fetch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert worker.stats["host_waits"] - waits == STEADY  # one wait per step
