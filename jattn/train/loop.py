"""`train_and_evaluate(config, workdir)`: the training loop, top to bottom.

1. check the config, build the mesh, load the data, build the model;
2. open the workdir's checkpoints and refuse an incompatible one;
3. derive the state's shardings from the model's logical axis names;
4. initialise the state, or restore it and the data iterator;
5. jit the train step (explicit shardings, donated state), eval and decode;
6. loop: step, log, evaluate, checkpoint, watch for SIGTERM;
7. final evaluation, `final_metrics.json`.

Helpers live beside this file by concern: `config` (keys, defaults, loading,
checks), `mesh` (shardings), `optim`, `steps` (loss and step functions),
`checkpoints`, `restore` (the data set of a config), `evaluation`, `metrics`
(step bookkeeping and output), `distributed`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.data import producibility
from jattn.data.tokenizers import check_saved, save_to_dir, vocab_hash
from jattn.train import allocator, data_checks, evaluation, filesystem, recovery, steps
from jattn.train import checkpoints as ckpt
from jattn.train import members as members_lib
from jattn.train import mesh as mesh_lib
from jattn.train.config import (
    ConfigError,
    build_model_config,
    check_config,
    config_to_dict,
    config_to_json,
    input_lengths,
)
from jattn.train.distributed import PreemptionWatch
from jattn.train.metrics import (
    MetricsWriter,
    NonFiniteLossError,
    Progress,
    TrainMetrics,
    logged_losses,
    strict_json_value,
    write_final_metrics,
)
from jattn.train.optim import make_optimizer
from jattn.train.restore import load_task
from jattn.train.sanity import SANE_STEP_METRIC, LossSanity, insane_warning
from jattn.train.workdir_lock import WorkdirLock

__all__ = ["FINAL_METRICS", "TrainingDivergedError", "build_model_config", "train_and_evaluate"]

FINAL_METRICS = "final_metrics.json"
DATA_CHECK = "data_check.json"  # `jattn.data.producibility.check` of the run's eval splits


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or Inf; the message names the step and the last good checkpoint."""


def _check_sizes(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
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


def _finished(workdir: str, latest: int | None, config) -> dict[str, Any] | None:
    """The saved final metrics if this workdir already completed `num_train_steps`."""
    path = os.path.join(workdir, FINAL_METRICS)
    if latest != config.num_train_steps or not os.path.exists(path):
        return None
    with open(path) as f:
        final = json.load(f)
    return final if final.get("step") == config.num_train_steps else None


def _write_run_config(workdir: str, config: ml_collections.ConfigDict, model_config) -> None:
    """`config.json` and `model_config.json` (what `load_run` reads back)."""
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config_to_json(config))
    with open(os.path.join(workdir, "model_config.json"), "w") as f:
        json.dump(model_config.to_dict(), f, indent=2, sort_keys=True)


def _make_init(model, tx, config: ml_collections.ConfigDict, rows: int):
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


def _abstract_state(init_boxed, root: jax.Array, mesh, rules):
    """`(abstract state, state shardings)`: shapes, dtypes and shardings of the
    state, from the logical axis names of the boxed parameters (nothing is
    allocated)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_boxed, root)
        shardings = mesh_lib.state_shardings(abstract_boxed, mesh, rules)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        mesh_lib.unbox_values(abstract_boxed),
        shardings,
    )
    return abstract_state, shardings


def _train_loader(task, config: ml_collections.ConfigDict):
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


def _decode_fn(model, config: ml_collections.ConfigDict):
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


def _compile(model, tx, schedule, config: ml_collections.ConfigDict, mesh, shardings):
    """`(train_step, eval_step, decode or None)`, jitted with explicit shardings.

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
    decode_fn = _decode_fn(model, config)
    decode = decode_fn and jax.jit(
        decode_fn, in_shardings=(shardings.params, batch_sharding), out_shardings=replicated
    )
    return train_step, eval_step, decode


