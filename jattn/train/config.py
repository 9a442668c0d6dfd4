"""Experiment configs, in one place: defaults, loading, overrides, checks, the model config.

A config file (`configs/X.py`) is a python file with
`get_config(arg=None) -> ml_collections.ConfigDict` that starts from
`default_config()` (every key of `jattn train`, with its default and
meaning) and changes what it needs; `apply_variant` handles the common
``:arg`` variants. Then, in the order `jattn train` runs them:

1. `load_config` imports the file, calls `get_config` (with the text after
   the last ``:`` when there is one) and locks the result, so that a
   misspelt key is an error instead of a silently ignored new field;
2. `apply_overrides` parses ``--config.model.d_model=128`` style arguments,
   converting each value to the type of the field it replaces;
3. `check_config` checks every key and value that needs nothing but the
   config, the model's fields included (by building the model config);
4. `build_model_config` makes the `jattn.models.TransformerConfig` of the
   run once the tokenizer's vocabulary is known.

``model.*`` are the fields of `TransformerConfig` with their defaults (read
from the dataclass, so a new field is a new key); the dataclass itself
checks their values.

Every problem is reported as a `ConfigError` whose message is one line that
names the key and the value it got; the CLI prints it and exits before
anything compiles.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import traceback
import typing
from collections.abc import Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

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
    "model_defaults",
    "removed_key_error",
    "split_overrides",
]

_OVERRIDE_PREFIX = "--config."


class ConfigError(ValueError):
    """A bad config, config key, override value, or a config that does not fit the run."""


# -- defaults ---------------------------------------------------------------------------


def _placeholder_type(annotation: Any) -> type:
    """The type a None default stands for: int for ``int | None`` (str if unclear)."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
    kind = kinds[0] if len(kinds) == 1 else annotation
    return kind if kind in (int, float, str, bool) else str


def _device_keys(c: ml_collections.ConfigDict) -> None:
    """How a run uses its devices: the mesh and the precision of its matmuls."""
    # Sharding: sizes of the mesh axes ("data", "fsdp", "tensor"); one may be -1.
    c.mesh_shape = (-1, 1, 1)
    c.logical_axis_rules = ()  # () -> jattn.train.mesh.DEFAULT_RULES
    # Precision of float32 matmuls (jax's default_matmul_precision for the whole
    # run): "default" leaves jax's default, which on a GPU runs them as TF32 (and
    # exact float32 on the CPU); "highest" (= "float32") asks for IEEE float32
    # everywhere, e.g. to compare a GPU run with the CPU's tables; also "high"
    # (bf16_3x on TPU), "tensorfloat32", "bfloat16". jattn.dot_product_attention's
    # kernels set their own (docs/gpu.md).
    c.matmul_precision = "default"


def model_defaults() -> ml_collections.ConfigDict:
    """`model.*`: every field of `jattn.models.TransformerConfig` with its default.

    ``vocab_size=-1`` means "the tokenizer's size, rounded up to a multiple of
    `vocab_multiple`". Fields whose default is None become typed placeholders
    (the type from the field's annotation), so that
    ``--config.model.num_kv_heads=2`` is checked as an int.
    """
    from jattn.models import TransformerConfig  # noqa: PLC0415

    hints = typing.get_type_hints(TransformerConfig)
    model = {}
    for f in dataclasses.fields(TransformerConfig):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:  # a required field: only vocab_size, which follows the tokenizer
            default = -1
        if default is None:
            default = config_dict.placeholder(_placeholder_type(hints[f.name]))
        model[f.name] = default
    return ml_collections.ConfigDict(model)


# Keys earlier jattn releases had for training several seeds (and swept optimiser
# values) in one program; a run is one seed now. Each is refused by name, in one
# line that says what replaces it.
_SEED_AXIS = (
    "a run trains one seed (config.seed): train several side by side as a grid with a "
    "seed axis, `jattn ablate --jobs N` (e.g. --config.grid.seed.values=0,1,2)"
)
REMOVED_KEYS = {
    "seeds": _SEED_AXIS,
    "seed_mesh_axis": _SEED_AXIS,
    "seed_program": _SEED_AXIS,
    "debug_nan_seed": _SEED_AXIS,
    "sweep_learning_rate": "a run trains one learning rate: sweep it as a grid axis on "
    "learning_rate, `jattn ablate --jobs N`",
    "sweep_warmup_steps": "a run trains one warmup: sweep it as a grid axis on "
    "warmup_steps, `jattn ablate --jobs N`",
}


def removed_key_error(key: str) -> ConfigError:
    """The one-line error for a key of `REMOVED_KEYS` (``config.seeds``, ...)."""
    return ConfigError(f"config.{key} was removed: {REMOVED_KEYS[key]}")


