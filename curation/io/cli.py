"""The jobs' command line: ``--config FILE.yaml``, repeated ``--set key.path=value``, ``--print-config``.

Jobs call :func:`parse_job_config` with their top-level model and embedded default::

    cfg, args = parse_job_config(PrepareConfig, description="...", default=PrepareConfig.demo_default)

``--config`` is merged onto the embedded default (:func:`schemas.config.load_config`), ``--set`` applies after it.
A bad setting ends the job with one ``error: ...`` and exit status 2; ``--print-config`` prints the resolved
config as YAML and exits; ``--help [SECTION]`` lists every config key with its default and description
(:mod:`curation.io.config_help`). Standard library, pydantic and :mod:`schemas` only: ``--help`` and a bad setting
answer before a job imports torch, Composer or Ray.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from pydantic import BaseModel

from curation.io.config_help import HelpError, format_keys
from schemas.config import ConfigError, config_to_yaml, load_config

__all__ = ["add_config_arguments", "parse_job_config", "resolve_alias"]

M = TypeVar("M", bound=BaseModel)


def add_config_arguments(parser: argparse.ArgumentParser, set_example: str | None = None) -> None:
    """``--config``, ``--set`` (its help shows ``set_example``, e.g. ``seq_len=256``) and ``--print-config``."""
    parser.add_argument("--config", help="YAML config file (default: the embedded default)")
    example = f", e.g. --set {set_example}" if set_example else ""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help=f"override a config key (the value is YAML; list items by index){example} (repeatable; "
        "--print-config lists the keys)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def parse_job_config(
    model: type[M],
    *,
    description: str,
    default: Callable[[], M] | None = None,
    argv: Sequence[str] | None = None,
    parser: argparse.ArgumentParser | None = None,
    set_example: str | None = None,
    aliases: Mapping[str, str] | None = None,
    default_for: Callable[[Mapping[str, str]], M] | None = None,
) -> tuple[M, argparse.Namespace]:
    """Parse a job's command line into a validated config (exits 2 with the message on a config error).

    ``set_example`` is an override of this job's config shown in ``--help`` (e.g. ``selection.gamma=0.5``).
    ``aliases``: short keys ``--set`` accepts for longer ones (``{"policy": "selection.policy"}``: ``--set policy=rho1``
    sets ``selection.policy``). ``default_for``: the embedded default made from the ``--set`` overrides (key → the
    value's text, the last one of a key; e.g. an output directory named after the policy set), in place of
    ``default``.
    """
    parser = parser or argparse.ArgumentParser(description=description, add_help=False)
    if not parser.add_help:
        parser.add_argument("-h", "--help", nargs="?", const="", default=None, metavar="SECTION",
                            help="show this help and every config key with its default and description (SECTION: "
                            "only the keys under it, e.g. --help selection) and exit")
    add_config_arguments(parser, set_example)
    args = parser.parse_args(argv)
    args.overrides = [resolve_alias(o, aliases or {}) for o in args.overrides]
    if default_for is not None:
        given = dict(o.partition("=")[::2] for o in args.overrides)
        default = lambda: default_for({k.strip(): v.strip() for k, v in given.items()})  # noqa: E731
    if getattr(args, "help", None) is not None:
        _print_help(parser, model, default, args.help)
    try:
        cfg = load_config(model, path=args.config, overrides=args.overrides, default=default)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        sys.stdout.write(config_to_yaml(cfg))
        raise SystemExit(0)
    return cfg, args


def resolve_alias(override: str, aliases: Mapping[str, str]) -> str:
    """``KEY=VALUE`` with ``KEY`` replaced by the key it is an alias of (``aliases``), else as given."""
    key, sep, value = override.partition("=")
    return f"{aliases.get(key.strip(), key)}{sep}{value}"


def _print_help(parser: argparse.ArgumentParser, model: type[M], default: Callable[[], M] | None, section: str) -> None:
    """Print the usage and the config keys (all, or ``section``'s) and exit 0; an unknown section exits 2."""
    try:
        keys = format_keys(model, default().model_dump(mode="json") if default is not None else None, section or None)
    except HelpError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.stdout.write(parser.format_help() + "\n" + keys)
    raise SystemExit(0)
