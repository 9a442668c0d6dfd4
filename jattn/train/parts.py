"""What a run's config holds: every key with its default, and the frozen pieces each part reads.

Two forms of one config:

- `default_config()`: the `ml_collections.ConfigDict` a config file starts
  from and a command line overrides, every key with its default and
  meaning (``model.*`` read from `jattn.models.TransformerConfig`'s fields,
  so a new field is a new key); `REMOVED_KEYS` are the keys earlier
  releases had, each refused in one line naming what replaced it;
- `Parts`: the same config read once, at the top of a run
  (`jattn.train.config.read_parts`), into one frozen value per part of the
  run: the model's (`ModelPart`), the optimiser's (`OptimizerPart`), the
  train step's (`StepPart`), the data's (`DataPart`), the evaluation's
  (`EvalPart`), the checkpoints' (`CheckpointPart`), the loop's
  (`LoopPart`) and the devices' (`DevicePart`). A module takes the piece it
  reads, never the whole config: the defaults of "0 means another key"
  (`max_input_len`, `eval_max_input_len`, `decode_max_len`) are resolved
  here once, and a piece's fields say what that part depends on.

`Parts.record` is the whole config as plain JSON (`config_to_dict`): what a
run writes (``config.json``, a checkpoint's ``meta``, TensorBoard's
hparams, wandb) and what a resume compares (`jattn.train.resume_keys`).

Every problem is a `ConfigError` whose message is one line that names the
key and the value it got.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict

__all__ = [
    "REMOVED_KEYS",
    "CheckpointPart",
    "ConfigError",
    "DataPart",
    "DevicePart",
    "EvalPart",
    "LoopPart",
    "ModelPart",
    "OptimizerPart",
    "Parts",
    "StepPart",
    "TASK_KEYS",
    "build_model_config",
    "config_to_dict",
    "config_to_json",
    "default_config",
    "input_lengths",
    "model_defaults",
    "precision_context",
    "precision_line",
    "removed_key_error",
]


class ConfigError(ValueError):
    """A bad config, config key, override value, or a config that does not fit the run."""


# -- every key with its default ----------------------------------------------------------


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


def input_lengths(config: ml_collections.ConfigDict) -> tuple[int, int]:
    """(training, evaluation) input tokens a row, resolving 0 to max_len / eval_max_len."""
    return (
        config.max_input_len or config.max_len,
        config.eval_max_input_len or config.eval_max_len,
    )


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


# -- the pieces each part reads ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelPart:
    """The model's piece: `model.*` as plain values and `vocab_multiple`; `build`
    makes the run's `TransformerConfig` once the tokenizer's size is known."""

    fields: dict[str, Any]  # model.*, as `config.model.to_dict()` gives them
    vocab_multiple: int

    @property
    def d_model(self) -> int:
        return self.fields["d_model"]

    def build(self, tokenizer_vocab: int | None = None):
        """The `TransformerConfig`; the model's own checks run here.

        Args:
          tokenizer_vocab: the tokenizer's vocabulary size; ``vocab_size=-1``
            becomes it, rounded up to a multiple of `vocab_multiple`. None
            (before the data is loaded, as `check_config` calls it) checks
            every other field with the smallest vocabulary.

        Raises:
          ConfigError: an invalid model field, or a vocab_size below the tokenizer's.
        """
        from jattn.models import TransformerConfig  # noqa: PLC0415

        fields = dict(self.fields)
        if fields["vocab_size"] <= 0:
            multiple = self.vocab_multiple
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


def build_model_config(config: ml_collections.ConfigDict, tokenizer_vocab: int | None = None):
    """The `TransformerConfig` of a full config's `model.*` (`ModelPart.build`)."""
    part = ModelPart(config.model.to_dict(), config.vocab_multiple)
    return part.build(tokenizer_vocab)


@dataclasses.dataclass(frozen=True)
class OptimizerPart:
    """The optimiser's and the learning-rate schedule's keys (`jattn.train.optim`),
    named as in the config; `d_model` is the model's (the "rsqrt" schedule's)."""

    optimizer: str
    schedule: str
    learning_rate: float
    warmup_steps: int
    num_train_steps: int
    d_model: int
    adam_b1: float
    adam_b2: float
    adam_eps: float
    weight_decay: float
    grad_clip_norm: float


@dataclasses.dataclass(frozen=True)
class StepPart:
    """What the train step reads besides the model and the optimiser
    (`jattn.train.steps.make_train_step`)."""

    label_smoothing: float
    grad_accum_steps: int
    debug_nan_at_step: int


