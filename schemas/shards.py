"""MDS column specs for the three shard kinds (docs/DESIGN.md §5) and a shard-directory validator.

No torch, no ray: only the standard library (the validator reads MDS ``index.json`` files).

Example:
    >>> from schemas.shards import CANDIDATE, token_dtype
    >>> CANDIDATE.mds_columns(vocab_size=50257)
    {'tokens': 'ndarray:uint16', 'source': 'str'}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = [
    "SCHEMA_VERSION",
    "TOKENS",
    "ShardSpec",
    "ShardSchemaError",
    "CANDIDATE",
    "SCORED",
    "SELECTED",
    "SPECS",
    "token_dtype",
    "validate_shard_dir",
]

#: Bumped whenever a column is added, removed or changes encoding.
SCHEMA_VERSION = "1.0"

#: Placeholder for the token column; resolved to uint16 or uint32 from the vocabulary size.
TOKENS = "ndarray:{token_dtype}"

_TOKEN_ENCODINGS = ("ndarray:uint16", "ndarray:uint32")


class ShardSchemaError(ValueError):
    """A shard directory does not match the expected spec (names the directory, shard and column)."""


def token_dtype(vocab_size: int) -> str:
    """Smallest unsigned dtype that holds every token id of a vocabulary of ``vocab_size`` ids."""
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class ShardSpec:
    """The columns of one shard kind.

    Attributes:
        name: ``candidate``, ``scored`` or ``selected``.
        columns: column name → MDS encoding; the token column uses :data:`TOKENS`.
    """

    name: str
    columns: dict[str, str]

    def mds_columns(self, *, vocab_size: int) -> dict[str, str]:
        """The ``columns`` argument for ``MDSWriter``, with the token dtype resolved."""
        dtype = token_dtype(vocab_size)
        return {k: v.format(token_dtype=dtype) for k, v in self.columns.items()}

    def matches(self, encodings: dict[str, str]) -> list[str]:
        """Problems (empty when none) of a shard's ``{column: encoding}`` against this spec."""
        problems = []
        for col, enc in self.columns.items():
            if col not in encodings:
                problems.append(f"missing column '{col}' (expected {enc.format(token_dtype='uint16|uint32')})")
                continue
            got = encodings[col]
            ok = got in _TOKEN_ENCODINGS if enc == TOKENS else got == enc
            if not ok:
                want = "ndarray:uint16 or ndarray:uint32" if enc == TOKENS else enc
                problems.append(f"column '{col}' has encoding '{got}', expected {want}")
        for col, enc in encodings.items():
            if col not in self.columns:
                problems.append(f"unexpected column '{col}' ({enc})")
            elif enc == "pkl":
                problems.append(f"column '{col}' uses pickle encoding, which is not allowed")
        return problems


CANDIDATE = ShardSpec("candidate", {"tokens": TOKENS, "source": "str"})
SCORED = ShardSpec(
    "scored",
    {"tokens": TOKENS, "source": "str", "ref_loss": "ndarray:float16", "episode": "int32"},
)
SELECTED = ShardSpec(
    "selected",
    {
        "tokens": TOKENS,
        "loss_mask": "ndarray:uint8",
        "score": "ndarray:float16",
        "source": "str",
        "step": "int64",
        "episode": "int32",
    },
)
SPECS: dict[str, ShardSpec] = {s.name: s for s in (CANDIDATE, SCORED, SELECTED)}


def _read_index(path: str) -> dict:
    index = os.path.join(path, "index.json")
    if not os.path.isdir(path):
        raise ShardSchemaError(f"{path}: not a directory")
    if not os.path.isfile(index):
        raise ShardSchemaError(f"{path}: no MDS index.json (not a shard directory, or not finished)")
    try:
        with open(index, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ShardSchemaError(f"{index}: unreadable MDS index ({e})") from e


def validate_shard_dir(path: str, spec: ShardSpec | str) -> dict[str, str]:
    """Check every shard listed in ``path/index.json`` against ``spec``.

    Args:
        path: an MDS directory (its ``index.json`` may list shards in subdirectories).
        spec: a :class:`ShardSpec` or its name (``candidate``, ``scored``, ``selected``).

    Returns:
        The directory's ``{column: encoding}`` (identical for all shards).

    Raises:
        ShardSchemaError: naming the directory, the shard file and the offending column.
    """
    if isinstance(spec, str):
        if spec not in SPECS:
            raise ValueError(f"unknown shard spec {spec!r}; valid: {sorted(SPECS)}")
        spec = SPECS[spec]
    index = _read_index(path)
    shards = index.get("shards")
    if not isinstance(shards, list) or not shards:
        raise ShardSchemaError(f"{path}: index.json lists no shards")
    found: dict[str, str] | None = None
    for shard in shards:
        if shard.get("format") != "mds":
            raise ShardSchemaError(f"{path}: shard format {shard.get('format')!r} is not 'mds'")
        name = (shard.get("raw_data") or {}).get("basename", "?")
        encodings = dict(zip(shard.get("column_names", []), shard.get("column_encodings", []), strict=False))
        problems = spec.matches(encodings)
        if problems:
            raise ShardSchemaError(
                f"{path}: shard {name} does not match the {spec.name} schema v{SCHEMA_VERSION}: "
                + "; ".join(problems)
            )
        if found is not None and encodings != found:
            raise ShardSchemaError(f"{path}: shard {name} has columns {encodings}, others have {found}")
        found = encodings
    assert found is not None
    return found
