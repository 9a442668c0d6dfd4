"""What a single run and a seed program both build from (public names).

`jattn.train.program` (a single run) and `jattn.train.seed_program` (every
seed in one program) take from here the pieces they share: the run's
environment (mesh, logical axis rules, data set, evaluation splits), the
workdir's protections at start (write probe, lock, damaged steps set aside),
the model and optimiser, the state's initialiser and its abstract shapes and
shardings, the training loader, the decode function, the single run's
compiled steps, the start-up summary and the log lines. The benchmarks use
them too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.data import producibility
from jattn.train import allocator, data_checks, filesystem, recovery, steps
from jattn.train import mesh as mesh_lib
from jattn.train.config import ConfigError, build_model_config, config_to_dict, input_lengths
from jattn.train.metrics import logged_losses
from jattn.train.optim import make_optimizer
from jattn.train.restore import load_task
from jattn.train.workdir_lock import WorkdirLock

__all__ = [
    "Environment",
    "Model",
    "abstract_state",
    "build_model",
    "check_sizes",
    "compile_steps",
    "decode_fn",
    "environment",
    "flat_hparams",
    "format_eval",
    "import_wandb",
    "last_logged_loss",
    "make_init",
    "metric_names",
    "open_workdir",
    "save_bytes",
    "startup_summary",
    "state_bytes",
    "train_loader",
    "warn",
]


@dataclasses.dataclass
class Environment:
    """Where a run trains: its mesh and rules, its data set and what it evaluates."""

    mesh: jax.sharding.Mesh
    rules: tuple[tuple[str, Any], ...]
    task: Any
    eval_splits: list[str]
    is_main: bool


@dataclasses.dataclass
class Model:
    """The model and optimiser a run trains (one for every seed of a program)."""

    config: Any  # TransformerConfig
    module: Any  # Transformer
    tx: Any
    schedule: Any


def check_sizes(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """Batch sizes against the data-parallel axes and the processes (before compiling)."""
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    nproc = jax.process_count()
    for key in ("batch_size", "eval_batch_size"):
        if config[key] % rows:
            raise ConfigError(
                f"{key}={config[key]} is not divisible by the data-parallel devices "
                f"data*fsdp={rows} of mesh {dict(mesh.shape)}"
            )
    if config.batch_size % nproc:
        raise ConfigError(f"batch_size={config.batch_size} is not divisible by {nproc} processes")
    micro = config.batch_size // config.grad_accum_steps
    if micro % rows:
        raise ConfigError(
            f"micro-batch batch_size/grad_accum_steps={micro} is not divisible by data*fsdp={rows}"
        )


def environment(config: ml_collections.ConfigDict) -> Environment:
    """The mesh, the rules, the data set and the checked evaluation splits of `config`
    (the config is checked already; this raises ConfigError before anything compiles)."""
    mesh = mesh_lib.make_mesh(config.mesh_shape)
    rules = tuple(tuple(r) for r in config.logical_axis_rules) or mesh_lib.DEFAULT_RULES
    check_sizes(config, mesh)
    task = load_task(config)
    eval_splits = data_checks.eval_splits(config, task)
    data_checks.check_best_metric(config, task, eval_splits)
    return Environment(mesh, rules, task, eval_splits, jax.process_index() == 0)


def build_model(config: ml_collections.ConfigDict, task) -> Model:
    """The Transformer of `config` for `task`'s vocabulary, and its optimiser."""
    from jattn.models import Transformer  # noqa: PLC0415 -- the model layer, on demand

    model_config = build_model_config(config, task.tokenizer.vocab_size)
    tx, schedule = make_optimizer(config)
    return Model(model_config, Transformer(model_config), tx, schedule)


