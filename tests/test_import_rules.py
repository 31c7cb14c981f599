"""Import rules of the packages: no private names across modules; the curation job needs no trainer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("curation", "training", "jobs", "schemas")


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield node.lineno, None, [a.name for a in node.names]


def _sources():
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_no_module_imports_another_modules_private_names():
    found = [f"{p.relative_to(REPO)}:{line}: {module}.{name}"
             for p in _sources() for line, module, names in _imports(p) if module
             for name in names if name.startswith("_") and not name.startswith("__")]
    assert not found, "private names imported across modules (make them public or move them): " + "; ".join(found)


@pytest.mark.parametrize("job", ["curate.py"])
def test_the_curation_job_imports_nothing_from_training(job):
    found = [f"{line}: {module or names}" for line, module, names in _imports(REPO / "jobs" / job)
             if (module or "").split(".")[0] == "training" or any(n.split(".")[0] == "training" for n in names)]
    assert not found, f"jobs/{job} (no training) imports training/: {found}"


def _top(module: str | None, names: list[str]) -> set[str]:
    return {module.split(".")[0]} if module else {n.split(".")[0] for n in names}


def test_only_the_ray_backend_imports_ray_and_the_core_imports_neither_ray_nor_composer():
    backend = REPO / "curation" / "engine" / "ray_backend"
    ray_users = sorted(str(p.relative_to(REPO)) for p in _sources()
                       if any("ray" in _top(m, n) for _, m, n in _imports(p)))
    assert ray_users and all(u.startswith(str(backend.relative_to(REPO))) for u in ray_users), ray_users
    core = sorted(p for p in (REPO / "curation" / "core").rglob("*.py"))
    found = [f"{p.relative_to(REPO)}:{line}" for p in core for line, m, n in _imports(p)
             if _top(m, n) & {"ray", "composer", "streaming", "training"}]
    assert not found, f"curation/core must stay pure torch: {found}"