# The config keys that name a run's data set and tokenizer (`DataPart.task_keys`).
TASK_KEYS = ("dataset", "data_dir", "tokenizer", "vocab_size", "source_key", "target_key")


@dataclasses.dataclass(frozen=True)
class DataPart:
    """The training data: which data set and tokenizer (`TASK_KEYS`), and the
    stream's rows (`jattn.train.load.train_loader`). `input_len` is the
    resolved `max_input_len` (0 there means `max_len`)."""

    dataset: str
    data_dir: str | None
    tokenizer: str
    vocab_size: int
    source_key: str | None
    target_key: str | None
    batch_size: int  # global rows a step
    max_len: int  # target tokens a row
    input_len: int  # input tokens a row
    pack: bool
    overlong: str
    seed: int

    def task_keys(self) -> dict[str, Any]:
        """The keys that name the run's data set and tokenizer (`jattn.data.load`'s)."""
        return {k: getattr(self, k) for k in TASK_KEYS}


@dataclasses.dataclass(frozen=True)
class EvalPart:
    """What evaluation reads (`jattn.train.evaluation`): the splits, their rows,
    and decoding. `input_len` and `decode_max_len` are resolved (0 in the
    config means `eval_max_len`); `seed` is the run's, handed to the loader."""

    splits: tuple[str, ...]
    batch_size: int  # global rows
    max_len: int
    input_len: int
    max_batches: int  # per split (0: the whole split)
    decode_examples: int  # per split
    decode: str  # "greedy" | "beam"
    beam_size: int
    beam_alpha: float
    decode_max_len: int
    seed: int


@dataclasses.dataclass(frozen=True)
class CheckpointPart:
    """What the checkpoints read (`jattn.train.checkpoints`): retention, and the
    run's whole config (`record`), which each step's ``meta`` saves and a
    resume compares with the saved one (`jattn.train.resume_keys`)."""

    keep: int  # the last N steps
    best_metric: str  # "" keeps only the last N
    best_mode: str  # "max" | "min"
    async_saves: bool
    record: dict[str, Any]  # `config_to_dict` of the run's config; read only


@dataclasses.dataclass(frozen=True)
class LoopPart:
    """What the training loop and its reporting read (`jattn.train.loop`,
    `jattn.train.run`): how long, how often, where it reports."""

    num_train_steps: int
    log_every_steps: int
    eval_every_steps: int
    checkpoint_every_steps: int
    progress_bar: bool
    wandb: bool
    wandb_project: str


@dataclasses.dataclass(frozen=True)
class DevicePart:
    """How the run uses its devices: the mesh, its rules, the matmul precision."""

    mesh_shape: tuple[int, ...]
    logical_axis_rules: tuple  # () -> jattn.train.mesh.DEFAULT_RULES
    matmul_precision: str

    def precision(self):
        """The context the run's steps are traced under (`precision_context`)."""
        return precision_context(self.matmul_precision)


def precision_context(name: str):
    """A context in which float32 matmuls take the precision `name` (jax's
    `default_matmul_precision`); nothing at "default", so a run without the
    key traces as before."""
    if name == "default":
        return contextlib.nullcontext()
    import jax  # noqa: PLC0415

    return jax.default_matmul_precision(name)


def precision_line(name: str, platform: str) -> str:
    """What `config.matmul_precision` means for a run's float32 matmuls on
    `platform` (`jax.devices()[0].platform`), as the run's header says it: a
    GPU run's default is TF32, which no CPU table reproduces digit for digit."""
    if name != "default":
        return f"float32 matmuls: {name} (config.matmul_precision)"
    meaning = {"gpu": "TF32 on the tensor cores", "cuda": "TF32 on the tensor cores",
               "tpu": "one bf16 pass on the MXU", "cpu": "IEEE float32"}  # fmt: skip
    return (
        f"float32 matmuls: default ({meaning.get(platform, 'jax default')} on {platform}; "
        "config.matmul_precision=highest for IEEE float32)"
    )


@dataclasses.dataclass(frozen=True)
class Parts:
    """A run's config read once into what each part of the run reads."""

    model: ModelPart
    optimizer: OptimizerPart
    step: StepPart
    data: DataPart
    evaluation: EvalPart
    checkpoints: CheckpointPart
    loop: LoopPart
    devices: DevicePart
    seed: int  # initialisation, dropout and the data order
    record: dict[str, Any]  # the whole config as plain JSON; read only
