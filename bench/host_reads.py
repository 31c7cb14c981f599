"""Host reads per steady step, counted on a CPU with a GPU run's branches taken (issue 52; docs/DESIGN.md §6).

On a GPU every value the host reads from the device, every blocking copy between them and every ``synchronize()``
drains the device's queue (:mod:`curation.core.host_sync`). :class:`HostReadCounter` counts them on a CPU:

* **what would live on the device**: a ``torch.overrides.TorchFunctionMode`` tags every tensor a GPU run would hold
  on its device: moved or created there (``.to(STAND_IN)``, ``device=STAND_IN``), computed from such a tensor, a
  parameter of a module placed there (and its gradient). :data:`~curation.core.host_sync.STAND_IN` is the device
  it stands in with: ``tensor.device`` of a tagged tensor answers it, so :func:`~curation.core.host_sync.queues`
  takes the branches a CUDA run takes (pinned buffers, non-blocking copies, events, fused AdamW, the
  synchronisation-free top-k, offloading), and ``resolve_device`` answers it for ``auto`` and ``cuda`` while the
  counter runs. Pinned host memory is tagged too (``pin_memory``), since pinning needs a GPU.
* **what is counted** (a *read*), each with the ``file:line`` and owner (``project``, ``composer``, ``torch``,
  ``other``) of the first frame outside torch, the standard library and this file: ``value`` (``.item()``,
  ``.tolist()``, ``bool``/``int``/``float`` of a device tensor, ``torch.equal``), ``d2h`` (a blocking copy to the
  host: ``.cpu()``, ``.to("cpu")``, ``copy_`` into pageable memory or without ``non_blocking``), ``h2d`` (a copy to
  the device without ``non_blocking``, a stream synchronisation in torch), ``shape`` (an output whose size depends
  on the values: ``nonzero``, a boolean index, ``masked_select``, ``unique``, ``bincount``), ``numpy`` (a device
  tensor's ``.numpy()``: an error on a GPU), ``wait`` (``torch.cuda.synchronize``, an event's or a stream's
  ``synchronize``). A non-blocking copy to the device from pageable memory is not a read; it is listed apart
  (``pageable``).
* **Composer**: its CPU device is replaced by :class:`StandInDevice`, which moves batches as its GPU device does
  (non-blocking copies).

:func:`bench.host_read_scenarios.measure` runs the scenarios of its ``SCENARIOS`` on a tiny Llama and a generated corpus: the trainer's
steady steps of every policy (``trainer_full``, ``trainer_random``, ``trainer_rho1``, ``trainer_blade``, with
microbatches ``trainer_blade_microbatched``), the trainer fed by the engine's workers (``trainer_engine``: pipelined
mode, the masks read from the engine's parts; ``trainer_engine_exact``: its scores), the reference's episode start
(``episode_start``, per episode), a refresh (``refresh``), a scoring worker's steps (``worker_scored``,
``worker_selected``) and a weight load (``weight_load``, per model and version, both ways). A *steady* step is one of
the run's middle steps without a refresh, an evaluation, a checkpoint or a proxy publication. ``jobs/bench_host_reads.py
--json`` prints the figures; ``tests/bench/test_host_reads.py`` asserts the targets.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from composer.devices import DeviceCPU
from torch import Tensor
from torch.optim import optimizer as torch_optimizer
from torch.overrides import TorchFunctionMode

from curation.core.host_sync import STAND_IN
from curation.io import models

__all__ = ["HostReadCounter", "Read", "StandInDevice", "labelled", "on_device", "is_pinned", "OWNERS", "KINDS"]

REPO = Path(__file__).resolve().parents[1]
OWNERS = ("project", "composer", "torch", "other")
KINDS = ("value", "d2h", "h2d", "shape", "numpy", "wait")

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_STDLIB = {str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib")}
_HERE = str(Path(__file__).resolve())
#: Files whose frames are passed over when a read is attributed: the counter, and the host-copy helper whose waits
#: are its callers' (the trainer's step reads, a worker's step)
_PASS_OVER = {_HERE, str(REPO / "curation" / "core" / "host_sync.py")}
_TAG, _PIN = "_host_reads_device", "_host_reads_pinned"
_BASE = torch._C.TensorBase
_DESCRIPTORS = {name: _BASE.__dict__[name] for name in ("device", "is_cuda", "data", "grad")}

_VALUE = {_BASE.item, _BASE.tolist, _BASE.__bool__, _BASE.__int__, _BASE.__float__, _BASE.__index__,
          _BASE.is_nonzero, _BASE.equal, torch.equal, torch.is_nonzero, torch.allclose, _BASE.allclose,
          torch.Tensor.__format__, torch.Tensor.__repr__}
_NUMPY = {_BASE.numpy, torch.Tensor.__array__}
_SHAPE = {torch.nonzero, _BASE.nonzero, torch.argwhere, _BASE.argwhere, torch.masked_select, _BASE.masked_select,
          torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive,
          torch.bincount, _BASE.bincount}


@dataclass(frozen=True)
class Read:
    """One host read: its kind, where it was made and whose code made it, and the step it was made in."""

    kind: str
    site: str
    owner: str
    label: Any = None


def _descriptor(func: Any) -> tuple[str, str] | None:
    """``(name, "__get__"|"__set__")`` when ``func`` is a tensor property's getter or setter of interest."""
    owner = getattr(func, "__self__", None)
    for name, d in _DESCRIPTORS.items():
        if owner is d:
            return name, func.__name__
    return None


