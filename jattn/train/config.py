"""Experiment configs: load `configs/X.py[:arg]`, apply `--config.key=value`, check them.

A config file is a python file with `get_config(arg=None) -> ml_collections.ConfigDict`.
`load_config` imports it, calls `get_config` (with the text after the last ``:``
when there is one) and locks the result, so that a misspelt key is an error
instead of a silently ignored new field. `apply_overrides` then parses
``--config.model.d_model=128`` style arguments, converting each value to the
type of the field it replaces.

Every problem is reported as a `ConfigError` whose message is one line that
names the key and the value it got; the CLI prints it and exits before
anything compiles.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
from collections.abc import Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

__all__ = [
    "ConfigError",
    "apply_overrides",
    "config_to_dict",
    "config_to_json",
    "load_config",
    "split_overrides",
]

_OVERRIDE_PREFIX = "--config."


class ConfigError(ValueError):
    """A bad config, config key, override value, or a config that does not fit the run."""


def load_config(spec: str) -> ml_collections.ConfigDict:
    """Imports a config file and returns its locked `get_config(arg)`.

    Args:
      spec: ``path/to/file.py`` or ``path/to/file.py:arg``; the text after the
        last colon is passed to ``get_config`` as a string.

    Returns:
      The locked ConfigDict.

    Raises:
      ConfigError: the file does not exist, has no ``get_config``, or the
        function rejects the argument.
    """
    path, arg = spec, None
    if ":" in spec and not os.path.exists(spec):
        path, arg = spec.rsplit(":", 1)
    if not os.path.isfile(path):
        raise ConfigError(f"--config: no such config file {path!r} (from {spec!r})")
    name = "jattn_config_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 -- any import error becomes one line
        raise ConfigError(f"--config: importing {path!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"--config: {path!r} defines no get_config(arg=None) function")
    try:
        config = module.get_config() if arg is None else module.get_config(arg)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--config: {path}:{arg} -> {e}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(
            f"--config: {path}.get_config() must return an ml_collections.ConfigDict, "
            f"got {type(config).__name__}"
        )
    config.lock()
    return config


def split_overrides(argv: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Separates ``--config.key=value`` / ``--config.key value`` from other arguments.

    Returns:
      (overrides as (dotted key, raw string) pairs, the remaining arguments).
    """
    overrides, rest = [], []
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(_OVERRIDE_PREFIX):
            body = arg[len(_OVERRIDE_PREFIX) :]
            if "=" in body:
                key, value = body.split("=", 1)
            elif i + 1 < len(argv):
                key, value = body, argv[i + 1]
                i += 1
            else:
                raise ConfigError(f"{arg}: missing value (use {arg}=VALUE)")
            if not key:
                raise ConfigError(f"{arg}: empty config key")
            overrides.append((key, value))
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


def _suggest(name: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_type(parent: ml_collections.ConfigDict, leaf: str) -> type | None:
    """The declared type of a field: its value's type, or a placeholder's type."""
    try:
        ref = parent.get_ref(leaf)
        return ref.get_type()
    except (AttributeError, KeyError, ValueError, TypeError):
        value = parent[leaf]
        return None if value is None else type(value)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse(key: str, raw: str, kind: type | None) -> Any:
    """Converts the override string `raw` to `kind` (the type of the field it replaces)."""
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in _TRUE | _FALSE:
                return low in _TRUE
            raise ValueError("expected true/false")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind is str:
            return raw
        if kind in (tuple, list):
            value = ast.literal_eval(raw)
            if isinstance(value, int | float | str):
                value = (value,)
            if not isinstance(value, tuple | list):
                raise ValueError("expected a tuple such as (-1,1,1)")
            return kind(value)
        # None-valued field without a declared type: a python literal, else a string.
        if raw.strip().lower() == "none":
            return None
        try:
            return ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return raw
    except (ValueError, SyntaxError) as e:
        name = kind.__name__ if kind else "literal"
        raise ConfigError(f"--config.{key}={raw!r}: not a valid {name} ({e})") from None


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Sequence[tuple[str, str]]
) -> ml_collections.ConfigDict:
    """Applies ``(dotted key, raw string)`` overrides to a locked config, in place.

    Raises:
      ConfigError: unknown key (with a suggestion), a key naming a group, or a
        value that does not parse as the field's type.
    """
    for key, raw in overrides:
        parts = key.split(".")
        node = config
        for i, part in enumerate(parts):
            where = ".".join(parts[:i]) or "config"
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                options = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                raise ConfigError(
                    f"--config.{key}: unknown config key {part!r} in {where}"
                    f"{_suggest(part, options)}"
                )
            if i < len(parts) - 1:
                node = node[part]
        leaf = parts[-1]
        if isinstance(node[leaf], ml_collections.ConfigDict):
            raise ConfigError(
                f"--config.{key}: is a group of keys ({', '.join(node[leaf].keys())}); "
                "set one of them"
            )
        value = _parse(key, raw, _field_type(node, leaf))
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--config.{key}={raw!r}: {e}") from None
    return config


def config_to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """A plain, JSON-friendly dict of the config (tuples become lists)."""
    return json.loads(config_to_json(config))


def config_to_json(config: ml_collections.ConfigDict) -> str:
    """The resolved config as indented JSON, keys sorted."""

    def default(o):
        if isinstance(o, config_dict.FieldReference):
            return o.get()
        return str(o)

    return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=default)
