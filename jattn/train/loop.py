"""`train_and_evaluate(config, workdir)`: the training loop, top to bottom.

1. check the config, build the mesh, load the data, build the model;
2. open the workdir's checkpoints and refuse an incompatible one;
3. derive the state's shardings from the model's logical axis names;
4. initialise the state, or restore it and the data iterator;
5. jit the train step (explicit shardings, donated state), eval and decode;
6. loop: step, check the loss, log, evaluate, checkpoint, watch for SIGTERM;
7. final evaluation, `final_metrics.json`.

Helpers live beside this file by concern: `mesh` (shardings), `optim`,
`steps` (loss and step functions), `checkpoints`, `evaluation`, `metrics`,
`distributed`, `defaults` and `config` (keys, loading, checks).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.train import checkpoints as ckpt
from jattn.train import evaluation, steps
from jattn.train import mesh as mesh_lib
from jattn.train.config import ConfigError, config_to_json
from jattn.train.defaults import check_config, input_lengths
from jattn.train.distributed import PreemptionWatch
from jattn.train.metrics import MetricsWriter, Progress, read_metrics
from jattn.train.optim import make_optimizer

__all__ = ["TrainingDivergedError", "build_model_config", "train_and_evaluate"]

FINAL_METRICS = "final_metrics.json"


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or Inf; the message names the step and the last good checkpoint."""


def build_model_config(config: ml_collections.ConfigDict, tokenizer_vocab: int) -> Any:
    """`TransformerConfig` from `config.model`, filling `vocab_size=-1` from the tokenizer.

    Raises:
      ConfigError: an invalid model field, or a vocab_size below the tokenizer's.
    """
    from jattn.models import TransformerConfig  # noqa: PLC0415

    fields = config.model.to_dict()
    if fields["vocab_size"] <= 0:
        multiple = config.vocab_multiple
        fields["vocab_size"] = math.ceil(tokenizer_vocab / multiple) * multiple
    elif fields["vocab_size"] < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's "
            f"{tokenizer_vocab} (use -1 to follow the tokenizer)"
        )
    try:
        return TransformerConfig.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.model: {e}") from None


def _load_task(config: ml_collections.ConfigDict):
    from jattn import data  # noqa: PLC0415

    try:
        return data.load(
            config.dataset,
            data_dir=config.data_dir,
            tokenizer=config.tokenizer,
            vocab_size=config.vocab_size,
            source_key=config.source_key,
            target_key=config.target_key,
        )
    except ValueError as e:
        raise ConfigError(f"dataset={config.dataset!r}: {e}") from None


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