def _tensors(x: Any) -> Iterator[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def on_device(t: Tensor) -> bool:
    """Whether ``t`` would live on the device (tagged by the counter)."""
    return bool(t.__dict__.get(_TAG, False))


def is_pinned(t: Tensor) -> bool:
    return bool(t.__dict__.get(_PIN, False))


def _tag(t: Tensor, device: bool, pinned: bool = False) -> None:
    t.__dict__[_TAG] = device
    t.__dict__[_PIN] = pinned and not device


def _is_stand_in(device: Any) -> bool:
    if device is None:
        return False
    try:
        return torch.device(device) == STAND_IN
    except (TypeError, RuntimeError):
        return False


class _Mode(TorchFunctionMode):
    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        c = self.counter
        prop = _descriptor(func)
        if prop is not None:
            return self._property(func, prop, args)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        dev_in = any(on_device(t) for t in inputs)
        if func is _BASE.to:
            return self._to(func, args, kwargs)
        if func is _BASE.cpu:
            src = args[0]
            if on_device(src):
                c.record("d2h")
            out = func(*args, **kwargs)
            if on_device(src):
                out = src.clone() if out is src else out
                _tag(out, False)
            return out
        if func is _BASE.copy_:
            return self._copy(func, args, kwargs)
        if func is _BASE.pin_memory:
            src = args[0]
            if on_device(src):
                c.record("d2h")
            out = src.clone() if not src.is_pinned() else src
            _tag(out, False, pinned=True)
            return out
        if func is _BASE.is_pinned:
            return is_pinned(args[0]) or func(*args, **kwargs)
        if dev_in and func in _VALUE:
            c.record("value")
        elif dev_in and func in _NUMPY:
            c.record("numpy")
        elif dev_in and (func in _SHAPE or (func is torch.repeat_interleave and "output_size" not in kwargs)):
            c.record("shape")
        elif dev_in and func in (_BASE.__getitem__, _BASE.__setitem__) and self._bool_index(func, args):
            c.record("shape")
        pin = bool(kwargs.pop("pin_memory", False))
        device_kw = kwargs.get("device")
        out = func(*args, **kwargs)
        if device_kw is not None and not isinstance(device_kw, Tensor):
            where = _is_stand_in(device_kw)
        else:
            where = dev_in
        pin_in = [t for t in inputs if is_pinned(t)]
        for t in _tensors(out):
            if any(t is x for x in inputs) and func not in (_BASE.__setitem__,):
                if func.__name__.endswith("_") and dev_in:
                    _tag(t, True)
                continue
            shares = any(_same_storage(t, p) for p in pin_in)
            _tag(t, where, pinned=(pin or shares) and not where)
        return out

    @staticmethod
    def _bool_index(func: Any, args: tuple) -> bool:
        index = args[1] if len(args) > 1 else None
        idx = index if isinstance(index, tuple) else (index,)
        is_bool = any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) and on_device(i) for i in idx)
        if not is_bool:
            return False
        if func is _BASE.__setitem__:  # t[mask] = scalar is a masked fill (no read); other values index_put
            value = args[2] if len(args) > 2 else None
            return isinstance(value, Tensor) and value.dim() > 0
        return True

    def _property(self, func: Any, prop: tuple[str, str], args: tuple) -> Any:
        name, kind = prop
        if kind == "__set__":
            out = func(*args)
            if name == "data" and isinstance(args[1], Tensor):
                _tag(args[0], on_device(args[1]), is_pinned(args[1]))
            return out
        t = args[0]
        if name == "device":
            return STAND_IN if on_device(t) else func(*args)
        if name == "is_cuda":
            return on_device(t) or func(*args)
        out = func(*args)
        if isinstance(out, Tensor) and on_device(t) and name in ("grad", "data"):
            _tag(out, True)
        return out

    def _to(self, func: Any, args: tuple, kwargs: dict) -> Any:
        c = self.counter
        src = args[0]
        rest = args[1:]
        kw = {k: v for k, v in kwargs.items() if k != "copy"}
        if rest and isinstance(rest[0], Tensor):
            dest_dev = on_device(rest[0])
            non_blocking = bool(kwargs.get("non_blocking", rest[1] if len(rest) > 1 else False))
        else:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*rest, **kw)
            dest_dev = on_device(src) if device is None else _is_stand_in(device)
        src_dev = on_device(src)
        if src_dev and not dest_dev:
            if not non_blocking:
                c.record("d2h")
        elif dest_dev and not src_dev:
            if not non_blocking:
                c.record("h2d")
            elif not is_pinned(src) and not src.is_pinned():
                c.record("h2d", pageable=True)
        out = func(*args, **kwargs)
        if src_dev != dest_dev and out is src:
            out = src.clone()
        _tag(out, dest_dev, pinned=(not dest_dev and src_dev and non_blocking) or (out is src and is_pinned(src)))
        return out

    def _copy(self, func: Any, args: tuple, kwargs: dict) -> Any:
        c = self.counter
        dst, src = args[0], args[1]
        non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        d_dev, s_dev = on_device(dst), isinstance(src, Tensor) and on_device(src)
        if s_dev and not d_dev and not (non_blocking and (is_pinned(dst) or dst.is_pinned())):
            c.record("d2h")
        elif d_dev and not s_dev and isinstance(src, Tensor):
            if not non_blocking:
                c.record("h2d")
            elif not (is_pinned(src) or src.is_pinned()):
                c.record("h2d", pageable=True)
        return func(*args, **kwargs)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False


