"""Part names of step-indexed shard directories: one function for every writer."""

from __future__ import annotations

import random

import pytest

from curation.engine.plan import WorkUnit
from curation.io.shards import part_name


def test_part_name_layout():
    assert part_name(0, 4) == "steps-000000000-000000004"
    assert part_name(12, 345_678_901) == "steps-000000012-345678901"


def test_part_names_sort_in_step_order():
    # the manifests and the merged index list parts by name: the order must be the steps' order
    rng = random.Random(0)
    ranges = sorted({(a, a + rng.randint(1, 5000)) for a in (rng.randint(0, 10**8) for _ in range(200))})
    names = [part_name(a, b) for a, b in ranges]
    assert sorted(names) == names and len(set(names)) == len(names)


@pytest.mark.parametrize("first,stop", [(0, 1), (3, 7), (999, 1000)])
def test_engine_units_use_the_writers_part_names(first, stop):
    # an engine's selected part has the name the single-process trainer gives the same steps
    assert WorkUnit(first, stop, "selected").name == part_name(first, stop)
    assert WorkUnit(first, stop, "scored", 0).name == part_name(first, stop)
