"""CI runs what README tells a new user to run: ``.ci/run``'s first two commands are README's set-up commands 1
and 2, character for character (issue 32: CI installed more than README said, and hid a test that failed without
the logger extras)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    """The command lines of a shell script or a bash block: no comments, no blank lines, no shell settings."""
    lines = [line.split(" #")[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "set ", "cd ", "export ", "start=", "main=",
                                                                      "loggers=", "echo "))]


def test_ci_runs_readmes_two_set_up_commands_first_exactly():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Set-up.*?```bash\n(.*?)```", readme, re.S)
    assert block, "README has no set-up block"
    want = _commands(block[1])
    assert len(want) == 2 and want[0].startswith("pip install -e ") and want[1].startswith("python -m pytest"), want
    ci = _commands((REPO / ".ci" / "run").read_text(encoding="utf-8"))
    assert ci[:2] == want, (ci[:2], want)


def test_the_longest_files_named_for_xdist_exist_and_are_handed_out_in_that_order():
    """tests/conftest.py's _LONGEST_FILES orders the files xdist hands out (a renamed file would silently go last);
    pyproject keeps xdist from reordering them by their number of tests."""
    import tomllib

    from tests.conftest import _LONGEST_FILES

    assert len(set(_LONGEST_FILES)) == len(_LONGEST_FILES)
    assert [f for f in _LONGEST_FILES if not (REPO / f).is_file()] == []
    opts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert "--dist loadfile" in opts["addopts"] and "--no-loadscope-reorder" in opts["addopts"]
