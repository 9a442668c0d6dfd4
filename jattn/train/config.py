"""A run's config from a file and the command line, and its one reading into pieces.

A config file (`configs/X.py`) is a python file with
`get_config(arg=None) -> ml_collections.ConfigDict` that starts from
`default_config()` (every key of `jattn train`, with its default and
meaning, `jattn.train.parts`) and changes what it needs; `apply_variant`
handles the common ``:arg`` variants. Then, in the order `jattn train` runs
them:

1. `load_config` imports the file, calls `get_config` (with the text after
   the last ``:`` when there is one) and locks the result, so that a
   misspelt key is an error instead of a silently ignored new field;
2. `apply_overrides` parses ``--config.model.d_model=128`` style arguments,
   converting each value to the type of the field it replaces;
3. `check_config` checks every key and value that needs nothing but the
   config, the model's fields included (`jattn.train.checks`);
4. `read_parts` reads the checked config, once, into the frozen pieces each
   part of the run takes (`jattn.train.parts.Parts`): from here on no module
   reads the config itself (tests/test_structure.py follows it from
   `train_and_evaluate`).

This module is also where the config's public names are imported from: the
keys and their defaults, `ConfigError` and the config's JSON form
(`jattn.train.parts`), and `check_config` (`jattn.train.checks`).

Every problem is reported as a `ConfigError` whose message is one line that
names the key and the value it got; the CLI prints it and exits before
anything compiles.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import traceback
from collections.abc import Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

from jattn.train.checks import check_config
from jattn.train.parts import (
    REMOVED_KEYS,
    CheckpointPart,
    ConfigError,
    DataPart,
    DevicePart,
    EvalPart,
    LoopPart,
    ModelPart,
    OptimizerPart,
    Parts,
    StepPart,
    build_model_config,
    config_to_dict,
    config_to_json,
    default_config,
    input_lengths,
    model_defaults,
    precision_context,
    removed_key_error,
)

__all__ = [
    "ConfigError",
    "REMOVED_KEYS",
    "apply_overrides",
    "apply_variant",
    "build_model_config",
    "check_config",
    "config_to_dict",
    "config_to_json",
    "default_config",
    "input_lengths",
    "load_config",
    "matmul_precision",
    "model_defaults",
    "read_parts",
    "removed_key_error",
    "split_overrides",
]

_OVERRIDE_PREFIX = "--config."


# -- variants (a config file's :arg) ----------------------------------------------------


def apply_variant(config: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
    """Applies a config file's ``:arg``, a comma-separated list of variants.

    Each item is a positional scheme (``shaw``, ``rope``, ``sinusoidal+shaw``,
    ... sets `model.position`), an attention implementation (``xla``,
    ``chunked``, ``pallas`` sets `model.attention_impl`), ``bf16`` (bfloat16
    compute, fp32 parameters), or ``greedy`` / ``beam`` (decoding). For example
    ``configs/base.py:rope,chunked``.

    Raises:
      ValueError: an item that is none of these, naming the valid ones.
    """
    from jattn.attention import IMPLEMENTATIONS  # noqa: PLC0415
    from jattn.models import SCHEMES  # noqa: PLC0415

    for item in [s.strip() for s in (arg or "").split(",") if s.strip()]:
        if item in SCHEMES:
            config.model.position = item
        elif item in IMPLEMENTATIONS:
            config.model.attention_impl = item
        elif item in ("bf16", "bfloat16"):
            config.model.dtype = "bfloat16"
        elif item in ("greedy", "beam"):
            config.decode = item
        else:
            raise ValueError(
                f"unknown config variant {item!r}; use comma-separated items from: positions "
                f"{sorted(SCHEMES)}, attention {sorted(IMPLEMENTATIONS)}, bf16, greedy, beam"
            )
    return config


# -- loading and overrides -------------------------------------------------------------


def _raised_in(error: BaseException, path: str) -> str:
    """`` (at FILE:LINE)``: the last line of the config file `path` in `error`'s
    traceback (where its own code went wrong), or "" when it is not in it."""
    target = os.path.realpath(path)
    frames = [
        f for f in traceback.extract_tb(error.__traceback__)
        if os.path.realpath(f.filename) == target
    ]  # fmt: skip
    return f" (at {path}:{frames[-1].lineno})" if frames else ""


def load_config(spec: str) -> ml_collections.ConfigDict:
    """Imports a config file and returns its locked `get_config(arg)`.

    Args:
      spec: ``path/to/file.py`` or ``path/to/file.py:arg``; the text after the
        last colon is passed to ``get_config`` as a string.

    Returns:
      The locked ConfigDict.

    Raises:
      ConfigError: the file does not exist, cannot be imported, has no
        ``get_config``, or the function rejects the argument or raises (any
        exception: one line naming it and the file's line).
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
    except (ValueError, KeyError, TypeError) as e:  # a rejected argument: its message says why
        raise ConfigError(f"--config: {path}:{arg} -> {e}") from e
    except Exception as e:  # noqa: BLE001 -- a bug in the file is a config error too: one line
        where = _raised_in(e, path)
        raise ConfigError(
            f"--config: {path}.get_config({'' if arg is None else repr(arg)}) raised "
            f"{type(e).__name__}: {e}{where}"
        ) from e
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


def _check_moved(arg: str, where: str, part: str) -> None:
    """A model field that moved into a scheme's options is an error naming its new key."""
    if where.split(".")[-1] != "model":
        return
    from jattn.models.config import renamed_key  # noqa: PLC0415

    moved = renamed_key(part)
    if moved:
        new = " and ".join(f"{where}.{key}" for key in moved.split(" and "))
        raise ConfigError(f"{arg}: {where}.{part} is now {new} (the scheme's own options)")


def _field_type(parent: ml_collections.ConfigDict, leaf: str) -> tuple[type | None, bool]:
    """The declared type of a field and whether None is a valid value for it.

    A placeholder (`config_dict.placeholder(int)`, as `model_defaults` makes for
    ``Optional`` fields) is typed by its declaration and may be None; any other
    field is typed by its value and may be None only while it is None.
    """
    field = dict(parent.items(preserve_field_references=True))[leaf]
    if isinstance(field, config_dict.FieldReference):
        return field.get_type(), True
    return (None, True) if field is None else (type(field), False)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _tuple_items(raw: str) -> tuple:
    """Plain comma-separated text as a tuple: ``validation,test_longer`` -> two strings.

    Items that are python literals (``-1``, ``0.5``) keep their type, the
    rest are strings. Text with brackets or quotes must be a python literal.
    """
    if any(c in raw for c in "()[]'\""):
        raise ValueError("expected a tuple such as (-1,1,1) or a,b,c")
    items = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        try:
            items.append(ast.literal_eval(item))
        except (ValueError, SyntaxError):
            items.append(item)
    return tuple(items)


def _parse(key: str, raw: str, kind: type | None, nullable: bool = False) -> Any:
    """Converts the override string `raw` to `kind` (the type of the field it replaces).

    ``None`` (also ``none`` for a non-string field) is None where the field may
    be None (`_field_type`), e.g. ``--config.model.num_kv_heads=None``.
    """
    if nullable and (raw.strip() == "None" or (kind is not str and raw.strip() == "none")):
        return None
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
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = _tuple_items(raw)  # validation,test_longer
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
    config: ml_collections.ConfigDict, overrides: Sequence[tuple[str, str]], *, prefix: str = ""
) -> ml_collections.ConfigDict:
    """Applies ``(dotted key, raw string)`` overrides to a locked config, in place.

    Args:
      config: a locked config (`load_config`).
      overrides: pairs such as ``("model.d_model", "128")``.
      prefix: where `config` sits in the command line's config, for messages
        (``"train."``: the training config of an experiment).

    Raises:
      ConfigError: unknown key (with a suggestion), a key naming a group, or a
        value that does not parse as the field's type.
    """
    for key, raw in overrides:
        name = prefix + key
        parts = key.split(".")
        node = config
        for i, part in enumerate(parts):
            where = (prefix + ".".join(parts[:i])).rstrip(".") or "config"
            if i == 0 and part in REMOVED_KEYS and part not in node:
                raise removed_key_error(part)
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                options = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                _check_moved(f"--config.{name}", where, part)
                raise ConfigError(
                    f"--config.{name}: unknown config key {part!r} in {where}"
                    f"{_suggest(part, options)}"
                )
            if i < len(parts) - 1:
                node = node[part]
        leaf = parts[-1]
        if isinstance(node[leaf], ml_collections.ConfigDict):
            raise ConfigError(
                f"--config.{name}: is a group of keys ({', '.join(node[leaf].keys())}); "
                "set one of them"
            )
        value = _parse(name, raw, *_field_type(node, leaf))
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--config.{name}={raw!r}: {e}") from None
    return config


