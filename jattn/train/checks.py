"""Checks of a run's config: alone (`check_config`), and against its data set once loaded.

`check_config` checks every key and value that needs nothing but the config,
the model's fields included (by building the model config); the CLI runs it
before anything is prepared. The other checks need the task, and run once it
is loaded, still before anything compiles:

- every name in `eval_splits` must be a split of the task (a misspelt
  "validaton" would otherwise run with no evaluation at all); the default
  pair ("validation", "test_longer") keeps only those the task has, as
  before, since tfds data sets rarely have ``test_longer``;
- `best_metric` must be a metric the run logs (``eval/<split>/<name>``
  with an evaluated split and one of the task's metrics), or a misspelt one
  silently stops keeping the best checkpoint (the default name is let pass
  when nothing is evaluated: ``eval_splits=()`` keeps the last N, as before);
- training rows must hold most examples: with ``overlong="drop"`` a
  `max_len` that drops more than `MAX_DROPPED` of a sample of the training
  split is refused (``max_len=2`` once dropped 501 of 512 examples without
  a word), and any dropped or truncated share is reported.

The data checks read the pieces of `jattn.train.parts`, `check_config` the
config itself. Every problem is a `ConfigError` in one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import ml_collections
import numpy as np

from jattn.train.parts import (
    REMOVED_KEYS,
    ConfigError,
    DataPart,
    EvalPart,
    build_model_config,
    default_config,
    input_lengths,
    removed_key_error,
)

__all__ = ["MAX_DROPPED", "check_best_metric", "check_config", "check_row_lengths", "eval_splits"]

# -- the config alone ----------------------------------------------------------------------

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


# -- against the data set ------------------------------------------------------------------

MAX_DROPPED = 0.75  # of the training examples; more is refused
_SAMPLE = 2048  # training examples measured (evenly spaced over the split)


def eval_splits(evaluation: EvalPart, data: DataPart, task) -> list[str]:
    """The evaluated splits: `evaluation.splits`, each checked against the task's.

    Raises:
      ConfigError: a named split the task does not have (unless the config
        keeps the default pair, of which the task's are used).
    """
    wanted = list(evaluation.splits)
    if tuple(wanted) == tuple(default_config().eval_splits):
        return [s for s in wanted if s in task.splits]
    unknown = [s for s in wanted if s not in task.splits]
    if unknown:
        raise ConfigError(
            f"config.eval_splits: {unknown} not a split of {data.dataset!r} "
            f"(its splits: {list(task.splits)}); use () for no evaluation"
        )
    return wanted


def check_best_metric(name: str, task, splits: list[str]) -> None:
    """Checks that the best checkpoint's metric `name` (``config.best_metric``, ""
    for none) is a metric the run logs.

    Raises:
      ConfigError: naming the metrics it could be.
    """
    if not name:
        return
    logged = [f"eval/{s}/{m}" for s in splits for m in ("loss", "accuracy", *task.metrics)]
    if name not in logged and not (name == default_config().best_metric and not splits):
        raise ConfigError(
            f"config.best_metric={name!r} is not a metric this run logs "
            f"({logged or 'no evaluation: eval_splits is empty'}); use one of them, or '' "
            "to keep only the last checkpoints"
        )


def check_row_lengths(data: DataPart, task, report: Callable[[str], None]) -> dict[str, float]:
    """Measures how many training examples the row lengths drop or truncate.

    Tokenizes up to 2048 evenly spaced training examples (milliseconds for
    the small tasks) and counts those whose inputs exceed the training input
    length or whose targets exceed `max_len`.

    Returns:
      ``{"over": share of the sample over-long, "sampled": n}``.

    Raises:
      ConfigError: ``overlong="drop"`` would drop more than `MAX_DROPPED`.
    """
    source = task.source("train")
    n = len(source)
    indices = np.unique(np.linspace(0, n - 1, num=min(n, _SAMPLE)).astype(np.int64))
    input_len = data.input_len
    encode = task.tokenizer.encode
    over = longest_in = longest_out = 0
    for ex in source.__getitems__(indices.tolist()):
        a, b = len(encode(ex["inputs"])), len(encode(ex["targets"]))
        longest_in, longest_out = max(longest_in, a), max(longest_out, b)
        over += a > input_len or b > data.max_len
    share = over / len(indices)
    if over:
        what = "drops" if data.overlong == "drop" else "truncates"
        line = (
            f"max_len={data.max_len} (inputs {input_len}) {what} {over} of {len(indices)} "
            f"sampled training examples ({share:.1%}; the longest have {longest_in} input and "
            f"{longest_out} target tokens, EOS included)"
        )
        if data.overlong == "drop" and share > MAX_DROPPED:
            raise ConfigError(
                f"{line}: more than {MAX_DROPPED:.0%}; raise max_len/max_input_len or set "
                "overlong='truncate'"
            )
        report(f"note: {line}")
    return {"over": share, "sampled": len(indices)}
