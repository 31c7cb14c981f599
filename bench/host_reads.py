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

:func:`measure` runs the scenarios of :data:`SCENARIOS` on a tiny Llama and a generated corpus: the trainer's
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
import shutil
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from curation.core.host_sync import STAND_IN

__all__ = ["HostReadCounter", "Read", "StandInDevice", "measure", "SCENARIOS", "TARGETS", "OWNERS", "KINDS"]

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
        from curation.io import models

        real = models.resolve_device

        def resolve(device: str = "auto") -> torch.device:
            return STAND_IN if device in ("auto", "cuda") else real(device)

        for module in list(sys.modules.values()):  # every `from curation.io.models import resolve_device`
            if getattr(module, "resolve_device", None) is real:
                self._patch(module, "resolve_device", resolve)
        # torch groups tensors by device in C++, which answers `cpu` for the stand-in's: the groups of device
        # tensors are keyed by STAND_IN (clip_grad_norm_, foreach and fused optimizers copy by those keys)
        from torch.utils import _foreach_utils

        group = _foreach_utils._group_tensors_by_device_and_dtype

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
        from composer.devices import DeviceCPU

        class _StandIn(DeviceCPU):
            _device = STAND_IN

            def tensor_to_device(self, tensor: Tensor) -> Tensor:
                return tensor.to(self._device, non_blocking=True)

        return _StandIn()


# ------------------------------------------------------------------------------------------------
# scenarios
# ------------------------------------------------------------------------------------------------
#: Steady-step targets (issue 52): reads per steady step (or per episode, refresh, model and version).
TARGETS = {"trainer_full": 1, "trainer_random": 1, "trainer_rho1": 1, "trainer_blade": 1,
           "trainer_blade_microbatched": 1, "trainer_engine": 1, "trainer_engine_exact": 1, "episode_start": 2,
           "worker_scored": 1, "worker_selected": 1, "weight_load": 2}


@dataclass
class Figures:
    """The reads of one scenario: ``per_step`` (the most of any measured step), by owner, and where."""

    per_step: int
    steps: int
    owners: dict[str, int]
    kinds: dict[str, int]
    sites: list[str]
    pageable: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"per_step": self.per_step, "steps": self.steps, "owners": self.owners, "kinds": self.kinds,
                "sites": self.sites, "pageable": self.pageable}


def figures(counter: HostReadCounter, labels: list[Any]) -> Figures:
    """The worst of the steps ``labels``: its reads by owner and kind, and every site of those steps' reads."""
    groups = counter.by_label()
    worst = max(labels, key=lambda s: len(groups.get(s, [])))
    reads = groups.get(worst, [])
    every = [r for s in labels for r in groups.get(s, [])]
    owners = Counter(r.owner for r in reads)
    kinds = Counter(r.kind for r in reads)
    sites = sorted({f"{r.site} ({r.owner}, {r.kind})" for r in every})
    pageable = sorted({f"{r.site} ({r.owner})" for r in counter.pageable if r.label in labels})
    return Figures(len(reads), len(labels), {o: owners.get(o, 0) for o in OWNERS},
                   {k: kinds[k] for k in KINDS if kinds.get(k)}, sites, pageable)


@dataclass
class Setting:
    """The scenarios' shared inputs: a generated corpus (prepared once under ``root``) and the tiny model."""

    root: str
    steps: int = 12
    batch_size: int = 4

    def data(self) -> str:
        out = os.path.join(self.root, "data")
        if not os.path.exists(os.path.join(out, "candidates", "index.json")):
            from curation.ingest.demo import write_demo_corpus
            from curation.ingest.prepare import prepare
            from schemas.config import PrepareConfig

            write_demo_corpus(os.path.join(self.root, "raw"),
                              sizes={"target": 60, "general": 60, "noise": 30, "target_val": 30})
            cfg = PrepareConfig.demo_default(self.root)
            prepare(cfg.model_copy(update={"progress": False,
                                           "tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": 512})}))
        return out

    def train_config(self, name: str, policy: str, **updates: Any) -> Any:
        from schemas.train_config import TrainConfig, demo_model_config

        self.data()
        base = TrainConfig.demo_default(self.root).model_dump(mode="json")
        cfg = {
            **base,
            "model": demo_model_config(512, hidden=32, layers=1).model_dump(mode="json"),
            "output_dir": os.path.join(self.root, "runs", name), "batch_size": self.batch_size,
            "max_steps": self.steps, "progress_bar": False, "plots": False, "threads": 1, "device": "auto",
            "selection": {**base["selection"], "policy": policy, "warmup_steps": 2, "tau": 100, "refresh_steps": 2,
                          "refresh_batch_size": 2, "rho1_steps": 2, "refresh_candidate_batches": 2},
            "eval": {**base["eval"], "interval": 1000, "batch_size": 4, "max_batches": 1},
            "checkpoint": {**base["checkpoint"], "interval": 1000, "keep": 1},
        }
        for k, v in updates.items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
        return TrainConfig.model_validate(cfg)


