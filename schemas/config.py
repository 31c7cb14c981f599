"""Validated job configs: pydantic models, YAML files, ``--set a.b=c`` overrides.

Every job section is a pydantic model that forbids unknown keys, so a typo is an error naming the key.
:func:`load_config` resolves a YAML file (or the embedded default) and overrides ``key.path=value`` (values
parsed as YAML, list items addressed by index: ``sources.0.text_field=body``) into a validated config; the
jobs' command line (``--config``, ``--set``, ``--print-config``) is :mod:`curation.io.cli`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from schemas.manifest import PATH_NAME_RULE, RESERVED_NAMES, check_path_name  # noqa: F401 (their home: a leaf)
from schemas.merging import exclusive_with, field_models, merge_config
from schemas.records import OPERATIONAL

__all__ = [
    "ConfigError", "StrictModel", "Gamma", "PATH_NAME_RULE", "PathName", "check_path_name", "SourceConfig",
    "TOKEN_ENCODING_TYPES", "TokenizerConfig", "RayConfig", "PrepareConfig", "apply_override", "load_config",
    "config_to_yaml", "DEMO_ROOT", "load_yaml", "load_record_yaml", "BoundedSafeLoader", "shown", "cut", "nearest_key",
]

M = TypeVar("M", bound=BaseModel)

#: Where the embedded demo writes its corpus and outputs (relative to the working directory).
DEMO_ROOT = os.path.join("runs", "demo")


#: At most this many characters of a value are quoted in an error (a config value can be megabytes long).
MAX_SHOWN = 200


def cut(text: str, limit: int = MAX_SHOWN) -> str:
    """``text``, cut to ``limit`` characters (then ``...`` and its full length)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters (:func:`cut`)."""
    return cut(repr(value), limit)


class BoundedSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: an alias (``*name``, ``<<: *name``) is refused, so a few hundred bytes cannot
    expand into gigabytes (the "billion laughs"), and a key given twice in a mapping is refused naming both lines
    (YAML would keep the last one silently). Errors are ``yaml.YAMLError`` with the line."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"the alias *{cut(str(event.anchor), 40)} is not accepted in a config (write the value out: "
                "aliases can expand a small file into gigabytes)", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the constructor below reports it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {shown(key, 60)} is given twice in this mapping (first on line {first}); "
                        "keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_record_yaml(stream: Any) -> Any:
    """Parse YAML written by ``yaml.safe_dump`` (a config record) with :class:`BoundedSafeLoader`."""
    return yaml.load(stream, Loader=BoundedSafeLoader)  # noqa: S506 (a SafeLoader subclass)


class _YAMLLoader(BoundedSafeLoader):
    """:class:`BoundedSafeLoader` with YAML 1.2 floats: ``1e-3`` is a number (YAML 1.1 reads a string), so strict
    float fields take the usual spelling of a learning rate."""


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


MAX_DEPTH = 64  # mappings and lists a config nests at most (deeper: one line, not a RecursionError)


def load_yaml(stream: Any) -> Any:
    """Parse YAML config text (a string or a file); not UTF-8, or nested past MAX_DEPTH: a one-line YAMLError."""
    depth = MAX_DEPTH + 1  # (kept when the parser recurses too deep)
    try:
        data = yaml.load(stream, Loader=_YAMLLoader)  # noqa: S506 (a SafeLoader subclass)
        depth, level = 0, [data] if isinstance(data, dict | list) else []
        while level and depth <= MAX_DEPTH:  # level by level: a value nested deeper than Python recurses
            depth, level = depth + 1, [v for n in level for v in (n.values() if isinstance(n, dict) else n)
                                       if isinstance(v, dict | list)]
    except UnicodeDecodeError as e:
        raise yaml.YAMLError(f"not UTF-8 text (byte 0x{e.object[e.start]:02x}): a config is a YAML text file") from None
    except RecursionError:
        pass
    if depth > MAX_DEPTH:
        raise yaml.YAMLError(f"mappings and lists nested more than {MAX_DEPTH} levels deep (a config nests a few)")
    return data


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key (and the file)."""


