"""Where the host waits for the device, in one place (docs/DESIGN.md §6, "Steps that never wait").

On a GPU every value the host reads from the device (``.item()``, ``bool(t)``, ``.tolist()``), every blocking copy
between them (``.cpu()``, ``.to("cpu")``, a copy to the device without ``non_blocking``) and every ``synchronize()``
drains the device's queue: the GPU idles while the host prepares the next launches. A steady step of the trainer or
of a scoring worker reads the device once, and not the step it is queueing: what it needs to know of a step (its
selection record, its loss, a finiteness flag) is copied without blocking into reused pinned host buffers and read
after an event, a step later (:class:`HostCopies`).

* :func:`queues`: whether a device queues its work (CUDA): the one test of the branches a GPU run takes (pinned
  buffers, non-blocking copies, events, fused AdamW, the synchronisation-free top-k, offloading). :data:`STAND_IN` is
  a CPU device that takes them too: the host-read counter (``bench/host_reads.py``) gives it to the tensors a GPU
  run would hold on its device, so that the reads of a GPU run are counted on a CPU. Nothing else produces it (a
  CPU tensor's ``device`` is ``cpu``, without an index).
* :func:`pinned`, :func:`event`: a pinned host copy of a tensor and a CUDA event, where :func:`queues`.
* :class:`PinnedRing`: named host buffers in a few slots, allocated once and reused.
* :class:`HostCopies`: device tensors copied into a ring's slot, read after the slot's event.

On a CPU (no queue) the copies are the tensors themselves and the waits are nothing: the same values, in the same
order. Pure torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["STAND_IN", "queues", "pinned", "event", "PinnedRing", "HostCopies", "Ticket", "matmul_settings",
           "set_matmul_precision"]

#: The device the host-read counter stands in for a GPU with (module docstring): a CPU with an index.
STAND_IN = torch.device("cpu", 0)

#: fp32 matmul precision of every process of a run on a GPU (trainer, scoring workers, refresh actor): TF32,
#: Composer's own default for its GPU device (``DeviceGPU(allow_tf32=True)``), so ℓ(u) and ℓ(w̃) are computed
#: alike in every process. A CPU keeps torch's default ("highest").
CUDA_MATMUL_PRECISION = "high"


def queues(device: torch.device | str | None) -> bool:
    """Whether work on ``device`` is queued (CUDA, or :data:`STAND_IN`): the branches of a GPU run apply."""
    if device is None:
        return False
    device = torch.device(device)
    return device.type == "cuda" or device == STAND_IN


def pinned(t: Tensor, device: torch.device | str | None) -> Tensor:
    """``t`` in pinned host memory when it is to be copied to ``device`` (:func:`queues`), so the copy need not
    block; ``t`` itself otherwise (and when it is pinned already)."""
    if not queues(device) or t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


def event(device: torch.device | str | None) -> Any:
    """A recorded CUDA event on ``device``'s current stream where :func:`queues` (None elsewhere)."""
    if not queues(device):
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def set_matmul_precision(device: torch.device | str) -> dict[str, Any]:
    """Apply the run's fp32 matmul precision for ``device`` (:data:`CUDA_MATMUL_PRECISION` on a GPU, TF32 in cuDNN
    too; a CPU is left as it is) and return :func:`matmul_settings`. Every process of a run calls it."""
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision(CUDA_MATMUL_PRECISION)
        torch.backends.cudnn.allow_tf32 = True
    return matmul_settings()


def matmul_settings() -> dict[str, Any]:
    """This process's fp32 matmul settings (the run's summary records them)."""
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


class PinnedRing:
    """Host buffers by name in ``slots`` slots, allocated on first use (or when a name's shape or dtype changes) and
    reused after that; pinned where the device :func:`queues`. A slot handed out by :meth:`next` is the caller's
    until ``slots`` more have been handed out: it must have finished with it (its copies done, its values read)."""

    def __init__(self, device: torch.device | str, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {slots}")
        self.device = torch.device(device)
        self.pin = queues(self.device)
        self._slots: list[dict[str, Tensor]] = [{} for _ in range(slots)]
        self._next = 0

    def next(self) -> int:
        """The index of the next slot."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        return i

    def buffer(self, slot: int, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Slot ``slot``'s buffer ``name`` (uninitialised when new)."""
        held = self._slots[slot].get(name)
        if held is None or held.shape != torch.Size(shape) or held.dtype != dtype:
            held = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
            self._slots[slot][name] = held
        return held


@dataclass
class Ticket:
    """Copies queued by :meth:`HostCopies.put`: their host tensors, once :meth:`HostCopies.get` has waited."""

    slot: int
    host: dict[str, Tensor]
    ready: Any  # torch.cuda.Event where the device queues, else None


class HostCopies:
    """Device tensors copied without blocking into the slots of a :class:`PinnedRing`, read after an event.

    :meth:`put` queues the copies of a set of tensors and records an event; :meth:`get` waits for that event (the one
    host wait) and returns the host tensors, which stay valid until ``slots`` more puts (copy out what is kept).
    Where the device does not queue (a CPU), the host tensors are the tensors themselves. Buffers and events are
    the slots' own, reused put after put.

    Args:
        device: where the tensors are.
        slots: puts that may be outstanding or held at once.
    """

    def __init__(self, device: torch.device | str, slots: int = 2) -> None:
        self.device = torch.device(device)
        self.queued = queues(self.device)
        self.ring = PinnedRing(self.device, slots)
        self._events: list[Any] = [None] * slots  # one CUDA event per slot, re-recorded at each put
        self.waits = 0

    def put(self, tensors: Mapping[str, Tensor]) -> Ticket:
        if not self.queued:
            return Ticket(-1, {k: v.detach() for k, v in tensors.items()}, None)
        slot = self.ring.next()
        host = {}
        for name, t in tensors.items():
            t = t.detach()
            host[name] = self.ring.buffer(slot, name, t.shape, t.dtype).copy_(t, non_blocking=True)
        ready = self._events[slot]
        if ready is None:
            ready = self._events[slot] = torch.cuda.Event()
        ready.record()
        return Ticket(slot, host, ready)

    def get(self, ticket: Ticket) -> dict[str, Tensor]:
        if ticket.ready is not None:
            ticket.ready.synchronize()  # this put's copies alone; what was queued after them keeps running
            ticket.ready = None
            self.waits += 1
        return ticket.host
