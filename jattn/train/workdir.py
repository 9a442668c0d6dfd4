"""A run's files: their names, and the one reader and writer of each.

A `jattn train` workdir (each member's workdir of a program) holds::

    config.json          the full config (`config_to_json`); `load_run` reads it back
    model_config.json    the TransformerConfig
    tokenizer.json       the tokenizer (and its vocabulary file)
    data_check.json      `jattn.data.producibility.check` of the evaluation splits
    metrics.jsonl        one JSON object a line: ``step`` and metric names
    tb/                  TensorBoard event files
    decodes/<split>.jsonl  the latest evaluation's decoded examples
    checkpoints/         orbax checkpoints (``checkpoints.skipped/``: set aside)
    final_metrics.json   once the run reached ``num_train_steps``

Training (`jattn.train.run`), recovery, `jattn.train.load`, checkpoints and
the ablation report (`jattn.analysis`) name these files only through the
constants here, and read them with these readers, so a name changes in one
place. Nothing here needs jax.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "DATA_CHECK",
    "DECODES",
    "FINAL_METRICS",
    "METRICS",
    "MODEL_CONFIG",
    "TENSORBOARD",
    "decodes_path",
    "finished_metrics",
    "read_json",
    "read_jsonl",
    "write_json",
    "write_run_files",
]

CONFIG = "config.json"
MODEL_CONFIG = "model_config.json"
DATA_CHECK = "data_check.json"
METRICS = "metrics.jsonl"
FINAL_METRICS = "final_metrics.json"
DECODES = "decodes"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"


def read_json(path: str) -> Any:
    """The JSON value in `path`, or None when there is no such file."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_json(path: str, value: Any) -> None:
    """Writes `value` to `path` as indented JSON."""
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every row of a JSON-lines file (empty when there is none); a torn line (a crash
    mid-write) is skipped."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows


def decodes_path(workdir: str, split: str) -> str:
    """``workdir/decodes/<split>.jsonl``."""
    return os.path.join(workdir, DECODES, f"{split}.jsonl")


def finished_metrics(workdir: str, num_train_steps: int) -> dict[str, Any] | None:
    """The saved ``final_metrics.json`` if the run in `workdir` reached
    `num_train_steps` (a run stopped earlier, or trained with fewer steps, is not
    finished), else None."""
    final = read_json(os.path.join(workdir, FINAL_METRICS))
    if final is not None and final.get("step") == num_train_steps:
        return final
    return None


def write_run_files(
    workdir: str, config, model_config, tokenizer, data_check: Mapping[str, Any]
) -> None:
    """What makes a workdir self-contained (`load_run`): ``config.json``,
    ``model_config.json``, the tokenizer and ``data_check.json``."""
    from jattn.data.tokenizers import save_to_dir  # noqa: PLC0415 -- keeps this module light
    from jattn.train.config import config_to_json  # noqa: PLC0415

    with open(os.path.join(workdir, CONFIG), "w") as f:
        f.write(config_to_json(config))
    with open(os.path.join(workdir, MODEL_CONFIG), "w") as f:
        json.dump(model_config.to_dict(), f, indent=2, sort_keys=True)
    save_to_dir(tokenizer, workdir)
    write_json(os.path.join(workdir, DATA_CHECK), dict(data_check))
