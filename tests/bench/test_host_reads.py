"""The host-read counter (bench/host_reads.py) and the targets it asserts: at most one host read per steady step of
the trainer (every policy, microbatched, fed by the engine) and of a scoring worker, at most two per episode start and
per weight load (issue 52). A read added to a steady step fails here, naming its file:line."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from bench.host_read_scenarios import SCENARIOS, TARGETS, Setting, check_target, figures, trainer_scenario
from bench.host_reads import HostReadCounter, on_device
from curation.core.host_sync import STAND_IN, HostCopies, queues

HERE = "tests/bench/test_host_reads.py"


def _line(marker: str) -> int:
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line(" not in line)


# ------------------------------------------------------------------------------------------------
# the counter
# ------------------------------------------------------------------------------------------------
def test_device_tensors_are_tracked_and_every_kind_of_read_is_counted_where_it_is_made():
    with HostReadCounter() as c:
        x = torch.ones(4).to(STAND_IN)  # a blocking copy to the device: a read
        y = (x * 2).sum()  # computed from a device tensor: on the device
        assert on_device(x) and on_device(y) and x.device == STAND_IN and queues(x.device)
        host = torch.arange(3)
        assert not on_device(host) and host.device == torch.device("cpu") and not queues(host.device)
        y.item()  # marker: value
        bool(y > 0)
        x.cpu()  # marker: d2h
        x[x > 1]  # marker: shape
        torch.zeros(2, device=STAND_IN).tolist()
        torch.cuda.synchronize()  # marker: wait
    kinds = [r.kind for r in c.reads]
    assert kinds == ["h2d", "value", "value", "d2h", "shape", "value", "wait"], kinds
    assert all(r.owner == "project" for r in c.reads)
    assert c.reads[1].site == f"{HERE}:{_line('marker: value')}"
    assert c.reads[3].site == f"{HERE}:{_line('marker: d2h')}"
    assert c.reads[4].site == f"{HERE}:{_line('marker: shape')}"
    assert c.reads[6].site == f"{HERE}:{_line('marker: wait')}"


def test_pinned_non_blocking_copies_and_host_work_are_not_reads():
    with HostReadCounter() as c:
        staged = torch.arange(6).pin_memory()  # (pinning needs a GPU: the counter tags it)
        assert staged.is_pinned() and staged[2:].is_pinned()
        dev = staged.to(STAND_IN, non_blocking=True)
        pageable = torch.arange(6).to(STAND_IN, non_blocking=True)  # not a read; listed apart
        host = torch.empty(6, dtype=torch.int64, pin_memory=True).copy_(dev * 2, non_blocking=True)
        (torch.arange(4) + 1).tolist()  # host values: free
        copies = HostCopies(dev.device)
        got = copies.get(copies.put({"a": dev + 1}))  # one event wait
    assert on_device(pageable) and not on_device(host)
    assert [r.kind for r in c.reads] == ["wait"] and [r.kind for r in c.pageable] == ["h2d"]
    assert got["a"].tolist() == [1, 2, 3, 4, 5, 6]


def test_a_module_placed_on_the_device_has_device_parameters_gradients_and_outputs():
    model = torch.nn.Linear(3, 2)
    with HostReadCounter() as c:
        model.to(STAND_IN)
        out = model(torch.ones(1, 3).to(STAND_IN, non_blocking=True))
        out.sum().backward()
        assert all(on_device(p) and on_device(p.grad) for p in model.parameters()) and on_device(out)
        assert next(model.parameters()).device == STAND_IN
        model.zero_grad(set_to_none=True)
        model.to("cpu")  # offloading: one blocking copy per tensor
    assert [r.kind for r in c.reads] == ["h2d", "h2d", "d2h", "d2h"]  # placed, then offloaded: a copy per tensor
    assert not any(on_device(p) for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# the targets
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> Setting:
    s = Setting(str(tmp_path_factory.mktemp("host_reads")))
    s.data()
    return s


def test_the_job_offers_every_scenario_and_prints_the_report_of_bench(capsys):
    """``jobs/bench_host_reads.py`` names the scenarios before torch loads (its ``--only`` choices): they are
    bench's, in its order; its text report is :func:`report_lines`'s."""
    from bench.host_read_scenarios import report_lines
    from tests.conftest import load_job

    assert load_job("bench_host_reads").SCENARIO_NAMES == tuple(SCENARIOS)
    r = {"targets": {"weight_load": 2}, "met": {"weight_load": False},
         "weight_load": {"per_step": 3, "owners": {"project": 3}, "sites": ["a.py:1 (project, wait)"]},
         "refresh": {"per_step": 2, "sites": []}}
    assert report_lines(r) == ["weight_load: 3 per step (target <= 2, NOT met); by owner {'project': 3}",
                               "    a.py:1 (project, wait)", "refresh: 2 per refresh; sites []"]


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_steady_steps_meet_their_target(setting, name):
    f = SCENARIOS[name](setting)
    check_target(name, f)
    assert f.steps >= 2 and f.per_step >= 1  # (measured, and at least the one read a step is allowed)
    assert f.owners["composer"] == 0 and f.owners["other"] == 0, f.sites


def test_a_read_added_to_a_steady_step_fails_naming_its_site(setting, monkeypatch):
    from training.blocks.model import MaskedCausalLM

    real = MaskedCausalLM.loss

    def loss_read_on_the_host(self, outputs, batch):
        loss = real(self, outputs, batch)
        loss.item()  # the deliberate read
        return loss

    monkeypatch.setattr(MaskedCausalLM, "loss", loss_read_on_the_host)
    f, _ = trainer_scenario(setting, "blade_read", "blade")
    site = f"{HERE}:{_line('the deliberate read')} (project, value)"
    assert f.per_step == 2 and site in f.sites, f.sites
    with pytest.raises(AssertionError, match=re.escape(site)):
        check_target("trainer_blade", f)


def test_the_selection_figures_add_no_read_to_a_steady_step(setting):
    """Issue 57's figures for the loggers (each log interval's shares and Δ quantiles, each ended episode's Δ
    histogram) come from the step records already read (issue 52): a blade run with τ = 4 and a log interval of 2
    logs both within its measured steps, at one read each. Episodes start at steps 2, 6 and 10 (their scoring and
    refresh: ``episode_start``'s target), not measured here; episode 0's histogram goes out at step 7, when step 6's
    record (episode 1's first) is read."""
    f, counter = trainer_scenario(setting, "blade_figures", "blade", selection={"tau": 4},
                                  throughput={"log_interval": 2})
    steady = [4, 5, 7, 8, 9]
    f = figures(counter, steady)
    check_target("trainer_blade", f)
    assert f.per_step == 1 and all(len(counter.by_label().get(s, [])) == 1 for s in steady), f.sites
    with open(os.path.join(setting.root, "runs", "blade_figures", "logs", "metrics.jsonl"), encoding="utf-8") as fh:
        lines = [json.loads(line) for line in fh]
    tables = {r["table"]: r["step"] for r in lines if "table" in r}
    assert tables == {"blade/delta_histogram/episode_0000": 6, "blade/delta_histogram/episode_0001": 10,
                      "blade/delta_histogram/episode_0002": 12}
    shares = sorted(r["step"] for r in lines if "blade/kept_share/target" in r)
    assert shares == [2, 4, 6, 8, 10, 12]
