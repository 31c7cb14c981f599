"""transformers' in-case imports of scikit-learn and SciPy wait for their first call (curation/io/deferred_imports.py).

Each check runs in a fresh interpreter (an import hook acts once per process, on modules not imported yet). Stand-in
``sklearn`` and ``scipy`` packages (with their distributions' metadata, so that transformers counts them installed)
record when they are imported and what their functions were called with; the last check (slow: a model built and
Composer imported, ≈ 6 s) uses the real ones, where installed, along the imports of a scoring worker and a trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO


def _fake_packages(root) -> str:  # noqa: ANN001 - pytest's tmp_path
    """``sklearn.metrics.roc_curve`` and ``scipy.optimize.linear_sum_assignment`` stand-ins under ``root``."""
    for pkg, dist, sub, fn in (("sklearn", "scikit_learn", "metrics", "roc_curve"),
                               ("scipy", "scipy", "optimize", "linear_sum_assignment")):
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text("")
        (root / pkg / f"{sub}.py").write_text(f"def {fn}(*args):\n    return ['{pkg}.{sub}.{fn}', *args]\n")
        info = root / f"{dist}-99.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 99.0\n")
    return str(root)


def _run(code: str, *path: str) -> dict:
    """``code`` in a fresh interpreter with ``path`` first on its import path; the JSON it printed last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO)])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_imports_wait_for_the_first_call_and_the_calls_reach_the_packages(tmp_path):
    out = _run("""
        import json, sys
        import curation  # installs the hook
        import transformers.generation.candidate_generator as cg
        import transformers.loss.loss_utils  # the four object-detection losses
        import transformers.loss.loss_rt_detr as rt
        from transformers.utils import import_utils
        before = sorted(m for m in ("sklearn", "sklearn.metrics", "scipy", "scipy.optimize") if m in sys.modules)
        flags = [import_utils.is_sklearn_available(), import_utils.is_scipy_available()]
        calls = [cg.roc_curve([0, 1], [0.2, 0.8]), rt.linear_sum_assignment([[1]])]
        after = sorted(m for m in ("sklearn.metrics", "scipy.optimize") if m in sys.modules)
        print(json.dumps({"before": before, "flags": flags, "calls": calls, "after": after,
                          "name": cg.roc_curve.__name__}))
        """, _fake_packages(tmp_path))
    assert out["before"] == []  # nothing imported by the modules themselves
    assert out["flags"] == [True, True]  # transformers still counts both installed
    assert out["calls"] == [["sklearn.metrics.roc_curve", [0, 1], [0.2, 0.8]],
                            ["scipy.optimize.linear_sum_assignment", [[1]]]]
    assert out["after"] == ["scipy.optimize", "sklearn.metrics"] and out["name"] == "roc_curve"


def test_a_module_imported_before_the_hook_or_without_its_package_is_as_transformers_makes_it(tmp_path):
    out = _run("""
        import json, sys
        from transformers.utils import import_utils
        import transformers.generation.candidate_generator as cg  # before the hook: transformers' own import
        import_utils._scipy_available = False  # (as where SciPy is not installed)
        import curation
        import transformers.loss.loss_for_object_detection as od
        print(json.dumps([cg.roc_curve.__module__, "sklearn.metrics" in sys.modules,
                          hasattr(od, "linear_sum_assignment"), "scipy.optimize" in sys.modules]))
        """, _fake_packages(tmp_path))
    assert out == ["sklearn.metrics", True, False, False]


@pytest.mark.slow
def test_a_scoring_worker_and_a_trainer_start_without_scikit_learn():
    """The real packages where installed: a tiny causal LM built (a scoring worker's start) and Composer imported
    with the trainer's modules import no scikit-learn and no SciPy (torchmetrics' ``scipy.signal`` waits too); its
    flags are its own again, and ``scipy.signal`` imported later gets the ``hamming`` torchmetrics adds."""
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed here (it comes with the eval and mlflow extras): nothing deferred")
    out = _run("""
        import json, sys
        from curation.io.models import build_causal_lm
        from schemas.train_config import ModelConfig
        build_causal_lm(ModelConfig.model_validate({"hf_config": {
            "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}}))
        built = sorted(m for m in ("sklearn", "scipy.optimize") if m in sys.modules)
        import training.runs.rank, composer
        trainer = sorted(m for m in ("sklearn", "scipy") if m in sys.modules)
        import lightning_utilities.core.imports as li, torchmetrics, torchmetrics.audio, torchmetrics.utilities.imports
        import torchmetrics.functional.audio
        own = [torchmetrics.package_available is li.package_available, li.package_available("scipy")] + [
            m._SCIPI_AVAILABLE is torchmetrics.utilities.imports._SCIPI_AVAILABLE
            for m in (torchmetrics.audio, torchmetrics.functional.audio)]
        import scipy.signal
        print(json.dumps({"built": built, "trainer": trainer, "own": own,
                          "hamming": scipy.signal.hamming is scipy.signal.windows.hamming}))
        """)
    assert out == {"built": [], "trainer": [], "own": [True] * 4, "hamming": True}