class _StepLabels:
    """A Composer callback that labels the counter's reads with the step being taken (from its dataloader event)."""

    def __new__(cls, counter: HostReadCounter) -> Any:
        from composer.core import Callback

        class _Labels(Callback):
            def before_dataloader(self, state: Any, logger: Any) -> None:
                counter.label = int(state.timestamp.batch)

            def fit_end(self, state: Any, logger: Any) -> None:
                counter.label = "fit_end"

        return _Labels()


def _steady(total: int, *, first: int, exclude: set[int] = frozenset()) -> list[int]:
    """The steps measured: from ``first`` to the one before the last (which evaluates and checkpoints)."""
    return [s for s in range(first, total - 1) if s not in exclude]


def trainer_scenario(setting: Setting, name: str, policy: str, *, counter_hook: Callable[[Any], None] | None = None,
                     **updates: Any) -> tuple[Figures, HostReadCounter]:
    """A single-process trainer of ``policy``: its steady steps after the warm-up (and the episode's start)."""
    from training.runs.wiring import build_training

    cfg = setting.train_config(name, policy, **updates)
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a new run, not a resumed one
    with HostReadCounter() as counter:
        run = build_training(cfg)
        run.trainer.state.callbacks.insert(0, _StepLabels(counter))
        counter.adopt(run.trainer)
        if counter_hook is not None:
            counter_hook(run)
        counter.label = "fit_start"
        run.fit()
    w = cfg.selection.warmup_steps
    return figures(counter, _steady(cfg.max_steps, first=w + 2)), counter


@contextlib.contextmanager
def labelled(counter: HostReadCounter, label: Any) -> Iterator[None]:
    """Reads inside are labelled ``label`` (the label before is restored after)."""
    before, counter.label = counter.label, label
    try:
        yield
    finally:
        counter.label = before


class LocalEngine:
    """The engine in this process, for the counter (an :class:`~curation.engine.handle.EngineHandle`): the real
    scoring worker and refresh runner of the job's work, run when the trainer asks for a part or publishes a proxy
    (no Ray). Their reads are labelled ``("engine", ...)``: they are not the trainer's."""

    def __init__(self, curation: Any, counter: HostReadCounter) -> None:
        from curation.engine.coordinator import Coordinator
        from curation.engine.plan import REFERENCE
        from curation.engine.refresh_runner import RefreshRunner
        from curation.engine.workers import ScoringWorker

        work = curation.work
        self.counter, self.plan = counter, curation.plan
        self.coordinator = Coordinator(work.units)
        self.wait_seconds = 0.0
        self.parts: dict[str, dict[str, Any]] = {}
        self.weights: dict[tuple[str, int], Any] = {}
        with labelled(counter, ("engine", "start")):
            self.worker = ScoringWorker(work.worker_spec, 0)
            self.runner = RefreshRunner(work.refresh_spec) if work.refresh_spec is not None else None
            if self.runner is not None and work.refresh_mode.name == "STATIC":
                self.weights[(REFERENCE, 0)] = self.runner.static()[0]

    def wait_part(self, step: int, *, timeout_s: float = 0.0) -> dict[str, Any]:
        unit = self.coordinator.unit_for(step)
        if unit.name not in self.parts:
            with labelled(self.counter, ("engine", step)):
                res = self.worker.run(unit, lambda kind, version: self.weights[(kind, version)])
            self.parts[unit.name] = {"part": res.name, "first": unit.first, "stop": unit.stop,
                                     "ref_version": unit.ref_version}
        return self.parts[unit.name]

    def publish_proxy(self, step: int, model: Any, recent: Any = None) -> None:
        from curation.core.refresh_data import RecentMasks
        from curation.engine.plan import PROXY, REFERENCE
        from curation.engine.weights import Weights

        weights = Weights.from_state_dict(model)  # (the trainer's reads: RayEngine does the same)
        self.weights[(PROXY, step)] = weights
        version = self.plan.refresh_sources().get(step)
        if version is not None and self.runner is not None:
            with labelled(self.counter, ("engine", "refresh")):
                self.weights[(REFERENCE, version)] = self.runner.refresh(
                    version, weights, recent or RecentMasks.from_pairs([]), source_step=step,
                    previous=self.weights.get((REFERENCE, version - 1)))[0]

    def reference(self, version: int, *, timeout_s: float = 0.0) -> Any:
        from curation.engine.plan import REFERENCE

        return self.weights[(REFERENCE, version)]

    def trainer_at(self, step: int) -> None:
        pass

    def progress(self) -> dict[str, Any]:
        return {"units_done": len(self.parts), "tokens": 0, "redone": 0}

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass

    def for_workers(self) -> LocalEngine:
        return self


