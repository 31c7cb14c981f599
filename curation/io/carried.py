"""Values handed to another process of a Ray cluster, whose node may keep its object-store cache elsewhere.

A path under this process's cache (``<BLADE_CACHE_DIR>/s3/<bucket>/<key>``: an ``s3://`` URL worked on locally,
:mod:`curation.io.storage`) means nothing on a node whose ``BLADE_CACHE_DIR`` differs: a work unit, a worker's
settings or a trainer's config built by the driver would send a scoring worker, a prepare task or a trainer rank on
another node to read and write the *driver's* cache directories (a path its machine may not have, and never the
bucket). So what crosses a process boundary is :func:`carry` ied: every string in it that is a cache path travels as
its URL, and :meth:`Carried.here` rebuilds the value in the process that uses it, each URL at *that* process's cache
path. Any value ``pickle`` handles may be carried (dataclasses, pydantic models, dicts, tuples): nothing is listed
field by field, so a field added later travels right too.

A :class:`Carried` stays one through any number of hops (a Ray Train controller between the driver and the ranks
unpickles and pickles it again unchanged); only :meth:`~Carried.here` resolves it. Strings that are URLs already stay
URLs (the records keep them); paths outside the cache (a shared filesystem's) travel as they are. Ray's own objects
inside the value (an actor's handle, an object reference) travel beside it, pickled by Ray, which counts the
references to them (``pickle`` alone would not: an actor whose handle only a carried value held would be ended).
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Generic, TypeVar

from curation.io import storage

__all__ = ["Carried", "carry"]

T = TypeVar("T")

_CACHE = "blade-cache-path"  # the persistent id's tag: (tag, url)


_PASSENGER = "ray-object"  # (tag, index into the passengers)


class _Out(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.passengers: list[Any] = []

    def persistent_id(self, obj: Any) -> tuple[str, Any] | None:  # noqa: D102 - pickle's hook
        if type(obj) is str:
            if obj.startswith(os.sep):  # (an absolute path: a relative one is never a cache path)
                url = storage.url_of(obj)
                if url is not None:
                    return (_CACHE, url)
            return None
        if type(obj).__module__.split(".")[0] == "ray":  # an actor handle, an object reference: Ray pickles it
            self.passengers.append(obj)
            return (_PASSENGER, len(self.passengers) - 1)
        return None


class _In(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, passengers: tuple[Any, ...]) -> None:
        super().__init__(file)
        self.passengers = passengers

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 - pickle's hook
        tag, value = pid
        if tag == _CACHE:
            return storage.local_path(value)
        if tag == _PASSENGER:
            return self.passengers[value]
        raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")


class Carried(Generic[T]):
    """A value on its way to another process (see the module docstring): :meth:`here` is the value there."""

    __slots__ = ("payload", "passengers")

    def __init__(self, payload: bytes, passengers: tuple[Any, ...] = ()) -> None:
        self.payload, self.passengers = payload, passengers

    def here(self) -> T:
        """The value in this process: each cache path it held is this process's cache path of the same URL."""
        return _In(io.BytesIO(self.payload), self.passengers).load()

    def __reduce__(self) -> tuple[Any, tuple[bytes, tuple[Any, ...]]]:
        return (Carried, (self.payload, self.passengers))

    def __repr__(self) -> str:
        return f"Carried({len(self.payload)} bytes, {len(self.passengers)} Ray objects)"


def carry(value: T) -> Carried[T]:
    """``value`` ready to travel: its cache paths as their URLs (:meth:`Carried.here` rebuilds it at the other end)."""
    buf = io.BytesIO()
    out = _Out(buf)
    out.dump(value)
    return Carried(buf.getvalue(), tuple(out.passengers))