def _import_wandb(config: ml_collections.ConfigDict):
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


def _startup_summary(
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


def _last_logged_loss(workdir: str) -> float:
    """The last `train/loss` (an interval's mean) of metrics.jsonl (a run resumed at
    its end trains no step)."""
    logged = logged_losses(workdir)
    return float(logged[-1]) if logged else float("nan")


def _warn(line: str) -> None:
    """One line on stderr (process 0 only): a skipped checkpoint, archived metrics, ..."""
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def _state_bytes(abstract_state) -> int:
    """Bytes of a checkpoint's state (parameters, optimiser state), a save's size."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract_state))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) the run in `workdir` and returns its final metrics.

    Args:
      config: a full config (see `jattn.train.config.default_config`).
      workdir: the run directory; holds `checkpoints/`, `metrics.jsonl`,
        `tb/`, `config.json`, `model_config.json`, the tokenizer
        (`tokenizer.json` and its vocabulary file), `decodes/` and, once done,
        `final_metrics.json`. An existing checkpoint is resumed.

    Returns:
      ``{"step", "preempted", "train/loss", "eval/<split>/<metric>", ...,
      "num_params", "train/steps_per_sec"}``, as written to
      `final_metrics.json` (strict JSON: None where unknown). ``train/loss``
      is the mean over the last logging interval, the number metrics.jsonl,
      TensorBoard and the progress bar show. A finished workdir returns its
      saved final metrics without training again.

    Raises:
      ConfigError: bad config, mesh, batch size, data set (damaged data included) or
        workdir (before compiling).
      TrainingDivergedError: a non-finite loss (nothing is saved for that step).
      WorkdirLockedError: another trainer holds the workdir.
      WorkdirIOError: the workdir or a checkpoint cannot be written (disk full,
        read-only); raised at start or at the first failed save.
      Terminated: SIGTERM before the first step or after the last save, or a
        second SIGTERM (the first one saves and returns normally).
    """
    watch = PreemptionWatch(stage="start-up")  # SIGTERM from here on ends the run
    with contextlib.ExitStack() as stack:
        stack.callback(watch.close)
        return _train_and_evaluate(config, workdir, watch, stack)


def _train_and_evaluate(config, workdir: str, watch: PreemptionWatch, stack) -> dict[str, Any]:
    """`train_and_evaluate` under `watch`; `stack` holds the workdir's lock."""
    from jattn import data as data_lib  # noqa: PLC0415
    from jattn.models import Transformer  # noqa: PLC0415

    if members_lib.is_program(config):  # every seed (and swept value) in one program
        from jattn.train.seed_loop import train_seeds  # noqa: PLC0415

        return train_seeds(config, workdir, watch=watch)  # it takes the workdir's lock

    # 1. Config, mesh, data, model. ----------------------------------------------------
    check_config(config)
    wandb = _import_wandb(config)
    workdir = os.path.abspath(workdir)
    is_main = jax.process_index() == 0
    mesh = mesh_lib.make_mesh(config.mesh_shape)
    rules = tuple(tuple(r) for r in config.logical_axis_rules) or mesh_lib.DEFAULT_RULES
    _check_sizes(config, mesh)
    task = load_task(config)
    eval_splits = data_checks.eval_splits(config, task)
    data_checks.check_best_metric(config, task, eval_splits)
    data_check = producibility.check(task, eval_splits)
    model_config = build_model_config(config, task.tokenizer.vocab_size)
    model = Transformer(model_config)
    tx, schedule = make_optimizer(config)

    # 2. Checkpoints: an incompatible workdir is an error, and is left untouched. ------
    vocab = vocab_hash(task.tokenizer)
    checkpoint_dir = os.path.join(workdir, ckpt.CHECKPOINT_DIR)
    if is_main:  # one writer; writable; damaged steps set aside before orbax opens them
        filesystem.check_writable(workdir, checkpoint_dir)
        lock = stack.enter_context(WorkdirLock(workdir))
        if lock.previous:
            pid = lock.previous.get("pid")
            _warn(f"warning: took over the lock of {workdir} left by pid {pid}, which died")
        recovery.set_aside_incomplete(checkpoint_dir, _warn)
    mngr = ckpt.make_manager(workdir, config)
    latest = ckpt.check_compatible(mngr, workdir, config, vocab)
    data_checks.check_row_lengths(config, task, _warn)  # after: a resume's diffs say more
    if latest is not None:
        try:
            check_saved(workdir, task.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    done = _finished(workdir, latest, config)
    if done is not None:
        mngr.close()
        return done
    if is_main:
        _write_run_config(workdir, config, model_config)
        save_to_dir(task.tokenizer, workdir)  # the run is self-contained (`load_run`)
        with open(os.path.join(workdir, DATA_CHECK), "w") as f:
            json.dump(data_check, f, indent=2)

    # 3. Abstract state and shardings from the logical axis names. ---------------------
    init_boxed = _make_init(model, tx, config, rows=mesh.shape["data"] * mesh.shape["fsdp"])
    root = jax.random.key_data(jax.random.key(config.seed))  # uint32 [2]
    abstract_state, shardings = _abstract_state(init_boxed, root, mesh, rules)
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state.params))

    # 4. Data iterators; initialise or restore the state. ------------------------------
    train_iter = iter(_train_loader(task, config))
    eval_sets = evaluation.load_eval_sets(task, data_lib.make_loader, config, eval_splits)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        state = None
        if latest is not None:  # the newest step that restores and verifies
            state, train_iter, latest = recovery.restore_newest(
                mngr,
                lambda step, it: ckpt.restore(mngr, step, abstract_state, it),
                lambda: iter(_train_loader(task, config)),
                _warn,
            )
        if state is None:
            if is_main:
                recovery.archive_metrics(workdir, _warn)
            init = jax.jit(lambda r: nn.meta.unbox(init_boxed(r)), out_shardings=shardings)
            state = init(root)

    # 5. Compiled functions: explicit shardings, the state donated. --------------------
    train_step, eval_step, decode = _compile(model, tx, schedule, config, mesh, shardings)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    to_global = functools.partial(
        mesh_lib.make_global_batch, sharding=batch_sharding, replicated_input=True
    )

    # 6. The loop. ---------------------------------------------------------------------
    step = start = int(jax.device_get(state.step))
    writer = MetricsWriter(workdir, enabled=is_main, resume_step=start)
    progress = Progress(
        config.num_train_steps, start, enabled=is_main and config.progress_bar, is_main=is_main
    )
    train_metrics = TrainMetrics(writer, progress)
    metric_names = ["train/loss", "train/accuracy"] + [
        f"eval/{es.split}/{m}"
        for es in eval_sets.values()
        for m in ("loss", "accuracy", *es.metrics)
    ]
    writer.hparams(flat_hparams(config), metric_names)
    if wandb is not None and is_main:
        run = wandb.init(
            project=config.wandb_project,
            name=os.path.basename(workdir),
            dir=workdir,
            config=config_to_dict(config),
        )
        writer.log_to_wandb(run)
    progress.write(
        _startup_summary(workdir, config, mesh, num_params, task, eval_sets, start, data_check)
    )

    def run_eval(params, step: int) -> dict[str, float]:
        metrics, decodes = evaluation.evaluate(
            params,
            eval_sets,
            eval_step=eval_step,
            decode=decode,
            to_global=to_global,
            tokenizer=task.tokenizer,
            num_decode=config.eval_decode_examples,
        )
        if is_main:
            evaluation.write_decodes(workdir, step, decodes)
        writer.write(step, metrics)
        return metrics

    eval_metrics: dict[str, float] = {}
    eval_step_done, preempted = -1, False
    sanity = LossSanity(logged_losses(workdir))
    last_sane, loss_sane, save_failed = (start or None), True, False
    save_bytes = int(1.2 * _state_bytes(abstract_state)) + (1 << 20)
    watch.stage = "training"
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            while step < config.num_train_steps:
                batch = mesh_lib.make_global_batch(next(train_iter), batch_sharding)
                state, device_metrics = train_step(state, batch)
                step += 1
                train_metrics.push(step, device_metrics)  # fetches the previous step's
                filesystem.check_saves(mngr)  # a background save that failed stops the run
                do_eval = step % config.eval_every_steps == 0 or step == config.num_train_steps
                do_save = step % config.checkpoint_every_steps == 0 or do_eval
                do_log = step % config.log_every_steps == 0 or do_save
                preempted = watch.reached(step)
                if do_log or preempted:
                    train_metrics.log(step)
                    loss_sane = sanity.observe(train_metrics.logged_loss)
                if do_eval:
                    eval_metrics, eval_step_done = run_eval(state.params, step), step
                    progress.write(_format_eval(step, eval_metrics))
                if do_save or preempted:
                    saved_metrics = {
                        **(eval_metrics if do_eval else {}),
                        SANE_STEP_METRIC: step if loss_sane else -1,
                    }
                    with filesystem.checked_save(mngr, step, save_bytes):
                        ckpt.save(mngr, step, state, train_iter, config, saved_metrics, vocab)
                    if loss_sane:
                        last_sane = step
                    else:
                        progress.write(
                            insane_warning(step, train_metrics.logged_loss, sanity, last_sane)
                        )
                if do_eval or do_save:
                    writer.flush()
                    train_metrics.restart_clock()
                if preempted:
                    filesystem.wait_for_saves(mngr)
                    progress.write(f"preempted: saved step {step} in {mngr.directory}; exiting")
                    break
            watch.stage = "finishing"
            train_metrics.fetch()
            filesystem.wait_for_saves(mngr)  # the last save's failure is an error too
            # 7. Final evaluation (if the last step's is missing, e.g. a restart at the end).
            if not preempted and eval_step_done != step:
                eval_metrics = run_eval(state.params, step)
    except NonFiniteLossError as e:
        mngr.wait_until_finished()
        latest_saved = mngr.latest_step()
        newer = f" (latest: step {latest_saved})" if latest_saved != last_sane else ""
        good = "none" if last_sane is None else f"step {last_sane}{newer} in {mngr.directory}"
        raise TrainingDivergedError(
            f"{e}; stopped without saving it. Last good (sane-loss) checkpoint: {good}"
        ) from None
    except (filesystem.WorkdirIOError, OSError) as e:
        error = filesystem.write_error(e, workdir, step)
        save_failed = error.save_failed  # orbax would wait 300 s for a failed save: do not
        raise error from None
    finally:
        watch.stage = "finishing"
        progress.close()
        filesystem.close_manager(mngr, save_failed=save_failed)
        with contextlib.suppress(OSError):
            writer.close()

    # train/loss: the mean over the last logging interval, as metrics.jsonl, TensorBoard
    # and the progress bar show it (NaN when no step ran in this process).
    last_loss = train_metrics.logged_loss
    result = {
        "step": step,
        "preempted": preempted,
        "train/loss": last_loss if math.isfinite(last_loss) else _last_logged_loss(workdir),
        "train/steps_per_sec": train_metrics.steady_steps_per_sec,
        "num_params": int(num_params),
        **eval_metrics,
        **producibility.metrics(data_check),
    }
    if is_main and not preempted:
        return write_final_metrics(os.path.join(workdir, FINAL_METRICS), result)
    return {k: strict_json_value(v) for k, v in result.items()}


def _format_eval(step: int, metrics: dict[str, float]) -> str:
    parts = [f"{k.removeprefix('eval/')}={v:.4g}" for k, v in sorted(metrics.items())]
    return f"step {step}: " + ", ".join(parts)