class StrictModel(BaseModel):
    """Base for config sections: unknown keys are errors, defaults are validated too, values are not coerced
    between kinds (``true`` is no integer, ``"256"`` no number; an int is a valid float), and a number is finite
    (``optim.lr=.inf`` is refused here, not after it was recorded and training diverged)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)


def check_unique_names(names: Sequence[str], what: str) -> None:
    """Raise ``ValueError("<what> [names given more than once]")`` when a name repeats."""
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what} {dup}")


#: A name used as one path component (a source's folder, a model's export folder).
PathName = Annotated[str, AfterValidator(check_path_name)]


def _check_gamma(v: float) -> float:
    if not (0.0 < v <= 1.0):
        raise ValueError(f"gamma must be in (0, 1], got {v!r}")
    return v


#: γ, the fraction of valid tokens kept per candidate batch, validated to lie in (0, 1].
Gamma = Annotated[float, AfterValidator(_check_gamma)]


# ------------------------------------------------------------------------------------------------
# prepare
# ------------------------------------------------------------------------------------------------
InputFormat = Literal["auto", "jsonl", "jsonl.zst", "parquet", "txt", "mds", "arrow"]

#: Formats whose records are token ids, not text (parquet too when ``tokens_field`` is set).
_TOKEN_FORMATS = ("mds", "arrow")

#: The integer types a ``bytes`` token column of an MDS dataset may hold (llm-foundry's ``token_encoding_type``).
TOKEN_ENCODING_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")

#: Source keys added after preparations were recorded: left out of the dump while at their defaults, so a
#: record written before them (``config.yaml``, a manifest's group key) still equals the config resuming it.
_LATER_SOURCE_KEYS = ("tokens_field", "token_rows", "token_encoding_type")


def _without_later_defaults(model: BaseModel, data: dict[str, Any], later: tuple[str, ...]) -> dict[str, Any]:
    """``data`` (``model`` dumped) without the keys of ``later`` that are at their defaults."""
    fields = type(model).model_fields
    return {k: v for k, v in data.items() if k not in later or v != fields[k].default}


class SourceConfig(StrictModel):
    """One named input source: files + how to get a document's text (or its token ids) out of a record."""

    name: str = Field(description="source label stored in every sequence's `source` column and the name of its "
                      "folder of parts (candidates/<name>/): " + PATH_NAME_RULE)
    paths: list[str] = Field(description="files or glob patterns (sorted, deduplicated); format mds: MDS dataset "
                             "directories (each with an index.json) or globs of them")
    format: InputFormat = Field("auto", description="input format; auto = from the file extension; mds and arrow "
                                "are pre-tokenized (see tokens_field)")
    text_field: str = Field("text", description="JSON/parquet field holding the text")
    template: str | None = Field(
        None, description="Python format template joining several fields, e.g. '{question}\\n{answer}'"
    )
    txt_split: Literal["file", "blank_line", "line"] = Field(
        "blank_line", description=".txt files: one document per file, per blank-line paragraph, or per line"
    )
    skip_documents: int = Field(0, ge=0, description="skip the first N documents (e.g. a held-out slice)")
    max_documents: int | None = Field(None, ge=1, description="stop after this many documents (after skipping)")
    tokens_field: str | None = Field(
        None, description="pre-tokenized input: the column of token ids (mds and arrow: default 'tokens'; set it to "
        "read a parquet column of token-id lists instead of text)")
    token_rows: Literal["stream", "documents"] = Field(
        "stream", description="pre-tokenized input: 'stream' = records are consecutive pieces of one token stream "
        "that already holds its EOS separators (llm-foundry's converters), joined as they are; 'documents' = each "
        "record is one document without EOS, followed by the tokenizer's EOS like a text document")
    token_encoding_type: Literal[TOKEN_ENCODING_TYPES] = Field(  # type: ignore[valid-type]
        "int64", description="mds `bytes` token columns: the integer type of the raw bytes (llm-foundry's "
        "token_encoding_type; int64 is what its converters wrote before v0.9); ndarray columns carry their own")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_path_name(v, "source name")

    @field_validator("paths")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one path or glob is required")
        return v

    @model_validator(mode="after")
    def _token_settings(self) -> SourceConfig:
        if self.tokens_field is not None and not self.tokens_field:
            raise ValueError("tokens_field must not be empty (leave it out for the default)")
        if self.tokens_field is not None and self.format in ("jsonl", "jsonl.zst", "txt"):
            raise ValueError(f"tokens_field: token ids are read from mds, parquet or arrow input, not {self.format}")
        if self.pre_tokenized and self.template is not None:
            raise ValueError("template: a pre-tokenized source (format mds or arrow, or tokens_field set) has no text")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _without_later_defaults(self, handler(self), _LATER_SOURCE_KEYS)

    @property
    def pre_tokenized(self) -> bool:
        """Records are token ids (MDS datasets, arrow files, parquet with ``tokens_field``), not text."""
        return self.format in _TOKEN_FORMATS or self.tokens_field is not None

    @property
    def token_column(self) -> str:
        """The column of token ids of a pre-tokenized source."""
        return self.tokens_field or "tokens"