def default_config() -> ml_collections.ConfigDict:
    """All keys, unlocked, with defaults suited to nothing in particular."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # initialisation, dropout and the data order (jattn.train.load)

    # Data (jattn.data.load / make_loader).
    c.dataset = "numbers"  # jattn task name or a tfds translation data set
    c.data_dir = config_dict.placeholder(str)  # None: $TFDS_DATA_DIR or ~/tensorflow_datasets
    c.tokenizer = "char"  # "char" | "spm" | "spm_bpe"
    c.vocab_size = 8000  # SentencePiece vocabulary size (ignored by "char")
    c.vocab_multiple = 8  # model vocab = tokenizer vocab rounded up to this (sharding)
    c.source_key = config_dict.placeholder(str)
    c.target_key = config_dict.placeholder(str)
    c.max_len = 64  # target (decoder) tokens a row in training, EOS included
    # Input (encoder) tokens a row in training; 0: max_len (the layout before this
    # key existed). Set it near the longest input when inputs are much shorter than
    # targets (configs/numbers.py), so encoder rows are not mostly padding.
    c.max_input_len = 0
    c.pack = True  # several examples a row; each side fills its own row length
    # "drop" | "truncate" training examples whose inputs exceed max_input_len or
    # whose targets exceed max_len (truncate cuts each side to its own limit).
    c.overlong = "drop"

    # Optimisation.
    c.batch_size = 64  # global rows a step (split over processes and the data axes)
    c.num_train_steps = 1000
    c.optimizer = "adam"  # "adam" | "adamw" | "sgd"
    c.schedule = "rsqrt"  # "rsqrt" (the paper) | "constant" | "cosine" | "linear"
    c.learning_rate = 1.0  # rsqrt: multiplier of d_model^-0.5 ...; others: peak rate
    c.warmup_steps = 4000
    c.adam_b1 = 0.9
    c.adam_b2 = 0.98
    c.adam_eps = 1e-9
    c.weight_decay = 0.0  # adamw only
    c.grad_clip_norm = 0.0  # > 0: clip the global gradient norm
    c.grad_accum_steps = 1  # micro-batches a step (one update)
    c.label_smoothing = 0.1
    # Resuming a workdir whose checkpoint was saved under another num_train_steps,
    # schedule, warmup_steps or learning_rate is refused unless this is True.
    c.allow_schedule_change = False
    # Resuming under another value of any other key that changes training (adam_b2,
    # label_smoothing, grad_clip_norm, ...) is refused unless it is named here, e.g.
    # --config.allow_config_change=adam_b2,label_smoothing (docs/reliability.md).
    c.allow_config_change = ()

    _device_keys(c)

    # Evaluation.
    c.eval_every_steps = 500
    c.eval_splits = ("validation", "test_longer")  # those the task has are used
    c.eval_batch_size = 64  # global rows
    c.eval_max_len = 128  # target tokens a row for evaluation (longer examples are dropped)
    c.eval_max_input_len = 0  # input tokens a row for evaluation (longer: dropped); 0: eval_max_len
    c.eval_max_batches = 4  # per split, for loss/accuracy (0: the whole split)
    c.eval_decode_examples = 128  # per split, decoded for exact match / BLEU / chrF
    c.decode = "greedy"  # "greedy" | "beam"
    c.beam_size = 4
    c.beam_alpha = 0.6
    c.decode_max_len = 0  # 0: eval_max_len

    # Checkpoints and output.
    c.checkpoint_every_steps = 500
    c.keep_checkpoints = 2  # the last N, plus the best by best_metric
    c.best_metric = "eval/validation/exact_match"  # "" keeps only the last N
    c.best_mode = "max"  # "max" | "min"
    c.async_checkpointing = True
    c.log_every_steps = 50
    c.progress_bar = True
    # Also log to Weights & Biases (needs the `wandb` package; never required).
    c.wandb = False
    c.wandb_project = "jattn"

    # Testing aid: > 0 makes the loss of that step NaN (see steps.make_train_step).
    c.debug_nan_at_step = 0

    c.model = model_defaults()
    return c


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


# -- checks and what a config builds ---------------------------------------------------


_POSITIVE = (
    "batch_size",
    "num_train_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "log_every_steps",
    "eval_batch_size",
    "eval_max_len",
    "max_len",
    "grad_accum_steps",
    "keep_checkpoints",
    "vocab_multiple",
    "beam_size",
)
# 0 means "the same as another key" (see `input_lengths`).
_NON_NEGATIVE = ("max_input_len", "eval_max_input_len")
_CHOICES = {
    "matmul_precision": ("default", "high", "highest", "float32", "tensorfloat32", "bfloat16"),
    "decode": ("greedy", "beam"),
    "best_mode": ("max", "min"),
    "overlong": ("drop", "truncate"),
}


def matmul_precision(config: ml_collections.ConfigDict):
    """A context in which the run's matmuls take `config.matmul_precision`
    (nothing at "default", so a run without the key traces as before)."""
    import contextlib  # noqa: PLC0415

    value = config.get("matmul_precision", "default")
    if value == "default":
        return contextlib.nullcontext()
    import jax  # noqa: PLC0415

    return jax.default_matmul_precision(value)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Checks keys and values that need nothing but the config, the model's included.

    Raises:
      ConfigError: a missing or unknown key (configs should start from
        `default_config`), an out-of-range value, or a model field that
        `TransformerConfig` rejects, in one line.
    """
    reference = default_config()
    missing = sorted(set(reference.keys()) - set(config.keys()))
    if missing:
        raise ConfigError(f"config lacks keys {missing}; start from jattn.train.default_config()")
    extra = sorted(set(config.keys()) - set(reference.keys()))
    for key in extra:
        if key in REMOVED_KEYS:  # a config file of an earlier release
            raise removed_key_error(key)
    if extra:
        raise ConfigError(f"unknown config keys {extra}")
    for key in _POSITIVE:
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config.{key} must be a positive int, got {value!r}")
    for key in _NON_NEGATIVE:
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"config.{key} must be an int >= 0 (0: the default), got {value!r}")
    for key, options in _CHOICES.items():
        if config[key] not in options:
            raise ConfigError(f"config.{key}={config[key]!r}: choose one of {options}")
    for key in ("learning_rate", "warmup_steps", "weight_decay", "grad_clip_norm"):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ConfigError(f"config.{key} must be a number >= 0, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"config.{key} must be finite, got {value!r}")
    if not 0.0 <= config.label_smoothing < 1.0:
        raise ConfigError(f"config.label_smoothing must be in [0, 1), got {config.label_smoothing}")
    if config.batch_size % config.grad_accum_steps:
        raise ConfigError(
            f"config.batch_size={config.batch_size} is not divisible by "
            f"grad_accum_steps={config.grad_accum_steps}"
        )
    model = build_model_config(config)  # unknown model keys and the model's own checks
    if model.random_positions:
        _check_random_positions(config, model)
    if model.max_position is not None:
        # The scheme supports model.max_position positions (a learned table's
        # rows): every row length must fit it.
        name, longest = max(_row_lengths(config).items(), key=lambda kv: kv[1])
        if longest > model.max_position:
            raise ConfigError(
                f"model.position={model.position!r} has model.max_len={model.max_position} "
                f"positions, but {name} resolves to {longest}: raise model.max_len"
            )


def _check_random_positions(config: ml_collections.ConfigDict, model) -> None:
    """Every segment a run draws random positions for fits in [0, M).

    A segment of n tokens takes n distinct positions of [0, M), so n > M
    cannot be drawn (in a jitted step it would repeat positions silently). A
    decoder-only example is one segment of its input and target tokens; with
    `random_positions_eval` evaluation and decoding draw them too.
    """
    rows = _row_lengths(config)
    if model.arch.joined:  # (input, target) rows that form one segment
        pairs = [("max_input_len", "max_len")]
        if model.random_positions_eval:
            pairs += [
                ("eval_max_input_len", "eval_max_len"),
                ("eval_max_input_len", "decode_max_len"),
            ]
        needs = {f"{a} + {b}": rows[a] + rows[b] for a, b in pairs}
    else:
        names = ["max_len", "max_input_len"]
        if model.random_positions_eval:
            names += ["eval_max_len", "eval_max_input_len", "decode_max_len"]
        needs = {n: rows[n] for n in names}
    name, need = max(needs.items(), key=lambda kv: kv[1])
    if need > model.random_positions:
        raise ConfigError(
            f"model.random_positions={model.random_positions} must be >= {name}={need}: a "
            "segment's positions are a sample of distinct values of [0, random_positions)"
        )


def _row_lengths(config: ml_collections.ConfigDict) -> dict[str, int]:
    """Every row length a run uses, resolved (0 means max_len / eval_max_len):
    max_len, max_input_len (training), eval_max_len, eval_max_input_len,
    decode_max_len."""
    train_in, eval_in = input_lengths(config)
    return {
        "max_len": config.max_len,
        "max_input_len": train_in,
        "eval_max_len": config.eval_max_len,
        "eval_max_input_len": eval_in,
        "decode_max_len": config.decode_max_len or config.eval_max_len,
    }


def input_lengths(config: ml_collections.ConfigDict) -> tuple[int, int]:
    """(training, evaluation) input tokens a row, resolving 0 to max_len / eval_max_len."""
    return (
        config.max_input_len or config.max_len,
        config.eval_max_input_len or config.eval_max_len,
    )


def build_model_config(config: ml_collections.ConfigDict, tokenizer_vocab: int | None = None):
    """The run's `TransformerConfig`, from `config.model`; the model's own checks run here.

    Args:
      config: a full config.
      tokenizer_vocab: the tokenizer's vocabulary size; ``model.vocab_size=-1``
        becomes it, rounded up to a multiple of `vocab_multiple`. None (before
        the data is loaded, as `check_config` calls it) checks every other
        field with the smallest vocabulary.

    Raises:
      ConfigError: an invalid model field, or a vocab_size below the tokenizer's.
    """
    from jattn.models import TransformerConfig  # noqa: PLC0415

    fields = config.model.to_dict()
    if fields["vocab_size"] <= 0:
        multiple = config.vocab_multiple
        fields["vocab_size"] = math.ceil((tokenizer_vocab or 2) / multiple) * multiple
    elif tokenizer_vocab is not None and fields["vocab_size"] < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's "
            f"{tokenizer_vocab} (use -1 to follow the tokenizer)"
        )
    try:
        return TransformerConfig.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.model: {e}") from None


# -- output ----------------------------------------------------------------------------


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
