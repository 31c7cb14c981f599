"""Config records: which keys of a config cannot change a job's outputs, and how a recorded config compares
with the one resuming it (pure: dicts and pydantic models in, the differing keys out).

The output directory's lock and its record files (reading, writing, refusing a rerun) are I/O:
:mod:`curation.io.outdir`.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

__all__ = ["OPERATIONAL", "EXTENDABLE", "INPUT", "operational_keys", "extendable_keys", "input_keys", "field_default",
           "config_diff", "as_dict", "leaves"]

#: ``json_schema_extra`` of a config field that cannot change a job's outputs (progress bars, Ray
#: addresses, worker counts of an exact engine...): a rerun may change it and still resume.
OPERATIONAL: dict[str, Any] = {"operational": True}

#: ``json_schema_extra`` of an integer config field a rerun may *raise* and still resume: the run is extended from
#: its checkpoint, and must end as a run that had the larger value from the start (``max_steps``: nothing the
#: first steps computed depends on it; docs/FAILURES.md, "Extending a run"). Lowering it is refused.
EXTENDABLE: dict[str, Any] = {"extendable": True}

#: ``json_schema_extra`` of a config field naming an input of the job (a shard directory, a tokenizer, weights, a
#: model directory): its content is fingerprinted and recorded with the run, and a resumed or extended run whose
#: input has other content is refused (:mod:`curation.io.inputs`).
INPUT: dict[str, Any] = {"input": True}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models_in(a)]
    return []


def operational_keys(model: type[BaseModel], prefix: str = "", *, mark: str = "operational") -> set[str]:
    """Dotted keys of the fields of ``model`` (nested sections included) marked :data:`OPERATIONAL` (``mark``:
    another marker, e.g. ``extendable``)."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        key = prefix + name
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get(mark):
            keys.add(key)
            continue
        for sub in _models_in(field.annotation):
            keys |= operational_keys(sub, key + ".", mark=mark)
    return keys


def extendable_keys(model: type[BaseModel]) -> set[str]:
    """Dotted keys of the fields of ``model`` marked :data:`EXTENDABLE`."""
    return operational_keys(model, mark="extendable")


def input_keys(model: type[BaseModel]) -> set[str]:
    """Dotted keys of the fields of ``model`` marked :data:`INPUT` (nested sections included, not those inside an
    :data:`OPERATIONAL` one: ``prepare`` of the main job keeps its own record)."""
    operational = operational_keys(model)
    return {k for k in operational_keys(model, mark="input")
            if not any(k == p or k.startswith(p + ".") for p in operational)}


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list | tuple) and value:
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out[prefix] = value


_MISSING = object()


def _json(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return json.loads(json.dumps(value))


def field_default(model: type[BaseModel], key: str) -> Any:
    """The default of the field at the dotted ``key`` of ``model`` (through nested sections), as its record holds
    it (JSON); leaves below a default section (``loggers.tensorboard`` of a default ``loggers``) too. ``_MISSING``
    (a private sentinel) when the key names no field, a required one, or an item of a list or dict."""
    parts = key.split(".")
    models: list[type[BaseModel]] = [model]
    for i, part in enumerate(parts):
        field = next((m.model_fields[part] for m in models if part in m.model_fields), None)
        if field is None:
            return _MISSING
        if i == len(parts) - 1:
            return _MISSING if field.is_required() else _json(field.get_default(call_default_factory=True))
        models = _models_in(field.annotation)
        if not models:
            return _MISSING
    return _MISSING


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any], ignore: set[str] = frozenset(),
                model: type[BaseModel] | None = None) -> list[str]:
    """Leaf keys (dotted, list items by index) whose values differ, as ``key: old → new``; keys under an
    ``ignore`` prefix are left out. With the config's ``model``, a key ``old`` does not have is equal when ``new``
    holds its field's default (:func:`field_default`): a setting added after ``old`` was recorded, at the default
    that is the recorded behaviour. Empty when the configs are equal."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    _flatten(json.loads(json.dumps(old)), "", a)
    _flatten(json.loads(json.dumps(new)), "", b)

    def ignored(key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in ignore)

    lines = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        if va is _MISSING and model is not None and _absent_at_default(model, key, vb):
            continue
        if va != vb and not ignored(key):
            show = ["(absent)" if v is _MISSING else json.dumps(v) for v in (va, vb)]
            lines.append(f"{key}: {show[0]} → {show[1]}")
    return lines


def _absent_at_default(model: type[BaseModel], key: str, value: Any) -> bool:
    """``key`` (a leaf of a flattened record) holds ``value``, and it or a section above it is a field whose default
    holds that same leaf value (a new section at its default flattens to leaves below the new field)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        default = field_default(model, ".".join(parts[:n]))
        if default is _MISSING:
            continue
        leaves: dict[str, Any] = {}
        _flatten(default, "", leaves)
        rest = ".".join(parts[n:])
        return rest in leaves and leaves[rest] == value
    return False


def as_dict(cfg: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    """A config (a model or a mapping) as the JSON dict its record holds."""
    return cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else json.loads(json.dumps(dict(cfg)))


def leaves(value: Any) -> dict[str, Any]:
    """The leaves of a record (JSON), by dotted key (list items by index), as :func:`config_diff` compares them."""
    out: dict[str, Any] = {}
    _flatten(json.loads(json.dumps(value)), "", out)
    return out