# -- the one reading of a checked config ---------------------------------------------------


def read_parts(config: ml_collections.ConfigDict) -> Parts:
    """The checked `config` read into the pieces each part of a run takes
    (`jattn.train.parts`): the model's, the optimiser's, the train step's, the
    data's, the evaluation's, the checkpoints', the loop's and the devices'.

    A piece's field named as a config key holds that key's value; the others
    are given here. "0 means another key" is resolved here (`max_input_len`,
    `eval_max_input_len`, `decode_max_len`); nothing is checked (that is
    `check_config`'s).
    """
    c = config
    record = config_to_dict(c)
    train_input, eval_input = input_lengths(c)
    model = ModelPart(c.model.to_dict(), c.vocab_multiple)
    evaluation = EvalPart(
        splits=tuple(c.eval_splits),
        batch_size=c.eval_batch_size,
        max_len=c.eval_max_len,
        input_len=eval_input,
        max_batches=c.eval_max_batches,
        decode_examples=c.eval_decode_examples,
        decode=c.decode,
        beam_size=c.beam_size,
        beam_alpha=c.beam_alpha,
        decode_max_len=c.decode_max_len or c.eval_max_len,
        seed=c.seed,
    )
    checkpoints = CheckpointPart(
        keep=c.keep_checkpoints,
        best_metric=c.best_metric,
        best_mode=c.best_mode,
        async_saves=bool(c.async_checkpointing),
        record=record,
    )
    devices = DevicePart(
        mesh_shape=tuple(c.mesh_shape),
        logical_axis_rules=tuple(tuple(r) for r in c.logical_axis_rules),
        matmul_precision=c.matmul_precision,
    )
    return Parts(
        model=model,
        optimizer=_named(OptimizerPart, c, d_model=model.d_model),
        step=_named(StepPart, c),
        data=_named(DataPart, c, input_len=train_input),
        evaluation=evaluation,
        checkpoints=checkpoints,
        loop=_named(LoopPart, c),
        devices=devices,
        seed=c.seed,
        record=record,
    )


def _named(cls, config: ml_collections.ConfigDict, **given):
    """The piece `cls` with each field not `given` read from the config key of its name."""
    return cls(**{
        f.name: given[f.name] if f.name in given else config[f.name]
        for f in dataclasses.fields(cls)
    })  # fmt: skip


def matmul_precision(config: ml_collections.ConfigDict):
    """A context in which the run's matmuls take `config.matmul_precision`
    (nothing at "default", so a run without the key traces as before);
    `DevicePart.precision` of a read config."""
    return precision_context(config.get("matmul_precision", "default"))
