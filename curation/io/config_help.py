"""``--help [SECTION]`` of the jobs: every config key with its default and its description.

The keys are read off the job's config model (each field's ``description``; a section's own docstring), the
defaults off the job's embedded default (what ``--config`` merges onto); a list of sections (``prepare.sources``)
shows its default list and the keys of one item (``prepare.sources.N.name``). ``SECTION`` narrows the listing to
one section or key (``--help train.selection``). Standard library and pydantic only: ``--help`` answers before a job
imports torch, Composer or Ray.
"""

from __future__ import annotations

import json
import re
import textwrap
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from schemas.config import nearest_key
from schemas.merging import section_models

__all__ = ["KeyDoc", "config_keys", "format_keys", "HelpError"]

#: Width of the listing (the description is wrapped under its key).
WIDTH = 110
_MISSING = object()


class HelpError(ValueError):
    """``--help SECTION`` names no section or key of the job's config."""


@dataclass(frozen=True)
class KeyDoc:
    """One key of a config: its dotted name, default (as YAML flow text), description; ``section``: a sub-config."""

    key: str
    default: str
    description: str
    section: bool = False


def _choices(annotation: Any) -> list[str]:
    """The values a ``Literal`` (or ``Literal | None``) annotation allows."""
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return [c for a in typing.get_args(annotation) for c in _choices(a)]


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value if value and value.strip() == value and value[0] not in "[{&*!|>'\"%@`#" else json.dumps(value)
    return json.dumps(value, ensure_ascii=False)


def _field_default(field: Any) -> Any:
    if field.default is not PydanticUndefined:
        return field.default.model_dump(mode="json") if isinstance(field.default, BaseModel) else field.default
    if field.default_factory is not None:
        value = field.default_factory()
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return _MISSING


def _plain(text: str) -> str:
    """Docstring markup as plain text: ``:class:`~a.B``` → ``B``, double backquotes → none."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return text.replace("``", "")


def _first_line(doc: str | None) -> str:
    """A section's docstring's first paragraph, on one line, as plain text."""
    return _plain(" ".join((doc or "").strip().split("\n\n")[0].split()))


def config_keys(model: type[BaseModel], default: Mapping[str, Any] | None = None, prefix: str = "") -> Iterator[KeyDoc]:
    """Every key of ``model`` in order, sections first as a line of their own; ``default``: the job's default config
    (dumped), whose values are shown (a key it lacks shows the field's default)."""
    for name, field in model.model_fields.items():
        key = prefix + name
        value = default.get(name, _MISSING) if isinstance(default, Mapping) else _MISSING
        if value is _MISSING:
            value = _field_default(field)
        models = section_models(field.annotation)
        choices = _choices(field.annotation)
        text = field.description or ""
        if choices and not any(c in text for c in choices if len(c) > 2):
            text = f"{text} (one of: {', '.join(choices)})".strip()
        if not models:
            yield KeyDoc(key, _shown(value), text)
            continue
        sub = models[0]
        listed = typing.get_origin(field.annotation) in (list, dict) or isinstance(value, list)
        heading = "; ".join(t for t in (text, _first_line(sub.__doc__)) if t)
        if listed:  # a list of sections: the default list, then the keys of one item
            yield KeyDoc(key, _shown(value), heading, section=True)
            yield from config_keys(sub, None, key + ".N.")
        else:
            yield KeyDoc(key, "null" if value is None else "", heading, section=True)
            yield from config_keys(sub, value if isinstance(value, Mapping) else None, key + ".")


def _matches(doc: KeyDoc, section: str) -> bool:
    """Whether ``doc`` is ``section`` or under it (an item index matches the ``N`` of a list's keys)."""
    key, want = doc.key.split("."), section.split(".")
    return len(key) >= len(want) and all(k == w or (k == "N" and w.isdigit()) for k, w in zip(key, want, strict=False))


def format_keys(model: type[BaseModel], default: Mapping[str, Any] | None = None, section: str | None = None) -> str:
    """The listing of ``--help`` (``section``: only the keys under it, e.g. ``train.selection``).

    Raises:
        HelpError: ``section`` names no key; the message lists the sections (and the nearest key).
    """
    docs = list(config_keys(model, default))
    shown = [d for d in docs if not section or _matches(d, section)]
    if not shown:
        sections = [d.key for d in docs if d.section]
        near = nearest_key(section or "", [d.key for d in docs])
        raise HelpError(f"--help {section}: no such section or key" + (f" (did you mean {near}?)" if near else "")
                        + f"; sections: {', '.join(sections)}")
    title = f"config keys under {section}" if section else "config keys"
    lines = [f"{title} (KEY = default; --config FILE merges onto these defaults, --set KEY=VALUE after it; "
             "--help SECTION for one section):"]
    for d in shown:
        head = f"{d.key}:" if d.section and not d.default else f"{d.key} = {d.default}"
        lines += textwrap.wrap(head, WIDTH, initial_indent="" if d.section else "  ",
                               subsequent_indent="    " if d.section else "      ", break_on_hyphens=False)
        if d.description:
            indent = "    " if d.section else "      "
            lines += textwrap.wrap(d.description, WIDTH, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(lines) + "\n"