class _Event:
    """``torch.cuda.Event`` while the counter runs: recording is free, waiting is a read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.counter = _ACTIVE[-1]

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.counter.record("wait")

    def elapsed_time(self, other: Any) -> float:
        self.counter.record("wait")
        return 0.0


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.counter = _ACTIVE[-1]

    def synchronize(self) -> None:
        self.counter.record("wait")

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event or _Event()


_ACTIVE: list[HostReadCounter] = []


class HostReadCounter:
    """Counts the host reads made inside ``with counter:`` (module docstring). ``counter.label = x`` labels the reads
    that follow (e.g. the step); :attr:`reads` holds every read, :attr:`pageable` the non-blocking copies from pageable
    memory."""

    def __init__(self) -> None:
        self.reads: list[Read] = []
        self.pageable: list[Read] = []
        self.label: Any = None
        self._mode = _Mode(self)
        self._undo: list[Callable[[], None]] = []

    # --- attribution -------------------------------------------------------------------------
    @staticmethod
    def _site(frame: FrameType | None) -> tuple[str, str]:
        """The first frame outside torch, the standard library and this file (torch's own when there is none)."""
        first_torch = None
        while frame is not None:
            path = os.path.realpath(frame.f_code.co_filename)
            if path in _PASS_OVER:
                pass
            elif path.startswith(_TORCH_DIR + os.sep):
                first_torch = first_torch or (path, frame.f_lineno)
            elif "site-packages" in path or not any(path.startswith(s + os.sep) for s in _STDLIB):
                return _where(path, frame.f_lineno)
            frame = frame.f_back
        return _where(*first_torch) if first_torch is not None else ("?", "other")

    def record(self, kind: str, *, pageable: bool = False) -> None:
        site, owner = self._site(sys._getframe(1))
        (self.pageable if pageable else self.reads).append(Read(kind, site, owner, self.label))

    # --- placing things on the device ----------------------------------------------------------
    def place(self, *objs: Any) -> None:
        """Tag ``objs`` (modules: their parameters and buffers; tensors) as living on the device."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for t in [*obj.parameters(), *obj.buffers()]:
                    _tag(t, True)
            elif isinstance(obj, Tensor):
                _tag(obj, True)

    def adopt(self, trainer: Any) -> None:
        """A Composer trainer made on the CPU, as it runs on a GPU: its device moves batches without blocking, its
        model's parameters (and its optimizer's state) are on the device."""
        state = trainer.state
        state.device = StandInDevice()
        self.place(state.model)
        for opt in state.optimizers:
            for s in opt.state.values():
                self.place(*[v for v in s.values() if isinstance(v, Tensor) and v.dim() > 0])

    # --- the context --------------------------------------------------------------------------
    def _patch(self, obj: Any, name: str, value: Any) -> None:
        old = getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old))

    def __enter__(self) -> HostReadCounter:
        _ACTIVE.append(self)
        counter = self
        self._patch(torch.cuda, "Event", _Event)
        self._patch(torch.cuda, "Stream", _Stream)
        self._patch(torch.cuda, "current_stream", lambda device=None: _Stream())
        self._patch(torch.cuda, "synchronize", lambda device=None: counter.record("wait"))
        real = models.resolve_device

        def resolve(device: str = "auto") -> torch.device:
            return STAND_IN if device in ("auto", "cuda") else real(device)

        for module in list(sys.modules.values()):  # every `from curation.io.models import resolve_device`
            if getattr(module, "resolve_device", None) is real:
                self._patch(module, "resolve_device", resolve)
        # torch groups tensors by device in C++, which answers `cpu` for the stand-in's: the groups of device
        # tensors are keyed by STAND_IN (clip_grad_norm_, foreach and fused optimizers copy by those keys)
        group = torch_optimizer._group_tensors_by_device_and_dtype  # (torch.utils._foreach_utils's, imported there)

        def grouped(tensorlistlist: Any, with_indices: bool = False) -> Any:
            out = group(tensorlistlist, with_indices)
            keyed = {}
            for (device, dtype), value in out.items():
                lists = value[0] if isinstance(value, tuple) else value
                on = any(on_device(t) for tl in lists for t in (tl or []) if isinstance(t, Tensor))
                keyed[(STAND_IN if on else device, dtype)] = value
            return keyed

        for module in list(sys.modules.values()):
            if getattr(module, "_group_tensors_by_device_and_dtype", None) is group:
                self._patch(module, "_group_tensors_by_device_and_dtype", grouped)

        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        while self._undo:
            self._undo.pop()()
        _ACTIVE.pop()

    # --- figures ------------------------------------------------------------------------------
    def by_label(self) -> dict[Any, list[Read]]:
        out: dict[Any, list[Read]] = {}
        for r in self.reads:
            out.setdefault(r.label, []).append(r)
        return out


def _where(path: str, line: int) -> tuple[str, str]:
    """``file:line`` and owner of a frame's file."""
    p = Path(path)
    try:
        return f"{p.relative_to(REPO)}:{line}", "project"
    except ValueError:
        pass
    parts = p.parts
    if "site-packages" in parts:
        rel = Path(*parts[parts.index("site-packages") + 1:])
        owner = {"composer": "composer", "torch": "torch"}.get(rel.parts[0], "other")
        return f"{rel}:{line}", owner
    if path.startswith(_TORCH_DIR):
        return f"torch/{Path(path).relative_to(_TORCH_DIR)}:{line}", "torch"
    return f"{path}:{line}", "other"


class StandInDevice:
    """Composer's device for the stand-in: a ``DeviceCPU`` that moves tensors to :data:`STAND_IN` without blocking, as
    its GPU device does (made lazily: Composer is imported only by the scenarios that use it)."""

    def __new__(cls) -> Any:
        class _StandIn(DeviceCPU):
            _device = STAND_IN

            def tensor_to_device(self, tensor: Tensor) -> Tensor:
                return tensor.to(self._device, non_blocking=True)

        return _StandIn()


@contextlib.contextmanager
def labelled(counter: HostReadCounter, label: Any) -> Iterator[None]:
    """Reads inside are labelled ``label`` (the label before is restored after)."""
    before, counter.label = counter.label, label
    try:
        yield
    finally:
        counter.label = before