class TokenizerConfig(StrictModel):
    """A local tokenizer (directory or tokenizer.json) or one trained on the fly from the inputs."""

    path: str | None = Field(None, description="HF tokenizer directory or tokenizer.json; None = train one")
    vocab_size: int = Field(4096, ge=260, le=2**20, description="vocabulary size when training")
    min_frequency: int = Field(2, ge=1, description="BPE merge min frequency when training")
    eos_token: str = Field("<|endoftext|>", description="token appended after every document")
    train_max_documents: int = Field(200_000, ge=1, description="documents used to train the tokenizer")


class RayConfig(StrictModel):
    """Which Ray cluster the job runs on."""

    address: str | None = Field(
        None,
        description="None: the cluster of `ray job submit` (RAY_ADDRESS) when there is one, else a new local "
        "instance; 'local': always a new local instance; else a cluster address (e.g. 127.0.0.1:6379)",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a new local instance; None = max(os.cpu_count(), what the actors ask for)"
    )
    include_dashboard: bool = Field(False, description="start the dashboard with a new local instance")


#: Prepare keys added after preparations were recorded, left out of the dump while at their defaults (as
#: :data:`_LATER_SOURCE_KEYS`).
_LATER_PREPARE_KEYS = ("unit_bytes", "stage_inputs", "resources")


