"""Host storage of the in-process reference off the training device (used by
:class:`training.selection.reference.InProcessReference`, which decides what goes where).

``blade`` (every refresh starts again from ``u``) scores every step of an episode right after the refresh; after that,
``w̃`` is read only by the ``‖u − w̃‖`` statistic, the checkpoints and ``final/reference.safetensors``. Moving
the float32 module to the host for that doubled the host memory of a GPU run (issue 12: 1.67× a plain run
at 124M parameters). :class:`CompactReference` keeps those weights in bfloat16 in one flat host buffer that
every refresh reuses (pinned when CUDA is available, so the copy from the device is a DMA): half the bytes,
no allocation per refresh, and no module.

The rounding to bfloat16 changes only what reads ``w̃`` after its scores exist: the logged distance (relative
error ~2⁻⁹ per weight) and the saved reference. The masks do not change: they come from the scores, and a
checkpoint carries the remaining scores of the episode (:class:`training.selection.reference.InProcessReference`), so a
resumed run does not re-score with the rounded weights.

``blade-nosync`` carries the reference's AdamW state (two moments, twice the weights) from refresh to refresh.
Between refreshes it follows the weights off the GPU: :class:`HostOptimizerState` keeps it in float32 (exactly)
in one reused pinned host buffer, and the next refresh copies it back (non-blocking) and continues from it.
"""

from __future__ import annotations

import copy
import ctypes
import mmap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from curation.core.host_sync import event, queues

__all__ = ["CompactReference", "HostOptimizerState"]


#: Pinned buffers from this size on are registered exactly (page-aligned pages of their own); smaller ones are blocks
#: of the caching host allocator, whose rounding up costs at most this much.
REGISTER_MIN_BYTES = 1 << 20


def page_aligned(size: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised 1-d tensor of ``size`` elements on pages of its own (an anonymous memory mapping, released
    when the last view of it goes)."""
    nbytes = size * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    pages = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    return torch.frombuffer(mmap.mmap(-1, pages), dtype=torch.uint8, count=nbytes).view(dtype)


def _clear_cuda_error() -> None:
    """Clear CUDA's last error after a failed runtime call (the next kernel launch's check would report it):
    ``cudaGetLastError`` of the process's CUDA runtime, found among its mapped libraries; best effort."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libraries = {line.split()[-1] for line in f if "libcudart" in line}
        for library in libraries:
            ctypes.CDLL(library).cudaGetLastError()
    except (OSError, AttributeError):
        pass


