"""Packages that libraries import only in case, imported on their first use instead.

transformers (< 5) imports ``sklearn.metrics`` (and with it SciPy and pandas) where scikit-learn is installed, for
one function of assisted generation (``roc_curve``), and ``scipy.optimize`` where SciPy is, for the object-detection
losses (``linear_sum_assignment``); both happen whenever a causal LM's class is imported. That is ≈ 1.1 s of CPU and
≈ 135 MB resident in every process that builds a model (each scoring worker, refresh actor and trainer rank at each
start) for functions this project never calls; an environment with the ``eval`` or ``mlflow`` extra (both pull
scikit-learn) has them. torchmetrics (Composer's metrics) imports ``scipy.signal`` (and with it ``scipy.stats``)
in its package, ``torchmetrics.audio`` and ``torchmetrics.functional.audio`` only to add ``scipy.signal.hamming``
(gone since SciPy 1.13) for the SRMRpy package its SRMR metric calls: ≈ 0.7 s of CPU in every process that imports
Composer (each trainer process and rank, at each start).

:func:`install` (run by ``curation/__init__`` and ``training/__init__``, so before any of their modules imports
transformers or Composer) adds an import hook that runs those modules as if the package were missing, then gives them
the names they would have imported as functions that import it on their first call, and makes the change the module
would have made to the package when the package is first imported (torchmetrics' ``hamming``): assisted generation,
those losses and SRMR still work, at the price of the import when first used. Nothing else changes: the
availability flags are the libraries' own again once the module ran, and a module already imported, a package
imported before the module, or a library whose modules no longer match (a flag or a name gone) is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

__all__ = ["DEFERRED", "PATCHES", "Deferral", "install"]

@dataclass(frozen=True)
class Deferral:
    """One module's in-case import: while the module runs, its package's availability flag says "missing".

    ``flags.flag`` is the flag the module reads: ``True`` or a requirement that is truthy where the package is
    installed (run with ``False``), or a function ``available(package)`` (run with one that answers ``False`` for
    this package only). ``names`` are what the module takes from ``source``, given back as functions that import it
    on their first call.
    """

    flags: str
    flag: str
    source: str
    names: tuple[str, ...] = ()


_SCIPY = Deferral("transformers.utils.import_utils", "_scipy_available", "scipy.optimize", ("linear_sum_assignment",))
_SIGNAL = Deferral("torchmetrics.utilities.imports", "_SCIPI_AVAILABLE", "scipy.signal")
#: module → its in-case import
DEFERRED: dict[str, Deferral] = {
    "transformers.generation.candidate_generator": Deferral("transformers.utils.import_utils", "_sklearn_available",
                                                            "sklearn.metrics", ("roc_curve",)),
    "transformers.loss.loss_for_object_detection": _SCIPY,
    "transformers.loss.loss_rt_detr": _SCIPY,
    "transformers.loss.loss_deformable_detr": _SCIPY,
    "transformers.loss.loss_grounding_dino": _SCIPY,
    "torchmetrics": Deferral("lightning_utilities.core.imports", "package_available", "scipy.signal"),
    "torchmetrics.audio": _SIGNAL,
    "torchmetrics.functional.audio": _SIGNAL,
}


def _hamming(signal: ModuleType) -> None:
    if not hasattr(signal, "hamming"):
        signal.hamming = signal.windows.hamming


#: what a deferred module does to the package it imports, done when that package is first imported instead:
#: torchmetrics adds ``scipy.signal.hamming`` (gone since SciPy 1.13) for the SRMRpy package its SRMR metric calls
PATCHES: dict[str, Callable[[ModuleType], None]] = {"scipy.signal": _hamming}
_due: set[str] = set()  # the patches a deferred module left to do


def _on_first_call(module: str, name: str) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}``, imported on the first call (curation.io.deferred_imports)."
    return call


def _missing(value: object, package: str) -> object:
    """What the flag says while the module runs; ``None`` where it does not say ``package`` is installed."""
    if isinstance(value, bool):
        return False if value else None
    if callable(value):
        if value(package) is not True:
            return None
        return lambda name: False if name == package else value(name)
    return False if value else None  # a requirement (lightning_utilities' RequirementCache)


class _Wrapped(importlib.abc.Loader):
    """A module's own loader, wrapped; what it does not define is the module's own loader's."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> object:  # get_source, get_filename, is_package...: the module's own
        if name == "loader" or name.startswith("__"):  # (not set yet, as in a copy: no recursion)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)


class _Loader(_Wrapped):
    """The module's own loader, run with its package's flag down; then the deferred names."""

    def __init__(self, loader: importlib.abc.Loader, deferral: Deferral) -> None:
        super().__init__(loader)
        self.deferral = deferral

    def exec_module(self, module: ModuleType) -> None:
        d = self.deferral
        try:
            flags = importlib.import_module(d.flags)
        except ImportError:
            flags = None
        value = getattr(flags, d.flag, None)
        missing = None if flags is None or d.source in sys.modules else _missing(value, d.source.split(".")[0])
        if missing is None:
            self.loader.exec_module(module)  # (package missing or imported already, or the library changed: as it is)
            return
        setattr(flags, d.flag, missing)
        try:
            self.loader.exec_module(module)
        finally:
            setattr(flags, d.flag, value)
        if module.__dict__.get(d.flag) is missing:  # (the module took the flag by name)
            setattr(module, d.flag, value)
        for name in d.names:
            if not hasattr(module, name):
                setattr(module, name, _on_first_call(d.source, name))
        if d.source in PATCHES:
            _due.add(d.source)


class _Patching(_Wrapped):
    """The package's own loader, then the patch a deferred module left to do."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        super().__init__(loader)
        self.patch = patch

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _due.discard(module.__name__)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in DEFERRED and fullname not in _due:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = (_Loader(spec.loader, DEFERRED[fullname]) if fullname in DEFERRED
                                   else _Patching(spec.loader, PATCHES[fullname]))
                return spec
        return None


def install() -> None:
    """Adds the hook once per process (first on ``sys.meta_path``)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
