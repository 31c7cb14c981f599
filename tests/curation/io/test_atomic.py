"""curation.io.atomic: files written whole get the modes any new file gets (0666 less the umask), not 0600."""

from __future__ import annotations

import os
import stat

import pytest

from curation.io.atomic import atomic_write_text, umask_mode, write_manifest, write_unit_record
from schemas.manifest import Manifest, UnitRecord


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664), (0o077, 0o600)])
def test_atomically_written_files_get_the_umasks_modes(tmp_path, umask, mask, mode):
    umask(mask)
    assert umask_mode() == mode
    atomic_write_text(str(tmp_path / "config.yaml"), "a: 1\n")
    manifest = write_manifest(str(tmp_path / "c"), Manifest(kind="candidate", job="prepare"))
    write_unit_record(str(tmp_path / "u" / "unit-00000.json"), UnitRecord(source="s", unit=0, spans=[]))
    atomic_write_text(str(tmp_path / "config.yaml"), "a: 2\n")  # a replaced file too
    for path in (tmp_path / "config.yaml", manifest, tmp_path / "u" / "unit-00000.json"):
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, path
    assert (tmp_path / "config.yaml").read_text() == "a: 2\n"
    assert sorted(os.listdir(tmp_path)) == ["c", "config.yaml", "u"]  # no temporary file left