def engine_scenario(setting: Setting, name: str, mode: str) -> Figures:
    """The trainer fed by the engine's workers (``mode``: pipelined, the engine's masks; exact, its scores), blade."""
    from curation.engine.training_curation import TrainingCuration
    from schemas.engine_config import CurateAndTrainConfig
    from training.runs.engine_feed import EngineMaskedBatches, EngineSync, build_pipelined_training
    from training.runs.wiring import build_training
    from training.selection.shard_scores import EngineScores

    t = setting.train_config(name, "blade")
    shutil.rmtree(t.output_dir, ignore_errors=True)
    cfg = CurateAndTrainConfig.model_validate({
        "train": t.model_dump(mode="json"), "prepare": None,
        "engine": {"mode": mode, "snapshot_period": 4, "lookahead": 100},
        "workers": {"count": 1, "threads": 1, "range_steps": 2}})
    curation = TrainingCuration.of(cfg)
    with HostReadCounter() as counter:
        engine = LocalEngine(curation, counter)
        feed = curation.feed(engine, timeout_s=60.0)
        if mode == "pipelined":
            run = build_pipelined_training(t, batches=lambda vocab: EngineMaskedBatches(feed, t.max_steps,
                                                                                          model_vocab=vocab))
        else:
            run = build_training(t, scored=EngineScores(feed), schedule=curation.plan.schedule)
        run.trainer.state.callbacks.insert(0, EngineSync(feed.handle, feed.plan, algorithm=run.algorithm,
                                                         distance_interval=t.effective_distance_interval))
        run.trainer.state.callbacks.insert(0, _StepLabels(counter))
        counter.adopt(run.trainer)
        counter.label = "fit_start"
        run.fit()
    published = {s - 1 for s in curation.plan.publish_steps()}
    return figures(counter, _steady(t.max_steps, first=t.selection.warmup_steps + 2, exclude=published))


def reference_scenario(setting: Setting, phase: str) -> Figures:
    """The in-process reference of a blade run (τ = 4): each episode's scoring (``score``) or each refresh."""
    from training.runs.wiring import build_training

    cfg = setting.train_config(f"reference_{phase}", "blade", selection={"tau": 4}, max_steps=14)  # 3 whole episodes
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    with HostReadCounter() as counter:
        run = build_training(cfg)
        reference = run.algorithm.reference
        method = {"score": "_score_from", "refresh": "refresh"}[phase]
        real = getattr(reference, method)
        episodes = []

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            episodes.append((phase, len(episodes)))
            with labelled(counter, episodes[-1]):
                return real(*args, **kwargs)

        setattr(reference, method, wrapped)
        run.trainer.state.callbacks.insert(0, _StepLabels(counter))
        counter.adopt(run.trainer)
        run.fit()
    return figures(counter, episodes[1:] or episodes)  # (the first refresh also allocates what later ones reuse)


def _worker_setup(setting: Setting, output: str) -> tuple[Any, Any, Any]:
    from curation.core.schedule import Schedule
    from curation.engine.workers import BatchOrder, WorkerSpec
    from curation.io.shards import shard_dir_info

    cfg = setting.train_config("worker", "blade")
    cand = shard_dir_info(cfg.data.candidates, "candidate")
    num = cand.manifest.totals().sequences
    spec = WorkerSpec(candidates=cfg.data.candidates, out_dir=os.path.join(setting.root, "runs", f"worker-{output}"),
                      model=cfg.model.architecture, order=BatchOrder("stream", num, cfg.batch_size, 0),
                      vocab_size=cand.vocab_size, policy="blade", gamma=0.5, schedule=Schedule.of(cfg),
                      device="auto", threads=1, needs_proxy=output == "selected")
    shutil.rmtree(spec.out_dir, ignore_errors=True)
    return cfg, spec, num


