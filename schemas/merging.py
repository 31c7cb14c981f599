"""Config layers: a ``--config`` file merged onto a job's embedded default, and the sections of a config model.

Pure (dicts and pydantic models in, dicts out). The rule, as llm-foundry's and Hydra's users expect:

* a **section** (a key whose field is a config model, e.g. ``train.selection``) merges key by key, at any depth, so a
  file of two keys changes two keys;
* anything else **replaces**: a scalar, ``null``, a list (``prepare.sources``: a file's list is the whole list, never
  merged item by item) and a free-form mapping (``model.hf_config``: a GPT-2's config is not a Llama's with keys
  added);
* a model's **exclusive keys** (:attr:`ExclusiveKeys`, e.g. ``model.hf_config`` / ``model.path``): setting one of a
  group drops the others that came from the layer below, so ``model.path`` alone replaces the default's
  ``hf_config``. A layer that sets two of a group keeps both (the model's validation then names the conflict).

``--set`` overrides come after the file (:func:`schemas.config.apply_override`, with the same exclusive groups).
"""

from __future__ import annotations

import copy
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel

__all__ = ["EXCLUSIVE_ATTR", "section_models", "field_models", "exclusive_with", "merge_config"]

#: The class attribute of a config model naming its groups of mutually exclusive keys (a tuple of tuples of field
#: names), e.g. ``exclusive_keys = (("hf_config", "path"),)``.
EXCLUSIVE_ATTR = "exclusive_keys"


def section_models(annotation: Any) -> list[type[BaseModel]]:
    """The config models inside a field's annotation (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in section_models(a)]


def field_models(models: Iterable[type[BaseModel]], key: str) -> list[type[BaseModel]]:
    """The config models of the field ``key`` in any of ``models`` (a section's sections)."""
    return [m for mod in models if key in mod.model_fields for m in section_models(mod.model_fields[key].annotation)]


def _is_section(models: Iterable[type[BaseModel]], key: str) -> bool:
    """Whether ``key`` of ``models`` holds one config model (or None), not a list or a mapping of them."""
    for mod in models:
        field = mod.model_fields.get(key)
        if field is None:
            continue
        ann = field.annotation
        options = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
        return any(isinstance(a, type) and issubclass(a, BaseModel) for a in options)
    return False


def exclusive_with(models: Iterable[type[BaseModel]], key: str) -> set[str]:
    """The keys that setting ``key`` of a section of ``models`` drops (its exclusive groups, :data:`EXCLUSIVE_ATTR`)."""
    return {other for mod in models for group in getattr(mod, EXCLUSIVE_ATTR, ()) if key in group
            for other in group if other != key}


def merge_config(base: Mapping[str, Any], layer: Mapping[str, Any],
                 models: Iterable[type[BaseModel]] = ()) -> dict[str, Any]:
    """``layer`` merged onto ``base`` (module docstring); ``models``: the config model(s) of this level (none: every
    mapping merges). Neither argument is changed."""
    models = list(models)
    out = copy.deepcopy(dict(base))
    for key, value in layer.items():
        if value is not None:
            for other in exclusive_with(models, key) - set(layer):
                out.pop(other, None)
        below = out.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping) and (not models or _is_section(models, key)):
            out[key] = merge_config(below, value, field_models(models, key))
        else:
            out[key] = copy.deepcopy(value)
    return out