class PrepareConfig(StrictModel):
    """Config of ``jobs/prepare.py``: corpora → packed candidate shards + validation shards."""

    sources: list[SourceConfig] = Field(description="candidate-pool sources")
    validation: list[SourceConfig] = Field(default_factory=list, description="target/validation sources")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    output_dir: str = Field(description="writes candidates/, validation/, tokenizer/ under it")
    seq_len: int = Field(128, ge=2, le=1 << 20, description="L: tokens per packed sequence")
    seed: int = Field(0, description="seeds the within-part sequence shuffle")
    sequences_per_part: int = Field(
        2048, ge=1, description="sequences per resumable part (one MDS subdirectory, shuffled within)"
    )
    shard_size_limit: int = Field(1 << 26, ge=1 << 12, description="MDS shard size limit in bytes")
    skip_bad_records: bool = Field(False, description="count+report bad records in the manifest instead of failing")
    progress: bool = Field(True, description="a progress bar on a terminal; else (a pipe, a log file) a progress line "
                           "per tenth of the work units; false: neither", json_schema_extra=OPERATIONAL)
    demo: bool = Field(False, description="generate the embedded demo corpus into output_dir/raw first")
    unit_bytes: int = Field(
        8 << 20, ge=1, description="input bytes per work unit: a source's files, in order, are cut into units of "
        "about this size (a large plain .jsonl at a line, a .parquet at a row group; other files whole), each "
        "packed on its own (its last fewer-than-seq_len tokens dropped and counted)")
    workers: int | None = Field(
        None, ge=1, description="processes preparing work units at once (Ray tasks of one CPU); None = the CPUs of "
        "the machine (or of the Ray cluster), at most one per unit_bytes of input left; 1 = in this process, "
        "without Ray. The output is the same for any number", json_schema_extra=OPERATIONAL)
    ray: RayConfig = Field(default_factory=RayConfig, description="the Ray cluster of workers > 1",
                           json_schema_extra=OPERATIONAL)
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each work unit's task asks for besides its CPU, to "
        "keep them on the nodes started with them (e.g. {prep: 1}; ray start --resources '{\"prep\": 8}')",
        json_schema_extra=OPERATIONAL)
    stage_inputs: str | None = Field(
        None, description="s3://bucket/prefix: upload the local inputs there first, and read them from there on "
        "every node (Ray nodes that do not share this machine's filesystem); unit records then name the copies")

    @field_validator("stage_inputs")
    @classmethod
    def _stage(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("s3://"):
            raise ValueError(f"{v}: not an s3:// URL (the object store every node reads the inputs from)")
        return v

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: list[SourceConfig]) -> list[SourceConfig]:
        if not v:
            raise ValueError("at least one source is required")
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> PrepareConfig:
        for group in ("sources", "validation"):
            check_unique_names([s.name for s in getattr(self, group)], f"{group}: duplicate source names")
            for i, s in enumerate(getattr(self, group)):
                if s.pre_tokenized and self.tokenizer.path is None:
                    raise ValueError(
                        f"{group}.{i} ({s.name!r}) is pre-tokenized: set tokenizer.path to the tokenizer its ids "
                        "come from (a tokenizer is trained only from text)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _without_later_defaults(self, handler(self), _LATER_PREPARE_KEYS)

    @classmethod
    def demo_default(cls, root: str = DEMO_ROOT) -> PrepareConfig:
        """The embedded default: the generated domain-shift demo corpus (see ``curation.ingest.demo``)."""
        raw = os.path.join(root, "raw")
        return cls(
            sources=[
                SourceConfig(name="target", paths=[os.path.join(raw, "target.jsonl")], template="{question}\n{answer}"),
                SourceConfig(name="general", paths=[os.path.join(raw, "general.jsonl")]),
                SourceConfig(name="noise", paths=[os.path.join(raw, "noise.jsonl")]),
            ],
            validation=[
                SourceConfig(
                    name="target_val", paths=[os.path.join(raw, "target_val.jsonl")], template="{question}\n{answer}"
                )
            ],
            tokenizer=TokenizerConfig(path=None, vocab_size=2048),
            output_dir=os.path.join(root, "data"),
            seq_len=128,
            sequences_per_part=1024,
            demo=True,
        )


# ------------------------------------------------------------------------------------------------
# loading machinery
# ------------------------------------------------------------------------------------------------
def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions) between two short strings."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def nearest_key(name: str, valid: Sequence[str]) -> str | None:
    """The valid key nearest ``name`` by edit distance when it is a likely typo (at most 2 edits, or a third of the
    name), else None; ties go to the first in ``valid``."""
    if len(name) > 100:  # no key is this long (and the distance costs len(name) × len(key))
        return None
    best = min(valid, key=lambda v: edit_distance(name, v), default=None)
    if best is None:
        return None
    return best if edit_distance(name, best) <= max(2, len(name) // 3) else None


def _keys_beside(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The valid keys of the section that holds the key at ``loc`` (an error's location in ``model``)."""
    models = [model]
    for part in loc[:-1]:
        inner = field_models(models, part) if isinstance(part, str) else []
        models = inner or models  # a list index, a dict key or a union's tag: the same section
    return [k for m in models for k in m.model_fields]


def _format_validation_error(err: ValidationError, origin: str, model: type[BaseModel] | None = None) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        got = e.get("input")
        extra = "" if e["type"] in ("missing",) or isinstance(got, dict) else f" (got {shown(got)})"
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            near = nearest_key(str(e["loc"][-1]), _keys_beside(model, e["loc"])) if model and e["loc"] else None
            extra = f" (did you mean {near}?)" if near else extra
        lines.append(f"  {cut(key, 100)}: {cut(msg, 2 * MAX_SHOWN)}{extra}")
    return f"invalid config ({origin}):\n" + "\n".join(lines)


def apply_override(data: dict[str, Any], assignment: str, model: type[BaseModel] | None = None) -> None:
    """Apply one ``a.b.c=value`` override in place; ``value`` is parsed as YAML. With the config ``model``, a key of
    an exclusive group (:mod:`schemas.merging`: ``model.path``) set to a value clears the others of its group."""
    if "=" not in assignment:
        raise ConfigError(f"--set {shown(assignment)}: expected key.path=value")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {shown(assignment)}: empty key segment")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {shown(key, 100)}: value {shown(raw)} is not valid YAML ({e})") from e
    node: Any = data
    models = [model] if model is not None else []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: '{where}' is not an index of a list of {len(node)} items")
            idx = int(part)
            if last:
                node[idx] = value
            else:
                node = node[idx]
        elif isinstance(node, dict):
            if last:
                node[part] = value
                for other in exclusive_with(models, part) if value is not None else ():
                    if node.get(other) is not None:
                        node[other] = None
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
                models = field_models(models, part)
        else:
            raise ConfigError(f"--set {key}: '{'.'.join(parts[:i])}' is a value, not a section")


def load_config(
    model: type[M],
    *,
    path: str | None = None,
    overrides: Sequence[str] = (),
    default: Callable[[], M] | None = None,
) -> M:
    """Resolve a config: the embedded ``default``, the YAML file at ``path`` merged onto it (sections key by key,
    everything else replaced: :func:`schemas.merging.merge_config`), then the overrides; validated.

    Raises:
        ConfigError: naming the file and the offending key(s).
    """
    origin = path or "embedded default"
    base = default().model_dump(mode="json") if default is not None else {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                data = load_yaml(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
        if base:
            origin += " merged onto the embedded default"
        data = merge_config(base, data, [model])
    else:
        data = base
    for o in overrides:
        apply_override(data, o, model)
    if overrides:
        origin += " + --set " + " ".join(cut(o, 100) for o in overrides)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, origin, model)) from None


def config_to_yaml(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