def _finished(workdir: str, latest: int | None, config) -> dict[str, Any] | None:
    """The saved final metrics if this workdir already completed `num_train_steps`."""
    path = os.path.join(workdir, FINAL_METRICS)
    if latest != config.num_train_steps or not os.path.exists(path):
        return None
    with open(path) as f:
        final = json.load(f)
    return final if final.get("step") == config.num_train_steps else None


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) the run in `workdir` and returns its final metrics.

    Args:
      config: a full config (see `jattn.train.defaults.default_config`).
      workdir: the run directory; holds `checkpoints/`, `metrics.jsonl`,
        `tb/`, `config.json`, `model_config.json`, `decodes/` and, once done,
        `final_metrics.json`. An existing checkpoint is resumed.

    Returns:
      ``{"step", "preempted", "train/loss", "eval/<split>/<metric>", ...,
      "num_params", "train/steps_per_sec"}``. A finished workdir returns its
      saved final metrics without training again.

    Raises:
      ConfigError: bad config, mesh, batch size, data set or workdir (before compiling).
      TrainingDivergedError: a non-finite loss (nothing is saved for that step).
    """
    from jattn import data as data_lib  # noqa: PLC0415
    from jattn.models import Transformer  # noqa: PLC0415

    # 1. Config, mesh, data, model. ----------------------------------------------------
    check_config(config)
    workdir = os.path.abspath(workdir)
    is_main = jax.process_index() == 0
    mesh = mesh_lib.make_mesh(config.mesh_shape)
    rules = tuple(tuple(r) for r in config.logical_axis_rules) or mesh_lib.DEFAULT_RULES
    _check_sizes(config, mesh)
    task = _load_task(config)
    eval_splits = [s for s in config.eval_splits if s in task.splits]
    model_config = build_model_config(config, task.tokenizer.vocab_size)
    model = Transformer(model_config)
    tx, schedule = make_optimizer(config)

    # 2. Checkpoints: an incompatible workdir is an error, and is left untouched. ------
    mngr = ckpt.make_manager(workdir, config)
    latest = ckpt.check_compatible(mngr, workdir, config)
    done = _finished(workdir, latest, config)
    if done is not None:
        mngr.close()
        return done
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config_to_json(config))
        with open(os.path.join(workdir, "model_config.json"), "w") as f:
            json.dump(model_config.to_dict(), f, indent=2, sort_keys=True)

    # 3. Abstract state and shardings from the logical axis names. ---------------------
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
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

    root = jax.random.key_data(jax.random.key(config.seed))  # uint32 [2]
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_boxed, root)
        shardings = mesh_lib.state_shardings(abstract_boxed, mesh, rules)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        mesh_lib.unbox_values(abstract_boxed),
        shardings,
    )
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state.params))
    batch_sharding = mesh_lib.batch_sharding(mesh)
    replicated = NamedSharding(mesh, P())

    # 4. Data iterators; initialise or restore the state. ------------------------------
    train_iter = iter(
        data_lib.make_loader(
            task,
            "train",
            batch_size=config.batch_size // jax.process_count(),
            max_len=config.max_len,
            max_input_len=input_len,
            seed=config.seed,
            shuffle=True,
            pack=config.pack,
            overlong=config.overlong,
            shard_index=jax.process_index(),
            shard_count=jax.process_count(),
        )
    )
    eval_sets = evaluation.load_eval_sets(task, data_lib.make_loader, config, eval_splits)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        if latest is not None:
            state = ckpt.restore(mngr, latest, abstract_state, train_iter)
        else:
            init = jax.jit(lambda r: nn.meta.unbox(init_boxed(r)), out_shardings=shardings)
            state = init(root)

    # 5. Compiled functions: explicit shardings, the state donated. --------------------
    micro_spec = NamedSharding(mesh, P(None, *mesh_lib.BATCH_SPEC))
    train_step = jax.jit(
        steps.make_train_step(
            model,
            tx,
            schedule,
            label_smoothing=config.label_smoothing,
            grad_accum_steps=config.grad_accum_steps,
            micro_spec=micro_spec,
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
    to_global = functools.partial(
        mesh_lib.make_global_batch, sharding=batch_sharding, replicated_input=True
    )

    def run_eval(state_params, step: int) -> dict[str, float]:
        metrics, decodes = evaluation.evaluate(
            state_params,
            eval_sets,
            eval_step=eval_step,
            decode=decode,
            to_global=to_global,
            tokenizer=task.tokenizer,
            num_decode=config.eval_decode_examples,
        )
        if is_main:
            evaluation.write_decodes(workdir, step, decodes)
        return metrics

    # 6. The loop. ---------------------------------------------------------------------
    start = int(jax.device_get(state.step))
    writer = MetricsWriter(workdir, enabled=is_main, resume_step=start)
    progress = Progress(
        config.num_train_steps, start, enabled=is_main and config.progress_bar, is_main=is_main
    )
    watch = PreemptionWatch()
    sums = {"loss": 0.0, "accuracy": 0.0, "tokens": 0.0, "grad_norm": 0.0, "count": 0}
    last = {"learning_rate": 0.0, "loss": float("nan")}
    eval_metrics: dict[str, float] = {}
    eval_step_done = -1
    pending = None  # (step, device metrics) of the step in flight
    preempted = False
    step = start
    timer = {"t": time.perf_counter(), "steady_t": 0.0, "steady_steps": 0, "first": True}

    def consume(item) -> None:
        """Fetches one step's metrics; stops the run on a non-finite loss."""
        s, device_metrics = item
        m = jax.device_get(device_metrics)
        loss = float(m["loss"])
        if not math.isfinite(loss):
            mngr.wait_until_finished()
            good = mngr.latest_step()
            raise TrainingDivergedError(
                f"non-finite loss ({loss}) at step {s}; stopped without saving it. Last good "
                f"checkpoint: step {good} in {mngr.directory}"
            )
        for k in ("loss", "accuracy", "tokens", "grad_norm"):
            sums[k] += float(m[k])
        sums["count"] += 1
        last.update(loss=loss, learning_rate=float(m["learning_rate"]))

    def flush_train_metrics(s: int) -> None:
        now = time.perf_counter()
        elapsed = max(now - timer["t"], 1e-9)
        n = max(sums["count"], 1)
        if timer["first"]:  # the first interval of this process includes compilation
            timer["first"] = False
        else:
            timer["steady_t"] += elapsed
            timer["steady_steps"] += sums["count"]
        row = {
            "train/loss": sums["loss"] / n,
            "train/accuracy": sums["accuracy"] / n,
            "train/grad_norm": sums["grad_norm"] / n,
            "train/learning_rate": last["learning_rate"],
            "train/tokens_per_sec": sums["tokens"] / elapsed,
            "train/steps_per_sec": sums["count"] / elapsed,
        }
        writer.write(s, row)
        progress.update(sums["count"], row["train/loss"], row["train/tokens_per_sec"])
        for k in sums:
            sums[k] = 0
        timer["t"] = time.perf_counter()

    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            while step < config.num_train_steps:
                batch = mesh_lib.make_global_batch(next(train_iter), batch_sharding)
                state, device_metrics = train_step(state, batch)
                if pending is not None:
                    consume(pending)  # the previous step, while this one runs
                pending = (step + 1, device_metrics)
                step += 1
                final = step == config.num_train_steps
                do_eval = step % config.eval_every_steps == 0 or final
                do_save = step % config.checkpoint_every_steps == 0 or do_eval
                do_log = step % config.log_every_steps == 0 or do_save
                preempted = watch.reached(step)
                if do_log or preempted:
                    consume(pending)
                    pending = None
                    flush_train_metrics(step)
                if do_eval:
                    eval_metrics = run_eval(state.params, step)
                    eval_step_done = step
                    writer.write(step, eval_metrics)
                    progress.write(_format_eval(step, eval_metrics))
                if do_save or preempted:
                    saved_metrics = eval_metrics if do_eval else None
                    ckpt.save(mngr, step, state, train_iter, config, saved_metrics)
                if do_eval or do_save:
                    writer.flush()
                    timer["t"] = time.perf_counter()
                if preempted:
                    mngr.wait_until_finished()
                    progress.write(f"preempted: saved step {step} in {mngr.directory}; exiting")
                    break
            if pending is not None:
                consume(pending)
            # 7. Final evaluation (if the last step's is missing, e.g. a restart at the end).
            if not preempted and eval_step_done != step:
                eval_metrics = run_eval(state.params, step)
                writer.write(step, eval_metrics)
    finally:
        watch.close()
        progress.close()
        mngr.wait_until_finished()
        mngr.close()
        writer.close()

    steady = timer["steady_steps"] / timer["steady_t"] if timer["steady_t"] > 0 else float("nan")
    if not math.isfinite(last["loss"]):  # resumed at the end: no step ran in this process
        logged = [r["train/loss"] for r in read_metrics(workdir) if "train/loss" in r]
        last["loss"] = float(logged[-1]) if logged else float("nan")
    result = {
        "step": step,
        "preempted": preempted,
        "train/loss": last["loss"],
        "train/steps_per_sec": steady,
        "num_params": int(num_params),
        **eval_metrics,
    }
    if is_main and not preempted:
        with open(os.path.join(workdir, FINAL_METRICS), "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
    return result


def _format_eval(step: int, metrics: dict[str, float]) -> str:
    parts = [f"{k.removeprefix('eval/')}={v:.4g}" for k, v in sorted(metrics.items())]
    return f"step {step}: " + ", ".join(parts)
