"""The engine directory's reference logs are read back for the report: only the files the run wrote."""

from __future__ import annotations

import json
import os

import pytest

from curation.engine.refresh_runner import refresh_logs
from curation.io.paths import UnsafeNameError


def test_a_reference_log_that_is_a_link_is_refused_not_reported(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "reference-0000.json").write_text(json.dumps({"version": 0, "steps": 3}))
    assert refresh_logs(str(engine)) == [{"version": 0, "steps": 3}]
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"version": 1, "secret": "outside the run"}))
    os.symlink(secret, engine / "reference-0001.json")
    with pytest.raises(UnsafeNameError, match=rf"^{engine}/reference-0001.json: a symbolic link \(to '{secret}'\), "
                                              r"not a reference log written by the run; refused") as e:
        refresh_logs(str(engine))
    assert "\n" not in str(e.value) and "outside the run" not in str(e.value)
