"""Every config key of `jattn train`, with its default and meaning, in one place.

Experiment configs (`configs/*.py`) start from `default_config()` and change
what they need; `check_config` verifies a finished config before anything is
built. Keys shared across the project (DESIGN.md): seed, num_train_steps,
checkpoint_every_steps, eval_every_steps, batch_size, learning_rate,
warmup_steps, dataset, mesh_shape, model.*.
"""

from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from jattn.train.config import ConfigError

__all__ = [
    "apply_variant",
    "check_config",
    "default_config",
    "input_lengths",
    "model_defaults",
]


def model_defaults() -> ml_collections.ConfigDict:
    """`model.*`: every field of `jattn.models.TransformerConfig` with its default.

    ``vocab_size=-1`` means "the tokenizer's size, rounded up to a multiple of
    `vocab_multiple`". Fields whose default is None become typed placeholders,
    so that ``--config.model.num_kv_heads=2`` is checked as an int.
    """
    from jattn.models import TransformerConfig  # noqa: PLC0415

    model = {}
    for f in dataclasses.fields(TransformerConfig):
        if f.name == "vocab_size":
            model[f.name] = -1
        elif f.default is None:
            kind = {"int": int, "str": str, "float": float}.get(str(f.type).split(" ")[0], str)
            model[f.name] = config_dict.placeholder(kind)
        else:
            model[f.name] = f.default
    return ml_collections.ConfigDict(model)


def default_config() -> ml_collections.ConfigDict:
    """All keys, unlocked, with defaults suited to nothing in particular."""
    c = ml_collections.ConfigDict()
    c.seed = 0

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

    # Sharding: sizes of the mesh axes ("data", "fsdp", "tensor"); one may be -1.
    c.mesh_shape = (-1, 1, 1)
    c.logical_axis_rules = ()  # () -> jattn.train.mesh.DEFAULT_RULES

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

    # Testing aid: > 0 makes the loss of that step NaN (see steps.make_train_step).
    c.debug_nan_at_step = 0

    c.model = model_defaults()
    return c


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
    "decode": ("greedy", "beam"),
    "best_mode": ("max", "min"),
    "overlong": ("drop", "truncate"),
}


def check_config(config: ml_collections.ConfigDict) -> None:
    """Checks keys and values that need nothing but the config.

    Raises:
      ConfigError: a missing key (configs should start from `default_config`)
        or an out-of-range value, in one line.
    """
    reference = default_config()
    missing = sorted(set(reference.keys()) - set(config.keys()))
    if missing:
        raise ConfigError(f"config lacks keys {missing}; start from jattn.train.default_config()")
    extra = sorted(set(config.keys()) - set(reference.keys()))
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
    if not 0.0 <= config.label_smoothing < 1.0:
        raise ConfigError(f"config.label_smoothing must be in [0, 1), got {config.label_smoothing}")
    if config.batch_size % config.grad_accum_steps:
        raise ConfigError(
            f"config.batch_size={config.batch_size} is not divisible by "
            f"grad_accum_steps={config.grad_accum_steps}"
        )
    unknown_model = sorted(set(config.model.keys()) - set(model_defaults().keys()))
    if unknown_model:
        raise ConfigError(
            f"unknown model keys {['model.' + k for k in unknown_model]}; "
            f"TransformerConfig has {sorted(model_defaults().keys())}"
        )
    if config.model.get("position") == "learned":
        # A learned table has model.max_len rows: every row length must fit it.
        lengths = {
            "max_len": config.max_len,
            "max_input_len": input_lengths(config)[0],
            "eval_max_len": config.eval_max_len,
            "eval_max_input_len": input_lengths(config)[1],
            "decode_max_len": config.decode_max_len or config.eval_max_len,
        }
        name, longest = max(lengths.items(), key=lambda kv: kv[1])
        if longest > config.model.max_len:
            raise ConfigError(
                f"model.position='learned' has model.max_len={config.model.max_len} "
                f"positions, but {name} resolves to {longest}: raise model.max_len"
            )


def input_lengths(config: ml_collections.ConfigDict) -> tuple[int, int]:
    """(training, evaluation) input tokens a row, resolving 0 to max_len / eval_max_len."""
    return (
        config.max_input_len or config.max_len,
        config.eval_max_input_len or config.eval_max_len,
    )


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
    from jattn.models import POSITIONS  # noqa: PLC0415

    for item in [s.strip() for s in (arg or "").split(",") if s.strip()]:
        if item in POSITIONS:
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
                f"{sorted(POSITIONS)}, attention {sorted(IMPLEMENTATIONS)}, bf16, greedy, beam"
            )
    return config