class _HostBuffer:
    """Tensors packed one after another in one flat host buffer of one dtype, allocated on first use (or when the
    total size changes) and reused after that; pinned when CUDA is available, so the copies between it and a GPU
    are DMAs that need not block."""

    dtype: torch.dtype

    def __init__(self, *, pin: bool | None = None) -> None:
        self._pin = pin  # None: pinned when the tensors stored come from a GPU (curation.core.host_sync.queues)
        self.pin = bool(pin)
        self._buffer: Tensor | None = None
        self._registered: int | None = None  # the address pinned with cudaHostRegister (unregistered on release)
        self._ready: Any = None  # the event after the last fill's copies (waited for before the buffer is read)

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def _allocate(self, size: int) -> None:
        """A buffer of ``size`` elements. Pinned, a buffer of :data:`REGISTER_MIN_BYTES` or more is page-locked with
        ``cudaHostRegister``, exactly its pages: ``pin_memory=True`` takes blocks from the caching host allocator,
        which rounds each up to a power of two (an 86.7M-parameter reference in bfloat16, 165 MB, held 256 MB of
        pinned host memory on an H200). The pages are the buffer's own (an anonymous mapping, :func:`page_aligned`):
        a heap block could share a page with another registered buffer, whose registration then fails and leaves
        CUDA's last error for the next kernel launch to report, or pin unrelated tensors."""
        self._release()
        nbytes = size * self.dtype.itemsize
        if not self.pin or nbytes < REGISTER_MIN_BYTES or not torch.cuda.is_available():
            self._buffer = torch.empty(size, dtype=self.dtype, pin_memory=self.pin and size > 0)
            return
        self._buffer = page_aligned(size, self.dtype)
        ptr = self._buffer.data_ptr()
        if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0:
            self._registered = ptr
        else:  # not expected on pages of its own: the allocator's pinned block (rounded up) instead
            _clear_cuda_error()
            self._buffer = torch.empty(size, dtype=self.dtype, pin_memory=True)

    def _release(self) -> None:
        """Unpin the buffer before its memory can be freed (views of it stay valid, as ordinary host memory), once no
        copy from or to it is in flight (the caching host allocator tracked that with events; these pages are not
        its)."""
        if self._registered is not None:
            self.wait()
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already (the process frees it all)
            pass

    def _fill(self, tensors: list[Tensor]) -> None:
        """Copy ``tensors`` into the buffer, the first at offset 0 and each right after the previous one (on a GPU,
        each converted to the buffer's dtype there first, so the copy is a DMA of the stored bytes with no
        host-side temporary)."""
        size = sum(t.numel() for t in tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        if self._pin is None:
            self.pin = queues(device)
        self.wait()  # (the last fill's copies, before the buffer is written again)
        if self._buffer is None or self._buffer.numel() != size or (self.pin and not self._buffer.is_pinned()):
            self._allocate(size)
        offset = 0
        on_device = queues(device)
        for t in tensors:
            self._buffer[offset : offset + t.numel()].view(t.shape).copy_(t.to(self.dtype) if on_device else t,
                                                                           non_blocking=self.pin)
            offset += t.numel()
        # An event, not a device-wide synchronize: the buffer is read on the host only after wait()
        self._ready = event(device) if self.pin else None

    def wait(self) -> None:
        """Wait for the last fill's copies (nothing when they are done, or were not asynchronous)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None

    def _slice(self, offset: int, shape: torch.Size) -> Tensor:
        assert self._buffer is not None
        self.wait()
        return self._buffer[offset : offset + shape.numel()].view(shape)


class CompactReference(_HostBuffer):
    """``w̃``'s floating-point weights in bfloat16 in one reused host buffer (see the module docstring)."""

    dtype = torch.bfloat16

    def __init__(self, *, pin: bool | None = None) -> None:
        super().__init__(pin=pin)
        # state-dict name → (offset, shape); tied weights (one storage, several names) share an offset
        self._layout: dict[str, tuple[int, torch.Size]] = {}
        self._params: list[str] = []  # names of the module's parameters (tied weights once)
        self._others: dict[str, Tensor] = {}  # non-floating entries, kept as they are
        self.version: int | None = None

    @property
    def holds(self) -> bool:
        return self.version is not None

    def store(self, module: nn.Module, version: int) -> None:
        """Copy ``module``'s weights into the buffer (allocated on first use, or when the layout changes)."""
        layout: dict[str, tuple[int, torch.Size]] = {}
        offsets: dict[int, int] = {}  # address of a tensor's data → its offset, so a tied weight is stored once
        unique: list[Tensor] = []
        others: dict[str, Tensor] = {}
        size = 0
        for name, t in module.state_dict().items():
            if not t.is_floating_point():
                others[name] = t.detach().to("cpu").clone()
                continue
            if t.data_ptr() not in offsets:
                offsets[t.data_ptr()] = size
                unique.append(t.detach())
                size += t.numel()
            layout[name] = (offsets[t.data_ptr()], t.shape)
        self._fill(unique)
        self._layout, self._others, self.version = layout, others, version
        self._params = [n for n, _ in module.named_parameters()]

    def clear(self) -> None:
        """Forget the weights (the buffer stays allocated for the next refresh)."""
        self.version = None

    def _view(self, name: str) -> Tensor:
        return self._slice(*self._layout[name])

    def parameters(self) -> dict[str, Tensor]:
        """The parameters by name (views into the buffer, bfloat16), as ``param_distance`` reads a module's."""
        return {n: self._view(n) for n in self._params}

    def state_dict(self, *, copy: bool = True) -> dict[str, Tensor]:
        """A state dict of the weights (bfloat16 copies of the floating entries, which ``load_state_dict`` casts
        back to the module's dtype), safe to keep after the next :meth:`store`; ``copy=False``: views into the
        buffer (and the held non-floating entries), valid until the next :meth:`store`."""
        if not copy:
            return {**{n: self._view(n) for n in self._layout}, **self._others}
        return {**{n: self._view(n).clone() for n in self._layout}, **{k: v.clone() for k, v in self._others.items()}}


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of a stored optimizer state lives on the host, and the device it came from."""

    shape: torch.Size
    device: torch.device
    offset: int = 0  # in the float32 buffer, unless ``held``
    held: Tensor | None = None  # a tensor of another dtype, kept as a host copy of its own


def _map_state(state: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """An optimizer state dict with ``fn`` applied to every per-parameter value (``param_groups`` copied)."""
    return {**state, "state": {k: {n: fn(v) for n, v in s.items()} for k, s in state["state"].items()},
            "param_groups": copy.deepcopy(state["param_groups"])}


class HostOptimizerState(_HostBuffer):
    """An optimizer ``state_dict()``'s float32 tensors (AdamW's moments and step counts) in one reused host buffer.

    ``blade-nosync`` carries the reference AdamW from one refresh to the next; between refreshes it is only
    read by checkpoints, so off a GPU it need not hold twice the reference's weights in device memory. The
    values are kept in float32, exactly: :meth:`restore` gives back a state whose tensors are equal, on the
    devices they came from, so the continued AdamW takes the same steps.
    """

    dtype = torch.float32

    def __init__(self, *, pin: bool | None = None) -> None:
        super().__init__(pin=pin)
        self._layout: dict[str, Any] | None = None  # the state dict with a _Slot for each tensor

    @property
    def holds(self) -> bool:
        return self._layout is not None

    def store(self, state: Mapping[str, Any]) -> None:
        """Copy ``state``'s tensors to the host (into the buffer, allocated on first use or when the sizes change)."""
        tensors: list[Tensor] = []
        size = 0

        def slot(v: Any) -> Any:
            nonlocal size
            if not isinstance(v, Tensor):
                return v
            if v.dtype != self.dtype:
                return _Slot(v.shape, v.device, held=v.detach().to("cpu", copy=True))
            tensors.append(v.detach())
            size += v.numel()
            return _Slot(v.shape, v.device, offset=size - v.numel())

        layout = _map_state(state, slot)
        self._fill(tensors)
        self._layout = layout

    def clear(self) -> None:
        """Forget the state (the buffer stays allocated for the next refresh)."""
        self._layout = None

    def _view(self, s: Any) -> Any:
        if not isinstance(s, _Slot):
            return s
        return s.held if s.held is not None else self._slice(s.offset, s.shape)

    def state_dict(self) -> dict[str, Any]:
        """The stored state with host tensors (views into the buffer, valid until the next :meth:`store`), as a
        checkpoint saves it."""
        assert self._layout is not None
        return _map_state(self._layout, self._view)

    def restore(self) -> dict[str, Any]:
        """A copy of the stored state with each tensor back on the device it was stored from (non-blocking copies
        from the pinned buffer): new tensors, which the optimizer that loads them may update in place."""
        assert self._layout is not None
        return _map_state(self._layout, lambda s: self._view(s).to(s.device, copy=True, non_blocking=self.pin)
                          if isinstance(s, _Slot) else s)
