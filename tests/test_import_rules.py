"""Import rules of the packages (DESIGN.md §4): no import circle, imports at module level, the core pure, the
rooms of ``training/`` one way, the jobs thin, the experiments on the top floor (``bench/``); no private names across
modules; the curation job needs no trainer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("curation", "training", "bench", "jobs", "schemas")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines of ``if TYPE_CHECKING:`` blocks (imports for annotations only: nothing is imported at run time)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path: Path, *, runtime_only: bool = False):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_lines(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield node.lineno, None, [a.name for a in node.names]


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_targets(path: Path, *, runtime_only: bool = True) -> set[str]:
    """The project modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` when that is a module)."""
    modules = {_module(p) for p in _sources()}
    out = set()
    for _, module, names in _imports(path, runtime_only=runtime_only):
        for target in ([f"{module}.{n}" for n in names] + [module]) if module else names:
            if target in modules:
                out.add(target)
                if module and target != module:  # the package's __init__ runs too
                    out.add(module) if module in modules else None
    return out - {_module(path)}


def _function_local_imports(path: Path):
    for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                module = node.module if isinstance(node, ast.ImportFrom) else (
                    node.names[0].name if isinstance(node, ast.Import) else None)
                if module and module.split(".")[0] in PACKAGES:
                    yield node.lineno, module


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
             if _top(m, n) & {"ray", "composer", "streaming", "training", "safetensors"}]
    assert not found, f"curation/core must stay pure torch: {found}"


def test_the_project_modules_import_one_another_without_a_circle():
    """A module graph with no cycle (module-level and function-local imports alike): a cycle is reported with its
    modules, in import order."""
    graph = {_module(p): _project_targets(p) for p in _sources()}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " → ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


#: The packages in the order of their dependencies (DESIGN.md §4): each imports only the ones after it.
LAYERS = ("jobs", "bench", "training", "curation", "schemas")


def test_the_packages_import_one_way():
    """``jobs → bench → training → curation → schemas``: a module never imports one of a package before its own
    (imports for annotations included), even where no circle results; so nothing of the product imports the
    experiments of ``bench/``."""
    found = [f"{p.relative_to(REPO)}: {t}" for p in _sources() for t in _project_targets(p, runtime_only=False)
             if LAYERS.index(t.split(".")[0]) < LAYERS.index(_module(p).split(".")[0])]
    assert not found, f"imports against jobs → training → curation → schemas: {found}"


def test_the_folders_of_curation_import_one_another_without_a_circle():
    """The folders of ``curation/`` (core, ingest, io, engine, evaluation) form no loop either, even where the modules
    inside them do not (e.g. io → ingest → io through different modules)."""
    edges: dict[str, set[str]] = {}
    for p in _sources():
        src = _module(p).split(".")
        if src[0] != "curation" or len(src) < 3:
            continue
        for t in _project_targets(p, runtime_only=False):
            dst = t.split(".")
            if dst[0] == "curation" and len(dst) >= 2 and dst[1] != src[1]:
                edges.setdefault(src[1], set()).add(dst[1])

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ()))

    loops = sorted(f"{a} ↔ {b}" for a in edges for b in edges[a] if reaches(b, a, {b}))
    assert not loops, f"folder-level import loops in curation/: {loops}"


def test_project_modules_are_imported_at_module_level_except_by_the_jobs():
    """A function-local import between project modules hides a dependency (and often a circle). The jobs are
    the one exception, for start-up time: they parse the config (``--help``, a bad setting) before importing
    Composer, Ray or torch, and a single-process run never imports Ray."""
    found = [f"{p.relative_to(REPO)}:{line}: {module}" for p in _sources() if p.parts[len(REPO.parts)] != "jobs"
             for line, module in _function_local_imports(p)]
    assert not found, "function-local imports of project modules (move them to the top): " + "; ".join(found)


def test_the_core_imports_nothing_of_the_project_but_the_core():
    """``curation/core`` is the algorithm on tensors: no config models, no file formats, no engine (imports for
    annotations under ``TYPE_CHECKING`` only)."""
    core = sorted((REPO / "curation" / "core").rglob("*.py"))
    found = [f"{p.relative_to(REPO)}:{line}: {m or n}" for p in core for line, m, n in _imports(p, runtime_only=True)
             if (m or n[0]).split(".")[0] in PACKAGES and not (m or n[0]).startswith("curation.core")]
    assert not found, f"curation/core imports outside the core: {found}"


#: The rooms of training/, each importing only the rooms before it (and curation, schemas).
TRAINING_ROOMS = ("training.blocks", "training.selection", "training.runs")


@pytest.mark.parametrize("room", TRAINING_ROOMS)
def test_the_rooms_of_training_import_one_way(room):
    allowed = TRAINING_ROOMS[: TRAINING_ROOMS.index(room) + 1]
    files = sorted((REPO / Path(*room.split("."))).rglob("*.py"))
    found = [f"{p.relative_to(REPO)}: {t}" for p in files for t in _project_targets(p, runtime_only=False)
             if t.startswith("training.") and not t.startswith(allowed)]
    assert files and not found, f"{room} imports a later room of training/: {found}"


def test_no_source_file_is_longer_than_500_lines_and_the_jobs_stay_thin():
    long = [f"{p.relative_to(REPO)}: {n}" for p in _sources()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500]
    assert not long, f"source files over 500 lines: {long}"
    # an entry point parses its config (or its arguments), calls one library function (an experiment's: bench/) and
    # prints where the outputs are; one ceiling for every job
    jobs = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in (REPO / "jobs").glob("*.py")}
    fat = {name: n for name, n in jobs.items() if n > 100}
    assert jobs and not fat and jobs["curate_and_train.py"] < 90, fat


def test_no_function_of_the_product_is_longer_than_80_lines():
    """A function of ``curation/``, ``training/`` or ``schemas/`` fits on a screen (80 lines, docstring included):
    a longer one holds several steps that deserve names."""
    files = sorted(p for pkg in ("curation", "training", "schemas") for p in (REPO / pkg).rglob("*.py"))
    long = {f"{p.relative_to(REPO)}:{fn.name}": fn.end_lineno - fn.lineno + 1 for p, fn in _functions(files)
            if fn.end_lineno - fn.lineno + 1 > 80}
    assert not long, f"functions over 80 lines (name their steps): {long}"


#: The modules of the engine a trainer may import (DESIGN.md §4, "the engine–trainer seam"): its declared handle and
#: typed answers, the engine's work for a trainer, the plan, and the Ray backend (its session, engine and group).
ENGINE_DOORS = ("curation.engine.handle", "curation.engine.report", "curation.engine.training_curation",
                "curation.engine.plan", "curation.engine.ray_backend")


def test_training_reaches_the_engine_only_through_its_doors():
    """``training/`` imports of ``curation.engine`` only the seam's modules: not the part ledger, the refresh runner,
    the scorer or the workers (a kernel the trainer needs lives on the compute floor, a reader in ``curation/io``)."""
    files = sorted((REPO / "training").rglob("*.py"))
    found = [f"{p.relative_to(REPO)}: {t}" for p in files for t in _project_targets(p, runtime_only=False)
             if t.startswith("curation.engine.") and not t.startswith(ENGINE_DOORS)]
    assert files and not found, f"training/ reaches past the engine's doors: {found}"


@pytest.mark.parametrize(("job", "module"), [("bench_quality.py", "bench.quality"), ("soak.py", "bench.soak")])
def test_the_experiments_live_in_bench_not_in_training(job, module):
    """``training/`` holds product code only: the quality benchmark and the soak are ``bench/``'s, and their jobs
    import them from there."""
    assert not (REPO / "training" / "quality").exists() and not (REPO / "training" / "runs" / "soak.py").exists()
    imported = {m for _, m, _ in _imports(REPO / "jobs" / job) if m}
    assert any(m.startswith(module) for m in imported), f"jobs/{job} does not import {module}: {sorted(imported)}"


#: What ``schemas/`` (configs, manifests, shard specs: data and pure rules) must not do: handle signals, lock
#: files, parse command lines or write files. Those are I/O and live in ``curation/io`` (stop, outdir, cli, atomic).
_IO_MODULES = {"signal", "fcntl", "argparse", "tempfile", "shutil", "subprocess", "socket"}
_WRITING_CALLS = {"replace", "rename", "makedirs", "mkdir", "unlink", "remove", "rmdir", "write", "pwrite",
                  "ftruncate", "fsync", "chmod", "fchmod", "symlink", "link", "open"}


def _writes(tree: ast.AST):
    """Lines of ``open(..., "w"/"a"/"x"/"+")`` and of ``os.<a call that writes>`` (``os.open`` included)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                  None)
            if mode is not None and not (isinstance(mode, ast.Constant) and set(str(mode.value)) <= set("rbt")):
                yield node.lineno, "open(..., mode)"
        elif (isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "os"
              and fn.attr in _WRITING_CALLS):
            yield node.lineno, f"os.{fn.attr}"


def test_schemas_hold_no_signal_handling_locks_argument_parsing_or_file_writes():
    """``schemas/`` is what configs and records *are*; how a job stops on a signal, locks its output directory,
    parses its command line or writes a file whole is I/O (``curation/io``: DESIGN.md §4)."""
    files = sorted((REPO / "schemas").rglob("*.py"))
    found = [f"{p.relative_to(REPO)}:{line}: import {t}" for p in files for line, m, n in _imports(p)
             for t in _top(m, n) & _IO_MODULES]
    found += [f"{p.relative_to(REPO)}:{line}: {what}" for p in files
              for line, what in _writes(ast.parse(p.read_text(encoding="utf-8")))]
    assert files and not found, f"I/O in schemas/ (move it to curation/io): {found}"


def test_the_io_modules_the_jobs_use_before_their_config_is_parsed_import_nothing_heavy():
    """The jobs parse the command line, open the output directory and install the stop handler before they import
    torch, Composer or Ray (``--help`` and a bad setting answer at once): these modules, and what they import of the
    project, import none of those."""
    heavy = {"torch", "composer", "ray", "streaming", "transformers", "numpy", "safetensors", "boto3", "tokenizers"}
    todo = ["curation.io.cli", "curation.io.outdir", "curation.io.stop", "curation.io.atomic", "curation.io.objects"]
    seen: set[str] = set()
    found = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = REPO / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        in_functions = {n.lineno for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(fn)
                        if isinstance(n, ast.Import | ast.ImportFrom)}  # (imported when called, not on import)
        found += [f"{module}:{line}: {t}" for line, m, n in _imports(path, runtime_only=True)
                  if line not in in_functions for t in _top(m, n) & heavy]
        todo += sorted(_project_targets(path))
    assert not found, f"heavy imports on the jobs' start-up path: {found}"


# ------------------------------------------------------------------------------------------------
# the engine–trainer seam (DESIGN.md §4: "where each kind of change goes at the engine–trainer seam")
# ------------------------------------------------------------------------------------------------
def _functions(paths):
    for p in paths:
        for fn in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                yield p, fn


def _params(fn):
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs]


def test_the_trainer_reaches_the_engine_through_its_declared_handle():
    """No parameter of ``training/`` that takes the engine is untyped or ``Any``: it is an ``EngineHandle`` or the
    ``EngineFeed`` that carries one (``curation/engine/handle.py``)."""
    found = [f"{p.relative_to(REPO)}:{fn.lineno}: {fn.name}({arg.arg}: {ast.unparse(arg.annotation) if arg.annotation else '?'})"
             for p, fn in _functions(sorted((REPO / "training").rglob("*.py"))) for arg in _params(fn)
             if "engine" in arg.arg and (arg.annotation is None or "Any" in ast.unparse(arg.annotation))]
    assert not found, f"the engine crosses into training/ untyped: {found}"


def test_the_engine_settings_cross_ray_as_typed_objects_not_dicts():
    """The settings handed to the actors (``WorkerSpec``, ``RefreshSpec``), the engine's work and the trainer's feed
    hold typed objects (``ModelConfig``, ``BatchOrder``, ``Schedule``, ``CandidateStream``, ``SelectionConfig``,
    ``LedgerSpec``), not dicts flattened on one side and rebuilt on the other."""
    classes = {"curation/engine/workers.py": "WorkerSpec", "curation/engine/refresh_runner.py": "RefreshSpec",
               "curation/engine/work.py": "EngineWork", "curation/engine/handle.py": "EngineFeed"}
    found = []
    for path, name in classes.items():
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
        cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
        found += [f"{path}: {name}.{f.target.id}: {ast.unparse(f.annotation)}" for f in cls.body
                  if isinstance(f, ast.AnnAssign) and "dict" in ast.unparse(f.annotation).lower()]
    assert not found, f"engine settings as dicts: {found}"


def test_the_run_schedule_is_built_once_and_passed_as_an_object():
    """``Schedule.of(cfg)`` (``curation/core/schedule.py``) is the one place a run's schedule is made; the engine and
    the trainer neither construct one nor rebuild one from a dict."""
    files = sorted([*(REPO / "curation" / "engine").rglob("*.py"), *(REPO / "training").rglob("*.py")])
    found = [f"{p.relative_to(REPO)}:{n.lineno}: {ast.unparse(n.func)}" for p in files
             for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
             if isinstance(n, ast.Call) and ast.unparse(n.func) == "Schedule"]
    assert not found, f"schedules made outside Schedule.of: {found}"


def test_every_refresh_takes_its_start_state_as_one_object():
    """The refresh's start (previous weights, AdamW state, workspace, clone) is one ``RefreshStart``; no refresh of
    the core or the trainer (``refresh_reference``, ``SelectionPolicy.refresh``, ``RefreshData.refresh``,
    ``InProcessReference.refresh``) spells its fields out as parameters again. (The engine's refresh runner takes the
    previous reference version's ``Weights`` as they travel between actors, and builds the ``RefreshStart``.)"""
    files = sorted([*(REPO / "curation" / "core").rglob("*.py"), *(REPO / "training").rglob("*.py")])
    start = {"previous", "optimizer_state", "workspace", "clone"}
    found = [f"{p.relative_to(REPO)}:{fn.lineno}: {fn.name}({', '.join(sorted(names))})"
             for p, fn in _functions(files) if "refresh" in fn.name and (names := {a.arg for a in _params(fn)} & start)]
    assert not found, f"refresh start state spelled out as parameters: {found}"