def open_workdir(stack, workdir: str, checkpoint_dir: str, *dirs: str) -> None:
    """Process 0's protections at start: every folder writable, the workdir locked
    (held by `stack`), damaged checkpoint steps set aside before orbax opens them."""
    if jax.process_index() != 0:
        return
    filesystem.check_writable(workdir, checkpoint_dir, *dirs)
    lock = stack.enter_context(WorkdirLock(workdir))
    if lock.previous:
        pid = lock.previous.get("pid")
        warn(f"warning: took over the lock of {workdir} left by pid {pid}, which died")
    recovery.set_aside_incomplete(checkpoint_dir, warn)


def make_init(model, tx, config: ml_collections.ConfigDict, rows: int):
    """`rng key data -> TrainState` with boxed (logically annotated) parameters."""
    input_len, _ = input_lengths(config)  # encoder row length; config.max_len: decoder's

    def init_boxed(rng: jax.Array) -> steps.TrainState:
        init_rng, state_rng = jax.random.split(jax.random.wrap_key_data(rng))
        inputs = jnp.zeros((rows, input_len), jnp.int32)  # [rows, S]
        targets = jnp.zeros((rows, config.max_len), jnp.int32)  # [rows, T]
        params = model.init({"params": init_rng}, inputs, targets, train=False)["params"]
        return steps.TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(state_rng),
        )

    return init_boxed


def abstract_state(init_boxed, root: jax.Array, mesh, rules):
    """`(abstract state, state shardings)`: shapes, dtypes and shardings of the
    state, from the logical axis names of the boxed parameters (nothing is
    allocated)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_boxed, root)
        shardings = mesh_lib.state_shardings(abstract_boxed, mesh, rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        mesh_lib.unbox_values(abstract_boxed),
        shardings,
    )
    return abstract, shardings


def train_loader(task, config: ml_collections.ConfigDict):
    """This process's shard of the shuffled, packed training stream."""
    from jattn import data as data_lib  # noqa: PLC0415

    return data_lib.make_loader(
        task,
        "train",
        batch_size=config.batch_size // jax.process_count(),
        max_len=config.max_len,
        max_input_len=input_lengths(config)[0],
        seed=config.seed,
        shuffle=True,
        pack=config.pack,
        overlong=config.overlong,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
    )


def decode_fn(model, config: ml_collections.ConfigDict):
    """`(params, inputs [B, S]) -> ids [B, max_length]` per `config.decode`, or None."""
    if config.eval_decode_examples <= 0:
        return None
    from jattn.models import decoding  # noqa: PLC0415

    max_length = config.decode_max_len or config.eval_max_len
    if config.decode == "beam":
        return functools.partial(
            decoding.beam_search,
            model,
            max_length=max_length,
            beam_size=config.beam_size,
            alpha=config.beam_alpha,
        )
    return functools.partial(decoding.greedy, model, max_length=max_length)


