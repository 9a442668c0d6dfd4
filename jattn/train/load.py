"""What a run is made of, and a trained run: `open_task`, `environment`,
`build_model`, `load_run(workdir)`.

A run about to train loads its data set (`open_task`, `train_loader`), its
mesh and evaluation splits (`environment`) and its model and optimiser
(`build_model`), each from the pieces of its config that say what it is
(`jattn.train.parts`), and says so before the first step (`startup_summary`).

    run = jattn.train.load_run("runs/numbers")            # the latest checkpoint
    logits = run.model.apply({"params": run.params}, inputs, targets)
    ids = jattn.models.decoding.greedy(run.model, run.params, inputs, max_length=64)
    run.tokenizer.decode(ids[0])                          # the run's own vocabulary

The training loop and `load_run` open a config's data set the same way
(`open_task`, and `load_task` for a saved config), so an analysis sees the
tokenizer and splits the run trained on.

Parameters are restored onto one device (the first local one) whatever mesh
the run was trained on, so a checkpoint of an 8-device run opens on a laptop.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from jattn.data import producibility
from jattn.train import checks
from jattn.train import mesh as mesh_lib
from jattn.train import workdir as workdir_lib
from jattn.train.checkpoints import CHECKPOINT_DIR, step_problem
from jattn.train.parts import (
    TASK_KEYS,
    ConfigError,
    DataPart,
    LoopPart,
    Parts,
    default_config,
    precision_line,
)

__all__ = [
    "TASK_KEYS",
    "Environment",
    "Model",
    "TrainedRun",
    "build_model",
    "checkpoint_steps",
    "environment",
    "import_wandb",
    "load_run",
    "load_task",
    "open_task",
    "startup_summary",
    "train_loader",
]


def open_task(data: DataPart):
    """The `jattn.data` task (data set and tokenizer) of a run's data piece.

    Raises:
      ConfigError: an unknown data set or an unusable data key.
    """
    return _task(data.task_keys())


def load_task(config: ml_collections.ConfigDict):
    """The `jattn.data` task of a saved config (a workdir's ``config.json``).

    Keys a config lacks (a run saved before they existed) take their
    `default_config` values.

    Raises:
      ConfigError: an unknown data set or an unusable data key.
    """
    defaults = default_config()
    return _task({k: config.get(k, defaults[k]) for k in TASK_KEYS})


def _task(keys: dict[str, Any]):
    from jattn import data  # noqa: PLC0415

    keys = dict(keys)
    dataset = keys.pop("dataset")
    try:
        return data.load(dataset, **keys)
    except ValueError as e:
        raise ConfigError(f"dataset={dataset!r}: {e}") from None


def train_loader(task, data: DataPart):
    """This process's shard of the shuffled, packed training stream."""
    from jattn import data as data_lib  # noqa: PLC0415

    return data_lib.make_loader(
        task,
        "train",
        batch_size=data.batch_size // jax.process_count(),
        max_len=data.max_len,
        max_input_len=data.input_len,
        seed=data.seed,
        shuffle=True,
        pack=data.pack,
        overlong=data.overlong,
        shard=(jax.process_index(), jax.process_count()),
    )


# -- a run about to train: where, on what, with which model ------------------------------


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
    """The model and optimiser a run trains."""

    config: Any  # TransformerConfig
    module: Any  # Transformer
    tx: Any
    schedule: Any


def environment(parts: Parts) -> Environment:
    """The mesh, the rules, the data set and the checked evaluation splits of a run
    (its config is checked already; this raises ConfigError before anything compiles)."""
    devices, data, evaluation = parts.devices, parts.data, parts.evaluation
    mesh = mesh_lib.make_mesh(devices.mesh_shape)
    rules = devices.logical_axis_rules or mesh_lib.DEFAULT_RULES
    mesh_lib.check_sizes(mesh, data.batch_size, evaluation.batch_size, parts.step.grad_accum_steps)
    task = open_task(data)
    eval_splits = checks.eval_splits(evaluation, data, task)
    checks.check_best_metric(parts.checkpoints.best_metric, task, eval_splits)
    return Environment(mesh, rules, task, eval_splits, jax.process_index() == 0)


def build_model(parts: Parts, task) -> Model:
    """The Transformer of a run for `task`'s vocabulary, and its optimiser."""
    from jattn.models import Transformer  # noqa: PLC0415 -- the model layer, on demand
    from jattn.train.optim import make_optimizer  # noqa: PLC0415

    model_config = parts.model.build(task.tokenizer.vocab_size)
    tx, schedule = make_optimizer(parts.optimizer)
    return Model(model_config, Transformer(model_config), tx, schedule)


def import_wandb(loop: LoopPart):
    """The `wandb` module when `loop.wandb` (``config.wandb``) asks for it, else None.

    Raises:
      ConfigError: `config.wandb=True` without the package installed.
    """
    if not loop.wandb:
        return None
    try:
        import wandb  # noqa: PLC0415 -- optional, never required
    except ImportError:
        raise ConfigError(
            "config.wandb=True needs the `wandb` package, which is not installed "
            "(pip install wandb, or leave config.wandb=False)"
        ) from None
    return wandb


def startup_summary(
    workdir, parts: Parts, model: Model, mesh, task, eval_sets, start: int, data_check
) -> str:
    """What the run is about to do, printed before the first step. The parameter
    count is the architecture line's (`jattn.models.architecture_line`): this
    model's beside every other registered architecture's at this width (and
    "shared" layers where they are), so runs of different architectures can be
    compared at equal size."""
    from jattn.models import architecture_line  # noqa: PLC0415 -- the model layer
    from jattn.train import allocator  # noqa: PLC0415

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    sizes = []
    for split in task.splits:
        try:
            sizes.append(f"{split} {len(task.source(split)):,} examples")
        except (TypeError, ValueError):  # a source without a length
            sizes.append(f"{split} (size unknown)")
    data = parts.data
    lines = [
        f"workdir: {workdir}" + (f" (resuming at step {start})" if start else ""),
        architecture_line(model.config),  # "parameters: N (architecture, ...)"
        f"devices: {len(devices)} x {', '.join(kinds)} ({jax.process_count()} process(es)); "
        f"mesh {dict(mesh.shape)}"
        + ("; " + allocator.describe() if devices[0].platform == "cpu" else ""),
        precision_line(parts.devices.matmul_precision, devices[0].platform),
        f"data {data.dataset}: " + ", ".join(sizes),
        f"training rows: {data.batch_size} a step ({data.input_len} input + {data.max_len} "
        f"target tokens), {parts.loop.num_train_steps:,} steps",
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


# -- a trained run ----------------------------------------------------------------------


@dataclasses.dataclass
class TrainedRun:
    """A trained model read from a workdir.

    Attributes:
      config: the run's resolved config (`config.json`), unlocked.
      model: `jattn.models.Transformer` with the run's `TransformerConfig`.
      params: the parameters at `step` (jax arrays on one device).
      step: the checkpoint's step.
      tokenizer: the tokenizer the run trained with, read from the workdir
        (``tokenizer.json``, saved when the run started), so decoding needs
        neither the data set nor its vocabulary cache. Runs saved before the
        workdir kept it fall back to `task.tokenizer`.
      task: the run's data set and tokenizer (`load_task`), loaded on first use.
    """

    config: ml_collections.ConfigDict
    model: Any
    params: Any
    step: int
    tokenizer: Any = None

    @functools.cached_property
    def task(self):
        return load_task(self.config)


def checkpoint_steps(workdir: str) -> list[int]:
    """The steps of the complete checkpoints in `workdir`, ascending (torn saves and
    step folders with a missing part, see `checkpoints.step_problem`, excluded)."""
    folder = os.path.join(workdir, CHECKPOINT_DIR)
    if not os.path.isdir(folder):
        return []
    return sorted(
        int(name)
        for name in os.listdir(folder)
        if name.isdigit() and step_problem(os.path.join(folder, name)) is None
    )


def load_run(
    workdir: str, step: int | None = None, warn: Callable[[str], None] | None = None
) -> TrainedRun:
    """Reads the config, the model config, the parameters of checkpoint `step` and
    the tokenizer.

    The step is restored and verified as training verifies the step it resumes
    (`jattn.train.recovery.restore_verified`: the step counter, every array
    against the checksum its save recorded, every value finite). With `step`
    None, a step that fails is passed over for the next older one, each with a
    warning line, and a last line names the step used; nothing is moved (the
    run may be training). A named `step` that fails is an error.

    Args:
      workdir: a `jattn train` workdir.
      step: a checkpoint step; None takes the newest intact one.
      warn: prints one warning line (default: on stderr).

    Raises:
      FileNotFoundError: no run or no checkpoint there.
      ValueError: `step` is not one of the saved steps (they are listed), or it is
        damaged; with `step` None, no step restores and verifies.
    """
    from jattn.models import Transformer, TransformerConfig  # noqa: PLC0415

    warn = warn or _warn
    for name in (workdir_lib.CONFIG, workdir_lib.MODEL_CONFIG):
        if not os.path.exists(os.path.join(workdir, name)):
            raise FileNotFoundError(f"load_run: {workdir!r} has no {name}; not a jattn workdir")
    steps = checkpoint_steps(workdir)
    if not steps:
        raise FileNotFoundError(f"load_run: no checkpoint in {workdir!r}")
    if step is not None and step not in steps:
        raise ValueError(f"load_run: no checkpoint at step {step} in {workdir!r}; saved: {steps}")
    saved = workdir_lib.read_json(os.path.join(workdir, workdir_lib.CONFIG))
    config = ml_collections.ConfigDict(saved)
    model_config = TransformerConfig.from_dict(
        workdir_lib.read_json(os.path.join(workdir, workdir_lib.MODEL_CONFIG))
    )
    named = step is not None
    step, state = _newest_intact(workdir, [step] if named else steps, warn, named)
    model = Transformer(model_config)
    run = TrainedRun(config=config, model=model, params=state["params"], step=step)
    from jattn.data.tokenizers import load_from_dir  # noqa: PLC0415

    run.tokenizer = load_from_dir(workdir) or run.task.tokenizer
    return run


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _restore_state(step_dir: str) -> dict[str, Any]:
    """A step's whole state as a plain dict of arrays on one device (any mesh it was
    saved from)."""
    path = os.path.abspath(os.path.join(step_dir, "state"))
    checkpointer = ocp.StandardCheckpointer()
    # The item's own metadata (`state/_METADATA`): the checkpointer's `metadata` also
    # looks for a step file inside the item folder and logs absl's "Metadata file does
    # not exist: .../_CHECKPOINT_METADATA" warning before every `jattn decode`.
    try:
        saved = ocp.StandardCheckpointHandler().metadata(epath.Path(path))
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), saved
        )
        return checkpointer.restore(path, target)
    finally:
        checkpointer.close()


