"""Schedule: warm-up, episodes, refreshes, reference versions."""

from __future__ import annotations

import pytest

from curation.core.schedule import WARMUP_EPISODE, Schedule


def test_warmup_episodes_and_refreshes_by_hand():
    s = Schedule(warmup=3, tau=4, total_steps=12)
    steps = range(12)
    assert [s.is_warmup(t) for t in steps] == [True] * 3 + [False] * 9
    assert [s.episode(t) for t in steps] == [-1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert [t for t in steps if s.refresh_due(t)] == [3, 7, 11]
    assert [s.reference_version(t) for t in steps] == [-1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert [s.reference_version(t, refreshed=False) for t in steps] == [-1] * 3 + [0] * 9
    assert s.num_refreshes() == 3
    assert list(s.steps_scored_by(1)) == [7, 8, 9, 10]
    assert list(s.steps_scored_by(2)) == [11]  # clipped to total_steps
    assert list(s.steps_scored_by(5)) == []
    assert s.refresh_step(2) == 11
    assert not s.refresh_due(15)  # past the end: nothing left to score


def test_every_refresh_starts_the_episode_it_scores():
    s = Schedule(warmup=5, tau=3, total_steps=40)
    for t in range(40):
        if s.refresh_due(t):
            assert s.steps_scored_by(s.episode(t))[0] == t
        if not s.is_warmup(t):
            assert t in s.steps_scored_by(s.reference_version(t))


def test_no_warmup_matches_design_episode_formula():
    s = Schedule(warmup=0, tau=5)
    assert all(s.episode(t) == t // 5 for t in range(50))
    assert [t for t in range(20) if s.refresh_due(t)] == [0, 5, 10, 15]
    with pytest.raises(ValueError, match="total_steps"):
        s.num_refreshes()


def test_warmup_longer_than_run():
    s = Schedule(warmup=10, tau=4, total_steps=8)
    assert s.num_refreshes() == 0 and all(s.episode(t) == WARMUP_EPISODE for t in range(8))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup": -1, "tau": 2}, "warmup"),
        ({"warmup": 0, "tau": 0}, "tau"),
        ({"warmup": 0, "tau": 1.5}, "tau"),
        ({"warmup": 0, "tau": 2, "total_steps": -3}, "total_steps"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


def test_negative_step_raises():
    s = Schedule(warmup=2, tau=3, total_steps=9)
    with pytest.raises(ValueError, match="step t"):
        s.episode(-1)


def test_episode_end_by_hand():
    # W = 3, τ = 4, 12 steps: episode 0 = steps 3..6, episode 1 = 7..10, episode 2 = 11 (clipped at 12)
    s = Schedule(warmup=3, tau=4, total_steps=12)
    assert [s.episode_end(t) for t in range(3, 12)] == [7, 7, 7, 7, 11, 11, 11, 11, 12]
    assert Schedule(warmup=0, tau=5).episode_end(12) == 15  # open-ended: not clipped
    for t in range(3, 12):  # the same steps as the reference that scores t
        assert s.episode_end(t) == s.steps_scored_by(s.reference_version(t)).stop
    with pytest.raises(ValueError, match="step 2 is a warm-up step"):
        s.episode_end(2)


def test_same_episodes_ignores_total_steps_only():
    s = Schedule(warmup=3, tau=4, total_steps=12)
    assert s.same_episodes(s.to_dict())
    assert s.same_episodes({"warmup": 3, "tau": 4, "total_steps": 40})  # a finished run extended
    assert s.same_episodes({"warmup": 3, "tau": 4})
    assert not s.same_episodes({"warmup": 2, "tau": 4, "total_steps": 12})
    assert not s.same_episodes({"warmup": 3, "tau": 5, "total_steps": 12})
    assert not s.same_episodes({})


def test_episode_starts_are_the_refresh_steps():
    s = Schedule(warmup=3, tau=4, total_steps=12)
    assert list(s.episode_starts()) == [3, 7, 11] == [t for t in range(12) if s.refresh_due(t)]
    assert list(s.episode_starts(11)) == [3, 7] and list(s.episode_starts(2)) == []
    assert len(s.episode_starts()) == s.num_refreshes()
    assert list(Schedule(warmup=0, tau=5).episode_starts(11)) == [0, 5, 10]
    with pytest.raises(ValueError, match="needs a stop step"):
        Schedule(warmup=0, tau=5).episode_starts()
