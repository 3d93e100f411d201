"""Service configs are frozen dataclasses; each field is settable by env var and by CLI flag.

Field `redis_url` of a config with env prefix `PDSERVE_` reads `PDSERVE_REDIS_URL` and `--redis-url`;
the flag wins over the env var, the env var over the default. Validation is the dataclass's
`__post_init__`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "PDSERVE_"


def _base_type(tp: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _parse(tp: Any, raw: str) -> Any:
    tp = _base_type(tp)
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    return tp(raw)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        env = ENV_PREFIX + f.name.upper()
        # A boolean flag alone means true (`--insecure`); `--index-mirror false` still says false.
        extra = {"nargs": "?", "const": True} if _base_type(hints[f.name]) is bool else {}
        parser.add_argument(flag, dest=f.name, default=None, type=lambda s, t=hints[f.name]: _parse(t, s),
                            help=f"{help_text} (env {env})".strip(), **extra)


def load(cls: type[T], args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> T:
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw not in (None, ""):
            try:
                values[f.name] = _parse(hints[f.name], raw)
            except ValueError as e:
                raise ValueError(f"{ENV_PREFIX + f.name.upper()}: {e}") from e
        if args is not None and getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    return cls(**values)


def field(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})
