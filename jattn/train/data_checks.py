"""Config values that only make sense against the data: splits, best_metric, row lengths.

`check_config` sees the config alone; these checks need the task, and run
once it is loaded, still before anything compiles:

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
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections
import numpy as np

from jattn.train.config import ConfigError, default_config, input_lengths

__all__ = ["MAX_DROPPED", "check_best_metric", "check_row_lengths", "eval_splits"]

MAX_DROPPED = 0.75  # of the training examples; more is refused
_SAMPLE = 2048  # training examples measured (evenly spaced over the split)


def eval_splits(config: ml_collections.ConfigDict, task) -> list[str]:
    """The evaluated splits: `config.eval_splits`, each checked against the task's.

    Raises:
      ConfigError: a named split the task does not have (unless the config
        keeps the default pair, of which the task's are used).
    """
    wanted = list(config.eval_splits)
    if tuple(wanted) == tuple(default_config().eval_splits):
        return [s for s in wanted if s in task.splits]
    unknown = [s for s in wanted if s not in task.splits]
    if unknown:
        raise ConfigError(
            f"config.eval_splits: {unknown} not a split of {config.dataset!r} "
            f"(its splits: {list(task.splits)}); use () for no evaluation"
        )
    return wanted


def check_best_metric(config: ml_collections.ConfigDict, task, splits: list[str]) -> None:
    """Checks that `config.best_metric` ("" for none) names a metric the run logs.

    Raises:
      ConfigError: naming the metrics it could be.
    """
    name = config.best_metric
    if not name:
        return
    logged = [f"eval/{s}/{m}" for s in splits for m in ("loss", "accuracy", *task.metrics)]
    if name not in logged and not (name == default_config().best_metric and not splits):
        raise ConfigError(
            f"config.best_metric={name!r} is not a metric this run logs "
            f"({logged or 'no evaluation: eval_splits is empty'}); use one of them, or '' "
            "to keep only the last checkpoints"
        )


def check_row_lengths(
    config: ml_collections.ConfigDict, task, report: Callable[[str], None]
) -> dict[str, float]:
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
    input_len, _ = input_lengths(config)
    encode = task.tokenizer.encode
    over = longest_in = longest_out = 0
    for ex in source.__getitems__(indices.tolist()):
        a, b = len(encode(ex["inputs"])), len(encode(ex["targets"]))
        longest_in, longest_out = max(longest_in, a), max(longest_out, b)
        over += a > input_len or b > config.max_len
    share = over / len(indices)
    if over:
        what = "drops" if config.overlong == "drop" else "truncates"
        line = (
            f"max_len={config.max_len} (inputs {input_len}) {what} {over} of {len(indices)} "
            f"sampled training examples ({share:.1%}; the longest have {longest_in} input and "
            f"{longest_out} target tokens, EOS included)"
        )
        if config.overlong == "drop" and share > MAX_DROPPED:
            raise ConfigError(
                f"{line}: more than {MAX_DROPPED:.0%}; raise max_len/max_input_len or set "
                "overlong='truncate'"
            )
        report(f"note: {line}")
    return {"over": share, "sampled": len(indices)}
