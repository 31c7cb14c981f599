"""The soak's growth figures (training/runs/soak.py): each process against itself over the last attempt."""

from __future__ import annotations

import pytest

from training.runs.soak import _growth


def _samples(pid: int, role: str, values: list[tuple[int, int]], attempt: int = 2, t0: float = 0.0) -> list[dict]:
    return [{"attempt": attempt, "t": t0 + i, "step": i, "role": role, "pid": pid, "rss": rss, "fds": fds}
            for i, (rss, fds) in enumerate(values)]


def test_growth_is_the_worst_process_of_the_last_attempt_against_itself():
    samples = (_samples(1, "driver", [(1, 1)] * 8, attempt=1)  # an earlier attempt: ignored
               + _samples(2, "driver", [(100, 10)] * 4 + [(110, 10)] * 4)
               + _samples(3, "worker", [(200, 20)] * 8)
               + _samples(4, "worker", [(200, 20)] * 6 + [(200, 30)] * 2)
               + _samples(5, "worker", [(50, 5), (400, 40)], t0=3.0))  # restarted mid-attempt: left out
    d, w = _growth(samples, "driver"), _growth(samples, "worker")
    assert d["processes"] == 1 and d["rss"] == pytest.approx(0.10) and d["fds"] == 0.0
    assert (d["rss_first"], d["rss_last"]) == (100.0, 110.0)
    assert w["processes"] == 2 and w["excluded"] == 1
    assert w["rss"] == 0.0 and w["fds"] == pytest.approx(0.5) and (w["fds_first"], w["fds_last"]) == (20.0, 30.0)
    assert _growth([], "worker")["rss"] is None