def worker_scenario(setting: Setting, output: str) -> Figures:
    """A scoring worker's steady steps (a unit of 6 steps after a first unit loaded the weights)."""
    from curation.engine.plan import PROXY, REFERENCE, WorkUnit
    from curation.engine.weights import Weights
    from curation.engine.workers import ScoringWorker
    from curation.io.models import build_causal_lm

    cfg, spec, _ = _worker_setup(setting, output)
    weights = {(REFERENCE, 0): Weights.from_state_dict(build_causal_lm(cfg.model.architecture)),
               (PROXY, 2): Weights.from_state_dict(build_causal_lm(cfg.model.architecture))}
    proxy = 2 if output == "selected" else None
    with HostReadCounter() as counter:
        worker = ScoringWorker(spec, 0)
        real = worker._launch

        def launch(unit: Any, step: int, loaded: Any) -> Any:
            counter.label = step  # the step launched (and the one before it, finished after it)
            return real(unit, step, loaded)

        worker._launch = launch
        counter.label = "warm-up"
        worker.run(WorkUnit(2, 4, output, 0, proxy), lambda k, v: weights[(k, v)])
        worker.run(WorkUnit(4, 10, output, 0, proxy), lambda k, v: weights[(k, v)])
    return figures(counter, list(range(5, 9)))  # (step 9's label also holds its own finish, after the last launch)


def weight_load_scenario(setting: Setting) -> Figures:
    """One model's weights of a new version, both ways: loaded into a worker's scorer (after a first version) and
    taken from a model on the device (a proxy publication, a refresh's result)."""
    from curation.engine.plan import REFERENCE
    from curation.engine.weights import Weights
    from curation.engine.workers import ScoringWorker
    from curation.io.models import build_causal_lm

    cfg, spec, _ = _worker_setup(setting, "scored")
    versions = [Weights.from_state_dict(build_causal_lm(cfg.model.architecture.model_copy(update={"init_seed": i})))
                for i in range(2)]
    with HostReadCounter() as counter:
        worker = ScoringWorker(spec, 0)
        with labelled(counter, "first"):
            worker.set_weights(REFERENCE, 0, versions[0])
        with labelled(counter, "load"):
            worker.set_weights(REFERENCE, 1, versions[1])
        with labelled(counter, "take"):
            Weights.from_state_dict(worker.scorers[REFERENCE].model)
    return figures(counter, ["load", "take"])


def measure(root: str | None = None, *, only: list[str] | None = None) -> dict[str, Any]:
    """Every scenario's figures (``only``: these), the targets, and whether each is met."""
    with contextlib.ExitStack() as stack:
        if root is None:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="host-reads-"))
        setting = Setting(root)
        out: dict[str, Any] = {"torch": torch.__version__}
        start = time.perf_counter()
        for name, run in SCENARIOS.items():
            if only is not None and name not in only:
                continue
            out[name] = run(setting).to_dict()
        out["seconds"] = round(time.perf_counter() - start, 1)
        out["targets"] = {k: v for k, v in TARGETS.items() if k in out}
        out["met"] = {k: out[k]["per_step"] <= v for k, v in out["targets"].items()}
        out["sites"] = sorted({s for k in SCENARIOS if k in out for s in out[k]["sites"]})
        return out


SCENARIOS: dict[str, Callable[[Setting], Figures]] = {
    "trainer_full": lambda s: trainer_scenario(s, "full", "full")[0],
    "trainer_random": lambda s: trainer_scenario(s, "random", "random")[0],
    "trainer_rho1": lambda s: trainer_scenario(s, "rho1", "rho1")[0],
    "trainer_blade": lambda s: trainer_scenario(s, "blade", "blade")[0],
    "trainer_blade_microbatched": lambda s: trainer_scenario(s, "blade_mb", "blade", microbatch_size=2)[0],
    "trainer_engine": lambda s: engine_scenario(s, "engine_pipelined", "pipelined"),
    "trainer_engine_exact": lambda s: engine_scenario(s, "engine_exact", "exact"),
    "episode_start": lambda s: reference_scenario(s, "score"),
    "refresh": lambda s: reference_scenario(s, "refresh"),
    "worker_scored": lambda s: worker_scenario(s, "scored"),
    "worker_selected": lambda s: worker_scenario(s, "selected"),
    "weight_load": weight_load_scenario,
}
