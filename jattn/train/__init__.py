"""Training: one config path, a jitted sharded loop, orbax checkpoints, metrics.

    from jattn.train import load_config, apply_overrides, train_and_evaluate
    config = load_config("configs/numbers.py")
    apply_overrides(config, [("num_train_steps", "100")])
    final = train_and_evaluate(config, "/tmp/run")   # {"eval/validation/exact_match": ...}

Needs the `train` extra (flax, optax, orbax, grain, ml_collections, ...).
"""

from jattn.train.config import (
    ConfigError,
    apply_overrides,
    apply_variant,
    build_model_config,
    check_config,
    config_to_dict,
    config_to_json,
    default_config,
    load_config,
    split_overrides,
)
from jattn.train.load import TrainedRun, checkpoint_steps, load_run, load_task
from jattn.train.loop import TrainingDivergedError
from jattn.train.metrics import read_metrics
from jattn.train.run import train_and_evaluate

__all__ = [
    "ConfigError",
    "TrainedRun",
    "TrainingDivergedError",
    "apply_overrides",
    "apply_variant",
    "build_model_config",
    "check_config",
    "checkpoint_steps",
    "config_to_dict",
    "config_to_json",
    "default_config",
    "load_config",
    "load_run",
    "load_task",
    "read_metrics",
    "split_overrides",
    "train_and_evaluate",
]