def compile_steps(model, tx, schedule, config: ml_collections.ConfigDict, mesh, shardings):
    """A single run's `(train_step, eval_step, decode or None)`, jitted with explicit
    shardings.

    The train step donates the state; every output but the state is replicated.
    """
    batch_sharding = mesh_lib.batch_sharding(mesh)
    replicated = NamedSharding(mesh, P())
    train_step = jax.jit(
        steps.make_train_step(
            model,
            tx,
            schedule,
            label_smoothing=config.label_smoothing,
            grad_accum_steps=config.grad_accum_steps,
            micro_spec=NamedSharding(mesh, P(None, *mesh_lib.BATCH_SPEC)),
            debug_nan_at_step=config.debug_nan_at_step,
        ),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
    eval_step = jax.jit(
        steps.make_eval_step(model),
        in_shardings=(shardings.params, batch_sharding),
        out_shardings=replicated,
    )
    decode_one = decode_fn(model, config)
    decode = decode_one and jax.jit(
        decode_one, in_shardings=(shardings.params, batch_sharding), out_shardings=replicated
    )
    return train_step, eval_step, decode


def import_wandb(config: ml_collections.ConfigDict):
    """The `wandb` module when `config.wandb` asks for it, else None.

    Raises:
      ConfigError: `config.wandb=True` without the package installed.
    """
    if not config.wandb:
        return None
    try:
        import wandb  # noqa: PLC0415 -- optional, never required
    except ImportError:
        raise ConfigError(
            "config.wandb=True needs the `wandb` package, which is not installed "
            "(pip install wandb, or leave config.wandb=False)"
        ) from None
    return wandb


def flat_hparams(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as flat ``{"key": value, "model.key": value}`` for TensorBoard."""
    flat = {}
    for key, value in config_to_dict(config).items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            name = key if sub is None else f"{key}.{sub}"
            flat[name] = "" if v is None else (str(tuple(v)) if isinstance(v, list) else v)
    return flat


def metric_names(eval_sets) -> list[str]:
    """The scalars TensorBoard's HPARAMS table shows: training's and every split's."""
    return ["train/loss", "train/accuracy"] + [
        f"eval/{es.split}/{m}"
        for es in eval_sets.values()
        for m in ("loss", "accuracy", *es.metrics)
    ]


def _architectures_line(config, task) -> str:
    """Both architectures' parameter counts at this run's width, so a decoder-only
    run and an encoder-decoder one can be compared at equal size."""
    from jattn.models import architecture_counts  # noqa: PLC0415 -- the model layer

    model_config = build_model_config(config, task.tokenizer.vocab_size)
    counts = architecture_counts(model_config)
    n = model_config.num_layers
    return (
        f"at this width: encoder_decoder {counts['encoder_decoder']:,} parameters "
        f"({n}+{n} layers), decoder_only {counts['decoder_only']:,} ({2 * n} layers)"
    )


def startup_summary(
    workdir, config, mesh, num_params: int, task, eval_sets, start: int, data_check
) -> str:
    """What the run is about to do, printed before the first step."""
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    sizes = []
    for split in task.splits:
        try:
            sizes.append(f"{split} {len(task.source(split)):,} examples")
        except (TypeError, ValueError):  # a source without a length
            sizes.append(f"{split} (size unknown)")
    input_len, _ = input_lengths(config)
    lines = [
        f"workdir: {workdir}" + (f" (resuming at step {start})" if start else ""),
        f"parameters: {num_params:,}",
        _architectures_line(config, task),
        f"devices: {len(devices)} x {', '.join(kinds)} ({jax.process_count()} process(es)); "
        f"mesh {dict(mesh.shape)}"
        + ("; " + allocator.describe() if devices[0].platform == "cpu" else ""),
        f"data {config.dataset}: " + ", ".join(sizes),
        f"training rows: {config.batch_size} a step ({input_len} input + {config.max_len} "
        f"target tokens), {config.num_train_steps:,} steps",
    ]
    if eval_sets:
        lines.append(
            "evaluated: "
            + ", ".join(
                f"{es.split} {es.num_examples:,} examples in {len(es.batches)} batch(es)"
                for es in eval_sets.values()
            )
        )
    lines += producibility.summary_lines(data_check) + producibility.warnings(data_check)
    lines.append(f"tensorboard --logdir {workdir}")
    return "\n".join(lines)


def format_eval(step: int, metrics: dict[str, float]) -> str:
    """``step 100: validation/loss=1.23, ...``: an evaluation's log line."""
    parts = [f"{k.removeprefix('eval/')}={v:.4g}" for k, v in sorted(metrics.items())]
    return f"step {step}: " + ", ".join(parts)


def last_logged_loss(workdir: str) -> float:
    """The last `train/loss` (an interval's mean) of metrics.jsonl (a run resumed at
    its end trains no step)."""
    logged = logged_losses(workdir)
    return float(logged[-1]) if logged else float("nan")


def warn(line: str) -> None:
    """One line on stderr (process 0 only): a skipped checkpoint, archived metrics, ..."""
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def state_bytes(abstract) -> int:
    """Bytes of a checkpoint's state (parameters, optimiser state), a save's size."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def save_bytes(abstract) -> int:
    """The free space a save of `abstract` asks for: its bytes, a fifth more, and 1 MiB."""
    return int(1.2 * state_bytes(abstract)) + (1 << 20)
