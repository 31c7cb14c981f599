"""Which shard files an error blames: bad data found in a shard of a run's input (a corrupt shard, a token id
outside the model's vocabulary, a record that does not decode) is told apart from any other error by the shard files
it names, carried on the exception itself (:func:`blame`).

The blame travels with the error: through ``raise ... from``, through Ray (an exception's attributes are pickled
with it; a :class:`ray.exceptions.RayTaskError` keeps the original as ``cause``), through the engine's coordinator and
the data-parallel group's ``parallel/fatal.json`` (each passes :func:`blamed` on beside the message). When the job
stops on it, its output directory's lock records the failure of the input that holds those shards
(:func:`curation.io.inputs.record_failure`), so that a rerun accepts that input with those shards fixed and
nothing else changed (docs/FAILURES.md, "A rerun resumes only with the same inputs").

Standard library only: the readers and the engine import it.
"""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["blame", "blamed"]

E = TypeVar("E", bound=BaseException)

#: The attribute of an exception that holds the absolute paths of the shard files it blames.
ATTRIBUTE = "input_shards"


def blame(error: E, *files: str) -> E:
    """``error``, blaming the shard ``files`` too (absolute paths, or object-store URLs of cache paths; the ones it
    blamed already are kept)."""
    known = list(getattr(error, ATTRIBUTE, None) or ())
    for f in files:  # (a URL, from a process on another node, is kept as it is)
        full = f if isinstance(f, str) and "://" in f else os.path.abspath(f) if isinstance(f, str) and f else None
        if full is not None and full not in known:
            known.append(full)
    if known:
        setattr(error, ATTRIBUTE, tuple(known))
    return error


def blamed(error: BaseException | None) -> list[str]:
    """The shard files ``error`` blames, and those of the errors it was raised from or while handling (its
    ``__cause__`` and ``__context__``, a Ray error's ``cause``), in the order met, each once."""
    out: list[str] = []
    seen: set[int] = set()
    todo = [error]
    while todo and len(seen) < 64:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        attrs = getattr(e, "__dict__", {})  # (not getattr: a Ray error's looks its attributes up on its cause)
        for f in attrs.get(ATTRIBUTE) or ():
            if isinstance(f, str) and f not in out:
                out.append(f)
        cause = attrs.get("cause")
        todo += [c for c in (cause, e.__cause__, e.__context__) if isinstance(c, BaseException)]
    return out