def _newest_intact(workdir: str, steps: list[int], warn, named: bool) -> tuple[int, Any]:
    """The newest of `steps` that restores and verifies, and its state.

    A `named` step that fails raises ValueError. Otherwise each newer step
    passed over is one warning line (a step folder with a missing part,
    `step_problem`, included), and when any was, one more line names the step
    used.
    """
    from jattn.train import recovery  # noqa: PLC0415 -- orbax's read filters, on demand

    folder = os.path.join(workdir, CHECKPOINT_DIR)
    passed = [] if named else _incomplete(folder)
    step, state = None, None
    with recovery.quiet_abandoned_reads():
        for candidate in reversed(steps):
            step_dir = os.path.join(folder, str(candidate))
            state, problem = recovery.restore_verified(
                lambda d=step_dir: _restore_state(d), candidate, step_dir
            )
            if problem is None:
                step = candidate
                break
            if named:
                raise ValueError(f"load_run: checkpoint step {candidate} in {workdir!r} {problem}")
            passed.append((candidate, problem))
    newer = sorted((p for p in passed if step is None or p[0] > step), reverse=True)
    for s, problem in newer:
        warn(f"warning: checkpoint step {s} {problem}; not used")
    if step is None:
        raise ValueError(
            f"load_run: no checkpoint in {workdir!r} restores and verifies "
            f"(steps {', '.join(str(s) for s, _ in newer)}; see the warnings above)"
        )
    if newer:
        warn(f"warning: using checkpoint step {step}, the newest that restores and verifies")
    return step, state


def _incomplete(folder: str) -> list[tuple[int, str]]:
    """``(step, problem)`` of every step folder with a missing part (`step_problem`),
    ascending."""
    return [
        (int(name), problem)
        for name in sorted(os.listdir(folder), key=lambda n: int(n) if n.isdigit() else -1)
        if name.isdigit() and (problem := step_problem(os.path.join(folder, name))) is not None
    ]