def test_the_loader_answers_for_the_modules_own_and_copies():
    """The wrapped loader passes what it does not define to the module's own (``get_filename``, for tracebacks and
    ``inspect``) and can be copied; one whose own loader is not set yet raises AttributeError, not RecursionError."""
    import copy
    import importlib.machinery

    from curation.io.deferred_imports import DEFERRED, _Loader

    own = importlib.machinery.SourceFileLoader("m", "/somewhere/m.py")
    loader = _Loader(own, DEFERRED["torchmetrics"])
    assert loader.get_filename() == "/somewhere/m.py" and copy.copy(loader).loader is own
    with pytest.raises(AttributeError, match="loader"):
        object.__new__(_Loader).get_filename  # noqa: B018


def test_each_kind_of_flag_reads_missing_while_the_module_runs_and_its_own_again_after(tmp_path, monkeypatch):
    """The three kinds of availability flag (a bool, a requirement object, a function of the package's name) read
    "missing" while a deferred module runs, and are their own again after, in the flags' module and in the module
    that took the flag by name; the package is not imported until asked for, then gets the patch the module would
    have made; a package imported before the module is left as the module makes it."""
    from curation.io import deferred_imports as di

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "flags.py").write_text(textwrap.dedent("""
        class Requirement:  # like lightning_utilities' RequirementCache: truthy where installed
            def __bool__(self):
                return True
        BOOL, REQUIREMENT = True, Requirement()
        def available(name):
            return name in ("pkg", "other")
        """))
    for kind, test in (("bool", "flags.BOOL"), ("requirement", "REQUIREMENT"), ("function", 'available("pkg")')):
        (tmp_path / "lib" / f"uses_{kind}.py").write_text(textwrap.dedent(f"""
            from lib import flags
            from lib.flags import REQUIREMENT, available
            SEEN = bool({test}), available("other")
            if SEEN[0]:
                import pkg.sub
                pkg.sub.PATCHED = "by lib.uses_{kind}"
            """))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub.py").write_text("def f():\n    return 'pkg.sub.f'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for kind, flag in (("bool", "BOOL"), ("requirement", "REQUIREMENT"), ("function", "available")):
        monkeypatch.setitem(di.DEFERRED, f"lib.uses_{kind}", di.Deferral("lib.flags", flag, "pkg.sub", ("f",)))
    monkeypatch.setitem(di.PATCHES, "pkg.sub", lambda sub: setattr(sub, "PATCHED", "on its first import"))
    try:
        import importlib

        flags = importlib.import_module("lib.flags")
        own = {name: getattr(flags, name) for name in ("BOOL", "REQUIREMENT", "available")}
        modules = [importlib.import_module(f"lib.uses_{kind}") for kind in ("bool", "requirement", "function")]
        assert [m.SEEN for m in modules] == [(False, True)] * 3  # "missing" for pkg only, while each ran
        assert {name: getattr(flags, name) for name in own} == own
        assert modules[1].REQUIREMENT is own["REQUIREMENT"] and modules[2].available is own["available"]
        assert "pkg.sub" not in sys.modules and "pkg.sub.f" == modules[0].f() and modules[0].f.__name__ == "f"
        assert sys.modules["pkg.sub"].PATCHED == "on its first import" and "pkg.sub" not in di._due
        sys.modules.pop("lib.uses_bool")
        again = importlib.import_module("lib.uses_bool")  # pkg.sub imported already: the module runs as it is
        assert again.SEEN == (True, True) and sys.modules["pkg.sub"].PATCHED == "by lib.uses_bool"
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] in ("lib", "pkg")]:
            del sys.modules[name]
