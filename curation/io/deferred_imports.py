"""scikit-learn and SciPy imported on first use by the transformers modules that import them only in case.

transformers (< 5) imports ``sklearn.metrics`` (and with it SciPy and pandas) where scikit-learn is installed, for
one function of assisted generation (``roc_curve``), and ``scipy.optimize`` where SciPy is, for the object-detection
losses (``linear_sum_assignment``); both happen whenever a causal LM's class is imported, and Composer's import
(torchmetrics) imports one too. That is ≈ 1.1 s of CPU and ≈ 135 MB resident in every process that builds a model
(each scoring worker, refresh actor and trainer rank at each start) for functions this project never calls; an
environment with the ``eval`` or ``mlflow`` extra (both pull scikit-learn) has them.

:func:`install` (run by ``curation/__init__`` and ``training/__init__``, so before any of their modules imports
transformers or Composer) adds an import hook that runs those modules as if the package were missing, then gives them
the names they would have imported as functions that import it on their first call: assisted generation and those
losses still work, at the price of the import when first called. Nothing else changes: the availability flags are
transformers' own again once the module ran, and a module already imported, or a transformers whose modules no longer
match (a flag or a name gone), is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["DEFERRED", "install"]

_SCIPY = ("_scipy_available", "scipy.optimize", ("linear_sum_assignment",))
#: module → (transformers.utils.import_utils's availability flag, the module it imports, the names it takes from it)
DEFERRED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "transformers.generation.candidate_generator": ("_sklearn_available", "sklearn.metrics", ("roc_curve",)),
    "transformers.loss.loss_for_object_detection": _SCIPY,
    "transformers.loss.loss_rt_detr": _SCIPY,
    "transformers.loss.loss_deformable_detr": _SCIPY,
    "transformers.loss.loss_grounding_dino": _SCIPY,
}


def _on_first_call(module: str, name: str) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}``, imported on the first call (curation.io.deferred_imports)."
    return call


class _Loader(importlib.abc.Loader):
    """The module's own loader, run with its package's flag down; then the deferred names."""

    def __init__(self, loader: importlib.abc.Loader, flag: str, source: str, names: Sequence[str]) -> None:
        self.loader, self.flag, self.source, self.names = loader, flag, source, tuple(names)

    def __getattr__(self, name: str) -> object:  # get_source, get_filename, is_package...: the module's own
        if name == "loader" or name.startswith("__"):  # (not set yet, as in a copy: no recursion)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        flags = sys.modules.get("transformers.utils.import_utils")
        if flags is None or getattr(flags, self.flag, None) is not True:
            self.loader.exec_module(module)  # (package missing, or transformers changed: as it is)
            return
        setattr(flags, self.flag, False)
        try:
            self.loader.exec_module(module)
        finally:
            setattr(flags, self.flag, True)
        for name in self.names:
            if not hasattr(module, name):
                setattr(module, name, _on_first_call(self.source, name))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in DEFERRED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, *DEFERRED[fullname])
                return spec
        return None


def install() -> None:
    """Adds the hook once per process (first on ``sys.meta_path``)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
